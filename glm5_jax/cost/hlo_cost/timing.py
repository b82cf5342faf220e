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


def exposed_async_groups(windows: list[tuple], instr_seconds: list[float]) -> list[tuple]:
    """The groups of overlapping async windows (start index, done index, seconds, what) over a computation's
    scheduled instructions that leave time exposed, as (exposed s, collectives' s, compute s beside them,
    [what of each window]); the rule is `exposed_async_seconds`'s."""
    n = len(instr_seconds)
    instr_seconds = instr_seconds * 2               # index i + n: instruction i in the next trip
    windows = [(start, done + n if done < start else done, seconds, what) for start, done, seconds, what in windows]
    out, group = [], None                           # group: [first start, last done, async seconds, whats]
    for start, done, seconds, what in sorted(windows, key=lambda w: w[:3]) + [(2 * n + 1, 0, 0.0, None)]:
        if group is not None and start < group[1]:
            group[1] = max(group[1], done)
            group[2] += seconds
            group[3].append(what)
            continue
        if group is not None:
            compute = sum(instr_seconds[group[0] + 1:group[1]])
            if group[2] > compute:
                out.append((group[2] - compute, group[2], compute, group[3]))
        group = [start, done, seconds, [what]]
    return out


def exposed_async_seconds(windows: list[tuple[int, int, float]], instr_seconds: list[float]) -> float:
    """Exposed seconds of async collectives, each a window (start index, done index, seconds) over a
    computation's scheduled instructions: it runs beside the instructions strictly between its start and
    its done. Windows that overlap share that compute (and are in flight together), so each group of
    overlapping windows exposes max(0, its collectives' seconds - the roofline seconds inside the union of
    its windows). A start without a done in the same computation runs to the computation's end; a done
    scheduled before its start (a loop body that waits at the top of the next trip for what it started at
    the bottom of this one) wraps round the body."""
    return sum(g[0] for g in exposed_async_groups([(*w, None) for w in windows], instr_seconds))


@dataclasses.dataclass(frozen=True)
class ExposedGroup:
    """A group of overlapping async collectives that the overlap rule leaves partly exposed (`hlo_cost`'s
    ``exposed_groups``): where, how often, and what is in it."""
    computation: str
    executions: float      # per step: the product of the trip counts of the loops around it
    exposed_seconds: float           # one execution
    collective_seconds: float        # one execution: the group's collectives, in flight together
    compute_seconds: float           # one execution: the roofline seconds scheduled beside them
    collectives: tuple               # (start instruction, seconds) of each, largest first


def executions_per_step(runs: dict, entry: str) -> dict[str, float]:
    """Each computation's executions per step: the sum over its callers of the caller's executions x the
    callee's runs per caller run."""
    executions: dict[str, float] = {}

    def visit(comp: str, times: float, depth: int = 0):
        if depth > 64:
            raise ValueError(f"computation call graph deeper than 64 at {comp!r}")
        executions[comp] = executions.get(comp, 0.0) + times
        for callee, k in runs.get(comp, {}).items():
            visit(callee, times * k, depth + 1)

    visit(entry, 1.0)
    return executions


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


def top_instructions(own_instrs: dict, executions: dict[str, float], n: int) -> list[TopInstruction]:
    """The n instructions with the most roofline seconds per step (``executions``: `executions_per_step`)."""
    rows = [TopInstruction(iname, comp, cat, opcode, op_name, executions[comp], sec * executions[comp],
                           nbytes * executions[comp], flops * executions[comp])
            for comp, instrs in own_instrs.items() if comp in executions
            for iname, cat, sec, nbytes, flops, opcode, op_name in instrs]
    return sorted(rows, key=lambda r: -r.seconds)[:n]
