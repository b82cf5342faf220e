"""Context parallelism: training with the sequence split over the `context` mesh axis equals training
without it.

A few AdamW steps per DSA stage on one device and on meshes with context=4 and context=2 x fsdp=2
(the zig-zag layout, keys gathered per layer, MoE, MTP, balance loss and routing-bias update included).
T = 64 is eight times index_topk, so the top-k drops keys and picks them across shard boundaries, and
the packed documents of every row straddle shard boundaries (chunks of 8 tokens at context=4).
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.cost.categories import categorize
from glm5_jax.cost.collectives import collective_groups, spanned_axes
from glm5_jax.cost.hlo_cost import hlo_cost
from glm5_jax.data import Batch, DataConfig
from glm5_jax.parallel.context import from_layout, lay_out, layout_index, to_layout
from glm5_jax.parallel.mesh import MeshConfig, MeshError, build_mesh, check_mesh_fits_model, mesh_and_rules
from glm5_jax.train.experiment import ExperimentConfig, TrainConfig
from glm5_jax.train.step import Trainer
from tests.train.test_train_step import MODEL  # the same tiny GLM-5 as the single-device train-step tests

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
    return Batch(tokens=tokens, segment_ids=segments, positions=np.repeat(positions[None], B, 0))


@functools.lru_cache
def initial_weights():
    """Step-0 params and routing bias on the host: the same for every stage, impl and mesh (built once)."""
    state = make_trainer("sparse", "context1", "xla").init_state(0)
    return jax.device_get((state.params, state.moe_bias))


def make_trainer(stage, mesh_name, impl, rows=B, masked_flash_factor=4.0):
    mesh_cfg, n_devices = MESHES[mesh_name]
    model = MODEL.replace(attention_impl=impl, masked_flash_factor=masked_flash_factor)
    exp = ExperimentConfig(model=model, data=DataConfig(batch_size=rows, seq_len=T),
                           train=TrainConfig(stage=stage, warmup_steps=1, learning_rate=1e-2, eps=1e-4),
                           mesh=mesh_cfg)
    return Trainer(exp, build_mesh(mesh_cfg, jax.devices()[:n_devices]))


@functools.lru_cache
def train(stage, mesh_name, impl="xla", steps=4, rows=B, masked_flash_factor=4.0):
    """(per-step [loss, lm_loss, indexer_loss], final (params, routing bias)) on the host; ``rows`` of
    each batch."""
    trainer = make_trainer(stage, mesh_name, impl, rows, masked_flash_factor)
    params, moe_bias = initial_weights()
    state = trainer.state_from_weights(jax.device_put(params, trainer.state_shardings.params),
                                       jax.device_put(moe_bias, trainer.state_shardings.moe_bias), seed=0)
    losses = []
    for i in range(steps):
        state, metrics = trainer.step(state, trainer.put_batch(jax.tree.map(lambda v: v[:rows], batch(seed=i))))
        losses.append([float(metrics[k]) for k in ("loss", "lm_loss")] + [float(metrics.get("indexer_loss", 0))])
    return np.array(losses), jax.device_get((state.params, state.moe_bias))


def assert_same_training(got, want):
    (got_losses, got_state), (want_losses, want_state) = got, want
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_state), jax.tree.leaves(want_state)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("stage", ["dense", "warmup", "sparse"])
def test_one_device_baseline_trains(stage):
    """The single-device runs the context-parallel ones are compared with (cached for them): the step
    moves the loss, and the indexer KL is in play outside the dense stage."""
    losses, _ = train(stage, "context1")
    assert np.all(np.isfinite(losses)) and losses[-1, 0] != losses[0, 0]
    assert (losses[:, 2] > 0).all() if stage != "dense" else (losses[:, 2] == 0).all()


@pytest.mark.parametrize("mesh_name", ["context4", "context2_fsdp2"])
@pytest.mark.parametrize("stage", ["dense", "warmup", "sparse"])
def test_context_parallel_training_equals_one_device(stage, mesh_name):
    assert_same_training(train(stage, mesh_name), train(stage, "context1"))


def test_one_device_pallas_baseline_trains():
    """The Pallas kernels' single-device run (interpreted; batch rows 0-1, the padded one included, to
    keep the interpreter short), cached for the next test."""
    losses, _ = train("sparse", "context1", impl="pallas_interpret", steps=2, rows=2)
    assert np.all(np.isfinite(losses)) and losses[-1, 0] != losses[0, 0] and (losses[:, 2] > 0).all()


def test_context_parallel_pallas_kernels_equal_one_device():
    """The Pallas indexer and sparse-attention kernels (interpreted) per sequence shard."""
    want = train("sparse", "context1", impl="pallas_interpret", steps=2, rows=2)
    assert_same_training(train("sparse", "context2", impl="pallas_interpret", steps=2, rows=2), want)


def test_flash_attention_over_context_trains_like_xla_on_one_device():
    """Dense stage with the flash kernel in the MHA form (interpreted) per sequence shard over the gathered
    latent rows, context=2 (kv_b_proj's gradient summed over the shards), trains like the XLA absorbed form
    on one device."""
    want = train("dense", "context1", impl="xla", steps=2, rows=2)
    assert_same_training(train("dense", "context2", impl="pallas_interpret", steps=2, rows=2), want)


def test_masked_flash_sparse_stage_over_context_trains_like_xla_on_one_device():
    """Sparse stage on the short-context TPU form: each shard's top-k as a mask over the flash kernel and
    the warm-up KL kernels over that mask (interpreted; masked_flash_factor 8, so T = 64 = 8 k takes this
    form), context=2, trains like the XLA path (per-query row gathers) on one device."""
    want = train("sparse", "context1", impl="xla", steps=2, rows=2)
    assert_same_training(train("sparse", "context2", impl="pallas_interpret", steps=2, rows=2,
                               masked_flash_factor=8.0), want)


def test_warmup_kl_kernel_over_context_trains_like_xla_on_one_device():
    """Warm-up stage (only the indexer trains, by its KL) with the flash kernel and the warm-up KL kernel
    (interpreted) per sequence shard, context=2 (each shard's KL sums, the indexer keys' gradient
    reduce-scattered to their shards), trains like the XLA path on one device."""
    want = train("warmup", "context1", impl="xla", steps=2, rows=2)
    assert_same_training(train("warmup", "context2", impl="pallas_interpret", steps=2, rows=2), want)


def test_zigzag_layout():
    x = np.arange(2 * 16).reshape(2, 16)
    laid = np.asarray(to_layout(x, 4))
    # 8 chunks of 2: shard i holds chunks i and 7 - i
    chunks = [0, 7, 1, 6, 2, 5, 3, 4]
    np.testing.assert_array_equal(laid[1], np.concatenate([x[1, 2 * c:2 * c + 2] for c in chunks]))
    np.testing.assert_array_equal(np.asarray(from_layout(laid, 4)), x)
    # a natural token index's place in the layout (the sparse core's rows stay in layout order)
    t = np.arange(16)
    np.testing.assert_array_equal(laid[1][np.asarray(layout_index(jnp.asarray(t), 4, 16))], x[1])
    np.testing.assert_array_equal(np.asarray(layout_index(jnp.asarray([0, 2, 3, 14, 15]), 4, 16)), [0, 4, 5, 2, 3])
    # every shard does the same causal work: sum over its queries of the keys before them
    work = [sum(t for t in laid[0, 4 * i:4 * i + 4]) for i in range(4)]
    assert len(set(work)) == 1, work


def test_lay_out_batch_matches_a_hand_permutation():
    """`lay_out` under a context=4 mesh: every array permuted like `order`, the shifted tokens and their
    validity computed in natural order first; without a sequence split nothing moves."""
    b = batch(0)
    mesh_cfg, n_devices = MESHES["context4"]
    order = np.concatenate([np.arange(8 * c, 8 * c + 8) for c in (0, 7, 1, 6, 2, 5, 3, 4)])   # T=64, n=4
    with mesh_and_rules(build_mesh(mesh_cfg, jax.devices()[:n_devices]), mesh_cfg.rules):
        laid = jax.device_get(lay_out(b, ahead=3))
    for name in ("tokens", "segment_ids", "positions"):
        np.testing.assert_array_equal(getattr(laid, name), getattr(b, name)[:, order])
    for k in (1, 2, 3):
        ahead = np.zeros_like(b.tokens)
        ahead[:, :T - k] = b.tokens[:, k:]
        later = np.zeros_like(b.segment_ids)
        later[:, :T - k] = b.segment_ids[:, k:]
        valid = (b.segment_ids > 0) & (later == b.segment_ids)
        np.testing.assert_array_equal(laid.ahead_tokens[k - 1], ahead[:, order])
        np.testing.assert_array_equal(laid.ahead_valid[k - 1], valid[:, order])
    natural = jax.device_get(lay_out(b, ahead=1))                  # no mesh in context: natural order
    np.testing.assert_array_equal(natural.tokens, b.tokens)
    np.testing.assert_array_equal(natural.ahead_tokens[0][:, :T - 1], b.tokens[:, 1:])


def test_context_mesh_checks():
    with pytest.raises(MeshError, match="seq_len=60 is not divisible by 2\\*context=8"):
        check_mesh_fits_model({"data": 1, "fsdp": 1, "context": 4, "expert": 1, "tensor": 1}, MODEL, B, 60)
    with pytest.raises(MeshError, match="fsdp\\*context=64 does not divide hidden_size=32"):
        check_mesh_fits_model({"data": 1, "fsdp": 4, "context": 16, "expert": 1, "tensor": 1}, MODEL, 4, 64)


def test_only_compressed_keys_cross_the_context_axis():
    """In the compiled sparse-stage step (one sequence per batch shard, expert-parallel MoE), every
    collective over `context` that carries tokens outside the MoE router carries latent rows
    (kv_lora_rank + qk_rope_head_dim), indexer keys (index_head_dim) or per-token scalars (positions,
    segment ids, loss masks): never hidden states or per-head keys / values. (The router's top-k over
    the flattened tokens is all-gathered by the partitioner, [B*T, n_routed_experts]: MoE, not attention.)"""
    seq_len, batch = 80, 2                        # a length no weight dimension has
    mesh_cfg = MeshConfig(data=1, fsdp=2, context=4)
    model = MODEL.replace(q_lora_rank=40, moe_ep="a2a")   # per-token widths distinct from the keys' (24, 16)
    exp = ExperimentConfig(model=model, data=DataConfig(batch_size=batch, seq_len=seq_len),
                           train=TrainConfig(stage="sparse"), mesh=mesh_cfg)
    mesh = build_mesh(mesh_cfg, jax.devices()[:8])
    trainer = Trainer(exp, mesh)
    spec = jax.ShapeDtypeStruct((batch, seq_len), np.int32, sharding=trainer.batch_sharding)
    with trainer.context():
        hlo = trainer._step.lower(trainer.abstract_state, Batch(spec, spec, spec)).compile().as_text()
    collective = re.compile(r"= (.+?) (all-gather|all-gather-start|reduce-scatter|all-to-all|all-reduce|"
                            r"all-reduce-start|collective-permute|collective-permute-start)\(")
    widths = {}
    for line in hlo.splitlines():
        m = collective.search(line)
        if (not m or "/moe/" in line
                or "context" not in spanned_axes(collective_groups(line, 8), mesh.axis_names, mesh.devices.shape)):
            continue
        for dims in re.findall(r"\w+\[([0-9,]*)\]", m.group(1)):      # each result (combined ones are tuples)
            dims = [int(d) for d in dims.split(",") if d]
            if seq_len in dims:
                widths.setdefault(int(np.prod(dims[dims.index(seq_len) + 1:])), []).append(m.group(2))
    latent, index_key = model.kv_lora_rank + model.qk_rope_head_dim, model.index_head_dim
    assert latent in widths and index_key in widths, widths     # the gathers happen, over `context`
    assert set(widths) <= {latent, index_key, 1}, widths
    # the per-shard attention names its parts (jax.named_scope), so the step's cost lands in the indexer
    # top-k, attention core and indexer KL categories of the compile report, not all in one (bytes: XLA:CPU
    # turns these small einsums into multiply-reduce fusions, which carry no matmul FLOPs)
    traffic = hlo_cost(hlo, categorize).by_category["bytes"]
    assert all(traffic.get(part, 0) > 0 for part in ("attention_core", "indexer_topk", "indexer_kl")), traffic
