"""onnxpipe: cut ONNX models into balanced pipeline stages and train them as a pipeline."""

from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph, load

__all__ = ["OnnxpipeError", "Graph", "load"]
__version__ = "0.1.0"
