"""The "experts_saveable" remat policy keeps the routed experts' gate and up products, so the backward pass
reruns only their down product; "full" reruns all three; "moe_saveable" also keeps the experts' input rows
and reruns none of them, nor the transport. Counted on the differentiated program's grouped
matmuls (`ragged_dot_general`: the CPU lowering of every expert product and of both its gradients)."""
import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta

from glm5_jax import Transformer
from glm5_jax.model.decoder import REMAT_POLICIES
from glm5_jax.model.layer_plan import plan_segments
from glm5_jax.model.moe.layer import MoE
from glm5_jax.parallel.mesh import DEFAULT_RULES, MeshConfig, build_mesh
from tests.model.test_model_properties import TINY, tokens
from tests.model.test_moe_ep import CFG as EP_CFG


def _all_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in its equations' parameters (scan, remat,
    shard_map, custom_vjp and jit bodies)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def _primitive_counts(jaxpr, counts):
    """Count every primitive of a jaxpr and of all the jaxprs nested in its equations' parameters."""
    counts.update(eqn.primitive.name for eqn in _all_eqns(jaxpr))
    return counts


def _row_all_to_alls(jaxpr):
    """Number of `all_to_all` equations moving floating-point rows (not the per-expert integer counts)."""
    return sum(eqn.primitive.name == "all_to_all" and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating)
               for eqn in _all_eqns(jaxpr))


def _grouped_matmuls_in_grad(policy, variables, ids):
    cfg = TINY.replace(remat_policy=policy, indexer_loss="sparse")

    def loss(params):
        return jnp.mean(Transformer(cfg).apply({**variables, "params": params}, ids, with_mtp=True).logits)

    return _primitive_counts(jax.make_jaxpr(jax.grad(loss))(variables["params"]).jaxpr,
                             collections.Counter())["ragged_dot_general"]


def test_experts_saveable_reruns_only_the_down_product_and_expert_out_all_but_it():
    ids = jnp.asarray(tokens(2, 32))
    variables = meta.unbox(jax.jit(Transformer(TINY).init)(jax.random.PRNGKey(0), ids))
    counts = {p: _grouped_matmuls_in_grad(p, variables, ids)
              for p in ("none", "full", "experts_saveable", "attention_expert_out_saveable")}
    # each scanned segment's body appears once in the program however many layers it scans over; every MoE
    # layer of a segment's repeating unit is one body (the MTP block is not rematerialised)
    moe_bodies = sum(kind.mlp == "moe" for segment in plan_segments(TINY) for kind in segment.unit)
    assert moe_bodies == 3
    # "full" reruns gate, up and down in the backward; "experts_saveable" only the down product;
    # "attention_expert_out_saveable" (the experts' outputs kept) gate and up but not the down product
    assert counts["full"] - counts["none"] == 3 * moe_bodies
    assert counts["experts_saveable"] - counts["none"] == moe_bodies
    assert counts["attention_expert_out_saveable"] - counts["none"] == 2 * moe_bodies


def test_experts_saveable_reaches_into_the_expert_parallel_shard_map():
    """With all_to_all expert parallelism the experts run inside a `shard_map`; the policy still saves their
    gate / up products there (one MoE layer under `jax.checkpoint`, expert=4 fake devices)."""
    cfg = EP_CFG.replace(moe_ep="a2a")
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16, cfg.hidden_size), jnp.float32)
    mask = jnp.ones((8, 16), bool)
    variables = meta.unbox(MoE(EP_CFG).init(jax.random.PRNGKey(0), x, mask))
    mesh = build_mesh(MeshConfig(data=1, fsdp=2, expert=4, tensor=1), jax.devices()[:8])

    def count(policy):
        def loss(params):
            out, _ = MoE(cfg).apply({**variables, "params": params}, x, mask)
            return jnp.sum(out ** 2)

        rematted = loss if policy is None else jax.checkpoint(loss, policy=REMAT_POLICIES[policy])
        with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
            jaxpr = jax.make_jaxpr(jax.grad(rematted))(variables["params"]).jaxpr
        return (_primitive_counts(jaxpr, collections.Counter())["ragged_dot_general"],
                _row_all_to_alls(jaxpr))

    (none, none_a2a), (full, full_a2a), (saveable, _) = count(None), count("full"), count("experts_saveable")
    # the policy-free count holds the forward's three products and the backward's gradient products; a
    # rematerialised product adds one more
    assert full == none + 3 and saveable == none + 1
    # "moe_saveable" also keeps the experts' input rows and outputs: the backward reruns no product and moves
    # no rows (the rematerialised forward under "full" sends rows out and results back again)
    moe, moe_a2a = count("moe_saveable")
    assert full_a2a > none_a2a > 0
    assert moe == none and moe_a2a == none_a2a



