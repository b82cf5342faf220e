"""`--mesh` parsing, and where each converted leaf lives on that mesh.

The rules are the project's one table (`glm5_jax.parallel.mesh.DEFAULT_RULES`), so a converted checkpoint
is laid out as training lays it out. The converter's mesh may name only some axes (``fsdp:4,expert:2``):
a logical axis takes those of its mesh axes that the mesh has, that the leaf does not use already and
whose sizes divide the dimension; a dimension left with none is replicated.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding

from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.parallel.mesh import DEFAULT_RULES


def parse_mesh(spec: str | None) -> jax.sharding.Mesh | None:
    """``"fsdp:4,expert:2"`` -> a Mesh (Auto axes) over the first 8 devices; empty -> None."""
    if not spec:
        return None
    try:
        axes = [(name.strip(), int(size)) for name, size in (part.split(":") for part in spec.split(","))]
    except ValueError:
        raise CheckpointError(f"--mesh={spec!r}: expected comma-separated axis:size pairs, e.g. fsdp:4,expert:2") from None
    n = math.prod(size for _, size in axes)
    if n > jax.device_count() or n < 1:
        raise CheckpointError(f"--mesh={spec!r} needs {n} devices, {jax.device_count()} available")
    names = tuple(name for name, _ in axes)
    return jax.make_mesh(tuple(size for _, size in axes), names, axis_types=(AxisType.Auto,) * len(axes),
                         devices=jax.devices()[:n])


def leaf_sharding(mesh, shape, logical_axes, rules=DEFAULT_RULES):
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    rule = {}
    for name, axes in rules:                  # first match wins, as in Flax
        rule.setdefault(name, axes)
    spec, used = [], set()
    for dim, name in zip(shape, logical_axes):
        wanted = rule.get(name)
        wanted = () if wanted is None else (wanted,) if isinstance(wanted, str) else tuple(wanted)
        taken, shards = [], 1
        for axis in wanted:
            if axis in mesh.shape and axis not in used and dim % (shards * mesh.shape[axis]) == 0:
                taken.append(axis)
                shards *= mesh.shape[axis]
        used.update(taken)
        spec.append(None if not taken else taken[0] if len(taken) == 1 else tuple(taken))
    return NamedSharding(mesh, PartitionSpec(*spec))
