"""One configuration (stages, micro-batches, schedule fixed): coarsen, solve the interval DP, hand its
answer to CP-SAT as a hint, then (when coarsened) refine: split the blocks around the best plan's stage
cuts into single nodes and solve again there, level by level while it improves; a coarsened graph of up to
`_PROVE_LEVEL` nodes is then searched node by node from the best plan. Every search node by node (an
uncoarsened graph's first one too) runs beside questions below its plan that raise the bound (`_prove`,
`probe`). Keeps the best plan under `evaluate` (least bottleneck, or least iteration time when the caller
ranks by it), never worse than a baseline.

What the plan's `SolveInfo` claims: `status` is CP-SAT's verdict over the blocks it searched last ("OPTIMAL":
no plan made of them beats the plan; refined plans only improve on it; where a large group offered some replica counts
only, the plan also meets the bound below); `bound_seconds` holds for every plan,
whatever its cuts (CP-SAT's proven bound, raised by the questions, only when it searched single nodes and every replica
count: nothing was coarsened, or `_prove` ran; the first-principles bound otherwise), and `gap` is measured against it;
`least_bottleneck_seconds` is the least bottleneck found, which a plan ranked by iteration time may exceed.

Reading order: `solve` -> `_baselines_once` -> `_prove` -> `_refine` -> `_stage_of_nodes` -> `_layout_of` -> `_choose` -> `_ensure_some_fit`.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.plan.baselines import baselines
from onnxpipe.plan.bounds import Bounds, LowerBound
from onnxpipe.plan.coarsen import Blocks, coarsen, refine
from onnxpipe.plan.cpsat import CpResult, Stall, Stop, half_the_cores, held_ceiling_ns, solve_cpsat
from onnxpipe.plan.deadline import Deadline
from onnxpipe.plan.dp import intervals, solve_dp
from onnxpipe.plan.evaluate import evaluate, fits, placed, within
from onnxpipe.plan.layout import EXACT_REPLICAS, Layout, to_assignment
from onnxpipe.plan.patterns import MOST, Patterns, reachable
from onnxpipe.plan.probe import Probed, close, probe
from onnxpipe.pricing.problem import Problem
from onnxpipe.plan.result import Plan, SolveInfo
from onnxpipe.units import format_bytes, plural

__all__ = ["solve", "default_blocks", "infeasible_message", "latency_message"]

#: Share of the time limit the coarse CP-SAT leaves to refinement, and the most refinement's CP-SAT takes.
_REFINE_SHARE = 0.3
_REFINE_CP_SHARE = 0.1
#: Where the search node by node follows (`_prove`, from the best plan), refinement's CP-SAT ends once it has found no better
#: plan for this long: over blocks it can rarely prove its plan optimal, so it ran to its limit. Measured on the six
#: coarsened exports at 2, 4 and 8 stages on gpu4, hetero and fpga4 (48 runs): the same least bottleneck in each, BART-base's
#: on fpga4 at 4 stages planned in 1.8 s instead of 4.4 (3 s of it that CP-SAT finding nothing better).
_STALL = 0.5
#: Relative improvement a refinement level must bring for the next one to run.
_IMPROVES = 1e-6
#: Coarsened graphs up to this many nodes are then searched node by node from the best plan, with questions below it
#: beside (`_prove`), for the rest of the time (as an uncoarsened graph's first search is; the questions end it once its
#: plan is proven within `probe.CLOSE`): CP-SAT proves the real exports' coarse plans optimal there in 0.3-2 s (8
#: heterogeneous stages included), which no first-principles bound can show. Given 0.3 of the time limit, the encoder-decoders'
#: at 8 stages ended early with their gap open: of 30 s, T5-small's export on gpu4 ended 2.3-3.2% above its bound in 10 s, and
#: is proven optimal in 27 s with the rest; BART-base's 3.3-4.5% in 10 s, 1.6% in 30 s; on hetero 10.4% in 13 s, 7.8% in 30 s.
_PROVE_LEVEL = 1500
#: Once the questions have proven the best plan within `probe.CLOSE` of a bound, the goal, the search down ends, but not
#: before this share of the time left: it proves most plans optimal in well under a second (BERT-base's export on gpu4 and
#: fpga4 at 2 stages in 0.2-0.5 s, where the questions had closed the gap a little before; small graphs at once; at 2
#: heterogeneous stages several exports' in 1-3 s: held 0.03 of the time limit instead, BERT-base's, LLaMA's, BART-base's
#: and T5-small's ended 0.47-0.48% above their bounds instead of proven optimal, and the zoo's gpt2-tiny under load at 2
#: stages with a 10-s limit).
_LEAST_SHARE = 0.1
#: A coarsened graph's search down whose questions are not asked by pattern (aimed on one device type, or bisecting) is held
#: only this share of that: there it rarely proves its plan (the encoder-decoders' bound stays on the floor), and held 0.1 of
#: the time left, BART-base's and T5-small's exports at 2 stages on gpu4 and fpga4 took 2 s longer (1.3-1.4 s -> 3.4-3.6 s of
#: solving) for the same plan and bound.
_AIMED_HOLD = 0.3


#: Graphs up to this many compute nodes are solved node by node, so OPTIMAL is optimal for the graph
#: itself (measured: the zoo's largest, 412 nodes, in at most 1.1 s at 8 heterogeneous stages, BERT-base's
#: export, 443 nodes forward only, in 3.8 s; a 990-node one took 8 s there, so larger graphs are coarsened).
_NODE_LEVEL = 500


def default_blocks(stages: int, nodes: int) -> int:
    """Every node up to `_NODE_LEVEL` nodes; beyond, enough blocks for balanced stages, few enough for
    CP-SAT to prove optimality over them quickly (refinement then moves the cuts node by node)."""
    if nodes <= _NODE_LEVEL:
        return nodes
    return min(400, max(120, 40 * stages))


def solve(
    problem: Problem,
    stages: int,
    *,
    recompute: str = "auto",
    replicas: bool = True,
    time_limit: float = 30.0,
    max_blocks: int | None = None,
    progress: Callable[[str], None] | None = None,
    also: Sequence[Plan] = (),
    by_iteration: bool = False,
    bounds: Bounds | None = None,
    deadline: Deadline | None = None,
) -> Plan:
    """The best plan found for this configuration, with its proven bound and gap on the bottleneck.

    `also`: more plans of `stages` stages to choose from; `by_iteration` ranks by predicted iteration
    time first (the plan may then have more than the least bottleneck, and says so in its gap). `bounds`:
    the problem's lower bounds when the caller has found some already. `deadline`: the whole planning
    command's (default: `time_limit` from now); each step stops there with the best plan found so far."""
    report = progress or (lambda _: None)
    started = time.perf_counter()
    deadline = deadline or Deadline(time_limit)
    bounds = bounds or Bounds(problem, deadline)
    bound = bounds(stages, replicas)
    _ensure_some_fit(problem, bound, stages)
    blocks = coarsen(problem, max_blocks or default_blocks(stages, problem.n))
    report(f"{plural(stages, 'stage')}: dynamic program over {plural(blocks.count, 'block')}")
    hint = solve_dp(problem, blocks, stages, recompute, replicas, table=intervals(blocks), deadline=deadline)
    found: list[Plan] = list(also)
    if hint is not None:
        found.append(evaluate(problem, to_assignment(problem, blocks, hint), replicas=replicas, bounds=bounds))
    # Replica counts restricted to `replica_choices` (a large group) limit CP-SAT's search as coarsening does.
    restricted = replicas and any(len(d) > EXACT_REPLICAS for d in problem.group_devices)
    coarsened = blocks.count < problem.n or restricted
    # The coarse plan is then only the start of a search node by node from the best plan (`_prove`).
    proving = coarsened and not restricted and problem.n <= _PROVE_LEVEL
    result = CpResult(None, "UNKNOWN", math.inf, 0.0, 0.0)

    def progress_line(value: float, best: float) -> None:
        report(f"{plural(stages, 'stage')}: CP-SAT: bottleneck {value * 1e3:.3f} ms, bound {best * 1e3:.3f} ms")

    # The baselines of `stages` stages, priced beside the first CP-SAT search once it searches (it leaves the interpreter lock;
    # on two cores the coarse search leaves one free) instead of after it: 0.2-0.5 s of the exports' planning at 8 stages.
    searching = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as beside:
        priced = beside.submit(_baselines_once, searching, problem, stages, recompute, replicas, bounds)
        try:
            if not coarsened and hint is not None and not deadline.passed():
                # Single nodes already: search down from the DP's plan, questions below it beside (`_prove`), the whole time.
                result = _prove(problem, blocks, hint, found[-1], stages, recompute, replicas, bound.seconds, deadline, report,
                                _LEAST_SHARE * deadline.remaining(), progress_line, searching)
            elif (remaining := _coarse_seconds(deadline, coarsened, proving)) > 0:
                report(f"{plural(stages, 'stage')}: CP-SAT over {plural(blocks.count, 'block')}, up to {remaining:.0f} s{_best_so_far(problem, found)}")
                result = solve_cpsat(
                    problem,
                    blocks,
                    stages,
                    recompute=recompute,
                    replicas=replicas,
                    hint=hint,
                    floor_seconds=bound.seconds,
                    ceiling_seconds=found[-1].bottleneck_seconds if hint is not None else math.inf,
                    time_limit=remaining,
                    progress=progress_line,
                    searching=searching,
                )
        finally:
            searching.set()  # priced now where no search ran (out of time, or no plan to start from); ends however planning ends
        if result.layout is not None:
            found.append(evaluate(problem, to_assignment(problem, blocks, result.layout), replicas=replicas, bounds=bounds))
        report(f"{plural(stages, 'stage')}: comparing against baselines{_best_so_far(problem, found)}")
        found.extend(priced.result())
    start = _choose(problem, found)
    if coarsened and start is not None and not deadline.passed():
        found.extend(_refine(problem, blocks, start, stages, recompute, replicas, bounds, deadline, _REFINE_CP_SHARE * deadline.seconds, report,
                             _STALL if proving else None))
    nodes, proof = blocks, result
    if proving and not deadline.passed() and (least := _choose(problem, found)) is not None:
        nodes = coarsen(problem, problem.n)
        proof = _prove(problem, nodes, _layout_of(problem, least, nodes, replicas), least, stages, recompute, replicas, bound.seconds,
                       deadline, report, hold=_LEAST_SHARE * deadline.remaining(), unpatterned=_AIMED_HOLD)
        if proof.layout is not None:
            found.append(evaluate(problem, to_assignment(problem, nodes, proof.layout), replicas=replicas, bounds=bounds))
    best = _choose(problem, found, by_iteration)
    least = _choose(problem, found)
    if best is None or least is None:
        fitting = [p.latency_seconds for p in found if fits(p) and placed(problem, p)]
        raise OnnxpipeError(latency_message(problem, fitting, stages) if fitting else infeasible_message(problem, bound, stages))
    objective = best.bottleneck_seconds
    # Over the blocks CP-SAT searched last: its bound (its model is the pricing rule `evaluate` applies, each term rounded
    # up to whole nanoseconds: `tolerance`; capped by the least bottleneck found, which every plan it did not search
    # exceeds); refined plans only improve on it.
    tolerance = 1e-9 * (nodes.count + len(nodes.nbytes) + 4)
    searched = proof.status in ("OPTIMAL", "FEASIBLE", "UNKNOWN")  # INFEASIBLE under a plan's own ceiling: that plan was not expressible
    on_blocks = max(min(proof.bound_seconds, least.bottleneck_seconds), bound.seconds) if searched else bound.seconds
    # A bound over blocks holds for every plan only when blocks are nodes and every replica count was open to CP-SAT (a large
    # group offers some: offered multiples of 32 of 1,000 devices, it said 0.106 ms where 8, 7, 8 and 9 replicas make 0.064).
    proven = on_blocks if nodes.count == problem.n and not restricted else bound.seconds
    # Likewise its verdict: over some replica counts, OPTIMAL only where the plan meets the bound that holds for every plan
    # (transformer-tiny served at 2 stages on 1,000 devices said OPTIMAL node by node 3.6% above it).
    status = "OPTIMAL" if proof.status == "OPTIMAL" and objective <= (proven if restricted else on_blocks) + tolerance else "FEASIBLE"
    info = SolveInfo(
        status=status,
        bound_seconds=proven,
        gap=max(0.0, (objective - proven) / objective) if objective > 0 else 0.0,
        solve_seconds=time.perf_counter() - started,
        coarsening_loss=blocks.rounding_seconds / objective if objective > 0 else 0.0,
        blocks=blocks.count,
        least_bottleneck_seconds=least.bottleneck_seconds,
    )
    return dataclasses.replace(best, solver=info)


