"""QAT's straight-through estimator: the gradient through the fake-quantised weights is the gradient with
respect to the dequantised weights, handed unchanged to the fp master weights."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model.moe.layer import MoE
from glm5_jax.quant import int4
from tests.quant.quant_helpers import GROUP, TINY_Q, numpy_fake_quantize


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float32"])
def test_fake_quantize_gradient_is_the_gradient_at_the_dequantized_weights(scale_dtype):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (5, 64))
    w = jax.random.normal(kw, (64, 24)) * 0.05

    def loss(v):
        return jnp.sum(jnp.sin(x @ v) ** 2)

    w_hat = int4.fake_quantize(w, GROUP, scale_dtype)
    # bf16 scales make q * s exact, so the numpy oracle agrees bitwise; an fp32 scale max|w| / 7 may
    # differ from numpy's by an ulp (XLA divides by a constant as a multiply by its reciprocal)
    tol = 0 if scale_dtype == "bfloat16" else 1e-6
    np.testing.assert_allclose(w_hat, numpy_fake_quantize(w, GROUP, jnp.dtype(scale_dtype)), rtol=tol, atol=0)
    g_ste = jax.grad(lambda v: loss(int4.fake_quantize(v, GROUP, scale_dtype)))(w)
    np.testing.assert_array_equal(g_ste, jax.grad(loss)(w_hat))
    assert np.abs(g_ste - jax.grad(loss)(w)).max() > 0     # not just the unquantised gradient


def test_qat_moe_expert_gradients_equal_gradients_at_dequantized_experts():
    cfg = TINY_Q.replace(moe_impl="ragged_dot")
    x = jax.random.normal(jax.random.key(1), (2, 6, cfg.hidden_size))
    mask = jnp.ones((2, 6), bool)
    variables = nn.meta.unbox(MoE(cfg).init(jax.random.key(2), x, mask))
    quantized = {**variables["params"], **{k: jnp.asarray(numpy_fake_quantize(variables["params"][k], GROUP))
                                          for k in ("gate_proj", "up_proj", "down_proj")}}

    def loss(c, params):
        out, aux = MoE(c).apply({**variables, "params": params}, x, mask)
        return jnp.sum(out ** 2)

    g_qat = jax.jit(jax.grad(lambda p: loss(cfg.replace(quant="int4_qat"), p)))(variables["params"])
    g_ref = jax.jit(jax.grad(lambda p: loss(cfg, p)))(quantized)
    for k in ("gate_proj", "up_proj", "down_proj"):
        np.testing.assert_allclose(g_qat[k], g_ref[k], rtol=1e-6, atol=1e-9)
        assert np.abs(g_ref[k]).max() > 0


def test_packed_int4_model_cannot_be_trained():
    import dataclasses

    from configs.sort_sft import get_config

    cfg = get_config()
    bad = dataclasses.replace(cfg, model=cfg.model.replace(quant="int4", quant_group_size=16))
    with pytest.raises(ValueError, match="int4_qat"):
        bad.validate()
