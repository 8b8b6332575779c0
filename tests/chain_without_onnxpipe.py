"""Chain a stage directory with json + onnxruntime + numpy only, reading nothing but manifest.json:
the proof that the manifest alone is enough. Usage: chain_without_onnxpipe.py DIR INPUTS.npz OUTPUTS.npz"""

import json
import sys

import numpy as np
import onnxruntime


def main(directory: str, inputs: str, outputs: str) -> None:
    with open(f"{directory}/manifest.json") as f:
        manifest = json.load(f)
    values = dict(np.load(inputs))
    for stage in manifest["stages"]:
        session = onnxruntime.InferenceSession(f"{directory}/{stage['file']}", providers=["CPUExecutionProvider"])
        names = [o["name"] for o in stage["outputs"]]
        feeds = {i["name"]: values[i["name"]] for i in stage["inputs"]}
        values.update(zip(names, session.run(names, feeds)))
    np.savez(outputs, **{o["name"]: values[o["name"]] for o in manifest["outputs"]})


if __name__ == "__main__":
    main(*sys.argv[1:4])
