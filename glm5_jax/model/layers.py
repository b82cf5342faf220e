"""Small building blocks: logically-partitioned parameters, norms, projections, SwiGLU.

Every parameter carries logical axis names; `glm5_jax.parallel.mesh` maps them to mesh axes. Weights are
stored in ``param_dtype`` and cast to the compute ``dtype`` at use; matmuls accumulate in fp32 and
norms run in fp32.
"""
from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.model.config import PROJECTION_IMPLS, ModelConfig
from glm5_jax.parallel.axes import ACT_EMBED, ACT_MLP, BATCH, EMBED, MLP, SEQ
from pallas_kernels.impls import XLA

ACT_BTD = (BATCH, SEQ, ACT_EMBED)


def logical_param(module: nn.Module, name: str, shape: Sequence[int], axes: Sequence[str | None],
                  init, dtype):
    """A parameter of `shape` annotated with logical `axes` (one name per dimension)."""
    assert len(shape) == len(axes), (name, shape, axes)
    return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


def normal_init(cfg: ModelConfig):
    return nn.initializers.normal(stddev=cfg.initializer_range)


def constrain(x, axes):
    return nn.with_logical_constraint(x, axes)


def einsum(spec: str, x, w, dtype, out_dtype=None, impl: str = XLA, grad_dtype="float32"):
    """x, w cast to the compute dtype; fp32 accumulation; result in `out_dtype` (default: `dtype`).

    `x` is an activation and `w` a weight. ``impl`` (`ModelConfig.projection_impl`) picks how a projection
    without batch dimensions shared by all three operands is differentiated: "xla" as JAX derives it,
    "cpu_transposed_grad" through `_transposed_grad_projection` (same maths, a weight-gradient layout
    XLA:CPU runs faster). Batched products (e.g. per-head) always take the plain path. ``grad_dtype``
    (`RuntimeConfig.grad_reduce_dtype`) other than fp32: the weight gradient through
    `_reduced_grad_projection`, whose matmul emits it in that dtype (any impl, batched or not).
    """
    if impl not in PROJECTION_IMPLS:
        raise ValueError(f"einsum: unknown projection impl {impl!r}; choose one of {PROJECTION_IMPLS}")
    x, w = x.astype(dtype), w.astype(dtype)
    x_dims, rest = spec.split(",")
    w_dims, out_dims = rest.split("->")
    if jnp.dtype(grad_dtype) != jnp.float32:
        y = _reduced_grad_projection(spec, jnp.dtype(grad_dtype), x, w)
    elif impl == XLA or set(x_dims) & set(w_dims) & set(out_dims):
        y = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    else:
        y = _transposed_grad_projection(spec, x, w)
    return y.astype(out_dtype or dtype)


def materialised_on_cpu(x):
    """`x` (typically a transpose) as its own buffer on XLA:CPU, where a dot contracting an operand's
    leading dims runs at about half the speed of one fed a [K, M] copy; the optimization barrier keeps
    XLA from folding the transpose back into the dot. Other backends keep the folded form."""
    return jax.lax.platform_dependent(x, cpu=jax.lax.optimization_barrier, default=lambda a: a)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _transposed_grad_projection(spec, x, w):
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def _transposed_grad_projection_fwd(spec, x, w):
    return _transposed_grad_projection(spec, x, w), (x, w)


