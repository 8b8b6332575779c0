"""Checkpoints: per stage an .npz (weights, optimizer state) with its sha256 in a small JSON, plus
`checkpoint.json` (step, data cursor, settings) written last. Every file goes temp + os.replace.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from onnxpipe.errors import OnnxpipeError

__all__ = ["StageState", "save_checkpoint", "load_checkpoint"]

#: (parameters, optimizer state) of one stage.
StageState = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(directory: str | os.PathLike, step: int, states: Sequence[StageState], meta: Mapping[str, Any]) -> None:
    """Write a checkpoint after `step` completed steps (the next step trains on batch `step`)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, (params, opt) in enumerate(states):
        npz = root / f"stage_{i}.npz"
        arrays = {f"param:{k}": v for k, v in params.items()} | {f"opt:{k}": v for k, v in opt.items()}
        _write_atomic(npz, lambda f, a=arrays: np.savez(f, **a))
        info = {"file": npz.name, "sha256": _sha256(npz), "step": step}
        _write_atomic(root / f"stage_{i}.json", lambda f, d=info: f.write(json.dumps(d, indent=2).encode()))
        entries.append(info)
    top = {"format": "onnxpipe.checkpoint/1", "step": step, "stages": entries, "meta": dict(meta)}
    _write_atomic(root / "checkpoint.json", lambda f: f.write(json.dumps(top, indent=2).encode()))


def load_checkpoint(directory: str | os.PathLike) -> tuple[int, list[StageState], dict[str, Any]]:
    """Read and verify a checkpoint: every stage file's checksum and step must match."""
    root = Path(directory)
    top_path = root / "checkpoint.json"
    if not top_path.is_file():
        raise OnnxpipeError(f"{root}: no checkpoint.json; pass a directory written by --checkpoint-dir or Pipeline.save")
    try:
        top = json.loads(top_path.read_text())
        step, entries = int(top["step"]), top["stages"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise OnnxpipeError(f"{top_path}: unreadable checkpoint index ({exc}); restart without --resume") from exc
    states: list[StageState] = []
    for entry in entries:
        npz = root / entry["file"]
        if not npz.is_file() or _sha256(npz) != entry["sha256"]:
            raise OnnxpipeError(f"{npz}: checkpoint file is missing or corrupted (sha256 mismatch); delete the checkpoint directory or restore it")
        if entry["step"] != step:
            raise OnnxpipeError(f"{npz}: holds step {entry['step']}, the checkpoint step {step}; the checkpoint was interrupted, restart without --resume")
        with np.load(npz) as data:
            params = {k[len("param:"):]: data[k] for k in data.files if k.startswith("param:")}
            opt = {k[len("opt:"):]: data[k] for k in data.files if k.startswith("opt:")}
        states.append((params, opt))
    return step, states, dict(top.get("meta", {}))
