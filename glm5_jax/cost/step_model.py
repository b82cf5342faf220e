"""The rules a compiled step's estimate is made under, shared by the training and decode compile reports.

`StepCostModel` bundles the HLO walk's `CostRules` with the collective model's choices; `step_timing` turns
one into the walk's `StepTiming` for a topology and mesh; `cost_model_record` is what a report records of
it (``report["cost_model"]``). docs/cost_model.md explains each rule.
"""
from __future__ import annotations

import dataclasses

from glm5_jax.cost.chips import chip_of_topology
from glm5_jax.cost.hlo_cost import CONSERVATIVE, CostRules, StepTiming
from glm5_jax.cost.ici import CollectiveModel, torus_dims


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """The rules a report's estimate is made under (docs/cost_model.md), recorded in it as ``cost_model``:
    the HLO walk's `CostRules` (kernel core split, grid-step and per-op seconds, kernels' bytes by their
    grids, ring collectives' HBM passes), the all-to-all link model (glm5_jax.cost.ici), the SparseCores'
    reduce-scatter rate (None: the chip's, glm5_jax.cost.chips; 1.0: the full link rate) and the expert
    load the routed experts' grouped matmuls run at ("busiest": the busiest chip's, its capacity buffer
    filled to moe_capacity_factor x the mean; "mean")."""
    rules: CostRules = CONSERVATIVE
    all_to_all_link_model: str = "busiest_link"
    sparsecore_rate: float | None = None
    expert_load: str = "busiest"
    sparsecore_kinds: tuple = ("reduce-scatter",)     # the offloaded collectives the rate applies to
    ring_dims: str = "per_dimension"                   # a multi-dim ring group (glm5_jax.cost.ici)


# the model before the conservative rules: every kernel on both cores at its declared bytes, balanced
# all-to-all links, SparseCore collectives at the link rate, the mean expert load
OPTIMISTIC = StepCostModel(CostRules(), "balanced", 1.0, "mean", ring_dims="add")


def cost_model_record(cost_model: StepCostModel, chip, comm_model) -> dict:
    """What a report records of the rules it was made under (docs/cost_model.md)."""
    rules = cost_model.rules
    return {"kernel_core_split": f"busiest of {chip.tensor_cores} cores by the parallel grid axes"
            if rules.kernel_core_split and chip.tensor_cores > 1 else "all cores",
            "grid_step_seconds": rules.grid_step_seconds, "op_fixed_seconds": rules.op_fixed_seconds,
            "kernel_bytes": "by grid" if rules.kernel_grid_bytes else "declared",
            "collective_hbm_passes": rules.collective_hbm_passes,
            "all_to_all_link_model": cost_model.all_to_all_link_model, "ring_dims": cost_model.ring_dims,
            "sparsecore_rate": comm_model.sparsecore_factor if comm_model is not None else None,
            "expert_load": cost_model.expert_load, "hbm_limit_gib": round(chip.hbm_bytes / 2**30, 2)}


def step_timing(topology: str, mesh, cost_model: StepCostModel = StepCostModel()):
    """(StepTiming at the chip's achievable rates, CollectiveModel or None): chips without ICI link facts
    (glm5_jax.cost.chips) get no communication time."""
    chip = chip_of_topology(topology)
    if chip.ici_link_bandwidth is None:
        return StepTiming(chip.achievable_flops, chip.achievable_hbm_bandwidth, lambda op: 0.0), None
    sparsecore = cost_model.sparsecore_rate if cost_model.sparsecore_rate is not None \
        else chip.sparsecore_reduce_scatter_factor
    model = CollectiveModel([d.coords for d in mesh.devices.flat], torus_dims(topology),
                            link_bandwidth=chip.achievable_link_bandwidth, step_latency=chip.ici_step_latency,
                            all_to_all_link_model=cost_model.all_to_all_link_model, sparsecore_factor=sparsecore,
                            sparsecore_kinds=cost_model.sparsecore_kinds, ring_dims=cost_model.ring_dims)
    return StepTiming(chip.achievable_flops, chip.achievable_hbm_bandwidth, model.seconds), model
