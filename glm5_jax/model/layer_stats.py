"""`LayerStats`: the per-layer training statistics every decoder layer returns (router load, balance
term, indexer KL, dropped assignments), with the same fields on every layer so they stack over layers.

A layer without an MoE FFN or without an indexer KL has zeros there and a False mask; means over layers
use the masks. The model returns them stacked in layer order, [L, ...] (MTP block last).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class LayerStats:
    expert_load: jax.Array      # [..., E] f32: routed assignments of non-padding tokens per expert
    balance_loss: jax.Array     # [...] f32: sequence-wise balance term Σ_i f_i P_i
    indexer_kl: jax.Array       # [...] f32: DSA indexer KL (when ModelConfig.indexer_loss is set)
    dropped: jax.Array          # [...] f32: assignments over expert capacity (expert-parallel MoE only)
    has_moe: jax.Array          # [...] bool: the layer ran an MoE FFN
    has_indexer_kl: jax.Array   # [...] bool: the layer computed an indexer KL

    @classmethod
    def of_layer(cls, num_experts: int, moe_aux: dict | None = None, indexer_kl=None) -> "LayerStats":
        """One layer's stats from its MoE aux ({"expert_load", "balance_loss"[, "dropped"]}) and KL."""
        zero = jnp.zeros((), jnp.float32)
        moe_aux = moe_aux or {}
        return cls(expert_load=moe_aux.get("expert_load", jnp.zeros((num_experts,), jnp.float32)),
                   balance_loss=moe_aux.get("balance_loss", zero),
                   indexer_kl=zero if indexer_kl is None else indexer_kl.astype(jnp.float32),
                   dropped=moe_aux.get("dropped", zero),
                   has_moe=jnp.asarray(bool(moe_aux)), has_indexer_kl=jnp.asarray(indexer_kl is not None))

    def __add__(self, other: "LayerStats") -> "LayerStats":
        """Quantities add up, masks combine with "or" (the same layer applied twice, or two micro-batches)."""
        return LayerStats(expert_load=self.expert_load + other.expert_load,
                          balance_loss=self.balance_loss + other.balance_loss,
                          indexer_kl=self.indexer_kl + other.indexer_kl, dropped=self.dropped + other.dropped,
                          has_moe=self.has_moe | other.has_moe,
                          has_indexer_kl=self.has_indexer_kl | other.has_indexer_kl)

    def losses_divided_by(self, n) -> "LayerStats":
        """Balance loss, indexer KL and dropped divided by n (the mean of n micro-batches' sums); loads
        stay summed, as the routing-bias update wants the step's total."""
        return self.replace(balance_loss=self.balance_loss / n, indexer_kl=self.indexer_kl / n,
                            dropped=self.dropped / n)

    @property
    def balance_loss_sum(self):
        """Σ over MoE layers of the balance term."""
        return jnp.sum(jnp.where(self.has_moe, self.balance_loss, 0.0))

    @property
    def indexer_kl_sum(self):
        return jnp.sum(jnp.where(self.has_indexer_kl, self.indexer_kl, 0.0))

    @property
    def indexer_kl_mean(self):
        """Mean indexer KL over the layers that computed one (0 when none did)."""
        return self.indexer_kl_sum / jnp.maximum(jnp.sum(self.has_indexer_kl), 1)


def stack(stats: list[LayerStats], axis: int = 0) -> LayerStats:
    return jax.tree.map(lambda *xs: jnp.stack(xs, axis), *stats)


def concatenate(stats: list[LayerStats]) -> LayerStats:
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *stats)
