"""DataConfig: everything that decides which tokens the trainer sees."""
from __future__ import annotations

import dataclasses

STDLIB = "stdlib"  # source name of the embedded corpus (the Python standard library's .py files)


class DataError(ValueError):
    """Bad data input: a missing path, an empty source, a malformed record, an impossible setting."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # "stdlib", or paths: text files, directories (walked recursively), local globs ('~/notes/*.md',
    # 'docs/**/*.md'; expanded by the pipeline), *.jsonl, *.arrayrecord; gs:// files and directories.
    # "stdlib" may also appear as one item of a tuple of paths. "sort": the generated sorting task
    # (data/sort_task.py; its own fixed vocabulary, vocab_size and the document settings are unused).
    source: str | tuple[str, ...] = STDLIB
    text_field: str = "text"           # field holding the document in each .jsonl line
    # a plain text file longer than 2x this is cut into documents of this size or a little more, each
    # ending at a paragraph (blank line) or line break (data/sources.py text_pieces): one long file still
    # has documents to hold out for eval; None: one document per file
    text_document_bytes: int | None = 8192
    tokenizer_path: str | None = None  # tokenizer.json; None: train (or reuse) a byte-level BPE in the workdir
    vocab_size: int = 4096             # size of the trained BPE (ignored with tokenizer_path)
    eos_token: str = "<|endoftext|>"   # end-of-document token appended to every document
    seq_len: int = 512                 # T of a packed row
    batch_size: int = 8                # global batch; each process yields batch_size // process_count rows
    seed: int = 0
    eval_fraction: float = 0.02        # share of documents held out for eval (by a stable hash of their key);
    #                                    0: no eval
    min_eval_docs: int = 4             # ...but at least this many (when eval_fraction > 0)
    max_corpus_bytes: int | None = None  # keep a deterministic subset of text documents of at most this size
    shuffle: bool = True               # shuffle documents (per epoch) and packed rows; training only
    num_epochs: int | None = None      # training passes over the data; None: repeat forever
    packing_bins: int | None = None    # rows packed at once (first-fit); None: max(2 * per-process batch, 16)
    read_threads: int = 2              # grain threads that read and tokenize documents
    prefetch_buffer: int = 16          # documents read ahead per process
    # Loader shards: the documents are split over this many independent packers, each yielding
    # batch_size // loader_shards rows; every process runs loader_shards // process_count of them.
    # 0: one per process. A fixed value makes the global batches independent of the process count.
    loader_shards: int = 0

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,) if isinstance(self.source, str) else tuple(self.source)

    def per_process_batch(self, process_count: int) -> int:
        if process_count < 1:
            raise DataError(f"process_count must be >= 1, got {process_count}")
        if self.batch_size % process_count:
            raise DataError(
                f"batch_size={self.batch_size} is not divisible by process_count={process_count}: "
                "every process must yield the same number of rows")
        self.shards_of_process(0, process_count)          # checks loader_shards
        return self.batch_size // process_count

    def shards_of_process(self, process_index: int, process_count: int) -> tuple[range, int]:
        """(loader shards this process runs, total loader shards)."""
        total = self.loader_shards or process_count
        if total % process_count or self.batch_size % total:
            raise DataError(f"DataConfig.loader_shards={total} must be a multiple of process_count="
                            f"{process_count} and divide batch_size={self.batch_size}")
        per = total // process_count
        return range(process_index * per, (process_index + 1) * per), total

    def validate(self) -> None:
        if not self.sources:
            raise DataError("DataConfig.source is empty: give 'stdlib' or at least one path")
        for name in ("seq_len", "batch_size", "read_threads", "prefetch_buffer"):
            if getattr(self, name) < 1:
                raise DataError(f"DataConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.tokenizer_path is None and self.vocab_size < 512:
            raise DataError(f"DataConfig.vocab_size={self.vocab_size} is too small for a byte-level BPE "
                            "(256 byte tokens + specials + merges); use >= 512")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise DataError(f"DataConfig.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.min_eval_docs < 0:
            raise DataError(f"DataConfig.min_eval_docs must be >= 0, got {self.min_eval_docs}")
        if self.text_document_bytes is not None and self.text_document_bytes < 1:
            raise DataError(f"DataConfig.text_document_bytes must be >= 1 or None, got {self.text_document_bytes}")
        if self.max_corpus_bytes is not None and self.max_corpus_bytes < 1:
            raise DataError(f"DataConfig.max_corpus_bytes must be >= 1 or None, got {self.max_corpus_bytes}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise DataError(f"DataConfig.num_epochs must be >= 1 or None, got {self.num_epochs}")
        if self.loader_shards < 0:
            raise DataError(f"DataConfig.loader_shards must be >= 0, got {self.loader_shards}")
        if self.packing_bins is not None and self.packing_bins < 1:
            raise DataError(f"DataConfig.packing_bins must be >= 1 or None, got {self.packing_bins}")
        if not self.text_field:
            raise DataError("DataConfig.text_field is empty")
