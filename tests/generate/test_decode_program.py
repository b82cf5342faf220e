"""The decode-only program (glm5_jax.generate.decode_program) and the read-only cache decode
(decode_cache_write="rows", glm5_jax/model/decode_rows.py): the same logits, tokens and cache as decoding with
each layer writing its cache (itself checked against the full forward in test_cached_decode.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import Transformer
from glm5_jax.generate.decode_program import decode_steps
from glm5_jax.generate.decoding import decode_config
from glm5_jax.model.kv_cache import init_cache
from tests.generate.tiny_models import TINY, init_variables

B, P, S, STEPS = 2, 12, 32, 10           # prompt 12 + 10 steps > index_topk = 8: the top-k drops slots


def _prefilled():
    cfg = decode_config(TINY)
    variables = init_variables(TINY)
    prompt = np.random.default_rng(0).integers(2, cfg.vocab_size, (B, P)).astype(np.int32)
    positions = np.broadcast_to(np.arange(P, dtype=np.int32), (B, P))
    logits, _, cache = jax.jit(lambda v, c: Transformer(cfg).apply(v, prompt, positions, np.ones((B, P), np.int32), c,
                                                                     method=Transformer.decode))(
        variables, init_cache(cfg, B, S)["decoder"])
    return cfg, variables, jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache


def _decodes_the_same_bit_for_bit(cfg, variables, token, cache, **switch):
    """STEPS steps from the prefilled cache with ``cfg`` and with ``cfg.replace(**switch)``: the same tokens and the
    same cache, bit for bit, and not one repeated token."""
    start = jnp.full((B,), P, jnp.int32)
    run = lambda c: jax.jit(lambda v, t, p, cache: decode_steps(c, STEPS, v, t, p, cache))(variables, token, start,
                                                                                          cache)
    want_tokens, want_cache = run(cfg)
    got_tokens, got_cache = run(cfg.replace(**switch))
    np.testing.assert_array_equal(np.asarray(got_tokens), np.asarray(want_tokens))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got_cache, want_cache)
    assert len(set(np.asarray(want_tokens).ravel().tolist())) > 1


def test_rows_decode_step_equals_layer_write():
    cfg, variables, token, cache = _prefilled()
    position = jnp.full((B, 1), P, jnp.int32)

    def step(c, cache):
        return jax.jit(lambda v, t, cache: Transformer(c).apply(v, t[:, None], position, jnp.ones((B, 1), jnp.int32),
                                                                 cache, method=Transformer.decode))(
            variables, token, cache)

    want_logits, _, want_cache = step(cfg, cache)
    got_logits, _, got_cache = step(cfg.replace(decode_cache_write="rows"), cache)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5), got_cache,
                 want_cache)
    leaf = jax.tree.leaves(got_cache)[0]                       # the new row was written at slot P
    assert np.abs(np.asarray(leaf[:, :, P])).max() > 0 and np.abs(np.asarray(leaf[:, :, P + 1:])).max() == 0


def test_decode_program_steps_equal_layer_write():
    cfg, variables, token, cache = _prefilled()
    start = jnp.full((B,), P, jnp.int32)
    run = lambda c: jax.jit(lambda v, t, p, cache: decode_steps(c, STEPS, v, t, p, cache))(variables, token, start,
                                                                                          cache)
    want_tokens, want_cache = run(cfg)
    got_tokens, got_cache = run(cfg.replace(decode_cache_write="rows"))
    np.testing.assert_array_equal(np.asarray(got_tokens), np.asarray(want_tokens))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5), got_cache,
                 want_cache)
    assert len(set(np.asarray(want_tokens).ravel().tolist())) > 1       # not one repeated token


def test_stacked_cache_read_equals_the_per_layer_slices():
    """decode_cache_read (every layer handed the segment's stacked cache and its index; the selected latent
    rows gathered in place by the row-gather kernel, interpreted): the same tokens as the scan's per-layer
    cache slices over 10 steps, logits and cache within fp32 tolerance."""
    cfg, variables, token, cache = _prefilled()
    cfg = cfg.replace(decode_cache_write="rows")
    start = jnp.full((B,), P, jnp.int32)
    run = lambda c: jax.jit(lambda v, t, p, cache: decode_steps(c, STEPS, v, t, p, cache))(variables, token, start,
                                                                                          cache)
    position = jnp.full((B, 1), P, jnp.int32)
    step = lambda c: jax.jit(lambda v, t, cache: Transformer(c).apply(  # noqa: E731
        v, t[:, None], position, jnp.ones((B, 1), jnp.int32), cache, method=Transformer.decode)[0])(
        variables, token, cache)
    want_tokens, want_cache = run(cfg)
    want_logits = step(cfg)
    got_tokens, got_cache = run(cfg.replace(decode_cache_read="pallas_interpret"))
    np.testing.assert_array_equal(np.asarray(got_tokens), np.asarray(want_tokens))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5), got_cache,
                 want_cache)
    np.testing.assert_allclose(np.asarray(step(cfg.replace(decode_cache_read="pallas_interpret"))),
                               np.asarray(want_logits), atol=1e-5, rtol=1e-5)
    assert len(set(np.asarray(want_tokens).ravel().tolist())) > 1       # not one repeated token


def test_stacked_int4_experts_equal_the_per_layer_slices():
    """decode_stacked_experts (each layer's packed experts read from the stacked arrays by the layer index, the
    INT4 kernel interpreted, experts over a data:2,expert:4 sampling mesh; the cached rows gathered from the
    stacked bf16 cache by the row-gather kernel, per batch shard): the same tokens and cache as the per-layer
    parameter slices."""
    import flax.linen as nn
    from glm5_jax.generate.decode_program import decode_rules
    from glm5_jax.generate.settings import decode_model_config
    from glm5_jax.model.moe.int4_weights import quantize_params
    from glm5_jax.parallel.mesh import build_mesh
    from glm5_jax.parallel.sampling import SAMPLING_RULES, parse_mesh_spec

    # all layers "full": the three MoE layers are one scanned segment of 3 repeats (layer index 0, 1, 2)
    base = TINY.replace(moe_intermediate_size=64, quant_group_size=8, mtp_depth=0, num_nextn_predict_layers=0,
                        initializer_range=0.3, indexer_types=("full",) * 4)
    params = quantize_params(init_variables(base)["params"], base)
    variables = {**init_variables(base), "params": params}
    cfg = decode_model_config(base, "int4", quant_matmul="pallas_interpret", moe_impl="ragged_dot",
                              cache_read="pallas_interpret")
    assert cfg.runtime.decode_stacked_experts and cfg.jnp_dtype == jnp.bfloat16
    mesh = build_mesh(parse_mesh_spec("data:2,expert:4", SAMPLING_RULES), jax.devices()[:8])
    token = jnp.array([3, 77], jnp.int32)
    start = jnp.zeros((B,), jnp.int32)

    def run(c):
        with jax.set_mesh(mesh), nn.logical_axis_rules(decode_rules(B, mesh)):
            return jax.jit(lambda v, t, p, cache: decode_steps(c, STEPS, v, t, p, cache))(
                variables, token, start, init_cache(c, B, S)["decoder"])

    want_tokens, want_cache = run(cfg.replace(decode_stacked_experts=False))
    got_tokens, got_cache = run(cfg)
    np.testing.assert_array_equal(np.asarray(got_tokens), np.asarray(want_tokens))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got_cache, want_cache)
    assert len(set(np.asarray(want_tokens).ravel().tolist())) > 1       # not one repeated token


@pytest.mark.parametrize("quant", ["none", "int4", "int4_rows_kernel", "int4_rows_kernel_ragged"])
def test_a2a_decode_dispatch_decodes_the_same_tokens(quant):
    """The decode program in fp32 over an expert:4,tensor:2 sampling mesh, 8 rows (2 per expert chip), the MoE
    through moe_ep="a2a_decode" (no assignment dropped at these shapes; INT4 experts through the kernel,
    interpreted): the same tokens as one device over 4 steps (the XLA grouped matmul, or the same INT4 kernel),
    and the first step's logits within 1e-5. (Its MoE equals the gather dispatch's within 1e-5:
    tests/model/test_decode_dispatch.py.) "int4_rows_kernel": 128 wide (received rows in lane tiles) with
    ``decode_moe_kernel``: each chip's received rows through pallas_kernels/int4_moe_rows (interpreted; in the
    program, with no INT4 block-matmul call left in its MoE); "..._ragged": the rows exchanged by the ragged
    all-to-all's bookkeeping (decode_a2a_exchange="ragged_dense", the collective emulated on CPU)."""
    import flax.linen as nn
    from glm5_jax.generate.decode_program import decode_rules
    from glm5_jax.model.moe.int4_weights import quantize_params
    from glm5_jax.parallel.mesh import build_mesh
    from glm5_jax.parallel.sampling import SAMPLING_RULES, parse_mesh_spec

    # experts 128 wide: a half over tensor:2 is still whole INT4 chunks (8 x quant_group_size)
    base = TINY.replace(moe_intermediate_size=128, quant_group_size=8, mtp_depth=0, num_nextn_predict_layers=0,
                        initializer_range=0.3,
                        hidden_size=128 if quant.startswith("int4_rows_kernel") else TINY.hidden_size)
    variables = init_variables(base)
    cfg = decode_config(base)
    if quant != "none":
        variables = {**variables, "params": quantize_params(variables["params"], base)}
        cfg = cfg.replace(quant="int4", quant_matmul="pallas_interpret")
    rows, steps = 8, 4
    token = jnp.asarray(np.random.default_rng(1).integers(2, cfg.vocab_size, rows), jnp.int32)
    start, position = jnp.zeros((rows,), jnp.int32), jnp.zeros((rows, 1), jnp.int32)
    mesh = build_mesh(parse_mesh_spec("expert:4,tensor:2", SAMPLING_RULES), jax.devices()[:8])

    def run(c, on_mesh):
        def program(v, t, cache):
            logits = Transformer(c).apply(v, t[:, None], position, jnp.ones((rows, 1), jnp.int32), cache,
                                          method=Transformer.decode)[0]
            return logits, decode_steps(c, steps, v, t, start, cache)[0]
        cache = init_cache(c, rows, S)["decoder"]
        if not on_mesh:
            return jax.jit(program)(variables, token, cache)
        with jax.set_mesh(mesh), nn.logical_axis_rules(decode_rules(rows, mesh)):
            return jax.jit(program)(variables, token, cache)

    want_logits, want_tokens = run(cfg, False)
    assert len(set(np.asarray(want_tokens).ravel().tolist())) > 1       # not one repeated token
    sharded = cfg.replace(moe_ep="a2a_decode", decode_moe_kernel=quant.startswith("int4_rows_kernel"),
                          decode_a2a_exchange="ragged_dense" if quant.endswith("ragged") else "slots")
    logits, tokens = run(sharded, True)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)
    if quant.startswith("int4_rows_kernel"):
        from pallas_kernels.int4_matmul.kernel import NAME as BLOCK_KERNEL
        from pallas_kernels.int4_moe_rows.kernel import NAME
        with jax.set_mesh(mesh), nn.logical_axis_rules(decode_rules(rows, mesh)):
            jaxpr = str(jax.make_jaxpr(lambda v, t: decode_steps(sharded, 1, v, t, start, init_cache(
                sharded, rows, S)["decoder"]))(variables, token))
        assert f"name={NAME}" in jaxpr and f"name={BLOCK_KERNEL}" not in jaxpr


