"""Time of a compiled collective on a TPU slice: a link-load model of the 3D-torus ICI.

Chip facts (`glm5_jax.cost.chips`): v5p has 1200 GB/s bidirectional ICI per chip over a 3D torus, six
ports, i.e. 100 GB/s per link in each direction; slices of 4x4x4 chips and larger have wraparound links on
every dim. Reports use the achievable share of that (``ChipSpec.ici_fraction``) and a fixed latency per
algorithm step (``ChipSpec.ici_step_latency``), both stated assumptions.

Model (`CollectiveModel.seconds`), per chip, all groups of the collective running at once:
* chips are placed by their physical coordinates; a group spans the torus dims along which its members
  differ;
* all-gather / reduce-scatter / all-reduce run as rings, one per spanned dim at once, each dim carrying
  its share of the bytes (glm5_jax.cost.collectives.moved_bytes). On each dim the members of a group
  that share their other coordinates form a ring in position order; every ring edge is routed hop by
  hop along the dim the shorter way round (two rings, in position order and reversed, half the bytes
  each), and the load of a directed link is the number of edges of ALL groups crossing it. A dim then
  moves 2 x link bandwidth / (its busiest link's load) bytes per second per chip. So groups whose
  members are several hops apart, or that share links with neighbouring groups, get a fraction of a
  link, and a pair of neighbours gets its one link in each direction;
* ``ring_dims="per_dimension"``: a group spanning several dims runs one ring per dim, one dim after
  another (dim d_k carries moved x prod_{j<k} n_dj x (n_dk - 1) / (n - 1)), pipelined: the busiest dim's
  time in the best order of the dims. ``"add"`` (the optimistic rules): the dims' bandwidths add,
  as if the bytes could be split over the dims in proportion to them. An FSDP group of 4 positions 4
  hops apart (4 groups interleaved on each link: 2 x 85 / 4 GB/s) x 16 neighbours (2 x 85 GB/s) moves
  212 GB/s per chip by "add", 19% less by "per_dimension";
* all-to-all / ragged-all-to-all, ``all_to_all_link_model``:
  "busiest_link": every member sends each other member bytes / n, routed dimension by dimension (dims in
  order, each the shorter way round, a tie split half each way), the messages of ALL groups loading the
  directed links they cross; the collective takes (bytes / n) x its busiest link's message count / link
  bandwidth. "balanced" (the optimistic rules): bytes x the mean hop count between members /
  (link bandwidth x links per chip on the spanned dims), as if every link carried the same load. A
  32-chip group on an 8 x 4 block of an 8x16x16 torus (its 4 positions on a 16-long dim: no wraparound
  inside the block) loads its busiest link with 32 messages where the balanced load is 26;
* collective-permute: operand bytes x the longest hop distance of its pairs / link bandwidth;
* plus the step latency x the algorithm's steps: a ring over n positions per dim takes the sum over
  dims of (n_d - 1) steps (twice for all-reduce), an all-to-all n - 1, a permute 1;
* ``sparsecore_factor``: a collective the SparseCores run (`CollectiveOp.offloaded`) of a kind in
  ``sparsecore_kinds`` takes that factor x its link time (the public v5p recipes tell libtpu's scheduler
  to expect an offloaded reduce-scatter to take 3x: ``--xla_tpu_sparse_core_reduce_scatter_latency_multiplier=3``);
* no contention between different collectives that run at the same time, no DCN (one slice).
"""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from glm5_jax.cost.chips import CHIPS
from glm5_jax.cost.collectives import group_size, moved_bytes

V5P_LINK_BYTES_PER_S = CHIPS["v5p"].ici_link_bandwidth    # one direction of one ICI link
MIN_WRAPAROUND_DIM = CHIPS["v5p"].min_wraparound_dim      # slices of 4x4x4 and larger are full tori
_RINGS = ("all-gather", "reduce-scatter", "all-reduce")


