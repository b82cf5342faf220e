"""Kimi Delta Attention as Pallas TPU kernels: the chunked forward and its backward.

Grid (B, H, N chunks): batch rows and heads "parallel" (TPU cores split them), chunks "arbitrary" (in
order; the backward's in reverse), the state [K, V] fp32 carried between chunks in VMEM scratch. Each
grid step runs pallas_kernels/kda/chunk_step.py on one chunk of one head: q, k, g [C, K] and v [C, V] are
head h's lane slab of the [B, T, H * K] operands (no transpose in HBM), beta a column [C, 1] of a
[B, H, T, 1] copy, the segment ids and the carried state's document id columns [C, 1] shared by all heads.

* forward: o [B, T, H*V] in q's dtype, the final state [B, H, K, V]; for the backward also the state at
  every chunk's start [B, H, N, K, V] fp32 (``save_states``).
* backward: per chunk, last first, the VJP of `chunk_step` at the saved state, fed the chunk's output
  cotangent and the state cotangent from the chunks after it (in scratch, starting from the final state's
  cotangent); it writes the chunk's dq, dk, dv, dg, dbeta (fp32) and, at chunk 0, d initial_state.

K and V must be multiples of 128 and T of the chunk (ops.py pads).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda.chunk_step import chunk_step
from pallas_kernels.tpu_utils import LANES

VMEM_LIMIT_BYTES = 64 * 2**20


def _check(T, K, V, chunk):
    if K % LANES or V % LANES or T % chunk or chunk % 16:
        raise ValueError(f"kda kernel: K={K} and V={V} must be multiples of {LANES}, T={T} of the chunk "
                         f"{chunk} (a multiple of 16); ops.py pads")


def _specs(B, H, N, C, K, V, reverse):
    chunk = (lambda n: N - 1 - n) if reverse else (lambda n: n)
    return dict(
        qk=pl.BlockSpec((None, C, K), lambda b, h, n: (b, chunk(n), h)),
        v=pl.BlockSpec((None, C, V), lambda b, h, n: (b, chunk(n), h)),
        beta=pl.BlockSpec((None, None, C, 1), lambda b, h, n: (b, h, chunk(n), 0)),
        meta=pl.BlockSpec((None, C, 1), lambda b, h, n: (b, chunk(n), 0)),
        state=pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0)),
        chunk_state=pl.BlockSpec((None, None, None, K, V), lambda b, h, n: (b, h, chunk(n), 0, 0)),
    )


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                vmem_limit_bytes=VMEM_LIMIT_BYTES)


def _cost(B, H, T, K, V, C, passes):
    """Per token: the intra-chunk scores (2 x 2 C K), T (about 2 C^2 in the inverse's products), the WY
    products and the state's (about 2 C (K + V) + 6 K V); the backward about three times that."""
    flops = B * H * T * (4 * C * K + 2 * C * C + 2 * C * (K + V) + 6 * K * V) * passes
    return pl.CostEstimate(flops=flops, transcendentals=B * H * T * (2 * 16 + 3) * K * passes,
                           bytes_accessed=B * H * T * (3 * K + 2 * V) * 4 * passes)


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, prev_ref, init_ref, o_ref, final_ref, *rest,
                scale, save_states):
    states_ref, S_ref = rest if save_states else (None, *rest)
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        S_ref[...] = init_ref[...]

    S = S_ref[...]
    if save_states:
        states_ref[...] = S
    f32 = lambda ref: ref[...].astype(jnp.float32)  # noqa: E731
    o, S_next = chunk_step(S, f32(q_ref), f32(k_ref), f32(v_ref), f32(g_ref), f32(beta_ref), seg_ref[...],
                           prev_ref[...], scale=scale)
    o_ref[...] = o.astype(o_ref.dtype)
    S_ref[...] = S_next

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        final_ref[...] = S_next


