"""The training/eval data pipeline: config -> documents -> tokenizer -> checkpointable grain iterators.

    data = build_data_pipeline(DataConfig(seq_len=512, batch_size=8), workdir)
    it = iter(data.train_dataset())          # grain DatasetIterator: get_state()/set_state(),
    batch = next(it)                         # or grain.checkpoint.CheckpointSave(it) inside orbax
    batch.tokens, batch.segment_ids, batch.positions      # a `Batch`: int32 [B, T] each

Per process: documents are shuffled globally (a fresh permutation each epoch, same on every process),
then loader shard s of S (DataConfig.loader_shards; default one per process) takes every S-th one starting
at s, tokenizes it, appends EOS, cuts it into seq_len chunks and packs the chunks into rows. Each process
runs its S / process_count shards and puts their rows side by side. Eval batches are packed from all eval
documents in every process, which keeps its own rows.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Sequence

import grain
import jax
import numpy as np

from glm5_jax.data.config import DataConfig, DataError
from glm5_jax.data.corpus import Document, select_within_budget, split_train_eval
from glm5_jax.data.packing import pack_and_batch
from glm5_jax.data.sort_task import SORT, SortPipeline
from glm5_jax.data.sources import DocumentReader, index_sources
from glm5_jax.data.tokenizer import Tokenizer, bpe_settings, cached_bpe, load_tokenizer


class TokenizeDocument(grain.transforms.Map):
    """Document -> int32 token ids with the EOS id appended."""

    def __init__(self, reader: DocumentReader, tokenizer: Tokenizer):
        self.reader = reader
        self.tokenizer = tokenizer

    def map(self, doc: Document) -> np.ndarray:
        content = self.reader.read(doc)
        if isinstance(content, str):
            ids = self.tokenizer.encode(content)
        else:
            ids = content
            bad = (ids < 0) | (ids >= self.tokenizer.vocab_size)
            if bad.any():
                raise DataError(f"ArrayRecord {doc.key}: token id {int(ids[bad][0])} is outside the "
                                f"tokenizer's vocabulary [0, {self.tokenizer.vocab_size})")
        return np.append(ids, np.int32(self.tokenizer.eos_id)).astype(np.int32)


def resolve_process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    """(index, count), defaulting to this JAX process."""
    if process_index is None or process_count is None:
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} is not in [0, process_count={process_count})")
    return process_index, process_count


def load_documents(config: DataConfig) -> tuple[list[Document], list[Document]]:
    """(train, eval) documents of the configured sources, after the byte budget."""
    config.validate()
    docs = select_within_budget(index_sources(config.sources, config.text_field, config.text_document_bytes),
                                config.max_corpus_bytes)
    return split_train_eval(docs, config.eval_fraction, config.min_eval_docs)


def corpus_fingerprint(docs: Sequence[Document]) -> str:
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(f"{doc.key}\t{doc.size}\n".encode())
    return digest.hexdigest()


def build_tokenizer(config: DataConfig, workdir: str, train_docs: Sequence[Document],
                    show_progress: bool = True) -> Tokenizer:
    """The user's tokenizer, or the byte-level BPE trained on `train_docs` (cached in workdir/tokenizer)."""
    if config.tokenizer_path is not None:
        return load_tokenizer(config.tokenizer_path, config.eos_token)
    text_docs = [d for d in train_docs if d.kind != "tokens"]
    if not text_docs:
        raise DataError("no text to train a tokenizer on (pre-tokenized ArrayRecord sources only): "
                        "set DataConfig.tokenizer_path to the tokenizer that produced the records")
    reader = DocumentReader(config.text_field)
    return cached_bpe(os.path.join(workdir, "tokenizer"),
                      bpe_settings(config.vocab_size, corpus_fingerprint(text_docs)),
                      texts=lambda: reader.texts(text_docs), num_texts=len(text_docs),
                      show_progress=show_progress)


