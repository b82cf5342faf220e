"""The collectives of the HLO: what each collective instruction moves (`CollectiveOp`), and how the TPU
compiler's async forms are recognised (start/done pairs, its async collective fusion, its all-reduce-scatter
fusion)."""
from __future__ import annotations

import dataclasses

from glm5_jax.cost.collectives import collective_groups
from glm5_jax.cost.hlo_cost.parsing import arrays_of, dense_bytes

# collectives whose async start returns ((operands), results, ...): all-reduce-start returns its result only
ASYNC_TUPLE_COLLECTIVES = {"all-gather", "all-to-all", "collective-permute", "ragged-all-to-all"}
COLLECTIVES = {"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute"}


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction as compiled: `nbytes` is its per-chip buffer (all-gather: the gathered
    result; the others: the operand), `groups` the partition ids that talk (collective-permute: the
    (source, target) pairs), `is_async` when the HLO issues it as a start/done pair."""
    kind: str
    nbytes: int
    groups: tuple
    is_async: bool
    category: str
    offloaded: bool = False       # run by the SparseCores (an async call on the "sparsecore" thread)


def collective_op(opcode: str, shape: str, operand_shapes: list[str], attrs: str, is_async: bool, category: str,
                  num_partitions: int, reduce_scatter: bool = False, offloaded: bool = False) -> CollectiveOp | None:
    """The collective an instruction is (an all-reduce as a reduce-scatter when ``reduce_scatter``), or None."""
    kind = opcode.removesuffix("-start")
    if kind not in COLLECTIVES:
        return None
    if kind == "all-reduce" and reduce_scatter:
        kind = "reduce-scatter"
    operands = [a for t in operand_shapes for a in arrays_of(t)]
    if kind == "all-gather":
        nbytes = dense_bytes(arrays_of(shape)[-1:]) if opcode.endswith("-start") else dense_bytes(arrays_of(shape))
    elif kind == "ragged-all-to-all":
        # each row is sent once: a chip sends at most its input buffer, and what all chips send is what their
        # output buffers take in, so a chip sends on average at most the smaller of the two (a dispatch: its
        # rows; their return: the rows its output buffer takes back)
        nbytes = min(dense_bytes(operands[:1]), dense_bytes(operands[1:2]))
    else:
        nbytes = dense_bytes(operands)
    return CollectiveOp(kind, nbytes, collective_groups(attrs, num_partitions), is_async, category, offloaded)


# The TPU compiler's async collective fusion writes one asynchronous collective three times: in the fusion
# instruction that starts it (named async-collective-start*), in the compute fusion it runs beside (its
# computation named async_collective_fusion*) and in the fusion that waits for it (async-collective-done*).
# It is counted once, at its start, as asynchronous.
ASYNC_COLLECTIVE_START = "async-collective-start"
ASYNC_COLLECTIVE_DONE = "async-collective-done"
ASYNC_COLLECTIVE_FUSION = "async_collective_fusion"


def ring_hbm_extra_bytes(op: CollectiveOp, passes: dict) -> float:
    """HBM bytes a ring collective moves beyond one read of its operand and one write of its result
    (`passes`: kind -> (x operand, x result), glm5_jax.cost.hlo_cost.rules.RING_HBM_PASSES)."""
    if op.kind not in passes or not op.groups:
        return 0.0
    n = len(op.groups[0])
    if n <= 1:
        return 0.0
    operand = op.nbytes / n if op.kind == "all-gather" else op.nbytes
    result = op.nbytes / n if op.kind == "reduce-scatter" else op.nbytes
    x_operand, x_result = passes[op.kind]
    return max(0.0, x_operand * op.nbytes + x_result * op.nbytes - operand - result)


def collectives_in(instrs: dict) -> set[str]:
    """The collective instructions (sync, or the start of an async one) of a computation."""
    return {n for n, (_, op, _, _, _) in instrs.items() if op.removesuffix("-start") in COLLECTIVES}


def reduce_scatter_fusion(instrs: dict) -> bool:
    """An all-reduce whose result is only dynamic-sliced to this chip's shard (the TPU compiler's
    all-reduce-scatter fusion) moves what a reduce-scatter moves."""
    root = list(instrs.values())[-1] if instrs else None
    return bool(root and root[1] == "dynamic-slice" and root[2] and root[2][0] in instrs
                and instrs[root[2][0]][1] == "all-reduce")


def collective_fusion_part(name: str, opcode: str, callees: dict) -> str | None:
    """Which fusion of an async collective fusion an instruction is ("start", "compute", "done"), or None."""
    if opcode != "fusion":
        return None
    if name.startswith(ASYNC_COLLECTIVE_START):
        return "start"
    if name.startswith(ASYNC_COLLECTIVE_DONE):
        return "done"
    return "compute" if callees.get("calls", "").startswith(ASYNC_COLLECTIVE_FUSION) else None


def async_start_of(name: str, opcode: str, operands: list[str]) -> str | None:
    """The start instruction an async done waits for: an ``X-done``'s (``async-done``, ``all-gather-done``,
    ...) operand, or the async collective fusion's ``async-collective-start.N`` for its
    ``async-collective-done.N``."""
    if opcode.endswith("-done") and operands:
        return operands[0]
    if name.startswith(ASYNC_COLLECTIVE_DONE):
        return ASYNC_COLLECTIVE_START + name[len(ASYNC_COLLECTIVE_DONE):]
    return None


