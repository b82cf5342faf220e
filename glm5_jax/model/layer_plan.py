"""How the main decoder stack is laid out as scanned segments.

Layers differ in two ways: dense FFN vs MoE (docs/architecture.md#moe-routing), and "full" indexer vs "shared" (reuses
the
previous full layer's top-k, docs/architecture.md#cross-layer-index-sharing). Layers of one structure are stacked and
run by one `nn.scan`
so compile time does not grow with depth. A repeating pattern (GLM-5.2's S S S F ...) becomes one
scanned *group* of several layers, so even irregular sharing compiles as a handful of scans.
GLM-5 itself is two segments: 3 dense layers, then 75 MoE layers. GLM-5.3-Flash's layers also differ in
their attention (KDA in three of every four layers, MLA in the fourth): 3 dense KDA layers, one MLA, ten
scanned groups of (KDA, KDA, KDA, MLA) and one last KDA layer.
"""
from __future__ import annotations

import dataclasses

from glm5_jax.model.config import ModelConfig

MAX_GROUP = 8  # longest repeating unit searched for


@dataclasses.dataclass(frozen=True)
class LayerKind:
    mlp: str       # "dense" | "moe"
    indexer: str   # "full" | "shared" | "none"
    attention: str = "mla"   # "mla" (MLA + DSA) | "kda" (GLM-5.3-Flash's linear attention, no indexer)


@dataclasses.dataclass(frozen=True)
class Segment:
    """`repeats` consecutive copies of a group of layers with kinds `unit`, starting at layer `first`."""
    name: str
    first: int
    unit: tuple[LayerKind, ...]
    repeats: int

    def layer_index(self, repeat: int, position: int) -> int:
        return self.first + repeat * len(self.unit) + position

    @property
    def num_layers(self) -> int:
        return len(self.unit) * self.repeats


def layer_kinds(cfg: ModelConfig) -> tuple[LayerKind, ...]:
    return tuple(LayerKind("dense" if i < cfg.first_k_dense_replace else "moe", "none" if a == "kda" else t, a)
                 for i, (t, a) in enumerate(zip(cfg.layer_indexer_types, cfg.layer_attention_types)))


def _best_unit(kinds, start):
    """(unit length, repeats) covering the most layers from `start`; shorter units win ties."""
    best = (1, 1)
    for p in range(1, min(MAX_GROUP, len(kinds) - start) + 1):
        unit = kinds[start:start + p]
        r = 1
        while kinds[start + r * p:start + (r + 1) * p] == unit:
            r += 1
        if r >= 2 and p * r > best[0] * best[1]:
            best = (p, r)
    return best


def plan_segments(cfg: ModelConfig) -> tuple[Segment, ...]:
    kinds = layer_kinds(cfg)
    segments, i = [], 0
    while i < len(kinds):
        p, r = _best_unit(kinds, i)
        segments.append(Segment(f"segment_{len(segments)}", i, kinds[i:i + p], r))
        i += p * r
    return tuple(segments)
