"""Planner: coarsening, an interval DP, CP-SAT, baselines, lower bounds and schedule exploration.

`plan` finds a plan; `evaluate` prices any assignment the same way (split's hand-given cuts, the
baselines); `lower_bound` says what no plan can beat; `baselines` shows what others would do;
`simulate_plan` predicts a plan's iteration (its stages priced again from the plan's record).
"""

from onnxpipe.plan.baselines import baselines
from onnxpipe.plan.bounds import LowerBound, lower_bound
from onnxpipe.plan.evaluate import evaluate, fits
from onnxpipe.plan.planner import choose_mode, compare, faster_stage_count, plan, plan_model
from onnxpipe.pricing.problem import Problem, build_problem
from onnxpipe.plan.predict import plan_target, read_plan, simulate_plan, stage_costs
from onnxpipe.plan.result import Candidate, Memory, Plan, SolveInfo, StagePlan
from onnxpipe.pricing.stage import Assignment

__all__ = [
    "plan",
    "plan_model",
    "choose_mode",
    "compare",
    "faster_stage_count",
    "evaluate",
    "fits",
    "Assignment",
    "lower_bound",
    "LowerBound",
    "baselines",
    "simulate_plan",
    "stage_costs",
    "read_plan",
    "plan_target",
    "Problem",
    "build_problem",
    "Plan",
    "StagePlan",
    "Memory",
    "SolveInfo",
    "Candidate",
]
