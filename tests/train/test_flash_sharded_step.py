"""A GLM-5.3-Flash train step (KDA + MLA with the pooled indexer, hyper-connection streams, clamped SwiGLU)
sharded over data x fsdp x tensor equals the single-device step: its model code shards by logical axes only."""
import jax
import numpy as np

from glm5_jax.data import Batch, DataConfig
from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.parallel.mesh import MeshConfig, build_mesh
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig
from glm5_jax.train.step import Trainer

MODEL = ModelConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, first_k_dense_replace=1,
                    intermediate_size=64, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=8, index_n_heads=2, index_head_dim=16,
                    index_topk=8, index_kpool=4, layer_types=("kda", "mla"), linear_num_heads=2, linear_head_dim=8,
                    hc_mult=2, swiglu_limit=1.0, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    num_nextn_predict_layers=0, mtp_depth=0, initializer_range=0.1,
                    runtime=RuntimeConfig(remat_policy="none", moe_impl="ragged_dot", kda_chunk=16))
# KDA chunks of 16 tokens: the chunk body compiles ~4x smaller than at the default 64, and document 2
# (tokens 15..23) carries its state from the first chunk into the second
B, T = 8, 24


def _step(mesh, devices):
    exp = ExperimentConfig(model=MODEL, data=DataConfig(batch_size=B, seq_len=T),
                           train=TrainConfig(stage="sparse", warmup_steps=1, learning_rate=1e-2, eps=1e-4), mesh=mesh)
    rng = np.random.default_rng(0)
    segments = np.ones((B, T), np.int32)
    segments[:, 15:] = 2
    segments[1, 20:] = 0
    positions = np.concatenate([np.arange(15), np.arange(9)])[None].repeat(B, 0).astype(np.int32)
    batch = Batch(tokens=rng.integers(0, MODEL.vocab_size, (B, T)).astype(np.int32), segment_ids=segments,
                  positions=positions)
    trainer = Trainer(exp, build_mesh(exp.mesh, devices))
    state, metrics = trainer.step(trainer.init_state(0), trainer.put_batch(batch))
    return jax.device_get(state.params), jax.device_get(metrics)


def test_sharded_flash_step_equals_single_device_step():
    params_a, metrics_a = _step(MeshConfig(data=1, fsdp=1), jax.devices()[:1])
    params_b, metrics_b = _step(MeshConfig(data=2, fsdp=2, expert=1, tensor=2), jax.devices()[:8])
    np.testing.assert_allclose(metrics_b["loss"], metrics_a["loss"], rtol=1e-5)
    a = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params_a)}
    b = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params_b)}
    assert any("kda" not in k and "q_conv" in k for k in a) and any("attn_hc" in k for k in a)
    # one Adam step of learning rate 1e-2 moves a weight by up to ~1e-2; the sharded step's other reduction
    # order moves a weight whose gradient is near eps by ~2e-6 (0.02% of a step): a wrong layout moves it ~1e-2
    for name in a:
        np.testing.assert_allclose(b[name], a[name], atol=1e-5, rtol=1e-5, err_msg=name)
