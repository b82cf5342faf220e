"""User data sources: text files, directories, globs, .jsonl and ArrayRecord files -> `Document`s; reading them back.

A source is "stdlib", a file, a directory (walked recursively, hidden entries skipped) or a local glob
(``~/notes/*.md``, ``docs/**/*.md``: expanded here, not by the shell; ``**`` crosses folders). A plain text
file longer than twice ``text_document_bytes`` is cut into several documents (`text_pieces`), so that one long
file still has documents to hold out for eval.

Paths are indexed once (jsonl lines are parsed and checked here, so a bad line fails at startup with
its file:line, not hours into training). Reading is lazy and thread-safe.
"""
from __future__ import annotations

import glob
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


GLOB_CHARS = "*?["


def text_pieces(f, size: int, target: int | None) -> list[tuple[int, int]]:
    """(offset, length) of the documents a text file of `size` bytes (open binary `f`) is cut into.

    With `target` None, or `size` <= 2 * target: the whole file. Otherwise consecutive pieces of target to
    2 * target bytes (the last may be shorter), each ending after the first paragraph break (a blank line)
    past `target` bytes, else after the first line break, else at 2 * target bytes on a UTF-8 character
    boundary. Cut points depend only on the bytes, so every run and process agrees on them.
    """
    if target is None or size <= 2 * target:
        return [(0, size)]
    pieces, start, buf, pos, eof = [], 0, b"", 0, False
    while True:
        if not eof and len(buf) - pos <= 2 * target:   # the cut below may look at byte 2 * target
            block = f.read(max(1 << 20, 2 * target))
            eof = not block
            buf, pos = buf[pos:] + block, 0
            continue
        rest = len(buf) - pos
        if rest == 0:
            return pieces
        if eof and rest <= 2 * target:
            pieces.append((start, rest))
            return pieces
        window = buf[pos + target - 1:pos + 2 * target]     # a cut lands after byte target - 1 at the earliest
        at = window.find(b"\n\n")
        cut = target + at + 1 if at >= 0 else -1
        if cut < 0:
            at = window.find(b"\n")
            cut = target + at if at >= 0 else 2 * target
            while at < 0 and cut > target and buf[pos + cut] & 0xC0 == 0x80:   # not inside a UTF-8 character
                cut -= 1
        pieces.append((start, cut))
        start, pos = start + cut, pos + cut


def _index_text_file(path: str, key: str, text_document_bytes: int | None) -> list[Document]:
    size = storage.getsize(path)
    if not size:
        return []
    if text_document_bytes is None or size <= 2 * text_document_bytes:
        return [Document(key=key, path=path, kind="text", size=size)]
    with storage.path(path).open("rb") as f:
        pieces = text_pieces(f, size, text_document_bytes)
    return [Document(key=f"{key}@{offset}", path=path, kind="text", offset=offset, size=length)
            for offset, length in pieces]


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


def _index_file(path: str, key: str, text_field: str, text_document_bytes: int | None) -> list[Document]:
    if path.endswith(JSONL_SUFFIXES):
        return _index_jsonl(path, key, text_field)
    if path.endswith(TOKEN_RECORD_SUFFIXES):
        return _index_token_records(path, key)
    return _index_text_file(path, key, text_document_bytes)


def _index_directory(root: str, text_field: str, text_document_bytes: int | None) -> list[Document]:
    docs = []
    for dirpath, dirnames, filenames in storage.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            path = storage.join(dirpath, name)
            rel = path[len(root.rstrip("/")) + 1:] if storage.is_remote(root) else \
                os.path.relpath(path, root).replace(os.sep, "/")
            docs.extend(_index_file(path, f"{root}/{rel}", text_field, text_document_bytes))
    return docs


def _index_path(path: str, text_field: str, text_document_bytes: int | None) -> list[Document]:
    if storage.isdir(path):
        return _index_directory(path, text_field, text_document_bytes)
    return _index_file(path, path, text_field, text_document_bytes)


def _index_glob(source: str, text_field: str, text_document_bytes: int | None) -> list[Document]:
    if storage.is_remote(source):
        raise DataError(f"data source {source}: glob patterns are expanded on local paths only; name the "
                        f"gs:// directory or file instead")
    matches = sorted(os.path.normpath(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
    if not matches:
        raise DataError(f"data source {source} matches no files")
    return [d for path in matches for d in _index_path(path, text_field, text_document_bytes)]


def index_sources(sources: Sequence[str], text_field: str, text_document_bytes: int | None = None) -> list[Document]:
    """All documents of the given sources, in a deterministic order. Each source must hold some text.
    `text_document_bytes`: the size long text files are cut at (`text_pieces`); None keeps each file whole."""
    docs = []
    for source in sources:
        if source == STDLIB:
            found = stdlib_documents()
        elif any(c in source for c in GLOB_CHARS):
            found = _index_glob(source, text_field, text_document_bytes)
        else:
            path = source.rstrip("/") if storage.is_remote(source) else os.path.normpath(os.path.expanduser(source))
            if not storage.exists(path):
                raise DataError(f"data source path does not exist: {source}")
            found = _index_path(path, text_field, text_document_bytes)
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
            f.seek(doc.offset)
            if doc.kind == "text":          # the whole file, or one piece of a long one
                # Invalid UTF-8 (a few stdlib test files are latin-1 on purpose) becomes U+FFFD.
                return f.read(doc.size if doc.size >= 0 else -1).decode("utf-8", errors="replace")
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