def _held(ceiling: float, nodes: Blocks) -> float:
    """A ceiling as CP-SAT's model over `nodes` holds it (`cpsat.held_ceiling_ns`), in seconds: the patterns a plan it finds
    within the ceiling may have are those reachable at this (`plan.patterns.reachable`)."""
    return held_ceiling_ns(ceiling, nodes) / 1e9


def _baselines_once(searching: threading.Event, problem: Problem, stages: int, recompute: str, replicas: bool, bounds: Bounds) -> list[Plan]:
    """The baselines of `stages` stages exactly as `compare` reports them (data parallelism is one stage on every device: at
    one stage it counts, across device groups too), so the plan is never worse than any of them; priced once `searching`."""
    searching.wait()
    return [p for p in baselines(problem, stages, recompute, replicas, bounds=bounds).values() if len(p.stages) == stages]


def _coarse_seconds(deadline: Deadline, coarsened: bool, proving: bool) -> float:
    """The CP-SAT over blocks' time. When the search node by node follows (`_prove`), its plan is only that search's
    start, so it takes no longer than refinement's CP-SAT: over BART-base's export at 8 heterogeneous stages (142 blocks,
    `coarsen`'s branch starts included) it ran 13 s, and the search node by node its 9 s after it: 23 s instead of 14."""
    remaining = deadline.remaining() * ((1 - _REFINE_SHARE) if coarsened else 1.0)
    if proving:
        return min(remaining, _REFINE_CP_SHARE * deadline.seconds)
    return remaining


