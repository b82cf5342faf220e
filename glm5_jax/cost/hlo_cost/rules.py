"""Which of the cost model's conservative rules a walk applies (`CostRules`); `CostRules()` is the model
before them (every kernel on both TensorCores at its declared bytes, no per-op or per-step overhead,
collectives' HBM traffic as one read and one write), `CONSERVATIVE` all of them (docs/cost_model.md)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CostRules:
    # a Pallas kernel's time by the cores its parallel grid axes can use: the busiest core's share of the
    # parallel iterations x ``cores_per_chip`` (one parallel iteration: 2x the two-core time)
    kernel_core_split: bool = False
    cores_per_chip: int = 2
    # seconds per Pallas grid step on the busiest core (JAX's Pallas TPU matmul guide: ~0.35 us)
    grid_step_seconds: float = 0.0
    # seconds per top-level instruction (a fusion / kernel / copy / collective launch)
    op_fixed_seconds: float = 0.0
    # a kernel's HBM bytes from its grid (each block x the times its index changes), not its declared estimate
    kernel_grid_bytes: bool = False
    # a ring collective's HBM traffic: reduce-scatter 3x its operand (read own chunk, read received, write
    # the sum, per step), all-gather 2x its result (write received, read to forward), all-reduce both
    collective_hbm_passes: bool = False

    @property
    def reads_grids(self) -> bool:
        return self.kernel_core_split or self.grid_step_seconds > 0 or self.kernel_grid_bytes


# ~0.35 us per grid step: https://docs.jax.dev/en/latest/pallas/tpu/matmul.html ("Performance of pipelining")
GRID_STEP_SECONDS = 0.35e-6
OP_FIXED_SECONDS = 1e-6
CONSERVATIVE = CostRules(kernel_core_split=True, grid_step_seconds=GRID_STEP_SECONDS,
                         op_fixed_seconds=OP_FIXED_SECONDS, kernel_grid_bytes=True, collective_hbm_passes=True)

# HBM bytes a ring collective moves per byte of its buffer (`CostRules.collective_hbm_passes`): kind ->
# (x operand, x result)
RING_HBM_PASSES = {"reduce-scatter": (3.0, 0.0), "all-gather": (0.0, 2.0), "all-reduce": (5.0, 0.0)}
