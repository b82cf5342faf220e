"""Time of a compiled collective on a TPU v5p slice: a bandwidth-only model of the 3D-torus ICI.

Numbers (`glm5_jax.cost.chips`, from the v5p documentation): 1200 GB/s bidirectional inter-chip bandwidth
per chip over a 3D torus, i.e. 6 links (+-x, +-y, +-z) of 100 GB/s each way; slices of 4x4x4 chips and
larger are full 3D tori (wraparound links on every dim), smaller ones are not.

Model, per chip (`CollectiveModel.seconds`):
* the chips of a group are located by their physical coordinates; a group uses the torus dims along
  which its members differ, with n_d distinct positions on dim d; a dim runs as a ring (both directions
  usable, 2 links) when the group covers the whole dim of a wraparound slice, else as a line (1 link's
  worth: the middle link carries everything);
* all-gather / reduce-scatter / all-reduce (ring algorithms, all spanned dims at once): bytes moved
  (glm5_jax.cost.collectives.moved_bytes) / (link bandwidth x links in use);
* all-to-all / ragged-all-to-all: bytes moved x the mean hop count between group members / (link
  bandwidth x links in use), i.e. link load assumed balanced;
* collective-permute: operand bytes x the longest hop distance of its pairs / link bandwidth;
* no per-hop latency, no contention between collectives that run at the same time, no DCN (one slice).
"""
from __future__ import annotations

import functools

import numpy as np

from glm5_jax.cost.chips import CHIPS
from glm5_jax.cost.collectives import group_size, moved_bytes

V5P_LINK_BYTES_PER_S = CHIPS["v5p"].ici_link_bandwidth    # one direction of one ICI link
MIN_WRAPAROUND_DIM = CHIPS["v5p"].min_wraparound_dim      # slices of 4x4x4 and larger are full tori


class CollectiveModel:
    """Seconds of one `CollectiveOp` on `devices` (partition id -> device with `.coords`) in a slice of
    `torus_dims` chips."""

    def __init__(self, device_coords, torus_dims, link_bandwidth: float = V5P_LINK_BYTES_PER_S):
        self.coords = np.asarray(device_coords, dtype=np.int64)      # [partitions, 3]
        self.torus_dims = tuple(torus_dims)
        self.wraparound = min(self.torus_dims) >= MIN_WRAPAROUND_DIM
        self.link_bandwidth = link_bandwidth

    @functools.lru_cache(maxsize=None)
    def _geometry(self, members: tuple) -> tuple[int, float, int]:
        """(links in use per chip, mean hops between distinct members, longest hop) of one group."""
        c = self.coords[list(members)]
        links, dist = 0, np.zeros((len(members), len(members)))
        for d, size in enumerate(self.torus_dims):
            positions = np.unique(c[:, d])
            if len(positions) < 2:
                continue
            ring = self.wraparound and len(positions) == size
            links += 2 if ring else 1
            delta = np.abs(c[:, None, d] - c[None, :, d])
            dist += np.minimum(delta, size - delta) if ring else delta
        n = len(members)
        mean_hops = dist.sum() / (n * (n - 1)) if n > 1 else 0.0
        return links, mean_hops, int(dist.max()) if n > 1 else 0

    def seconds(self, op) -> float:
        if not op.groups:
            return 0.0
        n = group_size(op.kind, op.groups)
        moved = moved_bytes(op.kind, op.nbytes, n)
        if moved == 0:
            return 0.0
        if op.kind == "collective-permute":
            hops = max(self._geometry(tuple(sorted(set(p))))[2] for p in op.groups if p[0] != p[1])
            return moved * hops / self.link_bandwidth
        members = next(g for g in op.groups if len(set(g)) > 1)
        links, mean_hops, _ = self._geometry(tuple(members))
        if op.kind in ("all-to-all", "ragged-all-to-all"):
            return moved * mean_hops / (self.link_bandwidth * links)
        return moved / (self.link_bandwidth * links)


def torus_dims(topology: str) -> tuple[int, ...]:
    """'v5p:8x16x16' -> (8, 16, 16)."""
    try:
        return tuple(int(v) for v in topology.split(":")[1].split("x"))
    except (IndexError, ValueError):
        raise ValueError(f"topology {topology!r}: expected CHIP:XxYxZ, e.g. v5p:8x16x16") from None


def collective_table(collectives: dict, model: CollectiveModel | None, axis_names, axis_sizes) -> list[dict]:
    """One row per (kind, mesh axes, category, async): executions per step, bytes moved per chip per
    step and the model's seconds, dearest first."""
    from glm5_jax.cost.collectives import spanned_axes

    rows = {}
    for op, count in collectives.items():
        axes = spanned_axes(op.groups, axis_names, axis_sizes) if op.groups else None
        key = (op.kind, "+".join(axes) if axes is not None else "unknown", op.category, op.is_async)
        row = rows.setdefault(key, {"kind": op.kind, "mesh_axes": key[1], "category": op.category,
                                    "async": op.is_async, "count": 0.0, "bytes_per_chip": 0.0, "seconds": 0.0})
        n = group_size(op.kind, op.groups) if op.groups else 1
        row["count"] += count
        row["bytes_per_chip"] += count * moved_bytes(op.kind, op.nbytes, n)
        if model is not None:
            row["seconds"] += count * model.seconds(op)
    return sorted(rows.values(), key=lambda r: (-r["seconds"], -r["bytes_per_chip"]))
