"""Where a model's variables live on a mesh: their NamedShardings from the parameters' logical axes.

    abstract = abstract_variables(cfg, mesh, rules)    # {"params", "moe_bias"}: ShapeDtypeStructs with shardings
    variables = place_variables(variables, cfg, mesh, rules)

A restore with these shardings (`glm5_jax.checkpoint.inference.load_variables`, an RL policy version) reads
each shard straight onto its devices; nothing is gathered on one device first.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax.core import meta

from glm5_jax.model.moe.layer import BIAS_COLLECTION
from glm5_jax.model.transformer import Transformer
from glm5_jax.parallel.mesh import logical_shardings, mesh_and_rules


def abstract_variables(model_cfg, mesh, rules) -> dict:
    """{"params", BIAS_COLLECTION} of `model_cfg`'s model as ShapeDtypeStructs carrying their shardings on
    `mesh` under `rules` (no arrays are made)."""
    with mesh_and_rules(mesh, rules):
        boxed = jax.eval_shape(lambda r: Transformer(model_cfg).init(r, jnp.zeros((1, 8), jnp.int32)),
                               jax.ShapeDtypeStruct((2,), jnp.uint32))
        shardings = meta.unbox(logical_shardings(boxed, mesh, rules))
    unboxed = meta.unbox(boxed)
    return {c: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            unboxed.get(c, {}), shardings.get(c, {}))
            for c in ("params", BIAS_COLLECTION)}


def variable_shardings(model_cfg, mesh, rules) -> dict:
    """The NamedShardings of `abstract_variables`."""
    return jax.tree.map(lambda a: a.sharding, abstract_variables(model_cfg, mesh, rules))


def place_variables(variables, model_cfg, mesh, rules) -> dict:
    """`variables` ({"params"[, BIAS_COLLECTION]}) put on `mesh` by their logical axes (a no-op for arrays
    already there)."""
    shardings = variable_shardings(model_cfg, mesh, rules)
    return {c: jax.device_put(v, shardings[c]) for c, v in variables.items()}