def make_dataset(config: DataConfig, documents: Sequence[Document], tokenizer: Tokenizer, *, train: bool,
                 process_index: int | None = None, process_count: int | None = None) -> grain.IterDataset:
    """Batches of packed rows from `documents`.

    train=True: shuffled (if config.shuffle), config.num_epochs passes (None = forever), full batches
    only. train=False: one pass in corpus order; the last batch is padded with empty rows.
    """
    config.validate()
    process_index, process_count = resolve_process(process_index, process_count)
    config.per_process_batch(process_count)
    if not documents:
        raise DataError(f"no {'training' if train else 'eval'} documents "
                        f"(eval_fraction={config.eval_fraction}, source={config.source})")
    if not train:
        # every process packs all eval documents and keeps its rows: the same number of batches everywhere
        # (the eval step is collective) and the same global batches for any process count
        rows = config.per_process_batch(process_count)
        lo = process_index * rows
        return _loader_shard(config, documents, tokenizer, False, 0, 1).map(
            lambda batch: jax.tree.map(lambda x: x[lo:lo + rows], batch))
    shards, total = config.shards_of_process(process_index, process_count)
    parts = [_loader_shard(config, documents, tokenizer, train, s, total) for s in shards]
    if len(parts) == 1:
        return parts[0]
    # several loader shards in this process: their rows side by side, in shard order
    return grain.experimental.ZipIterDataset(parts).map(
        lambda batches: jax.tree.map(lambda *xs: np.concatenate(xs), *batches))


def _loader_shard(config, documents, tokenizer, train, shard, num_shards) -> grain.IterDataset:
    batch_size = config.batch_size // num_shards
    shuffle = train and config.shuffle
    docs = grain.MapDataset.source(list(documents))
    if shuffle:
        docs = docs.seed(config.seed).shuffle()  # shuffle before repeat: a new permutation every epoch
    docs = docs.repeat(config.num_epochs if train else 1)
    # Slicing after the global shuffle: shards see disjoint documents that together cover each epoch.
    docs = docs[shard::num_shards]
    tokens = docs.map(TokenizeDocument(DocumentReader(config.text_field), tokenizer)).to_iter_dataset(
        grain.ReadOptions(num_threads=config.read_threads, prefetch_buffer_size=config.prefetch_buffer))
    return pack_and_batch(tokens, seq_len=config.seq_len, batch_size=batch_size,
                          packing_bins=config.packing_bins or max(2 * batch_size, 16),
                          seed=config.seed + shard, shuffle_rows=shuffle, drop_remainder=train)


@dataclasses.dataclass(frozen=True)
class DataPipeline:
    config: DataConfig
    tokenizer: Tokenizer
    train_documents: tuple[Document, ...]
    eval_documents: tuple[Document, ...]
    process_index: int
    process_count: int

    @property
    def has_eval(self) -> bool:
        """Whether there are eval documents (none with eval_fraction=0)."""
        return bool(self.eval_documents)

    def train_dataset(self) -> grain.IterDataset:
        return make_dataset(self.config, self.train_documents, self.tokenizer, train=True,
                            process_index=self.process_index, process_count=self.process_count)

    def eval_dataset(self) -> grain.IterDataset:
        return make_dataset(self.config, self.eval_documents, self.tokenizer, train=False,
                            process_index=self.process_index, process_count=self.process_count)


def build_data_pipeline(config: DataConfig, workdir: str, *, process_index: int | None = None,
                        process_count: int | None = None, show_progress: bool = True,
                        documents: tuple[Sequence[Document], Sequence[Document]] | None = None
                        ) -> DataPipeline | SortPipeline:
    """Indexes the sources, splits train/eval, loads or trains the tokenizer. Cheap after the first run.
    `documents`: the (train, eval) documents `load_documents(config)` already returned."""
    process_index, process_count = resolve_process(process_index, process_count)
    config.per_process_batch(process_count)  # fail early on an indivisible batch
    if config.source == SORT:                # generated task: fixed vocabulary, no documents
        return SortPipeline(config, process_index, process_count)
    train_docs, eval_docs = documents if documents is not None else load_documents(config)
    tokenizer = build_tokenizer(config, workdir, train_docs, show_progress)
    return DataPipeline(config, tokenizer, tuple(train_docs), tuple(eval_docs), process_index, process_count)
