"""Planner: CP-SAT formulation, coarsening, baselines, lower bounds and schedule exploration."""