def _prove(problem: Problem, nodes: Blocks, hint: Layout | None, least: Plan, stages: int, recompute: str, replicas: bool, floor: float,
           until: Deadline, report: Callable[[str], None], hold: float, progress: Callable[[float, float], None] | None = None,
           searching: threading.Event | None = None, unpatterned: float = 1.0) -> CpResult:
    """CP-SAT node by node down from the plan `least` (`hint`, its layout over `nodes`, when they can express it), its
    bottleneck the ceiling, and beside it in a second thread questions below that plan (`probe`), both until
    `until`: a better plan if there is one, and a bound that holds for every plan (proven optimal when it closes).
    The search down ends the questions when it ends; the questions end it once they have proven its plan within
    `probe.CLOSE` (aiming there first on one device type, where CP-SAT refutes such a question in seconds, and on
    several where the patterns reaching the best plan's bottleneck are few, each asked one pattern at a time, `plan.patterns`;
    otherwise bisecting), not before `hold` seconds (`unpatterned` of it where they are not asked by pattern). On several device types the search down and each question are told
    the patterns whose chain walk reaches their ceiling (`plan.patterns.reachable`): no plan of another is within it.
    Each plan the search down finds is handed to the questions, and where they aim ends the one being asked if it is at
    or below its ceiling (answered: moot, also one whose model is still being built; asked by pattern, the patterns left go to the next question, below that plan:
    T5-small's export at 4 heterogeneous stages ran its first question on for 8.7 s after the search down had answered it.
    Where they bisect over every type, the next question's larger model slowed the search down more than it saved:
    LLaMA's export at 8 heterogeneous stages proven in 5.7-6.4 s instead of 3.9-4.7 s). Side by side because neither alone does both:
    the search down proves the zoo's and most exports' plans optimal in 0.1-3 s and stalls on the encoder-decoders
    with its bound on the floor, where the questions raise it (measured on one core each; CP-SAT leaves the
    interpreter lock while it searches)."""
    best = least.bottleneck_seconds
    report(f"{plural(stages, 'stage')}: CP-SAT node by node from the best plan and below it, up to {until.remaining():.0f} s"
           f"{_best_so_far(problem, [least])}")
    workers = half_the_cores()
    # Building a model is Python, which holds the interpreter lock: the questions build theirs once the search down is
    # searching (CP-SAT leaves the lock), not against its build, which would start the search down later (`searching`:
    # the caller's, when more waits for it).
    searching = searching or threading.Event()

    one_type = len(problem.group_devices) == 1
    # On several device types, only the patterns of types whose chain walk reaches the best plan's bottleneck hold a better plan
    # (`reachable`); a question asked one of them at a time where they are few (`patterns`): aimed.
    possible = reachable(problem, stages, _held(best, nodes), replicas)
    few = possible if possible is not None and len(possible) <= MOST else None
    by_pattern = Patterns(problem, few, hint.groups if hint is not None else ()) if few is not None else None
    hold *= 1.0 if by_pattern is not None else unpatterned
    aim = one_type or by_pattern is not None
    asked_below = [math.inf]  # the ceiling of the question being asked
    found_below = [best]  # the bottleneck of the last (best) plan the search down has found

    def answered() -> bool:
        """Where questions aim (below), the search down has found a plan within the ceiling of the one being asked: it is
        moot (it ends, and the next asks below that plan)."""
        return aim and found_below[0] <= asked_below[0]

    asking = Stop(moot=answered)
    down = Stop()
    ended = threading.Event()  # the search down has ended
    started = time.perf_counter()

    # The longest a question's model took to build: a question given less time could not search, so it is not asked (near the
    # end of the time, BART-base's export at 4 heterogeneous stages built eight such models, 0.13-0.26 s each, past its limit).
    built = [0.0]

    def ask(low: float, ceiling: float, seconds: float) -> CpResult:
        searching.wait()
        asked_below[0] = ceiling

        # The patterns whose walk fits within the question's ceiling: no plan of another has a bottleneck within it.
        reach = reachable(problem, stages, _held(ceiling, nodes), replicas)

        def one(question: Problem, limit: float) -> CpResult:
            if limit < built[0]:
                return CpResult(None, "UNKNOWN", math.inf, low, 0.0)
            begun = time.perf_counter()
            answer = solve_cpsat(question, nodes, stages, recompute=recompute, replicas=replicas, floor_seconds=low, ceiling_seconds=ceiling,
                                 time_limit=limit, workers=workers, stop=asking, refute=True, patterns=None if by_pattern else reach)
            built[0] = max(built[0], time.perf_counter() - begun - answer.wall_seconds)
            return answer

        if by_pattern is None:
            return one(problem, seconds)
        # Once answered, the patterns not yet asked are left to the next question, below that plan (none of their models built).
        return by_pattern.ask(one, ceiling, Deadline(seconds), lambda: asking.stopped or answered(), reach)

    def found_down(value: float, bound: float) -> None:
        found_below[0] = value
        if answered():
            asking.interrupt()  # ask again below this plan
        if progress is not None:
            progress(value, bound)

    def questions() -> Probed:
        probed = probe(ask, floor, best, until, lambda text: report(f"{plural(stages, 'stage')}: {text}"),
                       stopped=lambda: asking.stopped or until.remaining() / 2 < built[0],
                       known=lambda: found_below[0], aim=aim)
        if close(min([found_below[0], *(r.objective_seconds for r in probed.found)]), probed.bound_seconds):
            # The best plan is within CLOSE of a bound for every plan, the goal: the search down, which may still prove it
            # optimal, ends once it has had `hold` seconds.
            ended.wait(max(0.0, started + hold - time.perf_counter()))
            down.stop()
        return probed

    with ThreadPoolExecutor(max_workers=1) as beside:
        asked = beside.submit(questions)
        try:
            searched = solve_cpsat(problem, nodes, stages, recompute=recompute, replicas=replicas, hint=hint, floor_seconds=floor,
                                   ceiling_seconds=best, time_limit=until.remaining(), workers=workers, progress=found_down,
                                   stop=down, searching=searching, patterns=possible)
        finally:
            ended.set()
            asking.stop()  # the search down has ended: proven, or out of time
            searching.set()  # a question still waiting finds itself stopped
        while not asked.done():  # told again: a question told in the instant before its solver began searching misses it
            wait([asked], timeout=0.05)
            asking.stop()
        probed = asked.result()
    if searched.status in ("OPTIMAL", "INFEASIBLE"):
        return searched
    bound = max(probed.bound_seconds, min(searched.bound_seconds, best))  # CP-SAT's bound under its ceiling holds below it
    top = min((r for r in (searched, *probed.found) if r.layout is not None), key=lambda r: r.objective_seconds, default=searched)
    status = "OPTIMAL" if top.status == "OPTIMAL" else "FEASIBLE" if top.layout is not None else "UNKNOWN"
    return CpResult(top.layout, status, top.objective_seconds, bound, searched.wall_seconds)


