"""User data sources: text files, directories, .jsonl and ArrayRecord files -> `Document`s; reading them back.

Paths are indexed once (jsonl lines are parsed and checked here, so a bad line fails at startup with
its file:line, not hours into training). Reading is lazy and thread-safe.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from typing import Sequence

import numpy as np

from glm5_jax import storage
from glm5_jax.data.config import STDLIB, DataError
from glm5_jax.data.corpus import Document, stdlib_documents

JSONL_SUFFIXES = (".jsonl",)
TOKEN_RECORD_SUFFIXES = (".arrayrecord", ".array_record")
TOKEN_DTYPE = np.dtype("<i4")  # pre-tokenized records: little-endian int32 token ids, one document each


def _index_text_file(path: str, key: str) -> list[Document]:
    size = storage.getsize(path)
    return [Document(key=key, path=path, kind="text", size=size)] if size else []


def _index_jsonl(path: str, key: str, text_field: str) -> list[Document]:
    docs, offset = [], 0
    with storage.path(path).open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise DataError(f"bad JSON at {where}: {e}") from None
                if not isinstance(record, dict) or text_field not in record:
                    raise DataError(f"{where}: line has no field {text_field!r} (set DataConfig.text_field)")
                if not isinstance(record[text_field], str):
                    raise DataError(f"{where}: field {text_field!r} is "
                                    f"{type(record[text_field]).__name__}, expected a string")
                if record[text_field]:
                    docs.append(Document(key=f"{key}:{lineno}", path=path, kind="jsonl",
                                         offset=offset, size=len(line)))
            offset += len(line)
    return docs


def _index_token_records(path: str, key: str) -> list[Document]:
    import grain  # deferred: grain pulls in a lot

    _check_local_records(path)
    count = len(grain.sources.ArrayRecordDataSource([path]))
    return [Document(key=f"{key}#{i}", path=path, kind="tokens", offset=i) for i in range(count)]


def _check_local_records(path: str) -> None:
    if storage.is_remote(path):
        raise DataError(f"ArrayRecord source {path}: array_record reads local files only (its reader opens "
                        f"paths with the C++ file API, which has no gs:// support); copy the records to a "
                        f"local disk, or use jsonl/text sources, which may be on gs://")


def _index_file(path: str, key: str, text_field: str) -> list[Document]:
    if path.endswith(JSONL_SUFFIXES):
        return _index_jsonl(path, key, text_field)
    if path.endswith(TOKEN_RECORD_SUFFIXES):
        return _index_token_records(path, key)
    return _index_text_file(path, key)


def _index_directory(root: str, text_field: str) -> list[Document]:
    docs = []
    for dirpath, dirnames, filenames in storage.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            path = storage.join(dirpath, name)
            rel = path[len(root.rstrip("/")) + 1:] if storage.is_remote(root) else \
                os.path.relpath(path, root).replace(os.sep, "/")
            docs.extend(_index_file(path, f"{root}/{rel}", text_field))
    return docs


def index_sources(sources: Sequence[str], text_field: str) -> list[Document]:
    """All documents of the given sources, in a deterministic order. Each source must hold some text."""
    docs = []
    for source in sources:
        if source == STDLIB:
            found = stdlib_documents()
        else:
            path = source.rstrip("/") if storage.is_remote(source) else os.path.normpath(source)
            if not storage.exists(path):
                raise DataError(f"data source path does not exist: {source}")
            if storage.isdir(path):
                found = _index_directory(path, text_field)
            else:
                found = _index_file(path, path, text_field)
            if not found:
                raise DataError(f"data source {source} holds no documents (empty files, directory or records)")
        logging.info("data: %d documents in source %s", len(found), source)
        docs.extend(found)
    if not docs:
        raise DataError("no documents: DataConfig.source is empty")
    return docs


class DocumentReader:
    """Loads a `Document`'s content: `str` for text and jsonl, int32 array for token records."""

    def __init__(self, text_field: str):
        self._text_field = text_field
        self._record_sources = {}  # path -> grain ArrayRecordDataSource, opened once
        self._lock = threading.Lock()

    def _token_record(self, doc: Document) -> np.ndarray:
        with self._lock:
            if doc.path not in self._record_sources:
                import grain

                self._record_sources[doc.path] = grain.sources.ArrayRecordDataSource([doc.path])
            source = self._record_sources[doc.path]
        raw = source[doc.offset]
        if len(raw) % TOKEN_DTYPE.itemsize:
            raise DataError(f"ArrayRecord {doc.key}: {len(raw)} bytes is not a whole number of int32 tokens")
        return np.frombuffer(raw, dtype=TOKEN_DTYPE).astype(np.int32)

    def read(self, doc: Document) -> str | np.ndarray:
        if doc.kind == "tokens":
            return self._token_record(doc)
        with storage.path(doc.path).open("rb") as f:
            if doc.kind == "text":
                # Invalid UTF-8 (a few stdlib test files are latin-1 on purpose) becomes U+FFFD.
                return f.read().decode("utf-8", errors="replace")
            f.seek(doc.offset)
            return json.loads(f.readline())[self._text_field]

    def texts(self, docs: Sequence[Document]):
        """Yields the text of every text/jsonl document, in order (for tokenizer training)."""
        for doc in docs:
            if doc.kind != "tokens":
                yield self.read(doc)


def write_token_records(path: str, documents: Sequence[Sequence[int]]) -> None:
    """Writes pre-tokenized documents as an ArrayRecord file that `index_sources` reads (one record each)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    _check_local_records(path)
    tmp = path + ".tmp"
    writer = ArrayRecordWriter(tmp, "group_size:1")
    try:
        for tokens in documents:
            writer.write(np.asarray(tokens, dtype=TOKEN_DTYPE).tobytes())
    finally:
        writer.close()
    os.replace(tmp, path)
