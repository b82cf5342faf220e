"""The decode-only program: N greedy decode steps over a filled latent cache, one program on device.

    tokens_BN, cache = decode_steps(cfg, N, variables, token_B, position_B, cache)

Step s feeds the previous token at position ``position_B + s`` (its row written into the cache there) and
takes the argmax of the logits as the next token; the loop is a ``lax.fori_loop`` inside one jitted program,
so no host round trip per token. This is the steady state of `glm5_jax.generate.decoding` (after the
prefill), built apart so a compile report can lower it with abstract, sharded params and a cache of T slots
(`abstract_decode_inputs`) and without a prompt. `lower_serve_step` lowers the server's own decode step the same
way (one token a call, each row sampled with its own settings).

`decode_model_config` (glm5_jax/generate/settings.py) gives the inference settings: bf16 weights, the absorbed
form, the DSA sparse stage, layers that read the cache and return their new rows (``decode_cache_write="rows"``,
glm5_jax/model/decode_rows.py: no per-step copy of the cache; with ``cache_read="pallas"`` each layer's selected
latent rows gathered from the stacked cache in place, pallas_kernels/row_gather: no per-layer slice), the decode
MoE dispatch (``moe_ep="gather"``, glm5_jax/model/moe/decode_dispatch.py, or ``"a2a_decode"``,
glm5_jax/model/moe/decode_a2a.py) and routed experts in bf16 or packed INT4 through the Pallas kernels, each
layer's experts read in place from the stacked [layers, ...] parameters (``decode_stacked_experts``,
glm5_jax/model/moe/int4_weights.py; bf16 experts with the gathered dispatch). The samplers decode with the same
settings under ``RuntimeConfig.sampler_kernels`` (settings.py `sampler_configs`).
"""
from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding

from glm5_jax.generate.cache_layout import pin_cache_layout, row_major
from glm5_jax.generate.settings import step_variables
from glm5_jax.generate.slot_sampling import NUM_TOP_LOGPROBS, decode_slots
from glm5_jax.model.kv_cache import cache_shardings, constrain_cache, init_cache
from glm5_jax.model.transformer import Transformer
from glm5_jax.parallel.axes import BATCH
from glm5_jax.parallel.mesh import logical_shardings
from glm5_jax.parallel.sampling import SAMPLING_RULES, axis_shards, replicated_rows


def decode_rules(batch: int, mesh, rules=SAMPLING_RULES):
    """``rules``, except that a batch that does not split over the batch axes (batch 1) is replicated."""
    return rules if batch % axis_shards(mesh, BATCH, rules) == 0 else replicated_rows(rules)


def decode_steps(cfg, steps: int, variables, token_B, position_B, cache):
    """``steps`` greedy decode steps -> (tokens [B, steps] int32, the updated cache)."""
    model = Transformer(cfg)
    B = token_B.shape[0]
    ones = jnp.ones((B, 1), jnp.int32)
    variables = step_variables(cfg, variables)     # once per program, not per step

    def step(s, carry):
        token, cache, out = carry
        logits, _, cache = model.apply(variables, token[:, None], (position_B + s)[:, None], ones,
                                       pin_cache_layout(cfg, cache), method=Transformer.decode)
        token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return token, pin_cache_layout(cfg, constrain_cache(cache)), out.at[:, s].set(token)

    out = jnp.zeros((B, steps), jnp.int32)
    _, cache, out = jax.lax.fori_loop(0, steps, step, (token_B, constrain_cache(cache), out))
    return out, cache


def abstract_decode_inputs(cfg, mesh, rules, batch: int, context: int):
    """(variables, token [B], position [B], cache of ``context`` slots) as ShapeDtypeStructs with their
    shardings under ``rules``: nothing allocated."""
    model = Transformer(cfg)
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    shardings = logical_shardings(boxed, mesh, rules)
    variables = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             nn.meta.unbox(boxed), shardings)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, context)["decoder"])
    cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache,
                         cache_shardings(cache, mesh, rules))
    rows = NamedSharding(mesh, nn.logical_to_mesh_axes((BATCH,), rules))
    token = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
    return variables, token, token, cache


def _cache_formats(cfg, cache):
    """The donated cache's formats, in and out: row-major where the layers read it in place (what the kernels take),
    else left to the compiler."""
    pinned = cfg.runtime.decode_cache_read == "pallas"
    return jax.tree.map(lambda x: Format(row_major(x) if pinned else Layout.AUTO, x.sharding), cache)


def lower_decode(cfg, mesh, rules, batch: int, context: int, steps: int):
    """The jitted decode program lowered with abstract inputs (the cache donated, in and out in one layout: it
    lives on device between calls, so no layout copy of the whole cache at entry and exit). With the per-layer
    slices (``decode_cache_read="slice"``) the compiler picks that layout; reading the stacked cache in place
    (``"pallas"``), the row-major one the row-gather kernel reads (left to pick, XLA lays the latent cache out
    [B, S, L, C] or slots-minor and copies it whole into the kernel's layout every step; docs/inference.md)."""
    args = abstract_decode_inputs(cfg, mesh, rules, batch, context)
    cache_formats = _cache_formats(cfg, args[3])
    fn = jax.jit(lambda v, t, p, c: decode_steps(cfg, steps, v, t, p, c), donate_argnums=(3,),
                 in_shardings=(*(jax.tree.map(lambda x: x.sharding, a) for a in args[:3]), cache_formats),
                 out_shardings=(NamedSharding(mesh, nn.logical_to_mesh_axes((BATCH, None), rules)), cache_formats))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        return fn.lower(*args), args


def _step_variables_abstract(cfg, variables):
    """The abstract variables as the sampler's decode step takes them (`step_variables`: experts and kv_b_proj in
    their stacked collections, kv_b_proj heads-major), each with the sharding the moves give it (the moves compiled
    alone: the server makes them once per weights version, outside its step)."""
    moved = jax.jit(lambda v: step_variables(cfg, v)).lower(variables).compile()
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        jax.eval_shape(lambda v: step_variables(cfg, v), variables), moved.output_shardings)


def lower_serve_step(cfg, mesh, rules, batch: int, context: int):
    """The server's decode step (`slot_sampling.decode_slots`: one token for each of ``batch`` slots, each row
    sampled with its own temperature / top-p / top-k and key, its top log-probs) lowered with abstract inputs: the
    weights as the step reads them (`_step_variables_abstract`), the cache of ``context`` slots donated and laid out
    as in `lower_decode`. One program call per token: the host launches it every step."""
    variables, token, _, cache = abstract_decode_inputs(cfg, mesh, rules, batch, context)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        variables = _step_variables_abstract(cfg, variables)
    rows = token.sharding
    per_row = lambda dtype, *shape: jax.ShapeDtypeStruct((batch, *shape), dtype, sharding=NamedSharding(  # noqa: E731
        mesh, nn.logical_to_mesh_axes((BATCH,) + (None,) * len(shape), rules)))
    sampling = (per_row(jnp.float32), per_row(jnp.float32), per_row(jnp.int32), per_row(jnp.uint32, 2),
                per_row(jnp.int32))
    cache_formats = _cache_formats(cfg, cache)
    args = (variables, cache, token, token, *sampling)
    fn = jax.jit(lambda *a: decode_slots(Transformer(cfg), min(NUM_TOP_LOGPROBS, cfg.vocab_size), *a),
                 donate_argnums=(1,),
                 in_shardings=(jax.tree.map(lambda x: x.sharding, variables), cache_formats, rows, rows,
                               *(x.sharding for x in sampling)),
                 out_shardings=(cache_formats, None))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        return fn.lower(*args), (variables, token, token, cache)
