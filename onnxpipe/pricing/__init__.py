"""Pricing: how long things take on a target and what one pipeline stage costs, computed in one place.

`timemodel` prices nodes, transfers and all-reduces on a target's devices and links; `problem` tabulates a
graph's costs on a target per device group; `stage` turns a stage assignment into one `StageCost` per stage.
The planner's solvers, its evaluation and baselines, and the simulator all read these.
"""