def _indexer_top_ks(jaxpr, k):
    """Number of `top_k` equations taking the `k` largest (the indexer's; routing takes other k's)."""
    return sum(eqn.primitive.name == "top_k" and eqn.params.get("k") == k for eqn in _all_eqns(jaxpr))


def _top_ks_in_grad(policy, variables, ids):
    cfg = TINY.replace(remat_policy=policy, indexer_loss="sparse")

    def loss(params):
        return jnp.mean(Transformer(cfg).apply({**variables, "params": params}, ids, with_mtp=True).logits)

    return _indexer_top_ks(jax.make_jaxpr(jax.grad(loss))(variables["params"]).jaxpr, cfg.index_topk)


def test_selection_saveable_does_not_rerun_the_top_k():
    """"full" reruns each full layer's lightning-indexer top-k in the backward pass; "selection_saveable"
    keeps the selection, so its program has the top-k count of no remat."""
    ids = jnp.asarray(tokens(2, 32))
    variables = meta.unbox(jax.jit(Transformer(TINY).init)(jax.random.PRNGKey(0), ids))
    assert TINY.index_topk not in (TINY.num_experts_per_tok, TINY.topk_group)
    counts = {p: _top_ks_in_grad(p, variables, ids) for p in ("none", "full", "selection_saveable")}
    # one indexer top-k per full-indexer layer of each scanned segment's unit, none in "shared" layers
    full_bodies = sum(kind.indexer == "full" for segment in plan_segments(TINY) for kind in segment.unit)
    assert full_bodies >= 1 and counts["none"] >= full_bodies
    assert counts["full"] - counts["none"] == full_bodies
    assert counts["selection_saveable"] == counts["none"]


def test_selection_saveable_reaches_into_the_context_parallel_shard_map():
    """With the sequence split over context shards the top-k runs inside the attention's `shard_map` (over
    the gathered keys); the selection is named there, so "selection_saveable" keeps it and the backward
    reruns no top-k, where "full" reruns each full layer's (context=2 fake devices)."""
    ids = jnp.asarray(tokens(2, 32))
    variables = meta.unbox(jax.jit(Transformer(TINY).init)(jax.random.PRNGKey(0), ids))
    mesh = build_mesh(MeshConfig(data=1, fsdp=1, context=2, expert=1, tensor=1), jax.devices()[:2])
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        counts = {p: _top_ks_in_grad(p, variables, ids) for p in ("none", "full", "selection_saveable")}
    full_bodies = sum(kind.indexer == "full" for segment in plan_segments(TINY) for kind in segment.unit)
    assert counts["none"] >= full_bodies >= 1
    assert counts["full"] - counts["none"] == full_bodies
    assert counts["selection_saveable"] == counts["none"]


def _named_kernels(jaxpr, name):
    """Number of `pallas_call` equations named ``name``, nested jaxprs included."""
    return sum(eqn.primitive.name == "pallas_call" and eqn.params.get("name") == name for eqn in _all_eqns(jaxpr))


def test_attention_saveable_does_not_rerun_the_attention_forward_kernel():
    """Context parallelism (context=2) with the Pallas sparse attention over gathered rows (the long-context
    path: no masked flash core) and the sparse indexer KL: "full" reruns every layer's attention forward
    kernel (with its KL-target sweep), the indexer KL's forward kernel and the indexer's scores + selection in
    the backward pass; "attention_saveable" keeps the attention kernel's out, lse and target, the KL kernel's
    lse and the selection, so its program runs each of those kernels as often as with no remat."""
    cfg = TINY.replace(attention_impl="pallas_interpret", masked_flash_factor=0, indexer_loss="sparse")
    ids = jnp.asarray(tokens(2, 32))
    variables = meta.unbox(jax.jit(Transformer(TINY).init)(jax.random.PRNGKey(0), ids))
    mesh = build_mesh(MeshConfig(data=1, fsdp=1, context=2, expert=1, tensor=1), jax.devices()[:2])

    def counts(policy):
        def loss(params):     # the indexer KL in the loss, so its backward runs
            out = Transformer(cfg.replace(remat_policy=policy)).apply({**variables, "params": params}, ids,
                                                                       with_mtp=True)
            return jnp.mean(out.logits) + jnp.sum(out.stats.indexer_kl)

        with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
            jaxpr = jax.make_jaxpr(jax.grad(loss))(variables["params"]).jaxpr
        # full-indexer layers attend with the KL-target sweep, shared ones without
        forward_kernels = sum(_named_kernels(jaxpr, n) for n in ("sparse_mla_fwd_target", "sparse_mla_fwd"))
        # the Pallas selection: the score kernel, then a sort (no top_k equation)
        return forward_kernels, _named_kernels(jaxpr, "lightning_indexer_scores"), \
            _named_kernels(jaxpr, "indexer_kl_sparse_fwd")

    (none, none_sel, none_kl), (full, full_sel, full_kl), saveable = (counts(p) for p in
                                                                      ("none", "full", "attention_saveable"))
    layers = sum(len(segment.unit) for segment in plan_segments(TINY))     # bodies of the scanned segments
    assert none >= layers >= 1 and full == none + layers
    assert none_sel >= 1 and full_sel > none_sel and none_kl >= 1 and full_kl > none_kl
    assert saveable == (none, none_sel, none_kl)


