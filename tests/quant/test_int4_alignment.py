"""The INT4 model is the QAT model: packed-weight logits equal the fake-quantised forward bit for bit
(fp32, CPU), both equal a model holding a numpy INT4 oracle's weights, and greedy decoding agrees."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import Transformer
from glm5_jax.generate.decoding import generate
from glm5_jax.model.moe.int4_weights import EXPERT_WEIGHTS, quantize_params
from glm5_jax.quant import int4
from tests.generate.tiny_models import init_variables
from tests.quant.quant_helpers import GROUP, TINY_Q, numpy_fake_quantize

QAT = TINY_Q.replace(quant="int4_qat")
INT4 = TINY_Q.replace(quant="int4")


def logits(cfg, variables, tokens):
    return np.asarray(jax.jit(lambda v, t: Transformer(cfg).apply(v, t).logits)(variables, tokens))


def int4_model():
    variables = init_variables(TINY_Q)                  # fp master weights (the QAT model's tree)
    return variables, {**variables, "params": quantize_params(variables["params"], QAT)}


def test_int4_logits_equal_qat_forward_bitwise():
    variables, int4_vars = int4_model()
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, TINY_Q.vocab_size)
    moe = int4_vars["params"]["decoder"]["segment_1"]["layer_0"]["moe"]
    fp_moe = variables["params"]["decoder"]["segment_1"]["layer_0"]["moe"]
    assert moe["gate_proj_packed"].dtype == jnp.int32 and "gate_proj" not in moe
    assert moe["gate_proj_packed"].shape[-2] * 8 == fp_moe["gate_proj"].shape[-2]
    # the packed weights hold exactly the numpy oracle's INT4 values
    for name in EXPERT_WEIGHTS:
        dequantized = int4.dequantize_packed(moe[f"{name}_packed"], moe[f"{name}_scale"], GROUP)
        np.testing.assert_array_equal(dequantized, numpy_fake_quantize(fp_moe[name], GROUP))
        assert np.abs(dequantized - fp_moe[name]).max() > 1e-3      # quantisation really changed them

    qat, packed = logits(QAT, variables, tokens), logits(INT4, int4_vars, tokens)
    np.testing.assert_array_equal(packed, qat)


def test_int4_greedy_decode_equals_qat_greedy_decode():
    variables, int4_vars = int4_model()
    prompt = jax.random.randint(jax.random.key(3), (2, 10), 0, TINY_Q.vocab_size)
    lengths = jnp.array([10, 7], jnp.int32)
    outs = [generate(cfg, v, prompt, lengths, max_new_tokens=12, temperature=0.0, rng=jax.random.key(0),
                     eos_ids=()) for cfg, v in ((QAT, variables), (INT4, int4_vars))]
    np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
    np.testing.assert_array_equal(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs))


def test_config_rejects_widths_int4_cannot_pack():
    from glm5_jax.model.config import ConfigError

    with pytest.raises(ConfigError, match="hidden_size=64.*multiple of 256"):
        TINY_Q.replace(quant="int4_qat", quant_group_size=32)          # D = 64 is not a multiple of 8 * 32
    with pytest.raises(ConfigError, match="quant_group_size"):
        TINY_Q.replace(quant="int4", quant_group_size=12)
    with pytest.raises(ConfigError, match="quant_matmul"):
        TINY_Q.replace(quant_matmul="pallas")                           # the kernel needs packed weights