def _refine(
    problem: Problem,
    blocks: Blocks,
    start: Plan,
    stages: int,
    recompute: str,
    replicas: bool,
    bounds: Bounds,
    deadline: Deadline,
    cp_seconds: float,
    report: Callable[[str], None],
    stall: float | None = None,
) -> list[Plan]:
    """Plans over blocks refined around the best plan's stage cuts (`refine`): the DP there, level after
    level around each new best while it improves (each level is cheap); then one CP-SAT over the last
    level's blocks, warm-started from the best plan (which is made of them) with its bottleneck as ceiling,
    for what intervals of the order cannot express, ended after `stall` seconds without a better plan (None: at its limit)."""
    found: list[Plan] = []
    best = start
    while True:
        node_stage = _stage_of_nodes(problem, best)
        finer = refine(problem, blocks, node_stage)
        report(f"{plural(stages, 'stage')}: refining, dynamic program over {plural(finer.count, 'block')} around the stage cuts{_best_so_far(problem, [best])}")
        layout = solve_dp(problem, finer, stages, recompute, replicas, deadline=deadline)
        if layout is None:
            break
        found.append(evaluate(problem, to_assignment(problem, finer, layout), replicas=replicas, bounds=bounds))
        if not (within(problem, found[-1]) and found[-1].bottleneck_seconds < best.bottleneck_seconds * (1 - _IMPROVES)):
            break
        best = found[-1]
        if deadline.passed():
            return found
    remaining = min(deadline.remaining(), cp_seconds)
    if remaining > 0:
        report(f"{plural(stages, 'stage')}: refining, CP-SAT over {plural(finer.count, 'block')}, up to {remaining:.0f} s{_best_so_far(problem, [best])}")
        idle = Stall(stall) if stall is not None else None
        try:
            result = solve_cpsat(problem, finer, stages, recompute=recompute, replicas=replicas, hint=_layout_of(problem, best, finer, replicas),
                                 floor_seconds=bounds(stages, replicas).seconds, ceiling_seconds=best.bottleneck_seconds, time_limit=remaining,
                                 progress=idle.found if idle else None, stop=idle.stop if idle else None)
        finally:
            if idle is not None:
                idle.close()
        if result.layout is not None:
            found.append(evaluate(problem, to_assignment(problem, finer, result.layout), replicas=replicas, bounds=bounds))
    return found


