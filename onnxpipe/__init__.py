"""onnxpipe: cut ONNX models into balanced pipeline stages and train them as a pipeline."""

from onnxpipe.cost import Costs, NodeCost, annotate
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph, load
from onnxpipe.target import Target, load_target
from onnxpipe.chain import chain, run_pipeline
from onnxpipe.split import split
from onnxpipe.verify import verify
from onnxpipe.train.pipeline import Pipeline

__all__ = ["annotate", "Costs", "NodeCost", "OnnxpipeError", "Graph", "load", "Target", "load_target", "split", "chain", "run_pipeline", "verify", "Pipeline"]
__version__ = "0.1.0"
