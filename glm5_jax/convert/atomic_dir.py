"""Write a directory under a temporary sibling name and publish it as the output only on success
(locally by rename; on object storage by copying with its commit file last, see storage.publish_dir)."""
from __future__ import annotations

import contextlib
import os
import tempfile
import uuid

from glm5_jax import storage
from glm5_jax.checkpoint.errors import CheckpointError


def check_output_dir(out_dir: str, overwrite: bool) -> None:
    if storage.exists(out_dir) and not overwrite:
        raise CheckpointError(f"output directory {out_dir} already exists; pass --overwrite to replace it")


@contextlib.contextmanager
def atomic_output_dir(out_dir: str, overwrite: bool, commit_file: str = "config.json",
                      stage_locally: bool = False, extra_commit_files: tuple[str, ...] = ()):
    """Yields a fresh temporary directory next to `out_dir`; on a clean exit it replaces `out_dir`,
    on any exception it is deleted and `out_dir` is left as it was. `commit_file` (relative to the
    output) is what readers require before taking the output as complete; on object storage it is
    published last. `stage_locally`: for a remote `out_dir`, the temporary directory is a local one
    (for writers that cannot write to object storage); `extra_commit_files`: see storage.publish_dir."""
    check_output_dir(out_dir, overwrite)
    out_dir = storage.absolute(out_dir)
    parent = storage.dirname(out_dir)
    if storage.is_remote(out_dir) and stage_locally:
        tmp = tempfile.mkdtemp(prefix=f".{storage.basename(out_dir)}.tmp-")
    elif storage.is_remote(out_dir):
        tmp = storage.join(parent, f".{storage.basename(out_dir)}.tmp-{uuid.uuid4().hex[:12]}")
    else:
        os.makedirs(parent, exist_ok=True)
        tmp = storage.make_temporary_dir(parent, f".{os.path.basename(out_dir)}.tmp-")   # published with its mode
    try:
        yield tmp
    except BaseException:
        storage.rmtree(tmp)
        raise
    storage.publish_dir(tmp, out_dir, commit_file, extra_commit_files)
