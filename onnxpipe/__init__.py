"""onnxpipe: cut ONNX models into balanced pipeline stages and train them as a pipeline."""

from onnxpipe.startup import quiet_until_command

quiet_until_command()  # first: Ctrl-C during the imports below exits the program quietly (never a library's user)

from onnxpipe.cost import Costs, NodeCost, annotate
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph, load
from onnxpipe.initializers import TieChoice
from onnxpipe.target import Target, load_target
from onnxpipe.chain import chain
from onnxpipe.split import split
from onnxpipe.verify import verify
from onnxpipe.plan import Plan, evaluate, lower_bound, plan_model
from onnxpipe.plan import plan as make_plan
from onnxpipe.train.infer import run_pipeline
from onnxpipe.train.pipeline import Pipeline
from onnxpipe.plan import simulate_plan as simulate
from onnxpipe.simulate import Simulation
from onnxpipe.calibrate import calibrate as calibrate_target
from onnxpipe.calibrate import import_for_target as import_times
from onnxpipe.calibrate import units as measured_units
from onnxpipe.calibrate import write_target

__all__ = ["annotate", "TieChoice", "Costs", "NodeCost", "OnnxpipeError", "Graph", "load", "Target", "load_target", "split", "chain", "run_pipeline", "verify", "Pipeline", "make_plan", "plan_model", "evaluate", "lower_bound", "Plan", "simulate", "Simulation", "import_times", "calibrate_target", "measured_units", "write_target"]
__version__ = "0.1.0"
