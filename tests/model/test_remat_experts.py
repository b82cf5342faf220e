"""The "experts_saveable" remat policy keeps the routed experts' gate and up products, so the backward pass
reruns only their down product; "full" reruns all three. Counted on the differentiated program's grouped
matmuls (`ragged_dot_general`: the CPU lowering of every expert product and of both its gradients)."""
import collections

import jax
import jax.numpy as jnp
from flax.core import meta

from glm5_jax import Transformer
from glm5_jax.layer_plan import plan_segments
from tests.model.test_model_properties import TINY, tokens


def _primitive_counts(jaxpr, counts):
    """Count every primitive of a jaxpr and of all the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _primitive_counts(inner, counts)
    return counts


def _grouped_matmuls_in_grad(policy, variables, ids):
    cfg = TINY.replace(remat_policy=policy, indexer_loss="sparse")

    def loss(params):
        return jnp.mean(Transformer(cfg).apply({**variables, "params": params}, ids, with_mtp=True).logits)

    return _primitive_counts(jax.make_jaxpr(jax.grad(loss))(variables["params"]).jaxpr,
                             collections.Counter())["ragged_dot_general"]


def test_experts_saveable_reruns_only_the_down_product():
    ids = jnp.asarray(tokens(2, 32))
    variables = meta.unbox(jax.jit(Transformer(TINY).init)(jax.random.PRNGKey(0), ids))
    counts = {p: _grouped_matmuls_in_grad(p, variables, ids) for p in ("none", "full", "experts_saveable")}
    # each scanned segment's body appears once in the program however many layers it scans over; every MoE
    # layer of a segment's repeating unit is one body (the MTP block is not rematerialised)
    moe_bodies = sum(kind.mlp == "moe" for segment in plan_segments(TINY) for kind in segment.unit)
    assert moe_bodies == 3
    # "full" reruns gate, up and down in the backward; "experts_saveable" only the down product
    assert counts["full"] - counts["none"] == 3 * moe_bodies
    assert counts["experts_saveable"] - counts["none"] == moe_bodies
