"""train.mu_dtype: the optimizer's first moment kept in bfloat16 (AdamW's mu, Muon's momentum), the second
moment and the parameters untouched; the updates equal the float32 ones up to bfloat16 rounding."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.train.experiment import TrainConfig
from glm5_jax.train.optim import make_optimizer
from glm5_jax.train.stage import stage_spec

PARAMS = {"embed": jnp.ones((8, 4), jnp.float32),
          "decoder": {"q_a_proj": jnp.full((2, 4, 6), 0.5, jnp.float32)},
          "norm": jnp.ones((4,), jnp.float32)}


def _grads(seed):
    leaves, tree = jax.tree.flatten(PARAMS)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return tree.unflatten([jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)])


def _states_by_dtype(state):
    return {str(x.dtype) for x in jax.tree.leaves(state) if x.ndim >= 1}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_bf16_first_moment(optimizer):
    cfg = TrainConfig(optimizer=optimizer, learning_rate=1e-2, warmup_steps=1, steps=10, clip_norm=1e9)
    opt32 = make_optimizer(cfg, stage_spec(cfg.stage))
    opt16 = make_optimizer(dataclasses.replace(cfg, mu_dtype="bfloat16"), stage_spec(cfg.stage))
    s32, s16 = opt32.init(PARAMS), opt16.init(PARAMS)
    # the float32 state holds float32 arrays only; the bf16 one holds one bf16 array per parameter (mu),
    # the rest (nu, counts) stays float32
    assert _states_by_dtype(s32) == {"float32"}
    n_bf16 = sum(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(s16))
    assert n_bf16 == len(jax.tree.leaves(PARAMS))
    # two steps: after one, Adam's update is sign(g) whatever the rounding
    for seed in (0, 1):
        u32, s32 = opt32.update(_grads(seed), s32, PARAMS)
        u16, s16 = opt16.update(_grads(seed), s16, PARAMS)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(u16))
    for a, b in zip(jax.tree.leaves(u16), jax.tree.leaves(u32)):
        # bf16 keeps 8 bits of mu: an error of a few 2^-9 of the largest update (relative errors are larger
        # only where mu nearly cancels)
        np.testing.assert_allclose(a, b, atol=1e-2 * float(np.max(np.abs(b))))
    # and they do differ: the first moment really is rounded to bfloat16
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(u16), jax.tree.leaves(u32)))
    assert sum(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(s16)) == n_bf16


def test_bad_mu_dtype_is_rejected():
    with pytest.raises(ValueError, match="train.mu_dtype"):
        TrainConfig(mu_dtype="float16").validate()
