"""Chaining the DSA stages (dense -> indexer warm-up -> sparse) on one set of weights: what each stage
trains, and that switching attention to the top-k barely moves the LM loss once the indexer is warm."""
import dataclasses

import jax
import numpy as np
import pytest

from glm5_jax.parallel.mesh import MeshConfig, build_mesh
from glm5_jax.train.stage import is_indexer_param
from glm5_jax.train.step import Trainer
from tests.train.test_train_step import MODEL, T, batch, experiment

MESH = MeshConfig(data=1, fsdp=1)


def trainer_for(stage, model=MODEL, **train):
    exp = experiment(stage, mesh=MESH, **train)
    return Trainer(dataclasses.replace(exp, model=model), build_mesh(MESH, jax.devices()[:1]))


def continue_as(trainer, state):
    """The next stage's state: the same weights and routing bias, a fresh optimizer, step 0."""
    return trainer.state_from_weights(state.params, state.moe_bias, seed=0)


def train(trainer, state, steps, seeds=(0, 1, 2, 3)):
    history = []
    for i in range(steps):
        state, metrics = trainer.step(state, trainer.put_batch(batch(seeds[i % len(seeds)])))
        history.append(jax.device_get(metrics))
    return state, history


def _split(params):
    flat = jax.tree_util.tree_leaves_with_path(jax.device_get(params))
    return ({jax.tree_util.keystr(p): np.asarray(x) for p, x in flat if is_indexer_param(p)},
            {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat if not is_indexer_param(p)})


def lm_loss(trainer, state, seed):
    """The LM loss a step of `trainer`'s stage reports for batch `seed` at `state` (before its update)."""
    out = jax.device_get(trainer.evaluate(state, trainer.put_batch(batch(seed))))
    return float(out["eval_loss_sum"] / out["eval_tokens"])


@pytest.fixture(scope="module")
def dense_state():
    dense = trainer_for("dense")
    state, _ = train(dense, dense.init_state(0), 6)
    return jax.device_get(state)


@pytest.fixture(scope="module")
def warmup_run(dense_state):
    """(state the warm-up starts from, state after 12 warm-up steps, per-step metrics)."""
    warm = trainer_for("warmup", learning_rate=3e-2)
    start = jax.device_get(continue_as(warm, dense_state))
    state, history = train(warm, continue_as(warm, start), 12, seeds=(0,))
    return start, jax.device_get(state), history


def test_warmup_trains_only_the_indexer_and_lowers_its_kl(warmup_run):
    start, state, history = warmup_run
    idx0, rest0 = _split(start.params)
    idx1, rest1 = _split(state.params)
    assert all(np.array_equal(rest0[k], rest1[k]) for k in rest0)          # everything else frozen
    assert all(not np.array_equal(idx0[k], idx1[k]) for k in idx0)        # every indexer weight moved
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(start.moe_bias), jax.tree.leaves(state.moe_bias)))
    kl = [h["indexer_loss"] for h in history]
    assert kl[-1] < 0.5 * kl[0], kl


def test_sparse_equals_dense_when_the_top_k_covers_the_sequence(dense_state):
    # index_topk >= T: every visible key is selected, so sparse attention is dense attention exactly
    model = MODEL.replace(index_topk=T)
    dense, sparse = trainer_for("dense", model=model), trainer_for("sparse", model=model)
    state = continue_as(sparse, dense_state)
    _, first_sparse = train(sparse, state, 1, seeds=(5,))
    np.testing.assert_allclose(first_sparse[0]["lm_loss"], lm_loss(dense, continue_as(dense, dense_state), 5),
                               rtol=1e-5)


def test_first_sparse_step_after_warmup_stays_close_to_dense(dense_state, warmup_run):
    """Documents of 15 and 9 tokens with index_topk 8: the top-k drops keys for later queries, and the LM
    loss moves by the attention output lost with the mass on dropped keys (each head's output is a convex
    combination of values; sparse renormalises it over the kept keys, so a query whose dropped keys held
    mass m moves by at most 2 m max|v|).
    The warm indexer keeps the keys dense attention weighs most, so the first sparse step's loss stays
    within 1% of the dense loss on the same weights and batch, closer than with the untrained indexer."""
    dense, sparse = trainer_for("dense"), trainer_for("sparse")
    dense_lm = lm_loss(dense, continue_as(dense, dense_state), 5)
    cold_lm = train(sparse, continue_as(sparse, dense_state), 1, seeds=(5,))[1][0]["lm_loss"]
    warmed = warmup_run[1]
    warm_lm = train(sparse, continue_as(sparse, warmed), 1, seeds=(5,))[1][0]["lm_loss"]
    print(f"dense {dense_lm:.6f}  sparse after warm-up {warm_lm:.6f}  sparse, untrained indexer {cold_lm:.6f}")
    assert abs(warm_lm - dense_lm) / dense_lm < 0.01, (dense_lm, warm_lm, cold_lm)
    assert abs(warm_lm - dense_lm) < abs(cold_lm - dense_lm), (dense_lm, warm_lm, cold_lm)
