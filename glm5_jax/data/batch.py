"""`Batch`: the rows the data pipelines yield and the train step takes (a pytree of int32 [B, T] arrays).

    tokens       token ids; padding is id 0
    segment_ids  1..n for the packed documents (chunks) of a row, 0 = padding
    positions    position inside the segment, restarting at 0

On the host the fields are numpy arrays (`Batch.from_rows` builds them); on devices, sharded jax arrays.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Batch:
    tokens: np.ndarray            # int32 [B, T]
    segment_ids: np.ndarray       # int32 [B, T]
    positions: np.ndarray         # int32 [B, T]

    @classmethod
    def from_rows(cls, tokens, segment_ids, positions, num_rows: int | None = None) -> Batch:
        """A host batch of int32 arrays, padded with empty rows (padding tokens, segment 0) to `num_rows`."""
        fields = (tokens, segment_ids, positions)
        short = 0 if num_rows is None else num_rows - tokens.shape[0]
        if short:
            fields = [np.concatenate([x, np.zeros((short, x.shape[1]), x.dtype)]) for x in fields]
        return cls(*(np.asarray(x).astype(np.int32, copy=False) for x in fields))

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T)."""
        return self.tokens.shape

    def ahead(self, k: int):
        """(the tokens k steps ahead, where they are valid targets) [B, T] in this batch's order: a target
        is valid when t and t + k hold the same non-padding segment. The last k positions get token 0."""
        T = self.tokens.shape[1]
        tokens = jnp.pad(self.tokens[:, k:], ((0, 0), (0, min(k, T))))
        later_segment = jnp.pad(self.segment_ids[:, k:], ((0, 0), (0, min(k, T))))
        return tokens, (self.segment_ids > 0) & (later_segment == self.segment_ids)