def _best_so_far(problem: Problem, found: Sequence[Plan]) -> str:
    """A progress line's tail: the best fitting plan's bottleneck and iteration so far."""
    best = _choose(problem, list(found))
    return f" (best so far: bottleneck {best.bottleneck_seconds * 1e3:.3f} ms, iteration {best.iteration_seconds * 1e3:.2f} ms)" if best else ""


def _stage_of_nodes(problem: Problem, plan: Plan) -> np.ndarray:
    position = {n: i for i, n in enumerate(problem.nodes)}
    node_stage = np.zeros(problem.n, dtype=np.int64)
    for s in plan.stages:
        node_stage[[position[n] for n in s.nodes]] = s.index
    return node_stage


def _layout_of(problem: Problem, plan: Plan, blocks: Blocks, replicas: bool) -> Layout | None:
    """A plan made of `blocks` as the solvers' layout; None when they cannot express it (a stage over
    several device groups, or replicated where replicas are off)."""
    groups = [{problem.group_of(d) for d in s.devices} for s in plan.stages]
    if any(len(g) > 1 for g in groups) or (not replicas and any(len(s.devices) > 1 for s in plan.stages)):
        return None
    return Layout(
        block_stage=_stage_of_nodes(problem, plan)[blocks.starts[:-1]],
        groups=tuple(g.pop() for g in groups),
        replicas=tuple(len(s.devices) for s in plan.stages),
        recompute=tuple(s.recompute for s in plan.stages),
    )


