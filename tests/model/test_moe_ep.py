"""Expert-parallel MoE (all_to_all over expert=4 fake CPU devices) equals the single-device MoE."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.model.moe.expert_parallel import (capacity, take_rows_of_chunks, take_token_rows, take_unique_rows,
                                                tile_rows)
from glm5_jax.model.moe.layer import MoE, grouped_swiglu, route
from glm5_jax.parallel.mesh import DEFAULT_RULES, MeshConfig, build_mesh

CFG = ModelConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, first_k_dense_replace=1,
                  intermediate_size=32, num_attention_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8,
                  qk_rope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=8, index_topk=4,
                  n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=12,
                  initializer_range=0.3, runtime=RuntimeConfig(remat_policy="none"))
B, T = 8, 16


def _inputs(cfg=CFG):
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, cfg.hidden_size), jnp.float32)
    mask = jnp.ones((B, T), bool).at[3, 10:].set(False)
    return x, mask


def _params(cfg=CFG):
    x, mask = _inputs(cfg)
    variables = meta.unbox(MoE(cfg).init(jax.random.PRNGKey(0), x, mask))
    # a non-zero routing bias so selection and gates differ, as in training
    bias = jax.random.normal(jax.random.PRNGKey(2), (CFG.n_routed_experts,)) * 0.1
    variables["moe_bias"]["e_score_correction_bias"] = bias
    return variables


def _loss_and_grads(cfg, variables, mesh=None, tensor_rules=DEFAULT_RULES):
    x, mask = _inputs(cfg)

    def loss(params, x):
        out, aux = MoE(cfg).apply({**variables, "params": params}, x, mask)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), (out, aux)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    if mesh is None:
        return fn(variables["params"], x)
    with jax.set_mesh(mesh), nn.logical_axis_rules(tensor_rules):
        return fn(variables["params"], x)


@pytest.mark.parametrize("mesh_cfg,hidden,chunks,align,chunk_by",
                         [(MeshConfig(data=1, fsdp=2, expert=4, tensor=1), 16, 1, 1, "tokens"),
                          (MeshConfig(data=1, fsdp=1, expert=4, tensor=2), 16, 1, 1, "tokens"),
                          (MeshConfig(data=1, fsdp=2, expert=4, tensor=1), 256, 1, 1, "tokens"),
                          (MeshConfig(data=1, fsdp=2, expert=4, tensor=1), 16, 2, 1, "tokens"),
                          (MeshConfig(data=1, fsdp=2, expert=4, tensor=1), 16, 2, 8, "tokens"),
                          (MeshConfig(data=1, fsdp=2, expert=2, tensor=2), 16, 2, 8, "experts")],
                         ids=["fsdp2_expert4", "expert4_tensor2", "fsdp2_expert4_tile_rows", "fsdp2_expert4_chunks2",
                              "fsdp2_expert4_chunks2_groups_aligned", "fsdp2_expert2_tensor2_expert_chunks2_aligned"])
def test_all_to_all_ep_equals_single_device(mesh_cfg, hidden, chunks, align, chunk_by):
    # align 8: each local expert's rows start at a multiple of 8 rows, the zero rows between are multiplied
    # hidden 256: the transport moves rows in the [rows, D / 128, 128] view (expert_parallel.tile_rows)
    # (init scaled with the width, so that outputs keep the magnitude the tolerances were set for)
    cfg = CFG.replace(hidden_size=hidden, initializer_range=CFG.initializer_range * (16 / hidden) ** 0.5)
    assert (tile_rows(jnp.zeros((4, hidden))).ndim == 3) == (hidden % 128 == 0)
    variables = _params(cfg)
    (ref_loss, (ref_out, ref_aux)), ref_grads = _loss_and_grads(cfg, variables)
    # capacity factor E / K: every (shard, expert) pair can hold all of a shard's tokens -> nothing dropped
    # expert chunks: 4 local experts per shard in 2 chunks of 2, each grouped matmul over its chunk's weights
    ep_cfg = cfg.replace(moe_ep="a2a", moe_capacity_factor=CFG.n_routed_experts / CFG.num_experts_per_tok,
                         moe_a2a_chunks=chunks, moe_group_align=align, moe_a2a_chunk_by=chunk_by)
    mesh = build_mesh(mesh_cfg, jax.devices()[:8])
    (loss, (out, aux)), grads = _loss_and_grads(ep_cfg, variables, mesh)
    assert float(aux["dropped"]) == 0.0
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(aux["expert_load"], ref_aux["expert_load"])
    for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("chunks,align,chunk_by", [(1, 1, "tokens"), (2, 1, "tokens"), (2, 8, "tokens"),
                                                   (2, 8, "experts")])
def test_all_to_all_ep_reports_and_zeroes_dropped_assignments(chunks, align, chunk_by):
    variables = _params()
    mesh = build_mesh(MeshConfig(data=1, fsdp=2, expert=4, tensor=1), jax.devices()[:8])
    x, mask = _inputs()
    factor = 0.5
    ep_cfg = CFG.replace(moe_ep="a2a", moe_capacity_factor=factor, n_shared_experts=0, moe_a2a_chunks=chunks,
                         moe_group_align=align, moe_a2a_chunk_by=chunk_by)
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        out, aux = jax.jit(lambda v, x: MoE(ep_cfg).apply(v, x, mask))(variables, x)
    # expected drops: per token chunk (16 tokens per shard, in `chunks` chunks; expert chunks: the whole shard),
    # assignments past `cap` for each expert, in token order
    x_ND = x.reshape(-1, CFG.hidden_size)
    scores = jax.nn.sigmoid(x_ND @ variables["params"]["router"])
    idx, gates = route(scores, variables["moe_bias"]["e_score_correction_bias"], CFG)
    token_chunks = chunks if chunk_by == "tokens" else 1
    n_chunk = B * T // 8 // token_chunks
    cap = capacity(n_chunk, CFG.num_experts_per_tok, CFG.n_routed_experts, factor)
    assert cap == {1: 2, 2: 1}[token_chunks]
    kept = np.zeros(idx.shape, bool)
    for s in range(B * T // n_chunk):
        seen = {}
        for n in range(s * n_chunk, (s + 1) * n_chunk):
            for k in range(CFG.num_experts_per_tok):
                e = int(idx[n, k])
                kept[n, k] = seen.get(e, 0) < cap
                seen[e] = seen.get(e, 0) + 1
    expected_dropped = int((~kept).sum())
    assert expected_dropped > 0
    assert float(aux["dropped"]) == expected_dropped
    # the output is the single-device MoE with dropped assignments' gates set to zero
    p = variables["params"]
    y = grouped_swiglu(x_ND, idx, p["gate_proj"], p["up_proj"], p["down_proj"], jnp.float32)
    expected = jnp.einsum("nk,nkd->nd", jnp.where(kept, gates, 0.0), y).reshape(B, T, -1)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_ep_needs_a_mesh():
    variables = _params()
    x, mask = _inputs()
    with pytest.raises(ValueError, match="needs a mesh in context"):
        MoE(CFG.replace(moe_ep="a2a")).apply(variables, x, mask)


def test_expert_weight_gradients_are_reduce_scattered_to_their_fsdp_shards():
    """The weights enter the expert-parallel shard_map FSDP-sharded and are all-gathered inside, so the
    backward reduce-scatters each weight gradient (E_local, F, D / fsdp) rather than all-reducing the
    whole local (E_local, F, D) gradient and slicing it."""
    import re

    variables = _params()
    x, mask = _inputs()
    cfg = CFG.replace(moe_ep="a2a", moe_capacity_factor=4.0)
    mesh = build_mesh(MeshConfig(data=1, fsdp=2, expert=4, tensor=1), jax.devices()[:8])

    def loss(params):
        out, _ = MoE(cfg).apply({**variables, "params": params}, x, mask)
        return jnp.sum(out)

    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        text = jax.jit(jax.grad(loss)).lower(variables["params"]).compile().as_text()
    E, D, F = CFG.n_routed_experts // 4, CFG.hidden_size, CFG.moe_intermediate_size
    scattered = re.findall(r"= f32\[([0-9,]+)\]\S* reduce-scatter\(", text)
    # gate and up enter transposed to [E, F, D], like down: all three scatter their minor (FSDP) dim
    assert sorted(scattered) == [f"{E},{F},{D // 2}"] * 3
    whole = re.findall(r"= f32\[([0-9,]+)\]\S* all-reduce\(", text)
    assert not {f"{E},{D},{F}", f"{E},{F},{D}"} & set(whole)


def test_transport_gathers_have_gather_gradients_equal_to_autodiff_on_the_rows_read():
    """The transport's gathers differentiate by a gather (the inverse map), not a scatter-add: equal to JAX's
    own gradient of a zero-filling gather on every row some output took; a dropped (token, choice) gets
    nothing."""
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 2, 4))
    rows = jnp.array([4, 0, 9, 2, 5, 9, 1], jnp.int32)            # 9: out of range (padding); x row 3 untaken
    inverse = jnp.full((6,), 7, jnp.int32).at[rows].set(jnp.arange(7, dtype=jnp.int32), mode="drop")
    dy = jax.random.normal(jax.random.PRNGKey(1), (7, 2, 4))

    def autodiff(x):
        return jnp.sum(x.at[rows].get(mode="fill", fill_value=0) * dy)

    want = jax.grad(autodiff)(x)
    got = jax.grad(lambda x: jnp.sum(take_unique_rows(x, rows, inverse, True) * dy))(x)
    taken = np.array([0, 1, 2, 4, 5])                             # row 3's gradient is left unspecified
    np.testing.assert_array_equal(got[taken], want[taken])
    np.testing.assert_array_equal(got[taken], dy[np.array([1, 6, 3, 0, 4])])
    filled = take_unique_rows(x, rows, inverse, True)
    np.testing.assert_array_equal(filled[2], 0)
    np.testing.assert_array_equal(filled[:2], x[jnp.array([4, 0])])

    # 3 tokens x 2 choices into 5 slots; token 2's second choice is dropped (slot 5 is out of range)
    slot_NK = jnp.array([[0, 3], [1, 4], [2, 5]], jnp.int32)
    token_of_slot = jnp.array([0, 1, 2, 0, 1], jnp.int32)
    xt = x[:3]
    ds = jax.random.normal(jax.random.PRNGKey(2), (5, 2, 4))
    want = jax.grad(lambda xt: jnp.sum(xt[token_of_slot] * ds))(xt)
    got = jax.grad(lambda xt: jnp.sum(take_token_rows(xt, token_of_slot, slot_NK) * ds))(xt)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got[2], ds[2], rtol=1e-6)      # its dropped choice adds nothing

    # the expert chunks' combine: 6 outputs from two chunks of 4 rows; output 5 is dropped (in neither)
    xs = [jax.random.normal(jax.random.PRNGKey(3 + j), (4, 2, 4)) for j in range(2)]
    rows_list = [jnp.array([1, 4, 0, 4, 4, 4], jnp.int32), jnp.array([4, 2, 4, 0, 3, 4], jnp.int32)]
    inverse_list = [jnp.full((4,), 6, jnp.int32).at[r].set(jnp.arange(6, dtype=jnp.int32), mode="drop")
                    for r in rows_list]
    dy = jax.random.normal(jax.random.PRNGKey(5), (6, 2, 4))
    combine = lambda xs: sum(x.at[r].get(mode="fill", fill_value=0) for x, r in zip(xs, rows_list))  # noqa: E731
    np.testing.assert_array_equal(take_rows_of_chunks(xs, rows_list, inverse_list), combine(xs))
    np.testing.assert_array_equal(take_rows_of_chunks(xs, rows_list, inverse_list)[5], 0)
    want = jax.grad(lambda xs: jnp.sum(combine(xs) * dy))(xs)
    got = jax.grad(lambda xs: jnp.sum(take_rows_of_chunks(xs, rows_list, inverse_list) * dy))(xs)
    for j, taken in enumerate([np.array([0, 1]), np.array([0, 2, 3])]):   # chunk 0's rows 2, 3: untaken
        np.testing.assert_array_equal(got[j][taken], want[j][taken])


def test_expert_chunks_must_split_the_local_experts():
    from glm5_jax.model.config import ConfigError
    variables = _params()
    x, mask = _inputs()
    mesh = build_mesh(MeshConfig(data=1, fsdp=2, expert=4, tensor=1), jax.devices()[:8])
    cfg = CFG.replace(moe_ep="a2a", moe_a2a_chunks=4, moe_a2a_chunk_by="experts")   # 2 local experts, 4 chunks
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        with pytest.raises(ValueError, match="2 local experts per shard do not split into moe_a2a_chunks=4"):
            MoE(cfg).apply(variables, x, mask)
    with pytest.raises(ConfigError, match="expert chunks are built by the a2a transport"):
        RuntimeConfig(moe_ep="ragged_a2a", moe_a2a_chunks=2, moe_a2a_chunk_by="experts")
