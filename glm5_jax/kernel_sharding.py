"""Running Pallas kernels under a mesh: wrap them in `shard_map` described by logical axis names.

Mosaic kernels cannot be partitioned automatically; on a mesh of more than one device they must run
per shard. Model code states each operand's logical axes ("batch", "act_heads", ...); this module
turns them into mesh axes with the sharding rules in context, so model code still never names a mesh.
"""
from __future__ import annotations

import flax.linen as nn
import jax


def _mesh_in_context():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty or mesh.size == 1 else mesh


def logical_shard_map(fn, in_axes, out_axes):
    """`fn` applied per shard when a multi-device mesh is in context, else `fn` itself.

    in_axes / out_axes: one tuple of logical axis names (or None) per operand / result.
    """
    def call(*args):
        mesh = _mesh_in_context()
        if mesh is None:
            return fn(*args)
        spec = lambda axes: nn.logical_to_mesh_axes(axes)   # rules from the enclosing nn.logical_axis_rules
        in_specs = tuple(spec(a) for a in in_axes)
        out_specs = tuple(spec(a) for a in out_axes) if isinstance(out_axes, tuple) and out_axes and \
            isinstance(out_axes[0], tuple) else spec(out_axes)
        # check_vma=False: Pallas calls do not carry varying-manual-axes types (JAX_NOTES §1.2).
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

    return call
