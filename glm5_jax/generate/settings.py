"""The model settings the samplers and the decode program run: same parameters, inference settings.

    cfg = decode_config(cfg)                           # XLA's forms: what every sampler prefills with
    cfg = decode_model_config(cfg, "int4", ...)        # the decode program (compile reports, decode_steps)
    prefill_cfg, step_cfg = sampler_configs(cfg)       # a sampler's prefill and its decode steps
    step_vars = step_variables(step_cfg, variables)    # the variables the decode steps read
    slots = round_up(slots, cache_slot_multiple(cfg))  # a cache the step's kernels can read

``RuntimeConfig.sampler_kernels`` chooses what a sampler's decode steps run (generate, serve, the RL generators and
policy server all go through `sampler_configs`): "xla" decodes with `decode_config` like the prefill; "pallas"
(TPU) or "pallas_interpret" (the same kernels on CPU) with `decode_model_config`'s settings: each layer reads the
stacked latent cache in place and returns its new rows, the fused gather + attention kernel, the routed experts
read in place by the one-call kernels (bf16, or packed INT4 when the checkpoint is quantised: the experts follow
the checkpoint, never a silent conversion; the bf16 one-call kernel with the gather dispatch), the router's top-k
kernel, and ``sampler_dispatch``'s MoE dispatch, which keeps every assignment unless ``sampler_capacity`` says
otherwise.
The prompt is prefilled with XLA's forms either way: the kernels are built for a few tokens a step, and the two
settings share the parameter tree and the cache.
"""
from __future__ import annotations

import contextlib

import jax

from glm5_jax.model.moe.int4_weights import stack_expert_variables
from glm5_jax.model.moe.layer import DECODE_DISPATCHES
from glm5_jax.model.stacked_weights import heads_major_kv_b, stack_kv_b_variables
from glm5_jax.parallel.mesh import mesh_and_rules
from glm5_jax.parallel.sampling import SAMPLING_RULES, sampling_mesh
from pallas_kernels.impls import PALLAS_IMPLS
from pallas_kernels.row_gather.kernel import TILE_ROWS

EXPERTS = ("bf16", "int4")
# gather: a chip's experts take up to 2x their expected share of the step's assignments; a2a_decode: a chip sends
# each other chip up to 2x its expected share of its assignments (in 16-row tiles)
DISPATCH_CAPACITY = 2.0
# the decode program's experts for a checkpoint's ModelConfig.quant
EXPERTS_OF_QUANT = {"none": "bf16", "int4": "int4"}


def decode_config(cfg):
    """The model config generation runs: same math, inference settings (absorbed MLA against the latent
    cache, no remat, no EP transport, no indexer loss). The training transport's own settings (a pod config's
    a2a chunks and aligned expert groups, which a train.py checkpoint stores) go with it."""
    return cfg.replace(remat_policy="none", mla_form="absorbed", moe_ep="none", indexer_loss="none",
                       moe_a2a_chunks=1, moe_a2a_chunk_by="tokens", moe_group_align=1)


def has_recurrent_layers(cfg) -> bool:
    """Whether the model has recurrent (KDA) layers: their state absorbs each token once, so an overlapping
    prefill chunk cannot recompute its first tokens' outputs (nor the MLA rows written from them). Such a
    prompt is prefilled in whole chunks instead, padded to a multiple of the chunk."""
    return "kda" in cfg.layer_attention_types


def decode_model_config(cfg, experts: str, quant_matmul: str = "pallas", moe_impl: str = "auto",
                        cache_write: str = "rows", cache_read: str = "slice", moe_ep: str = "gather",
                        attention: str = "xla", a2a_exchange: str = "slots"):
    """The decode program's settings of ``cfg`` (glm5_jax/generate/decode_program.py): bf16 weights, the absorbed
    form, the DSA sparse stage, the decode MoE dispatch at `DISPATCH_CAPACITY`, the per-step RoPE tables and
    spread norms, the stacked kv_b_proj heads-major. ``experts`` "bf16" or "int4"; ``cache_write`` the
    RuntimeConfig.decode_cache_write ("rows": layers read the cache, their new rows written after the scan);
    ``cache_read`` its decode_cache_read ("slice": the layer scan slices each layer's cache; "pallas": each layer
    gathers its selected rows from the stacked cache in place; with cache_write="layer" always "slice");
    ``moe_ep`` the decode MoE dispatch ("gather", few tokens per chip; "a2a_decode", many: moe/decode_a2a.py);
    ``attention`` the decode_attention with a stacked cache read ("xla": gather, then XLA's attention; "pallas":
    the fused kernel pallas_kernels/sparse_mla_decode); ``a2a_exchange`` the decode_a2a_exchange of
    moe_ep="a2a_decode" ("slots", "ragged", "ragged_dense")."""
    if experts not in EXPERTS:
        raise ValueError(f"experts={experts!r}: choose one of {EXPERTS}")
    if moe_ep not in DECODE_DISPATCHES:
        raise ValueError(f"moe_ep={moe_ep!r}: choose one of {DECODE_DISPATCHES}")
    cfg = decode_config(cfg).replace(moe_ep=moe_ep, decode_a2a_exchange=a2a_exchange, dtype="bfloat16",
                                     param_dtype="bfloat16",
                                     attention_mode="sparse", moe_impl=moe_impl, decode_cache_write=cache_write,
                                     decode_cache_read=cache_read if cache_write == "rows" else "slice",
                                     decode_attention=attention if cache_write == "rows" and cache_read != "slice"
                                     else "xla",
                                     moe_capacity_factor=DISPATCH_CAPACITY, rope_impl="pair_swap",
                                     decode_stacked_kv_b=True, decode_rope_tables=True,
                                     decode_kv_b_heads_major=True, decode_spread_norms=True,
                                     router_impl=quant_matmul if quant_matmul in PALLAS_IMPLS else "xla")
    if experts == "int4":
        cfg = cfg.replace(quant="int4", quant_matmul=quant_matmul, decode_stacked_experts=True, decode_moe_kernel=True)
    elif moe_ep == "gather" and quant_matmul in PALLAS_IMPLS:
        # bf16 experts of a few tokens a chip: the one-call kernel reads the stacked weights in place
        cfg = cfg.replace(quant_matmul=quant_matmul, decode_stacked_experts=True, decode_moe_kernel=True)
    return cfg


