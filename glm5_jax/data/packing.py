"""Token documents -> fixed-length packed rows -> `Batch`es (tokens, segment_ids, positions).

A document longer than seq_len is cut into seq_len-long chunks (each its own segment, positions
restarting at 0), so no token is dropped. Chunks are packed first-fit into rows by grain; rows are
batched; the last eval batch is padded with empty rows so every batch has the same shape.
"""
from __future__ import annotations

import logging

import grain
import grain.experimental as gx
import numpy as np

from glm5_jax.data.batch import Batch


class ChunkDocument(grain.experimental.FlatMapTransform):
    """int32 tokens [L] -> [{"tokens": tokens[i:i+seq_len]}, ...] covering all L tokens."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.max_fan_out = 1 << 30  # only a hint for grain's iter flat-map; documents can be long

    def flat_map(self, tokens: np.ndarray):
        return [{"tokens": tokens[i:i + self.seq_len]} for i in range(0, len(tokens), self.seq_len)]


class FormatBatch(grain.transforms.Map):
    """grain's packed rows -> a `Batch`; pads a short (final eval) batch with empty rows to batch_size."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self._logged = False

    def map(self, packed: dict) -> Batch:
        batch = Batch.from_rows(packed["tokens"], packed["tokens_segment_ids"], packed["tokens_positions"],
                                self.batch_size)
        if not self._logged:
            self._logged = True
            logging.info("data: first packed batch %s ready, %.1f%% padding",
                         batch.shape, 100.0 * float(np.mean(batch.segment_ids == 0)))
        return batch


def pack_and_batch(documents: grain.IterDataset, *, seq_len: int, batch_size: int, packing_bins: int,
                   seed: int, shuffle_rows: bool, drop_remainder: bool) -> grain.IterDataset:
    """`documents` yields int32 token arrays (EOS included); returns an IterDataset of `Batch`es."""
    chunks = gx.FlatMapIterDataset(documents, ChunkDocument(seq_len))
    rows = gx.FirstFitPackIterDataset(chunks, length_struct={"tokens": seq_len},
                                      num_packing_bins=packing_bins, seed=seed, shuffle_bins=shuffle_rows)
    return rows.batch(batch_size, drop_remainder=drop_remainder).map(FormatBatch(batch_size))
