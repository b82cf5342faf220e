"""Meshes and the logical-axis rules: the only place where model axis names meet device axes.

Mesh axes are ``data, fsdp, context, expert, tensor`` (AxisType.Auto: GSPMD semantics, which Flax's
logical helpers need). A sharding experiment is a change of `MeshConfig` (axis sizes, rules), never of
model code.

``context`` splits the sequence of training activations (logical "seq"): context parallelism for long
sequences. The sequence then runs in a zig-zag layout and attention gathers only the compressed keys
(glm5_jax/parallel/context.py, docs/training.md#context-parallelism). Parameters are FSDP-sharded over
``context`` too (its shards hold different tokens, like data-parallel shards), so a long-sequence mesh
does not replicate weights or optimizer state across it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from glm5_jax.parallel.axes import (ACT_EMBED, ACT_HEADS, ACT_MLP, ACT_VOCAB, BATCH, CACHE_SEQ, EMBED, EXP, HEADS,
                                    HC_EMBED, INDEX_DIM, INDEX_HEADS, KDA_QKV, KV, KV_LORA, O_KV, LAYERS, MLP, MLP_MOE, MTP_CONCAT, Q_LORA, SEQ,
                                    VOCAB)

DATA, FSDP, CONTEXT, EXPERT, TENSOR = MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")

# logical name -> mesh axis (or tuple of axes, or None = replicated). First match wins (Flax semantics).
DEFAULT_RULES = (
    (BATCH, (DATA, FSDP, EXPERT)),      # activations: batch over every data-parallel axis
    (SEQ, CONTEXT),                     # context parallelism: the sequence over `context`
    (CACHE_SEQ, CONTEXT),               # decode cache slots (kv_cache.LAYER_AXES): split like the sequence
                                        # on a context mesh (docs/long_context.md: how decode reads them)
    (ACT_EMBED, None),
    (ACT_HEADS, TENSOR),
    (ACT_MLP, TENSOR),
    (ACT_VOCAB, TENSOR),
    (EMBED, (FSDP, CONTEXT)),           # parameters: FSDP over the model width
    (VOCAB, TENSOR),
    (HEADS, TENSOR),
    # split like the attention heads: keeping them whole per tensor shard removes the KL's all-reduce of
    # partial scores over tensor, but doubles its [tokens, k, heads] HBM traffic per chip (744B compile:
    # 33.1 vs 27.6 TB per step at the same estimated step time), and the overlap flags hide the all-reduce
    (INDEX_HEADS, TENSOR),
    (MLP, TENSOR),
    (EXP, EXPERT),
    (MLP_MOE, TENSOR),
    # the MLA / indexer up-projections [q_lora|kv_lora, heads, ...] are FSDP-sharded on their LoRA rank
    # (their other dims are heads or small); the down-projections keep fsdp on "embed", which wins
    (Q_LORA, (FSDP, CONTEXT)),
    (KV_LORA, (FSDP, CONTEXT)),
    (KV, None),
    (O_KV, None),                       # o_proj's value width: as KV (one-row sampling splits it, sampling.py)
    (INDEX_DIM, None),
    (MTP_CONCAT, None),
    (KDA_QKV, TENSOR),                  # flat heads x width, head-major: split like the attention heads
    (HC_EMBED, None),                   # hyper-connection mixers: [(2 + n) n] columns, small, replicated
    (LAYERS, None),
)


class MeshError(ValueError):
    """An impossible mesh for these devices or this model; the message says why."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = -1          # -1: whatever is left of the devices
    context: int = 1        # sequence shards (context parallelism); needs seq_len % (2 * context) == 0
    expert: int = 1
    tensor: int = 1
    rules: tuple = DEFAULT_RULES

    def axis_sizes(self, num_devices: int) -> dict[str, int]:
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        free = [a for a, s in sizes.items() if s == -1]
        if len(free) > 1:
            raise MeshError(f"mesh: only one axis may be -1, got {free}")
        for a, s in sizes.items():
            if s != -1 and (not isinstance(s, int) or s < 1):
                raise MeshError(f"mesh.{a}={s}: axis sizes are positive ints (or -1 for the rest)")
        fixed = math.prod(s for s in sizes.values() if s != -1)
        if free:
            if num_devices % fixed:
                raise MeshError(f"mesh: {num_devices} devices cannot be split with fixed axes "
                                f"{ {a: s for a, s in sizes.items() if s != -1} } (product {fixed})")
            sizes[free[0]] = num_devices // fixed
        if math.prod(sizes.values()) != num_devices:
            raise MeshError(f"mesh {sizes} has {math.prod(sizes.values())} devices, but {num_devices} are available")
        return sizes


def check_mesh_fits_model(sizes: dict[str, int], model_cfg, global_batch: int, seq_len: int | None = None) -> None:
    """Divisibility the rules need, checked before any compile (``seq_len``: the training sequence length,
    checked against ``context``)."""
    problems = []
    context = sizes.get("context", 1)
    if model_cfg.num_attention_heads % sizes["tensor"]:
        problems.append(f"tensor={sizes['tensor']} does not divide num_attention_heads={model_cfg.num_attention_heads}")
    if model_cfg.num_moe_layers and model_cfg.n_routed_experts % sizes["expert"]:
        problems.append(f"expert={sizes['expert']} does not divide n_routed_experts={model_cfg.n_routed_experts}")
    weight_shards = sizes["fsdp"] * context          # the FSDP rules shard weights over fsdp x context
    for field in ("hidden_size", "q_lora_rank", "kv_lora_rank"):
        if getattr(model_cfg, field) % weight_shards:
            problems.append(f"fsdp*context={weight_shards} does not divide {field}={getattr(model_cfg, field)}")
    if context > 1 and seq_len is not None and seq_len % (2 * context):
        problems.append(f"seq_len={seq_len} is not divisible by 2*context={2 * context} (the zig-zag layout "
                        f"gives each context shard two equal chunks)")
    batch_shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if global_batch % batch_shards:
        problems.append(f"global batch {global_batch} is not divisible by data*fsdp*expert={batch_shards}")
    if problems:
        raise MeshError("mesh does not fit the model: " + "; ".join(problems))


def build_mesh(mesh_cfg: MeshConfig, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    sizes = mesh_cfg.axis_sizes(len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        device_grid = jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                                    devices=devices).devices
    except Exception:   # topologies make_mesh cannot lay out: plain row-major order
        device_grid = np.asarray(devices).reshape(shape)
    return Mesh(device_grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_shardings(abstract_boxed_tree, mesh: Mesh, rules):
    """NamedShardings for a tree of (boxed) abstract variables from their logical axis names."""
    specs = nn.get_partition_spec(abstract_boxed_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    """[B, T] inputs: batch over the data-parallel axes."""
    return NamedSharding(mesh, nn.logical_to_mesh_axes((BATCH, SEQ), rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


@contextlib.contextmanager
def mesh_and_rules(mesh: Mesh, rules):
    """Run under `mesh` (``jax.set_mesh``) with the logical-axis `rules` (Flax) in context: how model code,
    which names only logical axes, gets placed on devices."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield
