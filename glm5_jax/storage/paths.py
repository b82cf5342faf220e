"""Path operations on local paths (``os``, unchanged behaviour) and object-storage URLs (`etils.epath`)."""
from __future__ import annotations

import fnmatch
import os
import shutil

import fsspec.config
from etils import epath

# Several processes poll the same prefixes (rollouts, policy versions): never answer from a stale listing.
fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)

def is_remote(p) -> bool:
    """True for URLs such as gs://bucket/dir (anything with a scheme)."""
    return "://" in os.fspath(p)


def path(p) -> epath.Path:
    return epath.Path(os.fspath(p))


def absolute(p) -> str:
    """An absolute local path, or the URL without a trailing slash (orbax needs absolute paths)."""
    p = os.fspath(p)
    return p.rstrip("/") if is_remote(p) else os.path.abspath(p)


def join(p, *parts) -> str:
    p = os.fspath(p)
    if is_remote(p):
        return "/".join([p.rstrip("/")] + [str(x).strip("/") for x in parts])
    return os.path.join(p, *parts)


def basename(p) -> str:
    p = os.fspath(p)
    return p.rstrip("/").rsplit("/", 1)[-1] if is_remote(p) else os.path.basename(p)


def dirname(p) -> str:
    p = os.fspath(p)
    return p.rstrip("/").rsplit("/", 1)[0] if is_remote(p) else os.path.dirname(p)


def exists(p) -> bool:
    return path(p).exists() if is_remote(p) else os.path.exists(p)


def isdir(p) -> bool:
    """On object storage: some object lies under the prefix."""
    return path(p).is_dir() if is_remote(p) else os.path.isdir(p)


def isfile(p) -> bool:
    return path(p).is_file() if is_remote(p) else os.path.isfile(p)


def listdir(p) -> list[str]:
    """Entry names; FileNotFoundError when there is no such directory (or prefix)."""
    if not is_remote(p):
        return os.listdir(p)
    if not path(p).is_dir():
        raise FileNotFoundError(os.fspath(p))
    return [c.name for c in path(p).iterdir()]


def walk(p):
    """os.walk over a local directory or an object prefix: (dirpath, dirnames, filenames), top-down, sorted."""
    if not is_remote(p):
        yield from os.walk(p)
        return
    scheme = os.fspath(p).split("://")[0] + "://"
    for dirpath, dirnames, filenames in path(p).walk():
        dirpath = os.fspath(dirpath)          # gcsfs hands back the path without its scheme
        yield (dirpath if "://" in dirpath else scheme + dirpath), sorted(dirnames), sorted(filenames)


def glob(directory, pattern: str) -> list[str]:
    """Sorted paths of the entries of `directory` matching `pattern` (one level, fnmatch syntax)."""
    try:
        names = listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(join(directory, n) for n in names if fnmatch.fnmatch(n, pattern))


def makedirs(p) -> None:
    """Local: os.makedirs(exist_ok=True). Object storage has no directories; nothing to do."""
    if not is_remote(p):
        os.makedirs(p, exist_ok=True)


def getsize(p) -> int:
    return path(p).stat().length if is_remote(p) else os.path.getsize(p)


def read_bytes(p) -> bytes:
    if is_remote(p):
        return path(p).read_bytes()
    with open(p, "rb") as f:
        return f.read()


def read_text(p) -> str:
    return read_bytes(p).decode()


def remove(p) -> None:
    """Deletes one file/object; FileNotFoundError when it is not there."""
    if is_remote(p):
        if not path(p).exists():
            raise FileNotFoundError(os.fspath(p))
        path(p).unlink()
    else:
        os.unlink(p)


def rmtree(p) -> None:
    if is_remote(p):
        if path(p).exists():
            path(p).rmtree()
    else:
        shutil.rmtree(p, ignore_errors=True)
