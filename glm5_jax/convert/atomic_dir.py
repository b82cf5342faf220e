"""Write a directory under a temporary sibling name and rename it into place only on success."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from glm5_jax.checkpoint.errors import CheckpointError


def check_output_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.lexists(out_dir) and not overwrite:
        raise CheckpointError(f"output directory {out_dir} already exists; pass --overwrite to replace it")


@contextlib.contextmanager
def atomic_output_dir(out_dir: str, overwrite: bool):
    """Yields a fresh temporary directory next to `out_dir`; on a clean exit it replaces `out_dir`,
    on any exception it is deleted and `out_dir` is left as it was."""
    check_output_dir(out_dir, overwrite)
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.lexists(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
        os.rename(out_dir, os.path.join(old, "replaced"))
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)