@pytest.mark.parametrize("read", ["xla", "pallas_interpret"])
def test_slot_split_cache_decodes_the_same_tokens(read):
    """Cache slots over `context` (data:2,context:2,tensor:2, 16 slots a chip, batch rows at positions on both
    sides of the split, index_topk 8 of up to 32 visible slots), the stacked cache read in place: each shard selects
    and attends over its own slots (glm5_jax/model/decode_context.py: per-shard top-k merged, partial attention
    combined). In fp32 over 6 steps: the same tokens
    and cache as one device, the first step's logits within 1e-5."""
    import re
    import flax.linen as nn
    from glm5_jax.generate.decode_program import decode_rules
    from glm5_jax.parallel.axes import CACHE_SEQ
    from glm5_jax.parallel.mesh import build_mesh
    from glm5_jax.parallel.sampling import SAMPLING_RULES, parse_mesh_spec
    from glm5_jax.parallel.shard_map import logical_axis_shards

    cfg = decode_config(TINY).replace(decode_cache_write="rows", decode_cache_read=read)
    variables = init_variables(TINY)
    rows, slots, steps = 4, 32, 6
    rng = np.random.default_rng(4)
    token = jnp.asarray(rng.integers(2, cfg.vocab_size, rows), jnp.int32)
    start = jnp.asarray([3, 12, 15, 21], jnp.int32)            # both shards' slots, the split at 16 crossed
    cache = init_cache(cfg, rows, slots)["decoder"]
    cache = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), cache)   # a filled cache
    mesh = build_mesh(parse_mesh_spec("data:2,context:2,tensor:2", SAMPLING_RULES), jax.devices()[:8])

    def program(v, t, c):
        logits = Transformer(cfg).apply(v, t[:, None], start[:, None], jnp.ones((rows, 1), jnp.int32), c,
                                        method=Transformer.decode)[0]
        return (logits,) + decode_steps(cfg, steps, v, t, start, c)

    want_logits, want_tokens, want_cache = jax.jit(program)(variables, token, cache)
    assert len(set(np.asarray(want_tokens).ravel().tolist())) > 1
    with jax.set_mesh(mesh), nn.logical_axis_rules(decode_rules(rows, mesh)):
        assert logical_axis_shards(CACHE_SEQ) == 2
        jaxpr = str(jax.make_jaxpr(program)(variables, token, cache))
        logits, tokens, got_cache = jax.jit(program)(variables, token, cache)
    # per shard: each context shard's top-k candidates gathered over `context` (8 of its 16 slots, 2 shards)
    assert re.search(r"all_gather\[[^\]]*axis_name=\('context',\)", jaxpr.replace("\n", " "))
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5),
                 got_cache, want_cache)


