"""The sharded train step: mesh invariance, DSA stages, routing-bias balancing."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from glm5_jax.data import Batch, DataConfig
from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.parallel.mesh import MeshConfig, MeshError, build_mesh, check_mesh_fits_model
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig
from glm5_jax.train.stage import is_indexer_param
from glm5_jax.train.step import Trainer

MODEL = ModelConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, first_k_dense_replace=1,
                    intermediate_size=64, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=16,
                    index_topk=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    num_nextn_predict_layers=1, mtp_depth=1, initializer_range=0.1,
                    runtime=RuntimeConfig(remat_policy="none"))
B, T = 8, 24


def experiment(stage="sparse", mesh=MeshConfig(data=1, fsdp=1), **train):
    train = {"warmup_steps": 1, "learning_rate": 1e-2, **train}
    return ExperimentConfig(model=MODEL, data=DataConfig(batch_size=B, seq_len=T),
                            train=TrainConfig(stage=stage, **train), mesh=mesh)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, MODEL.vocab_size, (B, T)).astype(np.int32)
    segments = np.ones((B, T), np.int32)
    segments[:, 15:] = 2                       # two packed documents per row
    segments[1, 20:] = 0                       # and some padding
    positions = np.concatenate([np.arange(15), np.arange(9)])[None].repeat(B, 0).astype(np.int32)
    return Batch(tokens=tokens, segment_ids=segments, positions=positions)


def run_step(exp_cfg, devices, seed=0):
    trainer = Trainer(exp_cfg, build_mesh(exp_cfg.mesh, devices))
    state = trainer.init_state(seed)
    before = jax.device_get(state)                    # the step donates its input state
    new_state, metrics = trainer.step(state, trainer.put_batch(batch()))
    return before, jax.device_get(new_state), jax.device_get(metrics)


def _leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_sharded_step_equals_single_device_step():
    # eps well above the tiniest gradients keeps Adam's first update ~linear in g, so the comparison
    # measures the sharded computation rather than Adam's sign(g) amplification of rounding.
    single = run_step(experiment(eps=1e-4), jax.devices()[:1])
    sharded_cfg = experiment(eps=1e-4, mesh=MeshConfig(data=2, fsdp=2, expert=1, tensor=2))
    sharded = run_step(sharded_cfg, jax.devices()[:8])
    np.testing.assert_allclose(sharded[2]["loss"], single[2]["loss"], rtol=1e-5)
    init, a, b = _leaves(single[0].params), _leaves(single[1].params), _leaves(sharded[1].params)
    assert sum(not np.array_equal(init[k], a[k]) for k in a) > len(a) // 2      # the step really moved
    for name in a:
        np.testing.assert_allclose(b[name], a[name], atol=2e-6, rtol=1e-5, err_msg=name)
    bias_a, bias_b = _leaves(single[1].moe_bias), _leaves(sharded[1].moe_bias)
    for name in bias_a:
        assert np.any(bias_a[name] != 0)
        np.testing.assert_array_equal(bias_b[name], bias_a[name])


def test_warmup_changes_only_indexer_params():
    before, after, metrics = run_step(experiment(stage="warmup"), jax.devices()[:1])
    changed_indexer = 0
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(before.params), jax.tree.leaves(after.params)):
        if is_indexer_param(path):
            changed_indexer += int(not np.array_equal(x, y))
        else:
            np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
    assert changed_indexer > 0
    assert metrics["indexer_loss"] > 0
    for x, y in zip(jax.tree.leaves(before.moe_bias), jax.tree.leaves(after.moe_bias)):
        np.testing.assert_array_equal(x, y)          # the main model, routing included, is frozen


def _grads(exp_cfg, loss_parts):
    trainer = Trainer(exp_cfg, build_mesh(exp_cfg.mesh, jax.devices()[:1]))
    state = trainer.init_state(0)
    data = trainer.put_batch(batch())

    @jax.jit
    def grads_of_parts(params):
        return [jax.grad(lambda p: trainer._loss(p, state.moe_bias, data)[1][0][part])(params) for part in loss_parts]

    return [{jax.tree_util.keystr(p): np.asarray(g) for p, g in jax.tree_util.tree_leaves_with_path(grads)}
            for grads in grads_of_parts(state.params)]


def test_sparse_stage_lm_loss_never_reaches_the_indexer():
    lm, kl = _grads(experiment(stage="sparse"), ("lm_loss", "indexer_loss"))
    indexer = [k for k in lm if "indexer" in k]
    assert indexer
    for k in indexer:
        assert np.all(lm[k] == 0), k                           # exactly zero, not small
    assert all(np.any(kl[k] != 0) for k in indexer)
    assert all(np.all(kl[k] == 0) for k in kl if "indexer" not in k)   # KL trains only the indexer
    assert any(np.any(lm[k] != 0) for k in lm if "indexer" not in k)


def test_bias_update_reduces_load_imbalance():
    cfg = experiment(stage="dense", bias_update_rate=0.05, learning_rate=1e-9)   # only the bias moves
    trainer = Trainer(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    state = trainer.init_state(0)
    # skew the routing: experts 0 and 1 win every selection at first
    state = state.replace(moe_bias=jax.tree.map(lambda b: b.at[..., :2].add(0.3), state.moe_bias))
    data = trainer.put_batch(batch())
    spreads = []
    for _ in range(12):
        state, metrics = trainer.step(state, data)
        spreads.append(float(metrics["expert_load_max_over_mean_worst"]))
    assert spreads[0] >= 1.9                       # 2 of 4 experts take everything: max/mean = 2
    assert spreads[-1] < 1.5, spreads


def test_impossible_meshes_are_rejected_before_compiling():
    with pytest.raises(MeshError, match="only one axis may be -1"):
        MeshConfig(data=-1, fsdp=-1).axis_sizes(8)
    with pytest.raises(MeshError, match="has 12 devices, but 8"):
        MeshConfig(data=3, fsdp=4).axis_sizes(8)
    with pytest.raises(MeshError, match="cannot be split"):
        MeshConfig(data=3, fsdp=-1).axis_sizes(8)
    with pytest.raises(MeshError, match="tensor=4 does not divide num_attention_heads=2"):
        check_mesh_fits_model({"data": 1, "fsdp": 2, "expert": 1, "tensor": 4}, MODEL, B)
    with pytest.raises(MeshError, match="expert=8 does not divide n_routed_experts=4"):
        check_mesh_fits_model({"data": 1, "fsdp": 1, "expert": 8, "tensor": 1}, MODEL, B)
    with pytest.raises(MeshError, match="global batch 8 is not divisible"):
        check_mesh_fits_model({"data": 1, "fsdp": 16, "expert": 1, "tensor": 1}, MODEL.replace(hidden_size=64), B)


def test_rules_table_maps_exactly_the_logical_axes_the_model_names():
    """DEFAULT_RULES has one rule per name in parallel.axes.ALL, and every parameter of the model (MoE, MTP,
    indexer included) carries only those names: no axis silently falls through to replicated."""
    import flax.linen as nn

    from glm5_jax.model.param_count import abstract_variables
    from glm5_jax.parallel import axes
    from glm5_jax.parallel.mesh import DEFAULT_RULES

    rule_names = [name for name, _ in DEFAULT_RULES]
    assert sorted(rule_names) == sorted(axes.ALL) and len(set(rule_names)) == len(rule_names)
    specs = jax.tree.leaves(nn.get_partition_spec(abstract_variables(MODEL)),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    named = {n for spec in specs for n in spec if n is not None}
    assert named and named <= set(axes.ALL)
    assert {axes.EXP, axes.MTP_CONCAT, axes.INDEX_HEADS, axes.LAYERS} <= named


def _sharded_loss_and_grads(exp_cfg):
    """A function params -> (total loss, {path: gradient}) of one batch on the 8-device mesh of `exp_cfg`, and
    the seed-0 params."""
    trainer = Trainer(exp_cfg, build_mesh(exp_cfg.mesh, jax.devices()[:8]))
    state = trainer.init_state(0)
    data = trainer.put_batch(batch())
    with trainer.context():
        fn = jax.jit(jax.value_and_grad(lambda p: trainer._loss(p, state.moe_bias, data)[0]))

    def loss_and_grads(params):
        with trainer.context():
            loss, grads = fn(params)
        return float(loss), grads
    return loss_and_grads, state.params


def test_bf16_grad_reduce_keeps_the_loss_and_rounds_only_the_projection_gradients():
    """grad_reduce_dtype=bfloat16 (bf16 compute, fp32 master weights, data 2 x fsdp 2 x tensor 2): the same
    loss; the gradients of the weights that reach a matmul through layers.einsum differ from the
    fp32-reduced ones by bf16 rounding (the elementwise bound: tests/model/test_layers.py; measured here
    ~0.3% in L2, u = 0.39%), every other gradient is unchanged; and a step along them lowers the loss."""
    mesh = MeshConfig(data=2, fsdp=2, expert=1, tensor=2)
    bf16 = MODEL.replace(dtype="bfloat16")

    def cfg(model):
        return dataclasses.replace(experiment(stage="dense", mesh=mesh), model=model)

    fn32, params = _sharded_loss_and_grads(cfg(bf16))
    fn16, _ = _sharded_loss_and_grads(cfg(bf16.replace(grad_reduce_dtype="bfloat16")))
    (loss32, grads32), (loss16, grads16) = fn32(params), fn16(params)
    assert loss16 == loss32
    g32, g16 = _leaves(grads32), _leaves(grads16)
    # attention, dense MLP and shared expert projections, LM head, MTP eh_proj (not the routed experts,
    # whose grouped matmuls reduce bf16 already, nor the indexer, which the dense stage does not run)
    routed = ("['moe']['gate_proj']", "['moe']['up_proj']", "['moe']['down_proj']")
    changed = [k for k in g32 if k.endswith(("_proj']", "['lm_head']")) and not k.endswith(routed)
               and "['indexer']" not in k]
    assert len(changed) == 26, changed
    for k in g32:
        if k in changed:
            rel = np.linalg.norm(g16[k] - g32[k]) / np.linalg.norm(g32[k])
            assert 0 < rel <= 2.0 ** -6, (k, rel)
        else:
            np.testing.assert_array_equal(g16[k], g32[k], err_msg=k)
    norm = float(optax.tree.norm(grads16))
    stepped = jax.tree.map(lambda p, g: p - 0.5 / norm * g, params, grads16)
    assert fn16(stepped)[0] < loss16 - 0.01