class CollectiveModel:
    """Seconds of one `CollectiveOp` on `devices` (partition id -> device with `.coords`) in a slice of
    `torus_dims` chips: ``link_bandwidth`` bytes/s per link per direction, ``step_latency`` seconds per
    algorithm step."""

    def __init__(self, device_coords, torus_dims, link_bandwidth: float = V5P_LINK_BYTES_PER_S,
                 step_latency: float = 0.0, all_to_all_link_model: str = "balanced", sparsecore_factor: float = 1.0,
                 sparsecore_kinds: tuple = ("reduce-scatter",), ring_dims: str = "add"):
        if ring_dims not in ("add", "per_dimension"):
            raise ValueError(f"ring_dims={ring_dims!r}: 'add' or 'per_dimension'")
        self.ring_dims = ring_dims
        if all_to_all_link_model not in ("balanced", "busiest_link"):
            raise ValueError(f"all_to_all_link_model={all_to_all_link_model!r}: 'balanced' or 'busiest_link'")
        self.all_to_all_link_model = all_to_all_link_model
        self.sparsecore_factor, self.sparsecore_kinds = sparsecore_factor, tuple(sparsecore_kinds)
        self.coords = np.asarray(device_coords, dtype=np.int64)      # [partitions, 3]
        self.torus_dims = tuple(torus_dims)
        self.wraparound = min(self.torus_dims) >= MIN_WRAPAROUND_DIM
        self.link_bandwidth = link_bandwidth
        self.step_latency = step_latency

    def _spanned(self, members) -> list[int]:
        c = self.coords[list(members)]
        return [d for d in range(len(self.torus_dims)) if len(np.unique(c[:, d])) > 1]

    def _distance(self, a, b, d) -> np.ndarray:
        delta = np.abs(a - b)
        return np.minimum(delta, self.torus_dims[d] - delta) if self.wraparound else delta

    @functools.lru_cache(maxsize=None)
    def _group_geometry(self, members: tuple) -> tuple[int, float, int, int]:
        """(links per chip on the spanned dims, mean hops between distinct members, longest hop, ring
        steps: the sum over spanned dims of positions - 1) of one group."""
        c = self.coords[list(members)]
        links, steps, dist = 0, 0, np.zeros((len(members), len(members)))
        for d in self._spanned(members):
            links += 2 if self.wraparound else 1
            steps += len(np.unique(c[:, d])) - 1
            dist += self._distance(c[:, None, d], c[None, :, d], d)
        n = len(members)
        mean_hops = dist.sum() / (n * (n - 1)) if n > 1 else 0.0
        return links, mean_hops, int(dist.max()) if n > 1 else 0, steps

    def ring_bandwidth(self, groups: tuple) -> float:
        """Bytes/s of one chip's ring traffic when every group runs its rings at once, its dims' added."""
        return sum(self.ring_dim_bandwidths(groups).values())

    def ring_seconds_per_dimension(self, groups: tuple, moved: float) -> float:
        """Seconds of ring traffic ``moved`` (per chip, over a group of n = prod n_d chips) run as one ring
        per dimension, one dimension after another (a hierarchical all-gather: along d_1 it gathers
        chunks of S / n, then along d_2 blocks n_d1 x larger...: dim d_k carries
        moved x prod_{j<k} n_dj x (n_dk - 1) / (n - 1)), its phases pipelined: the busiest dimension's
        time, in the best order of the dims."""
        bandwidths = self.ring_dim_bandwidths(groups)
        members = next(g for g in groups if len(set(g)) > 1)
        c = self.coords[list(members)]
        sizes = {d: len(np.unique(c[:, d])) for d in bandwidths}
        n = math.prod(sizes.values())
        if len(bandwidths) < 2 or n < 2:
            return moved / sum(bandwidths.values())
        best = math.inf
        for order in itertools.permutations(bandwidths):
            before, busiest = 1, 0.0
            for d in order:
                busiest = max(busiest, moved * before * (sizes[d] - 1) / (n - 1) / bandwidths[d])
                before *= sizes[d]
            best = min(best, busiest)
        return best

    @functools.lru_cache(maxsize=None)
    def ring_dim_bandwidths(self, groups: tuple) -> dict:
        """Bytes/s of one chip's ring traffic when every group runs its rings at once (module docstring):
        per spanned dim, two rings (position order and its reverse) carry half the bytes each; every
        edge takes the shorter way round (a tie: forward for the first ring, backward for the second;
        no wraparound: the only way), and the dim moves 2 x link bandwidth / (its busiest directed
        link's edge count)."""
        members = next(g for g in groups if len(set(g)) > 1)
        total = {}
        for d in self._spanned(members):
            size = self.torus_dims[d]
            load = {}                                   # (line, link position, direction) -> edges crossing
            for g in groups:
                c = self.coords[list(g)]
                others = [k for k in range(c.shape[1]) if k != d]
                lines = {}
                for row in c:
                    lines.setdefault(tuple(row[others]), set()).add(int(row[d]))
                for line, positions in lines.items():
                    p = sorted(positions)
                    if len(p) < 2:
                        continue
                    forward = list(zip(p, p[1:] + p[:1]))
                    for ring, edges in ((+1, forward), (-1, [(b, a) for a, b in forward])):
                        for a, b in edges:
                            ahead = (b - a) % size
                            if not self.wraparound:
                                step, hops = (1, b - a) if b > a else (-1, a - b)
                            elif ahead != size - ahead:
                                step, hops = (1, ahead) if ahead < size - ahead else (-1, size - ahead)
                            else:
                                step, hops = ring, ahead
                            for h in range(hops):
                                link = (a + h) % size if step > 0 else (a - h - 1) % size
                                load[(line, link, step)] = load.get((line, link, step), 0) + 1
            if load:
                total[d] = 2 * self.link_bandwidth / max(load.values())
        return total

    @functools.lru_cache(maxsize=None)
    def all_to_all_busiest_link(self, groups: tuple) -> float:
        """Messages on the busiest directed link when every member of every group sends one message to
        each other member of its group, routed dimension by dimension (module docstring)."""
        load = {}                                   # (dim, link's start coords, direction) -> messages

        def add(at, d, step, weight):
            key = (d, tuple(at), step)
            load[key] = load.get(key, 0.0) + weight

        def route(at, dst, d, weight):
            if d == len(self.torus_dims):
                return
            size, here = self.torus_dims[d], int(at[d])
            ahead = (int(dst[d]) - here) % size
            if ahead == 0:
                return route(at, dst, d + 1, weight)
            if not self.wraparound:
                ways = [(1, ahead)] if dst[d] > here else [(-1, here - int(dst[d]))]
            elif ahead != size - ahead:
                ways = [(1, ahead)] if ahead < size - ahead else [(-1, size - ahead)]
            else:
                ways = [(1, ahead), (-1, ahead)]
            for step, hops in ways:
                pos = list(at)
                for _ in range(hops):
                    link = list(pos)
                    if step < 0:
                        link[d] = (pos[d] - 1) % size       # a link is named by its lower end
                    add(link, d, step, weight / len(ways))
                    pos[d] = (pos[d] + step) % size
                route(pos, dst, d + 1, weight / len(ways))

        for g in groups:
            c = self.coords[list(g)]
            for i in range(len(g)):
                for j in range(len(g)):
                    if i != j:
                        route([int(v) for v in c[i]], c[j], 0, 1.0)
        return max(load.values(), default=0.0)

    def seconds(self, op) -> float:
        base = self._link_seconds(op)
        if op.offloaded and op.kind in self.sparsecore_kinds:
            return base * self.sparsecore_factor
        return base

    def _link_seconds(self, op) -> float:
        if not op.groups:
            return 0.0
        n = group_size(op.kind, op.groups)
        moved = moved_bytes(op.kind, op.nbytes, n)
        if moved == 0:
            return 0.0
        if op.kind == "collective-permute":
            hops = max(self._group_geometry(tuple(sorted(set(p))))[2] for p in op.groups if p[0] != p[1])
            return moved * hops / self.link_bandwidth + self.step_latency
        members = next(g for g in op.groups if len(set(g)) > 1)
        links, mean_hops, _, steps = self._group_geometry(tuple(members))
        if op.kind in ("all-to-all", "ragged-all-to-all"):
            latency = (n - 1) * self.step_latency
            if self.all_to_all_link_model == "busiest_link":
                groups = tuple(tuple(g) for g in op.groups if len(set(g)) > 1)
                return op.nbytes / n * self.all_to_all_busiest_link(groups) / self.link_bandwidth + latency
            return moved * mean_hops / (self.link_bandwidth * links) + latency
        groups = tuple(tuple(g) for g in op.groups if len(set(g)) > 1)
        latency = steps * self.step_latency * (2 if op.kind == "all-reduce" else 1)
        if self.ring_dims == "per_dimension":
            return self.ring_seconds_per_dimension(groups, moved) + latency
        return moved / self.ring_bandwidth(groups) + latency


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