def test_pair_swap_rope_decodes_the_same_tokens_and_cache():
    """rope_impl="pair_swap" (what decode_model_config sets): the same tokens and the same cache, bit for bit, as
    the sliced interleaved rotation, over steps that rotate queries, keys and indexer heads at new positions."""
    cfg, variables, token, cache = _prefilled()
    assert cfg.rope_interleave and cfg.indexer_rope_interleave
    _decodes_the_same_bit_for_bit(cfg.replace(decode_cache_write="rows"), variables, token, cache, rope_impl="pair_swap")


def test_stacked_kv_b_equals_the_per_layer_slice():
    """decode_stacked_kv_b (kv_b_proj moved to the stacked-weights collection, each half read at the layer's
    index): the same tokens and cache, bit for bit, as the scan's per-layer slice of it."""
    from glm5_jax.model.stacked_weights import STACKED_WEIGHTS, stack_kv_b_variables

    cfg, variables, token, cache = _prefilled()
    cfg = cfg.replace(decode_cache_write="rows", decode_cache_read="xla")
    moved = stack_kv_b_variables(variables)[STACKED_WEIGHTS]["decoder"]
    assert all("kv_b_proj" in seg[layer]["attention"] for seg in moved.values() for layer in seg)
    _decodes_the_same_bit_for_bit(cfg, variables, token, cache, decode_stacked_kv_b=True)