def sampler_configs(cfg):
    """(prefill config, decode step config) of a sampler over ``cfg`` (module docstring): both `decode_config`
    with ``sampler_kernels="xla"``; else the step's `decode_model_config` with the kernels of that impl, the
    experts the checkpoint holds, ``sampler_dispatch``, the weights' and activations' dtypes of ``cfg``."""
    prefill = decode_config(cfg)
    kernels = cfg.runtime.sampler_kernels
    if kernels == "xla":
        return prefill, prefill
    why = None
    if cfg.quant not in EXPERTS_OF_QUANT:
        why = (f"reads bf16 or packed INT4 experts, not quant={cfg.quant!r} (quantise the checkpoint: "
               "glm5_jax/model/moe/int4_weights.quantize_params)")
    elif has_recurrent_layers(cfg):
        why = "decodes DSA's MLA layers; this model has KDA layers (GLM-5.3-Flash decodes with 'xla')"
    elif cfg.runtime.attention_mode != "sparse":
        why = f"decodes DSA's sparse stage; this model runs attention_mode={cfg.runtime.attention_mode!r}"
    elif cfg.runtime.capture_routing:
        why = "has no routing capture (capture_routing records it in the per-layer cache writes)"
    if why:
        raise ValueError(f"sampler_kernels={kernels!r} {why}")
    # XLA:CPU has no ragged all-to-all: the interpreted kernels' check takes its dense emulation
    exchange = "ragged" if kernels == "pallas" else "ragged_dense"
    step = decode_model_config(cfg, EXPERTS_OF_QUANT[cfg.quant], quant_matmul=kernels, moe_impl=cfg.runtime.moe_impl,
                               cache_read=kernels, attention=kernels, moe_ep=cfg.runtime.sampler_dispatch,
                               a2a_exchange=exchange)
    return prefill, step.replace(dtype=cfg.runtime.dtype, param_dtype=cfg.runtime.param_dtype,
                                 moe_capacity_factor=cfg.runtime.sampler_capacity or no_drop_capacity(cfg))


def no_drop_capacity(cfg) -> float:
    """A decode dispatch's capacity factor at which no assignment is dropped, whatever the routing: a chip's
    capacity is factor x its expected share n K n_local / E of n tokens' assignments (decode_dispatch.local_capacity),
    and at most n min(K, n_local) of them can choose its n_local experts (a token's K experts are distinct), which
    E / K x that share covers. E makes the gather's capacity every gathered assignment, which its one-call kernel
    takes whole."""
    return float(cfg.n_routed_experts) if cfg.runtime.sampler_dispatch == "gather" else \
        cfg.n_routed_experts / cfg.num_experts_per_tok


def step_variables(cfg, variables):
    """``variables`` as a model of ``cfg`` decodes them: the main stack's routed experts and kv_b_proj moved to
    their stacked collections (no copy) where ``cfg`` reads them in place, kv_b_proj's halves heads-major (a
    transpose: done once per program or per weights update, not per step)."""
    if cfg.runtime.decode_stacked_experts:      # each layer reads its experts from the stacked arrays
        variables = stack_expert_variables(variables)
    if cfg.runtime.decode_stacked_kv_b and cfg.runtime.decode_cache_read != "slice":    # and its kv_b_proj
        variables = stack_kv_b_variables(variables)
        if cfg.runtime.decode_kv_b_heads_major:
            variables = heads_major_kv_b(variables, cfg.qk_nope_head_dim)
    return variables


def cache_slot_multiple(cfg) -> int:
    """What a sampler's cache slots (per ``context`` shard) must be a multiple of for its decode steps: the kernels
    that read the stacked cache in place move whole HBM tiles of `TILE_ROWS` rows (1 with XLA's reads)."""
    return TILE_ROWS if sampler_configs(cfg)[1].runtime.decode_cache_read in PALLAS_IMPLS else 1


def kernels_context(cfg):
    """Where ``cfg``'s sampler runs its decode kernels with no mesh in context (one device): a one-device sampling
    mesh and its rules, since the decode MoE dispatch and the kernels' shard_maps place work by the mesh in context;
    nothing otherwise."""
    if cfg.runtime.sampler_kernels == "xla" or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    return mesh_and_rules(sampling_mesh(""), SAMPLING_RULES)
