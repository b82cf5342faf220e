"""Running Pallas kernels under a mesh: wrap them in `shard_map` described by logical axis names.

Mosaic kernels cannot be partitioned automatically; on a mesh of more than one device they must run
per shard. Model code states each operand's logical axes ("batch", "act_heads", ...); this module
turns them into mesh axes with the sharding rules in context, so model code still never names a mesh.

A logical axis whose size does not divide over its mesh axes (an init batch of 1, a batch-1 decode or
eval batch on a data-parallel mesh) is not split: every shard along those mesh axes then runs the whole
axis (replicated work, the same result), instead of failing.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax


def _mesh_in_context():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty or mesh.size == 1 else mesh


def multi_device_mesh_in_context() -> bool:
    """Whether a mesh of more than one device is in context (Pallas calls must then run per shard)."""
    return _mesh_in_context() is not None


def _mesh_axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _indivisible_axes(mesh, args, in_axes) -> set[str]:
    """Logical axis names some operand cannot split evenly over the mesh axes the rules give them."""
    bad = set()
    for x, axes in zip(args, in_axes):
        for size, name, entry in zip(x.shape, axes, nn.logical_to_mesh_axes(axes)):
            shards = math.prod(mesh.shape[a] for a in _mesh_axes_of(entry))
            if name is not None and size % shards:
                bad.add(name)
    return bad


def logical_axis_shards(name: str) -> int:
    """How many shards the current mesh and rules split the logical axis ``name`` into (1 without a mesh)."""
    mesh = _mesh_in_context()
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in logical_mesh_axes(name))


def logical_mesh_axes(name: str) -> tuple[str, ...]:
    """The mesh axes the rules in context give the logical axis ``name`` (possibly none)."""
    spec = nn.logical_to_mesh_axes((name,))
    return _mesh_axes_of(spec[0] if spec is not None and len(spec) else None)


def logical_shard_start(name: str, local_size: int):
    """Inside a `logical_shard_map` body: the first index along the logical axis ``name`` that this shard holds,
    its ``local_size`` entries of that axis (shards in mesh order along the axis's mesh axes); 0 when the rules
    leave the axis unsplit."""
    axes = logical_mesh_axes(name)
    return jax.lax.axis_index(axes) * local_size if axes else 0


def all_gather_logical(x, name: str, axis: int):
    """Inside a `logical_shard_map` body: ``x`` gathered whole along ``axis``, the dimension the logical
    axis ``name`` split (shards concatenated in mesh order). Its transpose is a reduce-scatter."""
    axes = logical_mesh_axes(name)
    return jax.lax.all_gather(x, axes, axis=axis, tiled=True) if axes else x


def logical_shard_map(fn, in_axes, out_axes):
    """`fn` applied per shard when a multi-device mesh is in context, else `fn` itself.

    in_axes / out_axes: one tuple of logical axis names (or None) per operand / result (out_axes may
    also be a single tuple for a single result).
    """
    single_out = not (isinstance(out_axes, tuple) and out_axes and isinstance(out_axes[0], tuple))

    def call(*args):
        mesh = _mesh_in_context()
        if mesh is None:
            return fn(*args)
        unsplit = _indivisible_axes(mesh, args, in_axes)

        def spec(axes):   # rules from the enclosing nn.logical_axis_rules; unsplittable names replicated
            return nn.logical_to_mesh_axes(tuple(None if a in unsplit else a for a in axes))

        in_specs = tuple(spec(a) for a in in_axes)
        out_specs = spec(out_axes) if single_out else tuple(spec(a) for a in out_axes)
        # check_vma=False: Pallas calls carry no varying-manual-axes types, so the checker cannot type them
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

    return call


def logical_pmean(x, logical_axis: str):
    """Inside a `logical_shard_map` function: the mean of ``x`` over the shards of ``logical_axis`` (the
    mesh axes the rules give it), e.g. a per-head-shard mean made whole over the heads. Outside a
    multi-device mesh, or for an axis the rules leave unsharded, ``x`` itself."""
    if _mesh_in_context() is None:
        return x
    axes = logical_mesh_axes(logical_axis)
    return jax.lax.pmean(x, axes) if axes else x