def test_rope_tables_made_once_per_step_decode_the_same_tokens_and_cache():
    """decode_rope_tables (the pair-swap RoPE tables of the step's positions made once before the layer scan and
    handed to every layer, what decode_model_config sets): the same tokens and cache, bit for bit, as each layer
    making its own, over steps at new positions."""
    from glm5_jax.model.attention import rope_tables

    cfg, variables, token, cache = _prefilled()
    cfg = cfg.replace(decode_cache_write="rows", rope_impl="pair_swap")
    tables = rope_tables(cfg, jnp.full((B, 1), P, jnp.int32))
    assert set(tables) == {(cfg.qk_rope_head_dim, cfg.qk_rope_head_dim), (cfg.qk_rope_head_dim, cfg.index_head_dim)}
    _decodes_the_same_bit_for_bit(cfg, variables, token, cache, decode_rope_tables=True)


def test_heads_major_kv_b_decodes_the_same_tokens_and_cache():
    """decode_kv_b_heads_major (the stacked kv_b_proj's halves stored [layers, H, R, dn] and [layers, H, dv, R],
    what decode_model_config sets): the same tokens and cache, bit for bit, as reading the halves of the stacked
    [layers, R, H, dn + dv] array; the split halves hold kv_b_proj's values."""
    from glm5_jax.model.stacked_weights import KV_B_UK, KV_B_UV, STACKED_WEIGHTS, heads_major_kv_b, stack_kv_b_variables

    cfg, variables, token, cache = _prefilled()
    cfg = cfg.replace(decode_cache_write="rows", decode_cache_read="xla", decode_stacked_kv_b=True)
    dn = cfg.qk_nope_head_dim
    stacked = stack_kv_b_variables(variables)[STACKED_WEIGHTS]["decoder"]
    split = heads_major_kv_b(stack_kv_b_variables(variables), dn)[STACKED_WEIGHTS]["decoder"]
    seg = next(iter(stacked))
    kv_b, halves = stacked[seg]["layer_0"]["attention"]["kv_b_proj"], split[seg]["layer_0"]["attention"]
    L, R, H, _ = kv_b.shape
    layer, r, h, n, v = L - 1, R - 2, H - 1, 3, 5          # one entry of each half, by hand
    assert halves[KV_B_UK][layer, h, r, n] == kv_b[layer, r, h, n]
    assert halves[KV_B_UV][layer, h, v, r] == kv_b[layer, r, h, dn + v]
    _decodes_the_same_bit_for_bit(cfg, variables, token, cache, decode_kv_b_heads_major=True)


