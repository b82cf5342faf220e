"""`--mesh` parsing and the logical-axis -> mesh-axis rules the converter shards leaves with.

`LOGICAL_RULES` is a converter-local default (a project-wide rules table will replace it): a logical
axis maps to its mesh axis only when the mesh has that axis, the axis is not already used by the leaf,
and it divides the dimension; otherwise the dimension is replicated.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding

from glm5_jax.checkpoint.errors import CheckpointError

LOGICAL_RULES = (
    ("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"), ("mlp_moe", "tensor"), ("exp", "expert"),
    ("heads", "tensor"), ("index_heads", "tensor"), ("layers", None), ("q_lora", None), ("kv_lora", None),
    ("kv", None), ("index_dim", None), ("mtp_concat", None),
)


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


def leaf_sharding(mesh, shape, logical_axes, rules=LOGICAL_RULES):
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    rule = dict(rules)
    spec, used = [], set()
    for dim, name in zip(shape, logical_axes):
        axis = rule.get(name)
        if axis in mesh.shape and axis not in used and dim % mesh.shape[axis] == 0:
            spec.append(axis)
            used.add(axis)
        else:
            spec.append(None)
    return NamedSharding(mesh, PartitionSpec(*spec))
