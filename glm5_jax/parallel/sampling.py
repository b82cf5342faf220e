"""The sampling mesh: how generation, serving and RL rollouts lay the model out, apart from training.

Training shards every weight over ``fsdp`` and gathers it once per step, which pays for itself over
millions of tokens. A decode step touches every weight for a handful of tokens per chip, so a per-step
weight gather would cost more than the step's arithmetic. The sampling rules therefore keep weights
resident: routed experts split over ``expert`` (each chip holds its experts whole), attention heads, FFN
widths, the vocabulary and the query's down-projection over ``tensor``, the rest replicated. Rows of the
batch split over ``data`` and ``expert`` (the expert axis also holds batch rows: a token's attention runs
on the chip that owns its row, its routed experts on the chips that own them), and the decode cache's
slot axis over ``context`` for long requests.

A sampling mesh is written ``data:2,expert:2,tensor:2`` (`parse_mesh_spec`); unnamed axes are 1, one
axis may be -1 (the remaining devices). ``fsdp`` is accepted for experiments but is 1 by default.
`sampling_mesh` builds it on the first devices it needs, `check_sampling_fits` says which of the model's
widths a mesh cannot split. Batch rows and cache slots need no such check: the samplers pad them
(`glm5_jax.generate.on_mesh`, `glm5_jax.serve.engine`).
"""
from __future__ import annotations

import math

import jax
from jax.sharding import Mesh

from glm5_jax.parallel.axes import (BATCH, CACHE_SEQ, EMBED, EXP, HEADS, INDEX_HEADS, KV_LORA, MLP, MLP_MOE, O_KV, Q_LORA,
                                    SEQ, VOCAB)
from glm5_jax.parallel.mesh import (CONTEXT, DEFAULT_RULES, EXPERT, MESH_AXES, TENSOR, MeshConfig, MeshError,
                                    build_mesh)

# The training rules with what sampling changes: no FSDP (weights stay resident, never gathered per step) and
# a prefill chunk's tokens kept on their row's chip; rows still split over data x fsdp x expert, heads / FFN
# widths / vocabulary over tensor, routed experts over expert, cache slots over context. The query's LoRA rank
# splits over tensor where heads do not already take it (rules apply in order, HEADS first): q_a_proj
# [D, q_lora] is read 1/tensor per chip instead of whole on every chip (a decode step reads every weight: at
# 744B, whole, it is the largest replicated read), its output all-gathered for the up-projections (the q_a norm's sum
# of squares is then a sum of per-shard partial sums); q_b_proj and the indexer's wq_b keep heads over tensor.
SAMPLING_OVERRIDES = {
    SEQ: None,
    CACHE_SEQ: CONTEXT,
    EMBED: None,
    Q_LORA: TENSOR,
    KV_LORA: None,
}
SAMPLING_RULES = tuple((name, SAMPLING_OVERRIDES.get(name, axes)) for name, axes in DEFAULT_RULES)


def parse_mesh_spec(spec: str, rules=SAMPLING_RULES) -> MeshConfig:
    """``"data:2,expert:2,tensor:2"`` -> MeshConfig (unnamed axes 1; one axis may be -1)."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    seen = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition(":")
        name = name.strip()
        if not sep or name not in sizes:
            raise MeshError(f"mesh spec {spec!r}: {part!r} is not AXIS:SIZE with AXIS one of {', '.join(MESH_AXES)}")
        if name in seen:
            raise MeshError(f"mesh spec {spec!r}: axis {name!r} given twice")
        try:
            size = int(value)
        except ValueError:
            raise MeshError(f"mesh spec {spec!r}: size {value!r} of {name!r} is not an integer") from None
        if size < 1 and size != -1:
            raise MeshError(f"mesh spec {spec!r}: {name}:{size} must be >= 1 (or -1 for the remaining devices)")
        sizes[name] = size
        seen.add(name)
    return MeshConfig(rules=rules, **sizes)


# a program over one batch row (the server's prefill of one slot): the row is replicated, heads, widths,
# experts and cache slots split as above (a row cannot split over the batch axes)
def replicated_rows(rules):
    """``rules`` with the batch axis replicated (a batch that cannot split over the batch axes), and the expert axis,
    which then holds no rows, also splitting o_proj's value width (`O_KV`): at one row every chip of an expert
    group would otherwise read the same o_proj shard, the largest attention weight, each step; split, a chip
    reads 1/expert of it and the output projection's partial sums are reduced over tensor x expert instead of
    tensor (the same one all-reduce)."""
    def rule(name, axes):
        if name == BATCH:
            return None
        if name == O_KV and axes is None:
            return EXPERT
        return axes
    return tuple((name, rule(name, axes)) for name, axes in rules)


ONE_ROW_RULES = replicated_rows(SAMPLING_RULES)


def sampling_mesh(spec: str = "", devices=None) -> Mesh:
    """The mesh of a spec over the first devices it needs (all of them when an axis is -1); ``""`` is one
    device. MeshError when the spec asks for more devices than exist."""
    devices = list(jax.devices() if devices is None else devices)
    cfg = parse_mesh_spec(spec)
    sizes = {a: getattr(cfg, a) for a in MESH_AXES}
    if -1 not in sizes.values():
        needed = math.prod(sizes.values())
        if needed > len(devices):
            raise MeshError(f"mesh spec {spec!r} needs {needed} devices, but only {len(devices)} exist"
                            f"{' (--host_devices=N simulates N CPU devices)' if devices[0].platform == 'cpu' else ''}")
        devices = devices[:needed]
    return build_mesh(cfg, devices)


def mesh_spec(mesh: Mesh) -> str:
    """The spec of a mesh's axes larger than 1 (``"data:2,tensor:2"``; ``""`` for one device)."""
    return ",".join(f"{a}:{n}" for a, n in mesh.shape.items() if n > 1)


def axis_shards(mesh: Mesh, logical: str, rules=SAMPLING_RULES) -> int:
    """Into how many pieces ``rules`` split the logical axis ``logical`` on ``mesh``."""
    entry = dict(rules)[logical]
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[a] for a in axes)


def check_sampling_fits(mesh: Mesh, model_cfg, rules=SAMPLING_RULES) -> None:
    """The divisibility the sampling rules need of the model's weights, checked before anything is loaded
    or compiled (batch rows and cache slots are padded instead). MeshError naming each problem."""
    problems = []

    def need(logical, size, what):
        shards = axis_shards(mesh, logical, rules)
        if size % shards:
            problems.append(f"{logical} splits {shards} ways ({mesh_spec(mesh)}) but {what}={size} is not "
                            f"divisible by {shards}")

    need(HEADS, model_cfg.num_attention_heads, "num_attention_heads")
    if model_cfg.use_indexer:
        need(INDEX_HEADS, model_cfg.index_n_heads, "index_n_heads")
    need(VOCAB, model_cfg.vocab_size, "vocab_size")
    if model_cfg.q_lora_rank:
        need(Q_LORA, model_cfg.q_lora_rank, "q_lora_rank")
    if model_cfg.first_k_dense_replace:
        need(MLP, model_cfg.intermediate_size, "intermediate_size")
    if model_cfg.num_moe_layers or model_cfg.num_nextn_predict_layers:
        need(EXP, model_cfg.n_routed_experts, "n_routed_experts")
        need(MLP_MOE, model_cfg.moe_intermediate_size, "moe_intermediate_size")
        if model_cfg.n_shared_experts:
            need(MLP, model_cfg.moe_intermediate_size * model_cfg.n_shared_experts, "the shared experts' width")
    if problems:
        raise MeshError("the sampling mesh does not fit the model: " + "; ".join(problems))