def test_spread_norms_decode_the_same_tokens_and_cache():
    """decode_spread_norms (every decoder-layer norm's row statistics spread over the row, layers.spread_mean; what
    decode_model_config sets): the same tokens and cache, bit for bit, and the same last logits as the plain norms."""
    cfg, variables, token, cache = _prefilled()
    cfg = cfg.replace(decode_cache_write="rows")
    position = jnp.full((B, 1), P, jnp.int32)
    step = lambda c: jax.jit(lambda v, t, cache: Transformer(c).apply(  # noqa: E731
        v, t[:, None], position, jnp.ones((B, 1), jnp.int32), cache, method=Transformer.decode)[0])(
        variables, token, cache)
    _decodes_the_same_bit_for_bit(cfg, variables, token, cache, decode_spread_norms=True)
    np.testing.assert_allclose(np.asarray(step(cfg.replace(decode_spread_norms=True))), np.asarray(step(cfg)),
                               atol=1e-5, rtol=1e-5)


def test_one_row_rules_split_o_proj_over_expert():
    """At one row (decode_rules at batch 1: replicated_rows) the expert axis holds no rows and splits o_proj's value
    width (O_KV): a chip holds 1 / (tensor x expert) of o_proj, not 1 / tensor. Decoding one row over an
    expert:4,tensor:2 mesh then gives the same tokens as with o_proj replicated over expert, the cache and logits
    within fp32 tolerance (the output projection's partial sums are added over tensor x expert, not tensor)."""
    import flax.linen as nn
    from glm5_jax.generate.decode_program import decode_rules
    from glm5_jax.parallel.axes import O_KV
    from glm5_jax.parallel.mesh import build_mesh, logical_shardings
    from glm5_jax.parallel.sampling import parse_mesh_spec

    cfg = decode_config(TINY).replace(decode_cache_write="rows")
    mesh = build_mesh(parse_mesh_spec("expert:4,tensor:2"), jax.devices()[:8])
    rules = decode_rules(1, mesh)
    assert dict(rules)[O_KV] == "expert"
    expert_replicated = tuple((name, None if name == O_KV else axes) for name, axes in rules)
    boxed = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    o_proj = lambda r: logical_shardings(boxed, mesh, r)["params"]["decoder"]["segment_1"]["layer_0"][  # noqa: E731
        "attention"]["o_proj"]
    shape = nn.meta.unbox(boxed)["params"]["decoder"]["segment_1"]["layer_0"]["attention"]["o_proj"].shape
    L, H, dv, D = shape
    assert o_proj(rules).shard_shape(shape) == (L, H // 2, dv // 4, D)
    assert o_proj(expert_replicated).shard_shape(shape) == (L, H // 2, dv, D)
    variables = init_variables(TINY)
    token, start = jnp.array([5], jnp.int32), jnp.zeros((1,), jnp.int32)

    def run(r):
        shardings = logical_shardings(boxed, mesh, r)
        placed = jax.device_put(variables, jax.tree.map(lambda s, v: s, shardings, variables))
        with jax.set_mesh(mesh), nn.logical_axis_rules(r):
            return jax.jit(lambda v, t, p, cache: decode_steps(cfg, 4, v, t, p, cache))(
                placed, token, start, init_cache(cfg, 1, S)["decoder"])

    want_tokens, want_cache = run(expert_replicated)
    got_tokens, got_cache = run(rules)
    np.testing.assert_array_equal(np.asarray(got_tokens), np.asarray(want_tokens))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5), got_cache,
                 want_cache)
    assert len(set(np.asarray(want_tokens).ravel().tolist())) > 1


