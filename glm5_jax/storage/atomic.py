"""Writes that a reader sees whole or not at all, locally and on object storage.

Local: a temporary file in the same directory, fsync, rename over the target, fsync of the directory.
Files and directories get the modes a plain ``open()`` / ``os.mkdir`` would give them (0o666 / 0o777
less the umask), not the owner-only modes of `tempfile`'s names.
Object storage: an object becomes visible only when its upload is finalised, whole; an upload that is
killed or discarded leaves no object. No temporary name is needed.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid

from glm5_jax.storage.paths import absolute, exists, is_remote, join, path, remove, rmtree, walk


def create_temporary_file(folder: str, prefix: str, suffix: str = ".tmp") -> tuple[int, str]:
    """(fd, path) of a new file ``<prefix><random><suffix>`` in `folder`, created as ``open()`` creates a
    file: mode 0o666 less the umask (`tempfile.mkstemp` makes it 0o600)."""
    while True:
        tmp = os.path.join(folder, f"{prefix}{uuid.uuid4().hex[:12]}{suffix}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def make_temporary_dir(folder: str, prefix: str) -> str:
    """A new directory ``<prefix><random>`` in `folder`, created as ``os.mkdir`` creates one: mode 0o777
    less the umask (`tempfile.mkdtemp` makes it 0o700, which a directory published by renaming it keeps)."""
    while True:
        tmp = os.path.join(folder, f"{prefix}{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(tmp, 0o777)
            return tmp
        except FileExistsError:
            continue


def write_atomically(target, data: bytes, tmp_dir=None) -> None:
    """`target` either keeps its old content (or stays absent) or holds all of `data`.

    `tmp_dir` (local only): where the temporary file goes; it must be on the same filesystem as `target`
    (default: the target's directory)."""
    with open_for_write(target, tmp_dir=tmp_dir) as f:
        f.write(data)


@contextlib.contextmanager
def open_for_write(target, tmp_dir=None, mode: str = "wb"):
    """A writable file for `target` that is published only when the block exits cleanly; on an exception
    nothing of it is published (local: the temporary file is deleted; remote: the upload is discarded)."""
    target = os.fspath(target)
    if is_remote(target):
        f = path(target).open(mode)
        try:
            yield f
        except BaseException:
            f.discard() if hasattr(f, "discard") else None     # fsspec: cancel the upload, write no object
            raise
        f.close()
        return
    folder = tmp_dir or os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = create_temporary_file(folder, f".{os.path.basename(target)}.")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(os.path.dirname(os.path.abspath(target)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def publish_dir(tmp, out_dir, commit_file: str, extra_commit_files: tuple[str, ...] = ()) -> None:
    """Makes the finished directory `tmp` the directory `out_dir`, replacing any old one.

    Local: two renames (old aside, new into place), as atomic as a directory swap gets.
    Object storage (either side remote): no rename, so the old `out_dir` is deleted *commit file first*
    (it stops counting as complete before anything else goes), then every object of `tmp` is copied with
    `commit_file` last, then `tmp` is deleted. A reader that requires `commit_file` (for an HF checkpoint:
    config.json, which every loader reads first) never takes a half-copied directory for a whole one.
    `extra_commit_files` are written (empty, if `tmp` lacks them) just before `commit_file`: markers that
    readers on object storage require but a local writer does not make (orbax's per-item
    commit_success.txt)."""
    tmp, out_dir = absolute(tmp), absolute(out_dir)
    if not is_remote(tmp) and not is_remote(out_dir):
        parent = os.path.dirname(out_dir)
        if os.path.lexists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rename(out_dir, os.path.join(old, "replaced"))
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
        return
    if exists(join(out_dir, commit_file)):
        path(join(out_dir, commit_file)).unlink()
    rmtree(out_dir)
    files = [join(d, n) for d, _, names in walk(tmp) for n in names]
    rel = {f: f[len(tmp) + 1:] for f in files}
    if commit_file not in rel.values():
        raise FileNotFoundError(f"{tmp} has no {commit_file}; refusing to publish it as {out_dir}")
    for f in sorted(files, key=lambda f: rel[f] == commit_file):        # the commit file last
        if rel[f] == commit_file:
            for extra in extra_commit_files:
                if extra not in rel.values():
                    write_atomically(join(out_dir, extra), b"")
        copy(f, join(out_dir, rel[f]))
    rmtree(tmp)


def copy(src, dst) -> None:
    """Copies one file; `dst` appears whole. Within object storage the copy is done by the server."""
    if is_remote(src) and is_remote(dst) and src.split("://")[0] == dst.split("://")[0]:
        path(src).copy(path(dst), overwrite=True)      # a server-side object copy: whole or absent
        return
    with path(src).open("rb") as fin, open_for_write(dst) as fout:
        shutil.copyfileobj(fin, fout, 16 * 2**20)


def copy_file(src, dst) -> None:
    """Copies one file between any two locations; the destination appears whole."""
    copy(os.fspath(src), os.fspath(dst))


def move(src, dst) -> None:
    """Local: os.replace (atomic). Object storage has no rename: copy, then delete the source, so at every
    moment at least one of the two is whole (a reader or a retry must accept finding both)."""
    if not is_remote(src) and not is_remote(dst):
        os.replace(src, dst)
        return
    copy_file(src, dst)
    remove(src)
