"""Documents and the embedded default corpus: the Python standard library's own .py files.

A `Document` is a reference (where to read it), not its text, so corpora of any size cost only a list
of small records. Subsetting (byte budget) and the eval split are deterministic functions of each
document's `key`, so every process and every run agrees on them without coordination.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sysconfig
from typing import Literal, Sequence

from glm5_jax.data.config import DataError

DocumentKind = Literal["text", "jsonl", "tokens"]


@dataclasses.dataclass(frozen=True)
class Document:
    key: str            # stable identity: eval split, byte budget and tokenizer-cache fingerprint use it
    path: str           # file holding the document
    kind: DocumentKind  # text: whole file; jsonl: one line; tokens: one ArrayRecord record of int32
    offset: int = 0     # jsonl: byte offset of the line; tokens: record index
    size: int = -1      # bytes of text (jsonl: of the line); -1 when unknown (tokens)


def stable_hash(text: str, salt: str) -> int:
    """64-bit hash that is the same on every machine and Python run (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(f"{salt}:{text}".encode(), digest_size=8).digest(), "little")


def stdlib_root() -> str:
    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def stdlib_documents() -> list[Document]:
    """Every non-empty .py file of the standard library, sorted by relative path.

    Third-party code (site-/dist-packages) and anything whose real path leaves the stdlib folder
    (symlinks) is excluded.
    """
    root = stdlib_root()
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            real = os.path.realpath(path)
            if not real.startswith(root + os.sep) or not os.path.isfile(real):
                continue
            size = os.path.getsize(real)
            if size == 0:  # empty __init__.py files carry no text
                continue
            docs.append(Document(key="stdlib/" + os.path.relpath(path, root).replace(os.sep, "/"),
                                 path=real, kind="text", size=size))
    docs.sort(key=lambda d: d.key)
    if not docs:
        raise DataError(f"no .py files found under the stdlib folder {root}")
    return docs


def select_within_budget(docs: Sequence[Document], max_bytes: int | None) -> list[Document]:
    """A deterministic, spread-out subset of at most `max_bytes` of text, in the input order.

    Documents are considered in stable-hash order (so a budget samples the whole corpus, not its
    alphabetical start) and taken while they fit.
    """
    if max_bytes is None:
        return list(docs)
    if any(d.size < 0 for d in docs):
        raise DataError("max_corpus_bytes cannot be applied to ArrayRecord (pre-tokenized) sources: "
                        "their sizes are unknown; set max_corpus_bytes=None")
    chosen, total = set(), 0
    for i in sorted(range(len(docs)), key=lambda i: stable_hash(docs[i].key, "budget")):
        if total + docs[i].size <= max_bytes:
            chosen.add(i)
            total += docs[i].size
    if not chosen:
        smallest = min(d.size for d in docs)
        raise DataError(f"max_corpus_bytes={max_bytes} is smaller than the smallest document ({smallest} bytes)")
    return [d for i, d in enumerate(docs) if i in chosen]


def split_train_eval(docs: Sequence[Document], eval_fraction: float,
                     min_eval_docs: int) -> tuple[list[Document], list[Document]]:
    """(train, eval): eval is the ceil(fraction * n) (at least min_eval_docs) documents of smallest hash;
    eval_fraction 0: no eval documents."""
    if eval_fraction <= 0:
        return list(docs), []
    n_eval = max(math.ceil(eval_fraction * len(docs)), min_eval_docs)
    if n_eval >= len(docs):
        raise DataError(f"the eval split needs {n_eval} documents but the corpus has only {len(docs)}: add data, "
                        f"or train without eval: --set=data.eval_fraction=0")
    eval_ids = set(sorted(range(len(docs)), key=lambda i: stable_hash(docs[i].key, "eval"))[:n_eval])
    train = [d for i, d in enumerate(docs) if i not in eval_ids]
    held_out = [d for i, d in enumerate(docs) if i in eval_ids]
    return train, held_out