def test_fused_decode_attention_decodes_the_same_tokens():
    """decode_attention="pallas_interpret" (pallas_kernels/sparse_mla_decode: the selected latent rows gathered and
    attended in one kernel, interpreted, per (batch, heads) shard of a data:2,tensor:2 sampling mesh): the same
    tokens over 10 steps as the row gather + XLA's attention on one device, the cache and the first step's logits
    within fp32 tolerance. Without a stacked cache read it is refused by name."""
    import flax.linen as nn
    from glm5_jax.generate.decode_program import decode_rules
    from glm5_jax.model.config import ConfigError
    from glm5_jax.parallel.mesh import build_mesh
    from glm5_jax.parallel.sampling import SAMPLING_RULES, parse_mesh_spec
    from pallas_kernels.sparse_mla_decode import kernel as sparse_mla_decode_kernel

    cfg, variables, token, cache = _prefilled()
    cfg = cfg.replace(decode_cache_write="rows", decode_cache_read="pallas_interpret")
    assert cfg.num_attention_heads % 2 == 0
    start, position = jnp.full((B,), P, jnp.int32), jnp.full((B, 1), P, jnp.int32)
    mesh = build_mesh(parse_mesh_spec("data:2,tensor:2", SAMPLING_RULES), jax.devices()[:4])

    def run(c, on_mesh):
        def program(v, t, cache):
            logits = Transformer(c).apply(v, t[:, None], position, jnp.ones((B, 1), jnp.int32), cache,
                                          method=Transformer.decode)[0]
            return (logits,) + tuple(decode_steps(c, STEPS, v, t, start, cache))
        if not on_mesh:
            return jax.jit(program)(variables, token, cache)
        with jax.set_mesh(mesh), nn.logical_axis_rules(decode_rules(B, mesh)):
            jaxpr = str(jax.make_jaxpr(program)(variables, token, cache))
            assert (jaxpr.count(f"name={sparse_mla_decode_kernel.NAME}") > 0) == (c.runtime.decode_attention != "xla")
            return jax.jit(program)(variables, token, cache)

    want_logits, want_tokens, want_cache = run(cfg, False)
    logits, tokens, got_cache = run(cfg.replace(decode_attention="pallas_interpret"), True)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5), got_cache,
                 want_cache)
    assert len(set(np.asarray(want_tokens).ravel().tolist())) > 1       # not one repeated token
    with pytest.raises(ConfigError, match="decode_attention"):
        cfg.replace(decode_cache_read="slice", decode_attention="pallas")


