"""Which hub tensors make up each leaf of our variable tree (built from the `hf.layout` table).

A `LeafPlan` is one leaf of ``variables`` (``params`` or ``moe_bias``): its full shape in our layout
and, per index of the scanned-layer axis (or once for unstacked leaves), the hub tensor it comes from.
Routed experts name a key template with ``{e}``; that element is itself a stack over experts.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from flax.core import meta

from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.hf.checkpoint import FP32_LEAVES
from glm5_jax.hf.layout import (GLOBAL_TENSORS, heads_for, hub_shape, layer_slots, layer_tensor_maps, layout_perm,
                                mtp_extra_tensors, split_dims)
from glm5_jax.model.param_count import abstract_variables


@dataclasses.dataclass(frozen=True)
class HubSource:
    """One hub tensor (or, for routed experts, the per-expert family ``key.format(e=...)``)."""
    key: str
    layout: str
    heads: int | None = None
    experts: int | None = None          # number of experts when `key` is a template

    def keys(self) -> list[str]:
        return [self.key.format(e=e) for e in range(self.experts)] if self.experts else [self.key]


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    collection: str                     # "params" | "moe_bias"
    path: tuple[str, ...]               # below the collection
    shape: tuple[int, ...]              # our layout, with the stacked-layer axis first when `stacked`
    sources: tuple[HubSource, ...]      # one per stacked index, or a single one
    stacked: bool
    logical_axes: tuple[str | None, ...] = ()   # the model's logical axis names ("layers", "exp", "embed", ...)

    @property
    def name(self) -> str:
        return "/".join((self.collection,) + self.path)

    @functools.cached_property
    def element_shape(self) -> tuple[int, ...]:
        """Our shape of one hub tensor (one layer; one expert)."""
        shape = self.shape[1:] if self.stacked else self.shape
        return shape[1:] if self.sources[0].experts else shape

    @functools.cached_property
    def hub_shape(self) -> tuple[int, ...]:
        return hub_shape(self.element_shape, self.sources[0].layout)

    @property
    def _lead(self) -> tuple[int, ...]:
        """Leading stacked axes (layers, experts) in front of one hub tensor's axes."""
        full = self.shape
        return full[: len(full) - len(self.element_shape)]

    @functools.cached_property
    def hub_order_shape(self) -> tuple[int, ...]:
        """The leaf as hub tensors stacked in their split hub layout (before the transpose to ours)."""
        src = self.sources[0]
        rows, cols = split_dims(self.hub_shape, src.layout, src.heads)
        return self._lead + rows + cols

    @functools.cached_property
    def hub_to_ours_perm(self) -> tuple[int, ...]:
        """``hub_order_array.transpose(perm)`` is the leaf in our layout."""
        n = len(self._lead)
        inner = layout_perm(self.sources[0].layout, len(self.hub_order_shape) - n)
        return tuple(range(n)) + tuple(n + p for p in inner)

    @property
    def keep_fp32(self) -> bool:
        return self.path[-2:] in FP32_LEAVES

    def hub_keys(self) -> list[str]:
        return [k for s in self.sources for k in s.keys()]


def _model_leaves(cfg) -> dict[tuple[str, ...], tuple[tuple[int, ...], tuple]]:
    """(collection, *path) -> (shape, logical axes) of every variable `Transformer(cfg)` creates."""
    # Parameter shapes do not depend on how attention runs; tracing the dense path without remat takes
    # about half the time of the default sparse one (the plan is traced on every conversion). A
    # difference would still be caught: build_plan checks the model's leaves against the table.
    boxed = abstract_variables(cfg.replace(attention_mode="dense", remat_policy="none"))
    leaves = jax.tree_util.tree_leaves_with_path(boxed, is_leaf=lambda x: isinstance(x, meta.Partitioned))
    out = {}
    for path, leaf in leaves:
        axes = tuple(leaf.names) if isinstance(leaf, meta.Partitioned) else ()
        shape = tuple(meta.unbox(leaf).shape)
        out[tuple(k.key for k in path)] = (shape, axes or (None,) * len(shape))
    return out


def build_plan(cfg) -> list[LeafPlan]:
    """Every leaf of the model's variables with its hub sources, checked against the model's shapes."""
    model = _model_leaves(cfg)
    singles: dict[tuple[str, ...], HubSource] = {}
    stacks: dict[tuple[str, ...], list[HubSource]] = {}
    globals_ = GLOBAL_TENSORS + (mtp_extra_tensors(cfg) if cfg.num_nextn_predict_layers else ())
    for path, key, layout in globals_:
        singles[("params",) + path] = HubSource(key, layout)
    for slot in layer_slots(cfg):
        for tmap in layer_tensor_maps(cfg, slot.kind):
            experts = cfg.n_routed_experts if tmap.layout == "experts" else None
            src = HubSource(f"model.layers.{slot.hf_layer}.{tmap.hf}", tmap.layout, heads_for(tmap, cfg), experts)
            full = (tmap.collection,) + slot.prefix + tmap.ours
            if slot.stack_index is None:
                singles[full] = src
            else:
                stacks.setdefault(full, []).append(src)
    planned = set(singles) | set(stacks)
    missing, extra = sorted(set(model) - planned), sorted(planned - set(model))
    if missing or extra:
        raise CheckpointError(f"hf.layout does not cover the model: model leaves without a hub tensor "
                              f"{['/'.join(m) for m in missing[:5]]}, table entries the model lacks "
                              f"{['/'.join(e) for e in extra[:5]]}")
    plan = [LeafPlan(p[0], p[1:], *model[p][:1], (s,), False, model[p][1]) for p, s in singles.items()]
    plan += [LeafPlan(p[0], p[1:], *model[p][:1], tuple(s), True, model[p][1]) for p, s in stacks.items()]
    return plan
