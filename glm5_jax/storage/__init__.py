"""Paths that are local or object-storage URLs (``gs://bucket/...``), through one abstraction: `etils.epath`,
the path type orbax and grain use. Each helper takes a ``str`` or path and keeps the local behaviour exactly
(absolute paths, atomic renames, fsync); on object storage it uses what the store guarantees instead:

* one object upload is atomic: readers see the whole object or none, and a killed upload leaves no object
  (`write_atomically`, `open_for_write`, which discards the upload when the block raises);
* there is no rename and no append, so a directory is published by writing its commit file last
  (`publish_dir`) and a log is kept as parts, each rewritten whole (`JsonlLog`).

Listings are never cached: several processes poll the same prefixes (fsspec's GCS listing cache would
hide objects another process wrote).
"""
from glm5_jax.storage.paths import (absolute, basename, dirname, exists, getsize, glob, is_remote,
                                    isdir, isfile, join, listdir, makedirs, path, read_bytes, read_text,
                                    remove, rmtree, walk)
from glm5_jax.storage.atomic import (copy_file, make_temporary_dir, move, open_for_write, publish_dir,
                                     write_atomically)
from glm5_jax.storage.jsonl_log import JsonlLog, read_jsonl

__all__ = ["absolute", "basename", "copy_file", "dirname", "exists", "getsize", "glob", "is_remote", "isdir",
           "isfile", "join", "listdir", "make_temporary_dir", "makedirs", "move", "path", "read_bytes", "read_text",
           "remove", "rmtree", "walk", "open_for_write", "publish_dir", "write_atomically", "JsonlLog", "read_jsonl"]
