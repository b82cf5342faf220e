"""Seconds from counts: the rates a step runs at (`StepTiming`), what async collectives leave exposed past
the compute scheduled beside them (`exposed_async_seconds`), and the instructions that cost the most
(`TopInstruction`)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepTiming:
    """What turns counts into seconds: per-chip peak FLOP/s and HBM bytes/s, and the time of one
    collective (`CollectiveOp` -> seconds; glm5_jax.cost.ici)."""
    peak_flops: float
    hbm_bandwidth: float
    collective_seconds: object


def exposed_async_seconds(windows: list[tuple[int, int, float]], instr_seconds: list[float]) -> float:
    """Exposed seconds of async collectives, each a window (start index, done index, seconds) over a
    computation's scheduled instructions: it runs beside the instructions strictly between its start and
    its done. Windows that overlap share that compute (and are in flight together), so each group of
    overlapping windows exposes max(0, its collectives' seconds - the roofline seconds inside the union of
    its windows). A start without a done in the same computation runs to the computation's end; a done
    scheduled before its start (a loop body that waits at the top of the next trip for what it started at
    the bottom of this one) wraps round the body."""
    n = len(instr_seconds)
    instr_seconds = instr_seconds * 2               # index i + n: instruction i in the next trip
    windows = [(start, done + n if done < start else done, seconds) for start, done, seconds in windows]
    exposed, group = 0.0, None                      # group: [first start, last done, async seconds]
    for start, done, seconds in sorted(windows) + [(2 * n + 1, 0, 0.0)]:
        if group is not None and start < group[1]:
            group[1] = max(group[1], done)
            group[2] += seconds
            continue
        if group is not None:
            exposed += max(0.0, group[2] - sum(instr_seconds[group[0] + 1:group[1]]))
        group = [start, done, seconds]
    return exposed


@dataclasses.dataclass(frozen=True)
class TopInstruction:
    """One top-level instruction of the step and what it costs per step (`hlo_cost`'s ``top``)."""
    name: str              # the instruction's name in the compiled HLO
    computation: str       # the computation it is in
    category: str
    opcode: str
    op_name: str           # its metadata op_name (the JAX source of it)
    executions: float      # per step: the product of the trip counts of the loops around it
    seconds: float         # roofline seconds per step, all executions
    bytes: float           # HBM bytes per step, all executions
    flops: float           # per step, all executions


def top_instructions(own_instrs: dict, runs: dict, entry: str, n: int) -> list[TopInstruction]:
    """The n instructions with the most roofline seconds per step: each computation's executions per step
    are the sum over its callers of the caller's executions x the callee's runs per caller run."""
    executions: dict[str, float] = {}

    def visit(comp: str, times: float, depth: int = 0):
        if depth > 64:
            raise ValueError(f"computation call graph deeper than 64 at {comp!r}")
        executions[comp] = executions.get(comp, 0.0) + times
        for callee, k in runs.get(comp, {}).items():
            visit(callee, times * k, depth + 1)

    visit(entry, 1.0)
    rows = [TopInstruction(iname, comp, cat, opcode, op_name, executions[comp], sec * executions[comp],
                           nbytes * executions[comp], flops * executions[comp])
            for comp, instrs in own_instrs.items() if comp in executions
            for iname, cat, sec, nbytes, flops, opcode, op_name in instrs]
    return sorted(rows, key=lambda r: -r.seconds)[:n]


