"""The decode dispatches (moe_ep="gather": tokens all-gathered over the expert axis, results reduce-scattered;
moe_ep="a2a_decode": each assignment sent to its expert's chip and back by all_to_all) equal the single-device
MoE, bf16-style fp experts and packed INT4 experts through the Pallas kernel."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from glm5_jax.model.moe.decode_dispatch import local_assignments
from glm5_jax.model.moe.int4_weights import quantize_params
from glm5_jax.model.moe.layer import MoE
from glm5_jax.parallel.mesh import build_mesh
from glm5_jax.parallel.sampling import SAMPLING_RULES, parse_mesh_spec
from tests.quant.quant_helpers import TINY_Q

# experts 128 wide: a half over tensor:2 is still whole INT4 chunks (8 x quant_group_size)
CFG = TINY_Q.replace(initializer_range=0.3, moe_intermediate_size=128)


# a2a_decode: send slots per destination chip at the worst case n x min(K, local experts): nothing dropped
NO_DROPS = CFG.n_routed_experts / CFG.num_experts_per_tok


def _moe_apply(cfg, params, x, mesh=None):
    fn = jax.jit(lambda p, x: MoE(cfg).apply(p, x, jnp.ones(x.shape[:2], bool)))
    if mesh is None:
        return fn(params, x)
    with jax.set_mesh(mesh), nn.logical_axis_rules(SAMPLING_RULES):
        return fn(params, x)


def _moe_out(cfg, params, x, mesh=None):
    return _moe_apply(cfg, params, x, mesh)[0]


def _variables(batch, quant, cfg=CFG):
    """(config, MoE variables, x [batch, 1, D]): fp experts, or packed INT4 ones."""
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, 1, cfg.hidden_size), jnp.float32)
    variables = meta.unbox(MoE(cfg).init(jax.random.PRNGKey(0), x, jnp.ones((batch, 1), bool)))
    if quant != "int4":
        return cfg, variables, x
    packed = quantize_params({"moe": variables["params"]}, cfg.replace(quant="int4_qat"))["moe"]
    return cfg.replace(quant="int4"), {**variables, "params": packed}, x


def _shared_expert_alone(cfg, variables, x):
    """The MoE's output with its routed experts zeroed: the shared expert alone (a dropped assignment's token)."""
    params = dict(variables["params"])
    for name in ("gate_proj", "up_proj", "down_proj"):
        params[name] = jnp.zeros_like(params[name])
    return _moe_out(cfg, {**variables, "params": params}, x)


def _dispatch_config(cfg, moe_ep, quant):
    return cfg.replace(moe_ep=moe_ep, quant_matmul="pallas_interpret" if quant == "int4" else "xla",
                       moe_capacity_factor=NO_DROPS if moe_ep == "a2a_decode" else cfg.runtime.moe_capacity_factor)


@pytest.mark.parametrize("spec,batch", [("expert:4,tensor:2", 8), ("data:2,expert:4", 8), ("expert:4,tensor:2", 1),
                                        ("expert:4,tensor:2", 32)],
                         ids=["expert4_tensor2", "data2_expert4", "batch1_replicated", "expert4_tensor2_8_per_chip"])
@pytest.mark.parametrize("quant", ["none", "int4"])
@pytest.mark.parametrize("moe_ep", ["gather", "a2a_decode"])
def test_decode_dispatch_equals_single_device(spec, batch, quant, moe_ep):
    # INT4, 8 tokens per chip at D = 128: a2a_decode's rows travel as [rows, D / 128, 128] (`tile_rows`)
    cfg, variables, x = _variables(batch, quant, CFG.replace(hidden_size=128) if batch == 32 and quant == "int4"
                                   else CFG)
    want = _moe_out(cfg, variables, x)                 # one device, the model's own grouped matmul
    mesh = build_mesh(parse_mesh_spec(spec, SAMPLING_RULES), jax.devices()[:8])
    got, aux = _moe_apply(_dispatch_config(cfg, moe_ep, quant), variables, x, mesh)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert np.abs(np.asarray(want)).max() > 1e-2
    if moe_ep == "a2a_decode":
        assert int(aux["dropped"]) == 0
        gathered = _moe_out(_dispatch_config(cfg, "gather", quant), variables, x, mesh)
        np.testing.assert_allclose(np.asarray(got), np.asarray(gathered), rtol=1e-5, atol=1e-5)


def test_int4_sorted_dispatch_equals_single_device(monkeypatch):
    """The gather's INT4 path through the sort, bincount and scatters (what more than COMPARE_MAX_ASSIGNMENTS
    assignments per chip take) on the 8-token case the comparisons take above."""
    from glm5_jax.model.moe import decode_dispatch
    monkeypatch.setattr(decode_dispatch, "COMPARE_MAX_ASSIGNMENTS", 0)
    test_decode_dispatch_equals_single_device("expert:4,tensor:2", 8, "int4", "gather")


def test_a2a_decode_drops_past_capacity_and_counts_them():
    """Every token routed to experts 0 and 1 (the correction bias), both on chip 0 of expert:4: each chip's 16
    tokens send it 32 assignments into 16 slots (capacity factor 1: 16 x 2 / 4 expected, one 16-row tile), so
    its first 8 tokens' are kept, in token order, and its last 8 tokens' dropped, 4 x 16 = 64 in all. Kept
    tokens come out as on one device, dropped ones without their routed term."""
    batch, n = 64, 16
    cfg, variables, x = _variables(batch, "none")
    bias = jnp.zeros((CFG.n_routed_experts,)).at[:2].set(100.0)
    variables = {**variables, "moe_bias": {"e_score_correction_bias": bias}}
    want, want_aux = _moe_apply(cfg, variables, x)
    assert (np.sort(np.asarray(want_aux["expert_idx"]), axis=-1) == [0, 1]).all()
    mesh = build_mesh(parse_mesh_spec("expert:4,tensor:2", SAMPLING_RULES), jax.devices()[:8])
    got, aux = _moe_apply(cfg.replace(moe_ep="a2a_decode", moe_capacity_factor=1.0), variables, x, mesh)
    assert int(aux["dropped"]) == 64
    kept = (np.arange(batch) % n) < n // 2
    np.testing.assert_allclose(np.asarray(got)[kept], np.asarray(want)[kept], rtol=2e-5, atol=2e-5)
    shared_only = _shared_expert_alone(cfg, variables, x)
    np.testing.assert_allclose(np.asarray(got)[~kept], np.asarray(shared_only)[~kept], rtol=2e-5, atol=2e-5)
    assert np.abs(np.asarray(want) - np.asarray(shared_only))[~kept].max() > 1e-2


@pytest.mark.parametrize("seed", range(8))
def test_compare_slots_equal_the_sorted_layout(seed):
    """`compare_slots` puts the same assignment in every slot of the blocks that run, with the same block
    experts and used-block count, as sorting by local expert, keeping the first ``cap`` local assignments
    and padding each expert's rows to whole blocks (`local_assignments` + `expert_blocks`), with the cap
    binding or not."""
    from glm5_jax.model.moe.decode_dispatch import compare_slots, local_keys
    from glm5_jax.model.moe.experts import expert_blocks, max_blocks

    rng = np.random.default_rng(seed)
    M, n_local, first, block = 24, 4, 4, 4
    idx = jnp.asarray(rng.integers(0, 12, M), jnp.int32)          # this chip holds experts 4..7
    cap = int(rng.choice([3, 8, 16, 24]))
    order, sizes = local_assignments(idx, first, n_local)
    take = order[:cap]
    kept = jnp.diff(jnp.minimum(jnp.cumsum(sizes[:n_local]), cap), prepend=0)
    rows = (take + 1).astype(jnp.float32)[:, None]                  # each row says which assignment it is
    x_blocks, block_expert, _, _ = expert_blocks(rows, jnp.append(kept, cap - jnp.sum(kept)), block)
    n_used = int(jnp.sum(-(-kept // block)))
    n_blocks = max_blocks(cap, n_local + 1, block)
    slot, got_expert, got_used = compare_slots(local_keys(idx, first, n_local), n_local, cap, block, n_blocks)
    assert int(got_used) == n_used and n_used > 0
    assert got_expert[:n_used].tolist() == jnp.minimum(block_expert, n_local - 1)[:n_used].tolist()
    slot = slot.reshape(-1, M)                                      # [slots, M]
    got_rows = jnp.sum(jnp.where(slot, jnp.arange(1, M + 1), 0), axis=1)
    assert got_rows[:n_used * block].tolist() == x_blocks.reshape(-1)[:n_used * block].astype(int).tolist()
    assert not bool(jnp.any(slot[n_used * block:]))


def test_local_assignments_sort_own_experts_first():
    idx = jnp.array([5, 2, 3, 7, 2, 0], jnp.int32)       # chip holding experts 2, 3
    order, sizes = local_assignments(idx, 2, 2)
    assert sizes.tolist() == [2, 1, 3]                  # expert 2 twice, expert 3 once, three elsewhere
    assert order[:3].tolist() == [1, 4, 2]


def test_local_capacity_is_factor_times_share_in_whole_tiles():
    from glm5_jax.model.moe.decode_dispatch import local_capacity
    assert local_capacity(16384, 4, 256, 2.0) == 512          # 2048 tokens x 8 choices: 256 expected on 4 of 256
    assert local_capacity(8, 32, 256, 2.0) == 8               # batch 1: all 8 assignments fit a 16-row tile
    assert local_capacity(1000, 1, 256, 1.0) == 16            # 3.9 expected -> one tile


@pytest.mark.parametrize("n_tokens,n_local,block,trials", [(1, 32, 16, 4000), (4, 32, 16, 4000), (128, 8, 4, 500)],
                         ids=["batch1", "batch4", "batch128_multi_block"])
def test_busiest_chip_blocks_against_monte_carlo(n_tokens, n_local, block, trials):
    """The busiest chip's expected INT4 row blocks against a simulation of the routing: each token chooses
    8 distinct experts of 256 uniformly; chip c holds experts [c * n_local, (c + 1) * n_local); its blocks
    are sum over its experts of ceil(rows / block). The simulated mean is within ~1% (its standard error is
    0.4% to 0.7%); the mean chip's blocks are well below (1.0, 3.8, 11.0)."""
    from glm5_jax.model.moe.decode_dispatch import busiest_chip_blocks

    E, K = 256, 8
    rng = np.random.default_rng(0)
    chosen = np.argsort(rng.random((trials, n_tokens, E)), axis=-1)[..., :K].reshape(trials, -1)
    rows = np.stack([np.bincount(c, minlength=E) for c in chosen])                   # [trials, E]
    blocks = (-(-rows // block)).reshape(trials, E // n_local, n_local).sum(-1)       # [trials, chips]
    simulated = blocks.max(-1).mean()
    formula = busiest_chip_blocks(n_tokens, K, E, n_local, block, E // n_local)
    assert formula == pytest.approx(simulated, rel=0.02)
    assert formula > blocks.mean() * 1.3
    if n_tokens == 1:                        # batch 1: ~2.5 touched experts on the busiest of 8 chips, not 1
        assert 2.4 < formula < 2.7


def test_expert_blocks_fit_their_static_count():
    """Every split of M rows over E groups, each group padded to whole blocks, fits `max_blocks` (checked over
    all splits of up to 6 rows into up to 4 groups), and rows in groups of their own reach it: 8 rows over 33
    groups in 16-row blocks take 8 (the decode chip at batch 1)."""
    import itertools

    from glm5_jax.model.moe.experts import expert_blocks, max_blocks

    for M, E, block in itertools.product(range(1, 7), range(1, 5), (1, 2, 4)):
        worst = max(sum(-(-g // block) for g in sizes)
                    for sizes in itertools.product(range(M + 1), repeat=E) if sum(sizes) == M)
        assert worst == max_blocks(M, E, block)
    sizes = jnp.array([1] * 8 + [0] * 25, jnp.int32)
    x = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4) + 1
    x_blocks, block_expert, n_used, dest = expert_blocks(x, sizes, 16)
    assert x_blocks.shape == (8, 16, 4) and int(n_used) == 8 and block_expert.tolist() == list(range(8))
    np.testing.assert_array_equal(np.asarray(x_blocks).reshape(-1, 4)[np.asarray(dest)], x)


@pytest.mark.parametrize("seed", range(3))
def test_int4_block_scatter_equals_gathering_the_sorted_rows_first(monkeypatch, seed):
    """`int4_block_scatter` adds the kernel's row blocks into their tokens straight from the block layout; the
    same sums, bit for bit, as gathering the rows back into sorted order (`block_rows`, zero past n_used) and
    adding those. The kernel stands in as a row-wise map with NaN in the blocks it never writes (past
    n_used), which must not leak."""
    from glm5_jax.model.moe import decode_dispatch
    from glm5_jax.model.moe.experts import expert_blocks
    from pallas_kernels.int4_matmul import ops as int4_ops

    def fake_kernel(x_blocks, block_expert, n_used, *_):
        y = jnp.sin(x_blocks.astype(jnp.float32) * 3.0) + block_expert[:, None, None]
        return jnp.where((jnp.arange(x_blocks.shape[0]) < n_used)[:, None, None], y, jnp.nan)
    monkeypatch.setattr(decode_dispatch, "int4_swiglu_blocks", fake_kernel)
    rng = np.random.default_rng(seed)
    n, k, D, E, n_local, block, cap = 24, 4, 8, 16, 4, 16, 40
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(n)]), jnp.int32)
    gates = jnp.asarray(rng.uniform(size=(n, k)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(n, D)), jnp.bfloat16)
    order, group_sizes = local_assignments(idx.reshape(-1), n_local, n_local)      # the chip of experts 4..7
    take = order[:cap]
    kept = jnp.diff(jnp.minimum(jnp.cumsum(group_sizes[:n_local]), cap), prepend=0)
    sizes = jnp.append(kept, cap - jnp.sum(kept)).astype(jnp.int32)
    got = decode_dispatch.int4_block_scatter(x[take // k], take, sizes, gates.reshape(-1), k, n, None,
                                             jnp.bfloat16, None, block, None)
    x_blocks, block_expert, _, dest = expert_blocks(x[take // k], sizes, block)
    n_used = jnp.sum(-(-sizes[:n_local] // block)).astype(jnp.int32)
    y_rows = int4_ops.block_rows(fake_kernel(x_blocks, jnp.minimum(block_expert, n_local - 1), n_used), dest, n_used)
    want = jnp.zeros((n, D), jnp.float32).at[take // k].add(y_rows * gates.reshape(-1)[take][:, None])
    assert int(jnp.sum(kept)) > 0 and np.isfinite(np.asarray(got)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("batch,quant", [(8, "int4"), (32, "none")], ids=["int4_2_per_chip", "fp_8_per_chip"])
def test_ragged_a2a_decode_equals_single_device_and_the_slots(batch, quant):
    """decode_a2a_exchange="ragged_dense" (the ragged exchange's bookkeeping over the dense emulation of
    ragged_all_to_all, glm5_jax/parallel/ragged_exchange.py) on expert:4,tensor:2: the single-device MoE within
    2e-5 and the slots exchange within 1e-5, nothing dropped."""
    cfg, variables, x = _variables(batch, quant, CFG.replace(hidden_size=128) if quant == "int4" else CFG)
    want = _moe_out(cfg, variables, x)
    mesh = build_mesh(parse_mesh_spec("expert:4,tensor:2", SAMPLING_RULES), jax.devices()[:8])
    slots = _dispatch_config(cfg, "a2a_decode", quant)
    got, aux = _moe_apply(slots.replace(decode_a2a_exchange="ragged_dense", moe_capacity_factor=2.0), variables, x,
                          mesh)
    assert int(aux["dropped"]) == 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_moe_out(slots, variables, x, mesh)), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(want)).max() > 1e-2


def test_ragged_a2a_decode_keeps_senders_in_order_past_capacity():
    """Every token routed to experts 0 and 1 (the correction bias), both on chip 0 of expert:4: chip 0 receives
    4 x 16 tokens x 2 = 128 rows but takes factor 1 x its expected 32; its senders' slices are kept in sender
    order, so the rows of chip 0's own 16 tokens fill it and chips 1-3's 96 are dropped. Chip 0's tokens come
    out as on one device, the others' with the shared expert alone."""
    batch, n = 64, 16
    cfg, variables, x = _variables(batch, "none")
    bias = jnp.zeros((CFG.n_routed_experts,)).at[:2].set(100.0)
    variables = {**variables, "moe_bias": {"e_score_correction_bias": bias}}
    want = _moe_out(cfg, variables, x)
    mesh = build_mesh(parse_mesh_spec("expert:4,tensor:2", SAMPLING_RULES), jax.devices()[:8])
    got, aux = _moe_apply(cfg.replace(moe_ep="a2a_decode", moe_capacity_factor=1.0,
                                      decode_a2a_exchange="ragged_dense"), variables, x, mesh)
    assert int(aux["dropped"]) == 96
    kept = np.arange(batch) < n
    np.testing.assert_allclose(np.asarray(got)[kept], np.asarray(want)[kept], rtol=2e-5, atol=2e-5)
    shared_only = _shared_expert_alone(cfg, variables, x)
    np.testing.assert_allclose(np.asarray(got)[~kept], np.asarray(shared_only)[~kept], rtol=2e-5, atol=2e-5)


def test_ragged_plan_by_hand():
    """3 chips, counts[s, r] of sender s's rows for receiver r, each receiver taking at most 4 rows in sender
    order: receiver 0 keeps 2, 2, 0 of (2, 3, 1), receiver 1 all of (1, 0, 2), receiver 2 1, 3, 0 of (1, 4, 0).
    For chip 1: it sends 2, 0, 3 rows (2 dropped); its slices start at 0, 3, 3 of its rows sorted by receiver
    and land after the kept rows of the senders before it (2, 1, 1); it receives 1, 0, 2 rows, landing at 0, 1,
    1; each sender's rows for chip 1 start at 2, 3, 1 of that sender's sorted rows (where the results go back)."""
    from glm5_jax.model.moe.decode_a2a import ragged_plan
    counts = jnp.array([[2, 1, 1], [3, 0, 4], [1, 2, 0]], jnp.int32)
    plan = {k: np.asarray(v).tolist() for k, v in ragged_plan(counts, 1, 4).items()}
    assert plan["send"] == [2, 0, 3]
    assert plan["send_offset"] == [0, 3, 3]
    assert plan["land"] == [2, 1, 1]
    assert plan["recv"] == [1, 0, 2]
    assert plan["recv_offset"] == [0, 1, 1]
    assert plan["back"] == [2, 3, 1]
    assert plan["dropped"] == 2
