"""Training data: embedded stdlib corpus, byte-level BPE, grain packing pipeline with checkpointable iterators.

    data = build_data_pipeline(DataConfig(seq_len=512, batch_size=8), workdir)   # stdlib + cached BPE
    it = iter(data.train_dataset())        # also data.eval_dataset(): one pass, last batch padded
    batch = next(it)                       # a `Batch` (glm5_jax/data/batch.py), a pytree of numpy arrays:
    batch.tokens         int32 [B, T]  token ids; padding is id 0
    batch.segment_ids    int32 [B, T]  1..n for the packed documents (chunks) of a row, 0 = padding
    batch.positions      int32 [B, T]  position inside the segment, restarting at 0
    batch.ahead(k)       the tokens k steps ahead and where they are valid targets (same segment)

B = batch_size // process_count rows per process. The iterator has get_state()/set_state() and
checkpoints with orbax as `grain.checkpoint.CheckpointSave(it)` / `CheckpointRestore(it)`.
"""
from glm5_jax.data.batch import Batch
from glm5_jax.data.config import STDLIB, DataConfig, DataError
from glm5_jax.data.corpus import Document, select_within_budget, split_train_eval, stdlib_documents
from glm5_jax.data.pipeline import (DataPipeline, build_data_pipeline, build_tokenizer, load_documents,
                                    make_dataset)
from glm5_jax.data.sources import DocumentReader, index_sources, write_token_records
from glm5_jax.data.tokenizer import Tokenizer, cached_bpe, load_tokenizer, train_bpe

__all__ = [
    "STDLIB", "Batch", "DataConfig", "DataError", "DataPipeline", "Document", "DocumentReader", "Tokenizer",
    "build_data_pipeline", "build_tokenizer", "cached_bpe", "index_sources", "load_documents",
    "load_tokenizer", "make_dataset", "select_within_budget", "split_train_eval", "stdlib_documents",
    "train_bpe", "write_token_records",
]
