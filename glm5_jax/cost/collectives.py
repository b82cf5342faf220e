"""Who talks in a compiled collective: replica groups of the optimized HLO as partition ids, and the mesh
axes (and physical torus dims) a group spans.

XLA writes groups in three forms: explicit lists (``replica_groups={{0,2},{1,3}}``), iota lists
(``replica_groups=[2,2]<=[2,2]T(1,0)``: arange reshaped, transposed, cut into rows) and device meshes
(``replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}``: arange over that mesh, a group varies the
named axes). ``collective-permute`` gives ``source_target_pairs`` instead. An empty list means every
partition. With SPMD partitioning the ids are partition ids, i.e. positions in the executable's device
assignment, which for a jit over a `Mesh` is ``mesh.devices.flat``.
"""
from __future__ import annotations

import re

import numpy as np

_LIST = re.compile(r"(replica_groups|source_target_pairs)=\{((?:\{[0-9,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?)?\s*\{([^}]*)\}")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(perm) if perm else ids


def collective_groups(attrs: str, num_partitions: int) -> tuple | None:
    """Groups of partition ids (tuple of tuples) of one collective's attributes; None when unreadable."""
    m = _MESH.search(attrs)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        if not axes:
            return None
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        ids = _iota(_ints(m.group(2)), _ints(m.group(3)) or None).reshape(sizes) if m.group(2) else \
            np.arange(int(np.prod(sizes))).reshape(sizes)
        varying = re.findall(r"'(\w+)'", m.group(4))
        if any(v not in names for v in varying):
            return None
        keep = [i for i, n in enumerate(names) if n not in varying] + [names.index(v) for v in varying]
        group_size = int(np.prod([sizes[names.index(v)] for v in varying])) if varying else 1
        return tuple(tuple(int(i) for i in row) for row in ids.transpose(keep).reshape(-1, group_size))
    m = _IOTA.search(attrs)
    if m:
        shape = _ints(m.group(1))
        ids = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None).reshape(shape)
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape[0], -1))
    m = _LIST.search(attrs)
    if m:
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([0-9,]*)\}", m.group(2)))
        if m.group(1) == "replica_groups" and not groups:
            return (tuple(range(num_partitions)),)
        return groups
    if "replica_groups" not in attrs and "source_target_pairs" not in attrs:
        return (tuple(range(num_partitions)),)
    return None


def group_size(kind: str, groups) -> int:
    """Chips in one group (collective-permute: 2 when anything moves, else 1)."""
    if not groups:
        return 1
    if kind == "collective-permute":
        return 2 if any(a != b for a, b in groups) else 1
    return len(groups[0])


def spanned_axes(groups, axis_names, axis_sizes) -> tuple[str, ...]:
    """Mesh axes along which the members of the first group (collective-permute: the first pair that
    moves) differ; partition id p sits at np.unravel_index(p, axis_sizes)."""
    if not groups:
        return ()
    members = next((g for g in groups if len(set(g)) > 1), groups[0])
    coords = np.array([np.unravel_index(p, axis_sizes) for p in members])
    return tuple(a for i, a in enumerate(axis_names) if len(set(coords[:, i])) > 1)


def moved_bytes(kind: str, nbytes: int, n: int) -> float:
    """Bytes each chip sends (= receives) for one collective over groups of n chips, the standard ring /
    pairwise algorithms: all-gather result x (n-1)/n, reduce-scatter operand x (n-1)/n, all-reduce
    (reduce-scatter + all-gather) 2 x operand x (n-1)/n, all-to-all operand x (n-1)/n,
    collective-permute its operand."""
    if n <= 1:
        return 0.0
    if kind == "collective-permute":
        return float(nbytes)
    share = nbytes * (n - 1) / n
    return 2 * share if kind == "all-reduce" else share
