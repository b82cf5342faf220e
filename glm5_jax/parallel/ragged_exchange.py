"""A ragged all-to-all over mesh axes (the semantics of `jax.lax.ragged_all_to_all`) by impl:

* ``"native"``: the collective itself (XLA:TPU and XLA:GPU compile it; each slice moves only its rows);
* ``"dense"``: the same exchange from one dense `all_to_all` of per-peer slabs [peers, rows, ...] and a scatter
  of the received slices into place. XLA:CPU has no ragged-all-to-all, so the CPU tests run this; it moves
  ``peers`` x the operand's rows and is no model of the native collective's cost.

The caller, one of ``peers`` members of ``axis_name``, sends ``operand[input_offsets[j] : + send_sizes[j]]``
to member j, where it lands at ``output_offsets[j]`` of j's ``output``; it receives ``recv_sizes[s]`` rows from
each member s, written where s's ``output_offsets`` say; ``output``'s other rows keep their values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

RAGGED_EXCHANGES = ("native", "dense")


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                      impl: str):
    """``output`` with the rows the members sent written in (module docstring); one slice per member (the
    offsets and sizes [peers] int32)."""
    if impl == "native":
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axis_name)
    if impl != "dense":
        raise ValueError(f"ragged_all_to_all: unknown impl {impl!r}; choose one of {RAGGED_EXCHANGES}")
    peers, rows, out_rows = input_offsets.shape[0], operand.shape[0], output.shape[0]
    i = jnp.arange(rows, dtype=jnp.int32)
    lead = lambda m: m.reshape(m.shape + (1,) * (operand.ndim - 1))        # noqa: E731  [peers, rows] -> rows' dims
    # slab[j, i]: row i of the slice for member j (zero past its size)
    slab = operand.at[input_offsets[:, None] + i[None, :]].get(mode="fill", fill_value=0)
    slab = jnp.where(lead(i[None, :] < send_sizes[:, None]), slab, jnp.zeros((), operand.dtype))
    to_peers = lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True)   # noqa: E731  row s: from member s
    received, landing = to_peers(slab), to_peers(output_offsets.astype(jnp.int32))
    dest = jnp.where(i[None, :] < recv_sizes[:, None], landing[:, None] + i[None, :], out_rows)   # past: dropped
    return output.at[dest.reshape(-1)].set(received.reshape(peers * rows, *operand.shape[1:]), mode="drop")