def _transposed_grad_projection_bwd(spec, residuals, g):
    """dx as JAX derives it; dw = x^T g with x^T materialised in [w's x-dims, summed dims] order first.

    XLA:CPU otherwise runs x^T g as a dot contracting x's leading (token) dims, at about half the speed
    of a plain [D, N] @ [N, F] matmul (measured 40 vs 84 GFLOP/s for [2048,512]^T @ [2048,8192]); the
    optimization barrier keeps XLA from folding the transpose back into the dot.
    """
    x, w = residuals
    x_dims, rest = spec.split(",")
    w_dims, out_dims = rest.split("->")
    _, dx_fn = jax.vjp(lambda x_: jnp.einsum(spec, x_, w, preferred_element_type=jnp.float32), x)
    (dx,) = dx_fn(g)
    summed = "".join(c for c in x_dims if c not in w_dims)
    kept = "".join(c for c in x_dims if c in w_dims)
    xt = jax.lax.optimization_barrier(jnp.einsum(f"{x_dims}->{kept}{summed}", x))
    dw = jnp.einsum(f"{kept}{summed},{out_dims}->{w_dims}", xt, g.astype(x.dtype),
                    preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_transposed_grad_projection.defvjp(_transposed_grad_projection_fwd, _transposed_grad_projection_bwd)


def spread_mean(x):
    """The mean over x's last axis at every position of x (x's shape): jnp.mean's sum plus x * 0 (zeros XLA cannot
    fold away: a float times 0 is not always 0), then divided; the same values as ``jnp.mean(x, -1, keepdims=True)``
    broadcast, for finite x. At one token (a one-element mean) XLA runs what follows a mean (the norms' + eps and
    rsqrt) as a chain of scalar ops, one top-level instruction each; spread over the row, they fuse into the op
    that applies the norm (RuntimeConfig.decode_spread_norms)."""
    return (jnp.sum(x, axis=-1, keepdims=True) + x * 0) / x.shape[-1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _reduced_grad_projection(spec, grad_dtype, x, w):
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def _reduced_grad_projection_fwd(spec, grad_dtype, x, w):
    return _reduced_grad_projection(spec, grad_dtype, x, w), (x, w)


def _reduced_grad_projection_bwd(spec, grad_dtype, residuals, g):
    """dx as JAX derives it; dw from a matmul that emits ``grad_dtype``.

    Under a sharded batch dw is a sum of per-shard partial products, and the partitioner reduces it where
    the matmul ends, in the matmul's output dtype: emitted in bf16 (each partial accumulated in fp32 by the
    MXU and rounded once) the FSDP reduce-scatter moves bf16. JAX's own transpose emits fp32 and rounds to
    bf16 (the weight's compute dtype) only after the reduction.
    """
    x, w = residuals
    _, dx_fn = jax.vjp(lambda x_: jnp.einsum(spec, x_, w, preferred_element_type=jnp.float32), x)
    _, dw_fn = jax.vjp(lambda w_: jnp.einsum(spec, x, w_, preferred_element_type=grad_dtype), w)
    (dx,), (dw,) = dx_fn(g), dw_fn(g.astype(grad_dtype))
    return dx, dw.astype(w.dtype)


_reduced_grad_projection.defvjp(_reduced_grad_projection_fwd, _reduced_grad_projection_bwd)


class RMSNorm(nn.Module):
    """g * x / sqrt(mean(x^2) + eps), in fp32, weight initialised to 1 (not the 1+g form). ``spread``
    (RuntimeConfig.decode_spread_norms): the mean spread over the row (`spread_mean`), the same values."""
    eps: float
    axis_name: str
    param_dtype: jnp.dtype = jnp.float32
    spread: bool = False

    @nn.compact
    def __call__(self, x):
        scale = logical_param(self, "scale", (x.shape[-1],), (self.axis_name,), nn.initializers.ones,
                              self.param_dtype)
        x32 = x.astype(jnp.float32)
        if self.spread:
            y = x32 * jax.lax.rsqrt(spread_mean(x32 * x32) + self.eps)
        else:
            y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (scale.astype(jnp.float32) * y).astype(x.dtype)


class LayerNorm(nn.Module):
    """Standard LayerNorm with bias, in fp32 (only the indexer key uses it). ``spread``: as `RMSNorm`'s."""
    eps: float
    axis_name: str
    param_dtype: jnp.dtype = jnp.float32
    spread: bool = False

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        scale = logical_param(self, "scale", (d,), (self.axis_name,), nn.initializers.ones, self.param_dtype)
        bias = logical_param(self, "bias", (d,), (self.axis_name,), nn.initializers.zeros, self.param_dtype)
        x32 = x.astype(jnp.float32)
        if self.spread:
            centred = x32 - spread_mean(x32)
            y = centred * jax.lax.rsqrt(spread_mean(jnp.square(centred)) + self.eps)
        else:
            mean = jnp.mean(x32, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
            y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


# the gate and up products of `SwiGLU` ([B, T, width] fp32 each), named for remat policies: kept, the backward
# reruns neither product (decoder.REMAT_POLICIES "moe_attention_saveable", "attention_expert_out_mlp_saveable")
SWIGLU_SAVED_NAMES = ("mlp_gate_out", "mlp_up_out")


def swiglu(gate, up, limit=None):
    """silu(gate) * up; with ``limit`` (GLM-5.3-Flash's clamped SwiGLU) gate <= limit and |up| <= limit first."""
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


class SwiGLU(nn.Module):
    """(silu(x Wg) * (x Wu)) Wd — the dense FFN of the first layers and the shared expert (clamped by
    ``cfg.swiglu_limit``)."""
    cfg: ModelConfig
    width: int

    @nn.compact
    def __call__(self, x_BTD):
        cfg, d = self.cfg, x_BTD.shape[-1]
        init, pdt, dt = normal_init(cfg), cfg.jnp_param_dtype, cfg.jnp_dtype
        w_gate = logical_param(self, "gate_proj", (d, self.width), (EMBED, MLP), init, pdt)
        w_up = logical_param(self, "up_proj", (d, self.width), (EMBED, MLP), init, pdt)
        w_down = logical_param(self, "down_proj", (self.width, d), (MLP, EMBED), init, pdt)
        proj = dict(impl=cfg.runtime.projection_impl, grad_dtype=cfg.runtime.grad_reduce_dtype)
        gate, up = (checkpoint_name(einsum("btd,df->btf", x_BTD, w, dt, jnp.float32, **proj), name)
                    for w, name in zip((w_gate, w_up), SWIGLU_SAVED_NAMES))
        h = constrain(swiglu(gate, up, cfg.swiglu_limit).astype(dt), (BATCH, SEQ, ACT_MLP))
        return einsum("btf,fd->btd", h, w_down, dt, **proj)
