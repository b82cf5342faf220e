"""The chunked LM head + cross-entropy (`RuntimeConfig.loss_chunk_tokens`, glm5_jax/model/lm_head.py) against
the whole-logits path: the same per-token NLL and gradients for chunks that divide the sequence and chunks
that do not, on one device and on a mesh; the same train-step loss terms and parameter gradients (main and
MTP heads)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model.config import ConfigError, RuntimeConfig
from glm5_jax.model.lm_head import chunked_token_nll, head_logits, token_nll
from glm5_jax.model.transformer import Transformer
from glm5_jax.parallel.mesh import MeshConfig, build_mesh, mesh_and_rules
from glm5_jax.train.stage import stage_spec
from glm5_jax.train.step import batch_losses
from tests.train.test_train_step import MODEL, _leaves, batch, experiment

MTP_MODEL = MODEL.replace(num_hidden_layers=1, num_nextn_predict_layers=1, mtp_depth=2)   # a dense layer, MTP


def _with_chunk(model_cfg, chunk):
    return model_cfg.replace(runtime=model_cfg.runtime.replace(loss_chunk_tokens=chunk))


@pytest.mark.parametrize("chunk", [1, 6, 7, 24, 40])
def test_chunked_token_nll_equals_whole_logits(chunk):
    """T = 24: chunks of 6 and 24 divide it, 7 and 40 are padded (4 x 7 = 28, 1 x 40); value and gradients
    w.r.t. the hidden states and the head weight equal the [B, T, V] computation's."""
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((2, 24, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 50)) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 50, (2, 24)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(2, 24)), jnp.float32)     # a cotangent that differs per position

    def whole(h, w):
        return jnp.sum(weights * token_nll(head_logits(h, w, jnp.float32, "xla"), targets))

    def chunked(h, w):
        return jnp.sum(weights * chunked_token_nll(h, w, targets, chunk=chunk, dtype=jnp.float32, impl="xla"))

    per_token = chunked_token_nll(h, w, targets, chunk=chunk, dtype=jnp.float32, impl="xla")
    np.testing.assert_allclose(per_token, token_nll(head_logits(h, w, jnp.float32, "xla"), targets), rtol=1e-6)
    (gh_w, gw_w), (gh_c, gw_c) = jax.grad(whole, (0, 1))(h, w), jax.grad(chunked, (0, 1))(h, w)
    np.testing.assert_allclose(gh_c, gh_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gw_c, gw_w, rtol=1e-5, atol=1e-7)


def test_chunked_token_nll_refuses_a_non_positive_chunk():
    h, w, t = jnp.zeros((1, 4, 2)), jnp.zeros((2, 3)), jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="chunk=0"):
        chunked_token_nll(h, w, t, chunk=0, dtype=jnp.float32, impl="xla")
    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        RuntimeConfig(loss_chunk_tokens=-1)


def _loss_and_grads(model_cfg, variables, data):
    stage = stage_spec("sparse")
    exp = experiment()
    model = Transformer(stage.model_config(model_cfg))

    def loss(params):
        total, parts, out = batch_losses(model, dict(variables, params=params), data, exp.train, stage)
        return total, (parts, out)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])


def test_train_loss_and_param_gradients_equal_the_whole_logits_path():
    """The train step's loss terms (LM, MTP depths 1 and 2) and every parameter's gradient, T = 24 in chunks
    of 5 (padded to 25); fp32. The chunked model returns NLL, no logits."""
    data = batch()
    variables = Transformer(MTP_MODEL).init(jax.random.PRNGKey(0), jnp.asarray(data.tokens))
    (whole, (parts_w, out_w)), grads_w = _loss_and_grads(MTP_MODEL, variables, data)
    (chunked, (parts_c, out_c)), grads_c = _loss_and_grads(_with_chunk(MTP_MODEL, 5), variables, data)
    assert out_w.logits is not None and out_c.logits is None and out_c.mtp_logits is None
    assert out_c.nll.shape == data.tokens.shape and out_c.mtp_nll.shape == (2,) + data.tokens.shape
    for name in ("loss", "lm_loss", "mtp_loss"):
        np.testing.assert_allclose(parts_c[name], parts_w[name], rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)
    a, b = _leaves(grads_w), _leaves(grads_c)
    assert np.abs(next(v for k, v in a.items() if "lm_head" in k)).max() > 0
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_chunked_token_nll_on_a_mesh_equals_one_device():
    """Under data 2 x context 2 x tensor 2 rules (rows, positions and the head's vocabulary split) chunks of
    5 positions of T = 24 give one device's whole-logits NLL and gradients."""
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((4, 24, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 64)) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 64, (4, 24)), jnp.int32)

    def value(h, w, chunk):
        nll = chunked_token_nll(h, w, targets, chunk=chunk, dtype=jnp.float32, impl="xla")
        return jnp.sum(nll * jnp.arange(1.0, 25.0)), nll

    expected = jax.value_and_grad(value, (0, 1), has_aux=True)(h, w, 24)
    mesh_cfg = MeshConfig(data=2, fsdp=1, context=2, tensor=2)
    with mesh_and_rules(build_mesh(mesh_cfg, jax.devices()[:8]), mesh_cfg.rules):
        got = jax.jit(jax.value_and_grad(value, (0, 1), has_aux=True), static_argnums=2)(h, w, 5)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)   # sums of terms weighted up to 24
