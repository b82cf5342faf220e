"""The routed-expert sum of a few tokens on one chip, packed INT4 experts, in plain XLA: the oracle for kernel.py.

Shapes: x [n, D] (the tokens), key [M = n K] (each (token, choice) assignment's expert, in token order:
assignment m is token m // K's; the chip holds experts ``offset`` .. ``offset`` + E_local - 1, others are
skipped), gates [M]; weights of the
chip's E_local experts packed as pallas_kernels/int4_matmul lays them out (int32 words [L, E, K/8, N], scales
[L, E, K/G, N], layer ``layer``): gate and up [D -> F], down [F -> D] (F: the chip's share of the experts'
width). -> y [n, D] fp32, y[t] = sum over t's local assignments m of gates[m] * down_e(h), h = (silu(x[t] gate_e)
* (x[t] up_e)) rounded to ``dtype``, each product in fp32 from ``dtype`` operands (the weights dequantised in
fp32, then cast, as the INT4 kernel does).
"""
import jax
import jax.numpy as jnp

from pallas_kernels.int4_matmul.reference import dequantized_weights


def int4_decode_moe(x_nD, key_M, gates_M, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
                    layer, offset=0, *, group_size, dtype):
    n_local = gate_packed.shape[1]
    key_M = key_M - offset
    local = (key_M >= 0) & (key_M < n_local)
    K = key_M.shape[0] // x_nD.shape[0]
    take = lambda w: w[layer]                                                 # noqa: E731
    w_gate, w_up, w_down = (dequantized_weights(take(p), take(s), group_size, dtype)
                            for p, s in ((gate_packed, gate_scale), (up_packed, up_scale), (down_packed, down_scale)))
    e = jnp.clip(key_M, 0, n_local - 1)
    x_MD = jnp.repeat(x_nD.astype(dtype), K, axis=0)
    mm = lambda a, w: jnp.einsum("md,mdf->mf", a, w[e], preferred_element_type=jnp.float32)  # noqa: E731
    h = (jax.nn.silu(mm(x_MD, w_gate)) * mm(x_MD, w_up)).astype(dtype)
    y = mm(h, w_down) * jnp.where(local, gates_M.astype(jnp.float32), 0.0)[:, None]
    return y.reshape(x_nD.shape[0], K, -1).sum(axis=1)