@pytest.mark.parametrize("experts", ["int4", "bf16"])
def test_one_call_moe_decodes_the_same_tokens(experts):
    """decode_moe_kernel (what decode_model_config sets with INT4 experts, and with bf16 experts and the gathered
    dispatch: each chip's routed-expert sum of the gathered token's assignments as pallas_kernels/int4_decode_moe
    or pallas_kernels/bf16_decode_moe, interpreted, reading the stacked experts in place, over a data:2,expert:4
    sampling mesh): the same tokens over 10 steps as the dispatch around the INT4 matmul kernel / the grouped
    matmul over per-layer slices, the cache within fp32 tolerance; the kernel is what runs."""
    import flax.linen as nn
    from glm5_jax.generate.decode_program import decode_rules
    from glm5_jax.generate.settings import decode_model_config
    from glm5_jax.model.moe.int4_weights import quantize_params
    from glm5_jax.parallel.mesh import build_mesh
    from glm5_jax.parallel.sampling import SAMPLING_RULES, parse_mesh_spec
    from pallas_kernels.bf16_decode_moe.kernel import NAME as BF16
    from pallas_kernels.int4_decode_moe.kernel import NAME as INT4

    base = TINY.replace(moe_intermediate_size=64, quant_group_size=8, mtp_depth=0, num_nextn_predict_layers=0,
                        initializer_range=0.3)
    variables = init_variables(base)
    if experts == "int4":
        variables = {**variables, "params": quantize_params(variables["params"], base)}
    cfg = decode_model_config(base, experts, quant_matmul="pallas_interpret", moe_impl="ragged_dot",
                              cache_read="pallas_interpret")
    assert cfg.runtime.decode_moe_kernel and cfg.runtime.decode_stacked_experts
    name = INT4 if experts == "int4" else BF16
    off = {"decode_moe_kernel": False}
    if experts == "bf16":       # the grouped matmul over each layer's slice
        off.update(decode_stacked_experts=False, quant_matmul="xla")
    mesh = build_mesh(parse_mesh_spec("data:2,expert:4", SAMPLING_RULES), jax.devices()[:8])
    token, start = jnp.array([3, 77], jnp.int32), jnp.zeros((B,), jnp.int32)

    def run(c):
        program = lambda v, t, p, cache: decode_steps(c, STEPS, v, t, p, cache)  # noqa: E731
        args = (variables, token, start, init_cache(c, B, S)["decoder"])
        with jax.set_mesh(mesh), nn.logical_axis_rules(decode_rules(B, mesh)):
            assert (f"name={name}" in str(jax.make_jaxpr(program)(*args))) == c.runtime.decode_moe_kernel
            return jax.jit(program)(*args)

    want_tokens, want_cache = run(cfg.replace(**off))
    got_tokens, got_cache = run(cfg)
    np.testing.assert_array_equal(np.asarray(got_tokens), np.asarray(want_tokens))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         atol=2e-2, rtol=2e-2), got_cache, want_cache)
    assert len(set(np.asarray(want_tokens).ravel().tolist())) > 1       # not one repeated token

