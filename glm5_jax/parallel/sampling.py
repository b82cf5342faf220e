"""The sampling mesh: how generation, serving and RL rollouts lay the model out, apart from training.

Training shards every weight over ``fsdp`` and gathers it once per step, which pays for itself over
millions of tokens. A decode step touches every weight for a handful of tokens per chip, so a per-step
weight gather would cost more than the step's arithmetic. The sampling rules therefore keep weights
resident: routed experts split over ``expert`` (each chip holds its experts whole), attention heads, FFN
widths and the vocabulary over ``tensor``, the rest replicated. Rows of the batch split over ``data`` and
``expert`` (the expert axis also holds batch rows: a token's attention runs on the chip that owns its
row, its routed experts on the chips that own them), and the decode cache's slot axis over ``context``
for long requests.

A sampling mesh is written ``data:2,expert:2,tensor:2`` (`parse_mesh_spec`); unnamed axes are 1, one
axis may be -1 (the remaining devices). ``fsdp`` is accepted for experiments but is 1 by default.
"""
from __future__ import annotations

from glm5_jax.parallel.axes import (ACT_EMBED, ACT_HEADS, ACT_MLP, ACT_VOCAB, BATCH, CACHE_SEQ, EMBED, EXP, HEADS,
                                    HC_EMBED, INDEX_DIM, INDEX_HEADS, KDA_QKV, KV, KV_LORA, LAYERS, MLP, MLP_MOE, MTP_CONCAT, Q_LORA, SEQ,
                                    VOCAB)
from glm5_jax.parallel.mesh import CONTEXT, DATA, EXPERT, FSDP, MESH_AXES, TENSOR, MeshConfig, MeshError

SAMPLING_RULES = (
    (BATCH, (DATA, FSDP, EXPERT)),      # rows: over every axis that does not split the model
    (SEQ, None),                        # prompt tokens of a prefill chunk stay on their row's chip
    (CACHE_SEQ, CONTEXT),               # decode-cache slots of a long request
    (ACT_EMBED, None),
    (ACT_HEADS, TENSOR),
    (ACT_MLP, TENSOR),
    (ACT_VOCAB, TENSOR),
    (EMBED, None),                      # no FSDP: weights stay resident, never gathered per step
    (VOCAB, TENSOR),
    (HEADS, TENSOR),
    (INDEX_HEADS, TENSOR),
    (MLP, TENSOR),
    (EXP, EXPERT),
    (MLP_MOE, TENSOR),
    (Q_LORA, None),
    (KV_LORA, None),
    (KV, None),
    (INDEX_DIM, None),
    (MTP_CONCAT, None),
    (KDA_QKV, TENSOR),
    (HC_EMBED, None),
    (LAYERS, None),
)


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