def test_partial_policies_run_the_masked_selection_and_warmup_kl_kernels_once():
    """The short-context sparse stage on Pallas (context=2): the attention is the flash kernel over the
    top-k as a mask and the indexer KL the warm-up kernel over the same mask, which computes the loss and the
    indexer's gradients in one forward. "full" reruns the KL kernel and the indexer's score kernel in the
    backward pass; every partial policy keeps the KL's gradients and sums (indexer_kl.ops.SAVED_NAMES) and
    the selection with its mask, so its program runs each kernel as often as with no remat."""
    cfg = TINY.replace(attention_impl="pallas_interpret", indexer_loss="sparse")
    ids = jnp.asarray(tokens(2, 32))
    variables = meta.unbox(jax.jit(Transformer(TINY).init)(jax.random.PRNGKey(0), ids))
    mesh = build_mesh(MeshConfig(data=1, fsdp=1, context=2, expert=1, tensor=1), jax.devices()[:2])

    def kl_kernels(policy):
        def loss(params):
            out = Transformer(cfg.replace(remat_policy=policy)).apply({**variables, "params": params}, ids)
            return jnp.mean(out.logits) + jnp.sum(out.stats.indexer_kl)

        with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
            jaxpr = jax.make_jaxpr(jax.grad(loss))(variables["params"]).jaxpr
        return tuple(_named_kernels(jaxpr, n) for n in ("indexer_kl_warmup_grads", "lightning_indexer_scores",
                                                         "flash_attention_fwd_masked"))

    (none, none_scores, none_flash), (full, full_scores, full_flash) = kl_kernels("none"), kl_kernels("full")
    full_layers = sum(kind.indexer == "full" for segment in plan_segments(TINY) for kind in segment.unit)
    assert none_flash >= 1 and full_flash > none_flash         # the masked flash core ran (and reruns)
    assert none == none_scores == full_layers >= 1 and full == full_scores == 2 * none
    for policy in ("moe_saveable", "selection_saveable"):
        assert kl_kernels(policy)[:2] == (none, none_scores)


def test_moe_attention_saveable_reruns_only_the_key_value_projection():
    """The dense stage's flash core (Pallas, interpreted) under context parallelism: "moe_saveable" reruns
    each layer's attention forward kernel and the query, key / value and output projections in the backward
    pass; "moe_attention_saveable" keeps the kernel's out and lse, the MHA query and its latent, the
    attention block's output and the SwiGLU's gate / up products, so its program has the forward kernels of
    no remat and none of those projections rerun (the key / value up-projection is, as the attention
    backward reads its results)."""
    cfg = TINY.replace(attention_impl="pallas_interpret", attention_mode="dense", indexer_loss="none")
    ids = jnp.asarray(tokens(2, 32))
    variables = meta.unbox(jax.jit(Transformer(TINY).init)(jax.random.PRNGKey(0), ids))
    mesh = build_mesh(MeshConfig(data=1, fsdp=1, context=2, expert=1, tensor=1), jax.devices()[:2])

    def counts(policy):
        def loss(params):
            return jnp.mean(Transformer(cfg.replace(remat_policy=policy)).apply(
                {**variables, "params": params}, ids).logits)

        with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
            jaxpr = jax.make_jaxpr(jax.grad(loss))(variables["params"]).jaxpr
        eqns = list(_all_eqns(jaxpr))
        flash = sum(e.primitive.name == "pallas_call" and "flash_attention_fwd" in str(e.params.get("name"))
                    for e in eqns)
        return flash, sum(e.primitive.name == "dot_general" for e in eqns)

    (none_fwd, none_dots), (moe_fwd, moe_dots), (kept_fwd, kept_dots) = (
        counts(p) for p in ("none", "moe_saveable", "moe_attention_saveable"))
    layers = sum(len(segment.unit) for segment in plan_segments(TINY))    # bodies of the scanned segments
    assert none_fwd >= layers >= 1 and moe_fwd == none_fwd + layers
    assert kept_fwd == none_fwd
    # what moe_saveable reruns and the new policy does not, per layer: the query's two projections, the
    # output projection, the forward kernel's two products (its interpreted body is in the jaxpr) and the
    # dense / shared SwiGLU's gate and up products
    assert moe_dots - kept_dots == 7 * layers and kept_dots > none_dots
