"""Context parallelism: training with the sequence split over the `context` mesh axis equals training
without it.

A few AdamW steps per DSA stage on one device and on meshes with context=4 and context=2 x fsdp=2
(the zig-zag layout, keys gathered per layer, MoE, MTP, balance loss and routing-bias update included).
T = 64 is eight times index_topk, so the top-k drops keys and picks them across shard boundaries, and
the packed documents of every row straddle shard boundaries (chunks of 8 tokens at context=4).
"""
import jax
import numpy as np
import pytest

from glm5_jax.config import ModelConfig
from glm5_jax.context_parallel import from_layout, to_layout
from glm5_jax.data import DataConfig
from glm5_jax.experiment import ExperimentConfig, TrainConfig
from glm5_jax.sharding import MeshConfig, MeshError, build_mesh, check_mesh_fits_model
from glm5_jax.train_step import Trainer

MODEL = ModelConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, first_k_dense_replace=1,
                    intermediate_size=64, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=16,
                    index_topk=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    num_nextn_predict_layers=1, mtp_depth=1, initializer_range=0.1, remat_policy="none")
B, T = 8, 64
MESHES = {"context1": (MeshConfig(data=1, fsdp=1), 1),
          "context4": (MeshConfig(data=1, fsdp=1, context=4), 4),
          "context2_fsdp2": (MeshConfig(data=1, fsdp=2, context=2), 4),
          "context2": (MeshConfig(data=1, fsdp=1, context=2), 2)}


def batch(seed):
    """Three packed documents per row (boundaries at 21 and 45, inside shard chunks), padding in row 1."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, MODEL.vocab_size, (B, T)).astype(np.int32)
    segments = np.repeat(np.array([1] * 21 + [2] * 24 + [3] * 19, np.int32)[None], B, 0)
    segments[1, 58:] = 0
    positions = np.concatenate([np.arange(21), np.arange(24), np.arange(19)]).astype(np.int32)
    return {"tokens": tokens, "segment_ids": segments, "positions": np.repeat(positions[None], B, 0)}


def train(stage, mesh_name, impl="xla", steps=4):
    mesh_cfg, n_devices = MESHES[mesh_name]
    exp = ExperimentConfig(model=MODEL.replace(attention_impl=impl), data=DataConfig(batch_size=B, seq_len=T),
                           train=TrainConfig(stage=stage, warmup_steps=1, learning_rate=1e-2, eps=1e-4),
                           mesh=mesh_cfg)
    trainer = Trainer(exp, build_mesh(mesh_cfg, jax.devices()[:n_devices]))
    state = trainer.init_state(0)
    losses = []
    for i in range(steps):
        state, metrics = trainer.step(state, trainer.put_batch(batch(seed=i)))
        losses.append([float(metrics[k]) for k in ("loss", "lm_loss")] + [float(metrics.get("indexer_loss", 0))])
    return np.array(losses), jax.device_get((state.params, state.moe_bias))


def assert_same_training(got, want):
    (got_losses, got_state), (want_losses, want_state) = got, want
    assert np.all(np.isfinite(want_losses)) and want_losses[-1, 0] != want_losses[0, 0]
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_state), jax.tree.leaves(want_state)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("stage", ["dense", "warmup", "sparse"])
def test_context_parallel_training_equals_one_device(stage):
    want = train(stage, "context1")
    if stage != "dense":
        assert want[0][-1, 2] > 0                       # the indexer KL is part of the comparison
    for mesh_name in ("context4", "context2_fsdp2"):
        assert_same_training(train(stage, mesh_name), want)


def test_context_parallel_pallas_kernels_equal_one_device():
    """The Pallas indexer and sparse-attention kernels (interpreted) per sequence shard."""
    want = train("sparse", "context1", impl="pallas_interpret", steps=2)
    assert_same_training(train("sparse", "context2", impl="pallas_interpret", steps=2), want)


def test_zigzag_layout():
    x = np.arange(2 * 16).reshape(2, 16)
    laid = np.asarray(to_layout(x, 4))
    # 8 chunks of 2: shard i holds chunks i and 7 - i
    chunks = [0, 7, 1, 6, 2, 5, 3, 4]
    np.testing.assert_array_equal(laid[1], np.concatenate([x[1, 2 * c:2 * c + 2] for c in chunks]))
    np.testing.assert_array_equal(np.asarray(from_layout(laid, 4)), x)
    # every shard does the same causal work: sum over its queries of the keys before them
    work = [sum(t for t in laid[0, 4 * i:4 * i + 4]) for i in range(4)]
    assert len(set(work)) == 1, work


def test_context_mesh_checks():
    with pytest.raises(MeshError, match="seq_len=60 is not divisible by 2\\*context=8"):
        check_mesh_fits_model({"data": 1, "fsdp": 1, "context": 4, "expert": 1, "tensor": 1}, MODEL, B, 60)
    with pytest.raises(MeshError, match="fsdp\\*context=64 does not divide hidden_size=32"):
        check_mesh_fits_model({"data": 1, "fsdp": 4, "context": 16, "expert": 1, "tensor": 1}, MODEL, 4, 64)
