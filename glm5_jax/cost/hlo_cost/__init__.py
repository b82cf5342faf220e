"""Matmul FLOPs, HBM bytes and collectives of an optimized HLO module with every loop body multiplied by
its trip count.

XLA's `compiled.cost_analysis()` visits a `while` body once, so for a model whose layers run in a
`scan` (and attention chunks in a `lax.map`) it reports the cost of roughly one layer. `hlo_cost` walks the
optimized HLO text instead and counts, per computation:

* compiler-visible FLOPs of `dot`, `convolution` and `ragged-dot` (2 x output elements x contracted
  size; elementwise work is not counted: it is small next to the matmuls of this model) (`matmul_flops`);
* kernel FLOPs of Mosaic custom calls (`tpu_custom_call`): the `pl.CostEstimate` a Pallas kernel
  declares, which the TPU lowering writes into the call's backend config
  (``custom_call_config.cost_estimate``), else for the ragged-dot lowering 2 x m x k x n from its shapes;
  megablox grouped matmuls, given the rows their groups hold, by the row tiles they visit (`kernels`);
* bytes accessed by each top-level instruction (operands + result, or a kernel's declared bytes; a
  fusion counts at its call site, never inside), roughly what XLA's own cost analysis counts
  (`hbm_traffic`);
* every collective (`CollectiveOp`: kind, per-chip buffer bytes, replica groups, async or not), an
  all-reduce that only feeds this chip's dynamic slice (the TPU all-reduce-scatter fusion) as a
  reduce-scatter (`collective_ops`);

and adds called computations: fusions and calls once, `while` bodies x their trip count (XLA's
`known_trip_count`, else read from the loop: `i < N` in the condition, `i`'s initial constant in the
caller, its step the constant the body adds; a loop whose count cannot be read is counted once and
reported; `trip_counts`), conditionals by their dearest branch (`walk`). With a `categorize` function every
count is also filed under a category read from the instruction's op_name metadata; with a `StepTiming`,
seconds (`timing`). The HLO text is read by `parsing`. With ``rules`` (`CostRules`; `CONSERVATIVE`: all of
them), the conservative rules of docs/cost_model.md: each Pallas kernel by its grid, read from its
serialized Mosaic module (`mosaic_grid`: the cores its parallel axes can use, its grid steps, the bytes its
blocks move), a fixed cost per top-level instruction, ring collectives' HBM passes; without, the model as
it was (kernels on both cores at their declared bytes).

Checked against hand counts (tests/cost/test_hlo_cost.py, test_hlo_kernels.py, test_hlo_collectives.py,
test_hbm_bytes.py) and, on GLM-5 train steps compiled for v5p, against the analytic model FLOPs of
glm5_jax/cost/flops.py (tests/train/test_compile_report.py). The TPU compiler writes batched matmuls as
convolutions with a dilated or padded "spatial" batch dim; those count only the taps that meet real input
elements.
"""
from glm5_jax.cost.hlo_cost.collective_ops import (ASYNC_COLLECTIVE_DONE, ASYNC_COLLECTIVE_FUSION,
                                                   ASYNC_COLLECTIVE_START, CollectiveOp)
from glm5_jax.cost.hlo_cost.hbm_traffic import (gather_read_bytes, scatter_touched_bytes, scatter_window,
                                                update_slice_bytes)
from glm5_jax.cost.hlo_cost.kernels import GroupedMatmulLoad, grouped_matmul_tiles
from glm5_jax.cost.hlo_cost.mosaic_grid import KernelGrid, kernel_grid
from glm5_jax.cost.hlo_cost.parsing import DTYPE_BYTES, Array, hbm_bytes, laid_out, parse_computations
from glm5_jax.cost.hlo_cost.rules import CONSERVATIVE, CostRules
from glm5_jax.cost.hlo_cost.timing import ExposedGroup, StepTiming, TopInstruction, exposed_async_seconds
from glm5_jax.cost.hlo_cost.trip_counts import trip_count
from glm5_jax.cost.hlo_cost.walk import HLO_COMPUTATION_PREFIX, HloCost, hlo_cost

__all__ = ["ASYNC_COLLECTIVE_DONE", "ASYNC_COLLECTIVE_FUSION", "ASYNC_COLLECTIVE_START", "CONSERVATIVE", "DTYPE_BYTES",
           "HLO_COMPUTATION_PREFIX", "Array", "CollectiveOp", "CostRules", "GroupedMatmulLoad", "HloCost",
           "KernelGrid", "StepTiming", "kernel_grid",
           "TopInstruction", "ExposedGroup", "exposed_async_seconds", "gather_read_bytes", "grouped_matmul_tiles",
           "hbm_bytes",
           "hlo_cost", "laid_out", "parse_computations", "scatter_touched_bytes", "scatter_window", "trip_count",
           "update_slice_bytes"]