def _choose(problem: Problem, found: list[Plan], by_iteration: bool = False) -> Plan | None:
    """The plan that fits (within the latency bound) with the least bottleneck (or iteration time, then
    bottleneck), then the least communication."""
    fitting = [p for p in found if within(problem, p)]
    if not fitting:
        return None

    def key(p: Plan) -> tuple[float, ...]:
        rest = (round(p.bottleneck_seconds, 12), sum(s.comm_in_seconds + s.comm_out_seconds for s in p.stages))
        return (round(p.iteration_seconds, 12), *rest) if by_iteration else rest

    return min(fitting, key=key)


def infeasible_message(problem: Problem, bound: LowerBound, stages: int) -> str:
    need = bound.memory_bytes
    cap = bound.capacity_bytes
    fixes = "try --recompute always, more stages, a smaller micro-batch (--microbatches), or a target with more memory"
    if need > cap:
        return f"no plan fits: the smallest stage needs {format_bytes(need)} of memory but the largest device holds {format_bytes(cap)}; {fixes}"
    if not bound.chain_fits:
        return (f"no plan with {plural(stages, 'stage')} fits in memory: however the model is cut, some stage's parameter state and one "
                f"micro-batch of its activations (held with recompute too) exceed its device's memory (largest device {format_bytes(cap)}); "
                "try more stages, a smaller micro-batch (--microbatches), or a target with more memory")
    return (
        f"no plan with {plural(stages, 'stage')} fits in memory (largest device {format_bytes(cap)}; every plan needs at least "
        f"{format_bytes(need)} on some device, more once activations are stashed); {fixes}"
    )


def latency_message(problem: Problem, fitting: Sequence[float], stages: int | None = None) -> str:
    """Why no plan is taken although some fit in memory (`fitting`: their latencies): each is over
    `--max-latency`; names the least latency among them."""
    best = min(fitting)
    of = f" of {stages} stage{'s' if stages != 1 else ''}" if stages is not None else ""
    more = " or drop --stages (fewer stages: fewer transfers)," if stages is not None else ""
    return (f"no plan{of} has a latency within --max-latency {problem.max_latency * 1e3:.4g} ms: the least latency among the "
            f"{len(fitting)} plans priced that fit is {best * 1e3:.4g} ms; raise --max-latency to at least {best * 1e3:.4g} ms,{more} "
            "or make each micro-batch smaller (more --microbatches, or a smaller --batch)")


def _ensure_some_fit(problem: Problem, bound: LowerBound, stages: int) -> None:
    if problem.n < stages:
        raise OnnxpipeError(f"the model has {plural(problem.n, 'compute node')}, fewer than {stages} stages; use at most {problem.n} stages")
    if not bound.fits:
        raise OnnxpipeError(infeasible_message(problem, bound, stages))
