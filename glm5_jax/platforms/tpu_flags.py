"""TPU compiler flag sets, chosen by name (`TrainConfig.tpu_flags`; the decode compile report's `--tpu_flags`).

libtpu reads its flags once, from the ``LIBTPU_INIT_ARGS`` environment variable, when it starts in a
process: `apply` must run before the first TPU use (a TPU backend, or a topology for an ahead-of-time
compile). `train.py` applies the config's set right after reading the config.

* ``"none"``: libtpu's defaults. Collectives are synchronous: every all-gather / reduce-scatter /
  all-reduce / all-to-all of the step waits for its data and stalls compute.
* ``"collective_overlap"``: the TPU compiler's async collective fusion: the FSDP all-gathers, gradient
  reduce-scatters and all-reduces run inside the compute fusions around them (async-collective-start /
  -done in the compiled HLO), so they overlap the layer's matmuls; data-parallel all-reduces of
  different sizes are combined. The same flags the public MaxText v5p training recipes set. Also the
  all-to-all asynchronous (``--xla_tpu_enable_async_all_to_all``): with the expert-parallel tokens sent in
  chunks (``RuntimeConfig.moe_a2a_chunks``) one chunk's transport runs beside another chunk's expert
  matmuls; the ragged all-to-all too (``--xla_tpu_enable_async_ragged_all_to_all``: the decode MoE's ragged
  exchange, glm5_jax/model/moe/decode_a2a.py, beside the shared expert). And the latency-hiding scheduler told to prefer keeping more collectives in flight over avoiding
  a stall (``--xla_lhs_prioritize_async_depth_over_stall``): with the all-to-alls async, the scheduler
  otherwise leaves most of the experts' FSDP weight all-gathers synchronous.
* ``"sparsecore_offload"``: ``"collective_overlap"`` with the FSDP weight all-gathers, gradient
  reduce-scatters and all-reduces offloaded to the SparseCores (v5p has four per chip, v6e two;
  ``--xla_tpu_enable_sparse_core_collective_offload_{reduce_scatter,all_reduce,all_gather}`` with the
  SparseCore settings the public v5p / v6e training recipes pair them with). In the compiled program each
  becomes an asynchronous call on the ``sparsecore`` thread, so it runs beside the TensorCore's compute;
  without it the TPU compiler leaves reduce-scatters synchronous (its async reduce-scatter fusion does not
  compile for these programs) and some all-gathers too. For chips with SparseCores only.

Flags the user already put in ``LIBTPU_INIT_ARGS`` win over the set's value for the same flag.
"""
from __future__ import annotations

import os

FLAG_SETS: dict[str, tuple[str, ...]] = {
    "none": (),
    "collective_overlap": (
        "--xla_tpu_enable_async_collective_fusion=true",
        "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
        "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true",
        "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
        "--xla_tpu_overlap_compute_collective_tc=true",
        "--xla_enable_async_all_gather=true",
        "--xla_enable_async_all_reduce=true",
        "--xla_enable_async_collective_permute=true",
        "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
        "--xla_tpu_data_parallel_opt_different_sized_ops=true",
        "--xla_tpu_enable_async_all_to_all=true",
        "--xla_tpu_enable_async_ragged_all_to_all=true",
        "--xla_lhs_prioritize_async_depth_over_stall=ENABLED",
    ),
}
# the all-gathers leave the TensorCore's async collective fusion for the SparseCores
FLAG_SETS["sparsecore_offload"] = tuple(
    f for f in FLAG_SETS["collective_overlap"] if not f.startswith("--xla_tpu_enable_async_collective_fusion_fuse_all_gather")
) + (
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false",
    "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
    "--xla_tpu_enable_sparse_core_reduce_scatter_v2=true",
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
    "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_3d_all_gather=true",
    "--xla_tpu_use_single_sparse_core_for_all_gather_offload=true",
    "--xla_tpu_enable_concurrent_sparse_core_offloading=true",
    "--xla_tpu_enable_sparse_core_collective_aggregator=true",
    "--xla_tpu_use_tc_device_shape_on_sc=true",
    "--xla_sc_disable_megacore_partitioning=true",
)
# the same, the all-reduces left to the TensorCore's async collective fusion: libtpu 0.0.42 fails to compile a
# bf16 all-reduce offloaded to the SparseCores ("'sc_tpu.vector_store' op Value element type 'f32' does not
# match base element type 'bf16'"), which a step with bf16 weights (model.param_dtype=bfloat16) has
_OFFLOAD_ALL_REDUCE = "--xla_tpu_enable_sparse_core_collective_offload_all_reduce"
FLAG_SETS["sparsecore_offload_tc_all_reduce"] = tuple(
    f for f in FLAG_SETS["sparsecore_offload"] if not f.startswith(_OFFLOAD_ALL_REDUCE)
) + (f"{_OFFLOAD_ALL_REDUCE}=false",)


def _flag_name(arg: str) -> str:
    return arg.lstrip("-").split("=", 1)[0]


def libtpu_init_args(name: str, existing: str = "") -> str:
    """``existing`` (a LIBTPU_INIT_ARGS value) plus the flags of set ``name`` it does not set itself."""
    if name not in FLAG_SETS:
        raise ValueError(f"tpu_flags={name!r}: choose one of {sorted(FLAG_SETS)}")
    have = {_flag_name(a) for a in existing.split()}
    added = [f for f in FLAG_SETS[name] if _flag_name(f) not in have]
    return " ".join(existing.split() + added)


def apply(name: str) -> str:
    """Set LIBTPU_INIT_ARGS for flag set ``name`` (before libtpu starts in this process) -> its value."""
    value = libtpu_init_args(name, os.environ.get("LIBTPU_INIT_ARGS", ""))
    os.environ["LIBTPU_INIT_ARGS"] = value
    return value