def kda_fwd(q_BTF, k_BTF, v_BTF, g_BTF, beta_BHT1, seg_BT1, prev_BT1, init_BHKV, *, scale, chunk,
            save_states, interpret=False):
    """q, k, g [B, T, H*K], v [B, T, H*V] (any float dtype), beta [B, H, T, 1] fp32, segment ids and the
    carried state's document id [B, T, 1] fp32, the initial state [B, H, K, V] fp32 -> (o [B, T, H*V],
    final state, and with ``save_states`` the chunk-start states [B, H, N, K, V])."""
    B, H, K, V = init_BHKV.shape
    T = q_BTF.shape[1]
    _check(T, K, V, chunk)
    N = T // chunk
    s = _specs(B, H, N, chunk, K, V, reverse=False)
    out_specs = [s["v"], s["state"]] + [s["chunk_state"]] * save_states
    out_shape = [jax.ShapeDtypeStruct((B, T, H * V), q_BTF.dtype), jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)]
    out_shape += [jax.ShapeDtypeStruct((B, H, N, K, V), jnp.float32)] * save_states
    outs = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, save_states=save_states),
        grid=(B, H, N),
        in_specs=[s["qk"], s["qk"], s["v"], s["qk"], s["beta"], s["meta"], s["meta"], s["state"]],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), jnp.float32)],
        compiler_params=_params(),
        interpret=interpret,
        name="kda_fwd",
        cost_estimate=_cost(B, H, T, K, V, chunk, passes=1),
    )(q_BTF, k_BTF, v_BTF, g_BTF, beta_BHT1, seg_BT1, prev_BT1, init_BHKV)
    return tuple(outs) if save_states else (*outs, None)


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, prev_ref, states_ref, do_ref, dfinal_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dinit_ref, dS_ref, *, scale):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        dS_ref[...] = dfinal_ref[...]

    seg, prev = seg_ref[...], prev_ref[...]

    def step(S, q, k, v, g, beta):
        return chunk_step(S, q, k, v, g, beta, seg, prev, scale=scale)

    primals = tuple(ref[...].astype(jnp.float32) for ref in (states_ref, q_ref, k_ref, v_ref, g_ref, beta_ref))
    _, pullback = jax.vjp(step, *primals)
    dS, dq, dk, dv, dg, dbeta = pullback((do_ref[...].astype(jnp.float32), dS_ref[...]))
    dq_ref[...], dk_ref[...], dv_ref[...], dg_ref[...], dbeta_ref[...] = dq, dk, dv, dg, dbeta
    dS_ref[...] = dS

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        dinit_ref[...] = dS


def kda_bwd(q_BTF, k_BTF, v_BTF, g_BTF, beta_BHT1, seg_BT1, prev_BT1, states_BHNKV, do_BTF, dfinal_BHKV, *,
            scale, chunk, interpret=False):
    """Operands of `kda_fwd` plus its chunk-start states, the cotangents of o [B, T, H*V] and of the final
    state [B, H, K, V] -> (dq, dk, dv, dg [B, T, H*K or H*V], dbeta [B, H, T, 1], d initial state), fp32."""
    B, H, N, K, V = states_BHNKV.shape
    T = q_BTF.shape[1]
    _check(T, K, V, chunk)
    s = _specs(B, H, N, chunk, K, V, reverse=True)
    f32 = jnp.float32
    return pl.pallas_call(
        functools.partial(_bwd_kernel, scale=scale),
        grid=(B, H, N),
        in_specs=[s["qk"], s["qk"], s["v"], s["qk"], s["beta"], s["meta"], s["meta"], s["chunk_state"], s["v"],
                  s["state"]],
        out_specs=[s["qk"], s["qk"], s["v"], s["qk"], s["beta"], s["state"]],
        out_shape=[jax.ShapeDtypeStruct((B, T, H * K), f32), jax.ShapeDtypeStruct((B, T, H * K), f32),
                   jax.ShapeDtypeStruct((B, T, H * V), f32), jax.ShapeDtypeStruct((B, T, H * K), f32),
                   jax.ShapeDtypeStruct((B, H, T, 1), f32), jax.ShapeDtypeStruct((B, H, K, V), f32)],
        scratch_shapes=[pltpu.VMEM((K, V), jnp.float32)],
        compiler_params=_params(),
        interpret=interpret,
        name="kda_bwd",
        cost_estimate=_cost(B, H, T, K, V, chunk, passes=3),
    )(q_BTF, k_BTF, v_BTF, g_BTF, beta_BHT1, seg_BT1, prev_BT1, states_BHNKV, do_BTF, dfinal_BHKV)
