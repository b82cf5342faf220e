"""Sparse MLA attention behind an ``impl`` switch ("xla" is the reference; kernels plug in here)."""
from pallas_kernels.sparse_mla import reference

IMPLS = ("xla",)


def sparse_mla(q_BTHC, kv_BSC, idx_BTK, valid_BTK, *, scale, v_dim, impl="xla"):
    if impl == "xla":
        return reference.sparse_mla(q_BTHC, kv_BSC, idx_BTK, valid_BTK, scale=scale, v_dim=v_dim)
    raise ValueError(f"sparse_mla: unknown impl {impl!r}; choose one of {IMPLS}")
