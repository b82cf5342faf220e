"""Training data: embedded stdlib corpus, byte-level BPE, grain packing pipeline with checkpointable iterators."""
from glm5_jax.data.config import STDLIB, DataConfig, DataError
from glm5_jax.data.corpus import Document, select_within_budget, split_train_eval, stdlib_documents
from glm5_jax.data.pipeline import (DataPipeline, build_data_pipeline, build_tokenizer, load_documents,
                                    make_dataset)
from glm5_jax.data.sources import DocumentReader, index_sources, write_token_records
from glm5_jax.data.tokenizer import Tokenizer, cached_bpe, load_tokenizer, train_bpe

__all__ = [
    "STDLIB", "DataConfig", "DataError", "DataPipeline", "Document", "DocumentReader", "Tokenizer",
    "build_data_pipeline", "build_tokenizer", "cached_bpe", "index_sources", "load_documents",
    "load_tokenizer", "make_dataset", "select_within_budget", "split_train_eval", "stdlib_documents",
    "train_bpe", "write_token_records",
]
