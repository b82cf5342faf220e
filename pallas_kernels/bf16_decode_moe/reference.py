"""The routed-expert sum of a few tokens on one chip, bf16 (fp) experts, in plain XLA: the oracle for kernel.py.

Shapes: x [n, D] (the tokens), key [M = n K] (each (token, choice) assignment's expert, in token order:
assignment m is token m // K's; the chip holds experts ``offset`` .. ``offset`` + E_local - 1, others are
skipped), gates [M]; the chip's E_local experts' weights stacked over layers, layer ``layer``: gate and up
[L, E_local, D, F], down [L, E_local, F, D] (F: the chip's share of the experts' width). -> y [n, D] fp32,
y[t] = sum over t's local assignments m of gates[m] * down_e(h), h = silu(g) * u rounded to ``dtype``, where g
and u are x[t] gate_e and x[t] up_e accumulated in fp32 and rounded to ``dtype`` (what the grouped-matmul path,
glm5_jax/model/moe/experts.swiglu_rows, computes), every product from ``dtype`` operands.
"""
import jax
import jax.numpy as jnp


def bf16_decode_moe(x_nD, key_M, gates_M, w_gate, w_up, w_down, layer, offset=0, *, dtype):
    n_local = w_gate.shape[1]
    key_M = key_M - offset
    local = (key_M >= 0) & (key_M < n_local)
    K = key_M.shape[0] // x_nD.shape[0]
    e = jnp.clip(key_M, 0, n_local - 1)
    x_MD = jnp.repeat(x_nD.astype(dtype), K, axis=0)

    def mm(a, w):
        return jnp.einsum("md,mdf->mf", a, w[layer][e].astype(dtype), preferred_element_type=jnp.float32)

    g, u = (mm(x_MD, w).astype(dtype).astype(jnp.float32) for w in (w_gate, w_up))
    h = (jax.nn.silu(g) * u).astype(dtype)
    y = mm(h, w_down) * jnp.where(local, gates_M.astype(jnp.float32), 0.0)[:, None]
    return y.reshape(x_nD.shape[0], K, -1).sum(axis=1)
