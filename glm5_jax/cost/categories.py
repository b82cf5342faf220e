"""Which part of the GLM-5 train step an HLO instruction (`categorize`) or a parameter (`categorize_param`)
belongs to: the one place that files the step into categories.

JAX writes the trace path into each instruction's metadata: transformations (`jvp(...)`,
`transpose(jvp(...))` for the backward pass), Flax module paths (`decoder/segment_1/layer_0/attention`),
Flax method scopes (`attention._select`), jitted functions (`jit(take_along_axis)`) and, for einsums, the
subscripts (`btd,dq->btq`). The rules below read those; an einsum one of whose terms has no batch
axis `b` multiplies by a weight (forward) or makes a weight gradient (backward).

The attention layer names its parts with `jax.named_scope` (glm5_jax/model/attention.py, and
glm5_jax/model/context_attention.py inside its per-shard `shard_map`): "lightning_indexer" (scores + top-k),
"attention_core" and "indexer_kl". Steps traced before those scopes existed are still recognised by the
attention layer's own loops and gathers right under `attention/` (`closed_call`, `while`, `cond`,
`vmap()`: the KL) and by method scopes (`_select`, `_sparse_core`, ...).
"""
from __future__ import annotations

import re

from glm5_jax.cost.hlo_cost import HLO_COMPUTATION_PREFIX

CATEGORIES = ("attention_core", "indexer_topk", "indexer_kl", "routed_experts", "shared_mlp", "projections",
              "hyper_connections", "layer_glue", "lm_head_loss", "mtp", "optimizer", "other")
CATEGORY_TITLES = {
    "attention_core": "attention core", "indexer_topk": "indexer scores + top-k", "indexer_kl": "indexer KL",
    "routed_experts": "routed experts", "shared_mlp": "shared expert + dense MLP",
    "projections": "projections (MLA + indexer)", "hyper_connections": "mHC mixers",
    "layer_glue": "norms, residuals, layer loop", "lm_head_loss": "LM head + loss", "mtp": "MTP",
    "optimizer": "optimizer", "other": "other",
}
_EINSUM = re.compile(r"([a-z]+),([a-z]+)->([a-z]+)")
# method scopes and kernel names of the attention core (older and current forms of glm5_jax/model/attention.py)
_CORE_SCOPES = ("attention_core", "_sparse_core", "sparse_mla", "dense_mla", "_training_sparse_xla", "_masked_dense",
                "_mha")
_KL_HEADS = ("closed_call", "while", "cond", "vmap()")
# the mHC mixers around each block and their merge (glm5_jax/model/decoder.py `_residual("attn_hc" / "ffn_hc")`;
# a merge traced without that scope: its einsum, glm5_jax/model/hyper_connections.py `merge`)
_HC_SCOPE = re.compile(r"/(attn_hc|ffn_hc)/|btji,btjd->btid")


def _weight_einsum(op_name: str) -> bool:
    specs = _EINSUM.findall(op_name)
    return bool(specs) and any("b" not in term for term in specs[-1])


def categorize(op_name: str) -> str:
    """One of CATEGORIES for an instruction's op_name (or, for a fusion without metadata,
    glm5_jax.cost.hlo_cost.HLO_COMPUTATION_PREFIX + the fused computation's name)."""
    if op_name.startswith(HLO_COMPUTATION_PREFIX):
        # the TPU compiler expands ragged-dot transposes (the expert weight gradients) into masked dense
        # convolutions over every group ("convolution_select_fusion" with an output mask); only the MoE
        # uses ragged dots
        return "routed_experts" if "convolution_select_fusion" in op_name else "other"
    if "/mtp/" in op_name or op_name.startswith("mtp/"):
        return "mtp"
    if "Transformer.head" in op_name or "lm_head" in op_name:
        return "lm_head_loss"
    if "indexer_kl" in op_name:
        return "indexer_kl"
    if "lightning_indexer" in op_name:
        return "indexer_topk"
    if "ragged-dot" in op_name or "ragged_dot" in op_name:
        return "routed_experts"
    if "/attention/" in op_name or op_name.startswith("attention/"):
        tail = op_name.split("attention/", 1)[1]
        if tail.split("/", 1)[0] in _KL_HEADS:
            return "indexer_kl"
        if "/indexer/" in op_name or _weight_einsum(op_name):
            return "projections"
        if "_select" in tail or "_indexer_topk" in tail:
            return "indexer_topk"
        if any(s in tail for s in _CORE_SCOPES):
            return "attention_core"
        return "projections"          # norms, RoPE, concatenations around the projections
    if "/moe/" in op_name:
        return "shared_mlp" if "/shared_expert/" in op_name else "routed_experts"
    if "/mlp/" in op_name:
        return "shared_mlp"
    if _HC_SCOPE.search(op_name):
        return "hyper_connections"
    if "/decoder/" in op_name:
        # what else runs inside the layer stack: norms, residual adds, the scan over layers (its carries,
        # the stacked activations it saves for the backward pass, the copies XLA makes of them); an
        # instruction without metadata inside the scan's body inherits this from the loop
        return "layer_glue"
    if "jvp(Transformer)" in op_name or "embed" in op_name:
        return "other"
    if "jvp(" in op_name:             # the loss, traced outside the model's modules
        return "lm_head_loss"
    if "Transformer." in op_name:
        # inside a model method (a decode program's `Transformer.decode`) but outside the layer stack and
        # every module: the model's, not the optimizer's
        return "other"
    if op_name.startswith("jit(") and "/" in op_name:
        return "optimizer"            # after the gradient: clipping, AdamW, routing-bias update
    return "other"


def categorize_param(names: list[str]) -> str | None:
    """The category of one parameter by its path in the parameter tree (what the model FLOPs of each
    category count); None: not a matmul weight (norms, the embedding table)."""
    if names[-1] in ("scale", "bias") or names[0] == "embed":
        return None
    if names[0] == "mtp":
        return "mtp"
    if names[0] == "lm_head":
        return "lm_head_loss"
    if "attn_hc" in names or "ffn_hc" in names:
        return "hyper_connections"
    if "shared_expert" in names or "mlp" in names:
        return "shared_mlp"
    if "moe" in names:
        return "routed_experts"
    if "attention" in names:
        return "projections"
    return "other"


EXPERT_PASSES = ("forward", "remat", "input_grad", "weight_grad")


def expert_pass(op_name: str) -> str:
    """Which pass of the train step a routed-expert instruction belongs to, else "not_experts".

    forward: the forward pass (`jvp(...)`); remat: the forward rerun inside the backward pass
    (`rematted_computation`, what the remat policy did not save); weight_grad: the weight gradients (the
    grouped matmul's `tgmm` kernel, or the TPU compiler's masked-dense expansion of ragged_dot's);
    input_grad: the rest of the backward pass (input gradients of the expert products, the router's
    gradients)."""
    if categorize(op_name) != "routed_experts":
        return "not_experts"
    if op_name.startswith(HLO_COMPUTATION_PREFIX) or "tgmm" in op_name:
        return "weight_grad"
    if "rematted_computation" in op_name:
        return "remat"
    return "input_grad" if "transpose(" in op_name else "forward"

