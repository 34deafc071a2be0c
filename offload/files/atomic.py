"""Files written whole or not at all, and damaged files set aside, for the file tier and the vLLM wing's counters.

``replace_file`` and ``create_file`` write into a new temporary file beside the target, made with O_CREAT|O_EXCL
and no link followed (``tempfile.mkstemp``): a link planted at a predictable temporary name is never followed
and no existing file is reused. ``replace_file`` then renames it over the target (a link at the target is
replaced, never followed); ``create_file`` links it to the target only if nothing is there, so a reader finds
the whole content or no file, and a failure (a full disk) leaves nothing behind. ``set_aside`` renames a file
the tier cannot trust out of its way, never deleting it.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

__all__ = ["create_file", "path_refusal", "replace_file", "set_aside"]


def path_refusal(path: str) -> str | None:
    """Why ``path`` cannot name a file this process writes, or None: a NUL byte or a character the file system
    cannot encode (a lone surrogate), a name or path longer than the system takes, an existing directory."""
    try:
        raw = os.fsencode(path)
    except UnicodeError:
        return "holds a character the file system cannot encode (a lone surrogate)"
    if b"\0" in raw:
        return "holds a NUL byte"
    if not raw:
        return "is empty"
    if len(raw) >= 4096 or any(len(part) > 255 for part in raw.split(b"/")):
        return "is longer than the system takes (4095 bytes, 255 per name)"
    if os.path.isdir(raw):
        return "is a directory; name a file in it"
    return None


def _temporary(path: Path, data: bytes, sync: bool) -> str:
    """A new private file beside ``path`` holding ``data`` (synced when asked); removed again when writing fails."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def replace_file(path: str | os.PathLike[str], data: bytes, *, sync: bool = False) -> None:
    """Replace the file at ``path`` with ``data`` in one rename (a reader sees the old file or the new one, whole).
    Raises OSError (the temporary file removed) or ValueError for a path the OS cannot take (a NUL byte)."""
    p = Path(path)
    tmp = _temporary(p, data, sync)
    try:
        os.replace(tmp, p)
    except BaseException:
        _unlink(tmp)
        raise


def create_file(path: str | os.PathLike[str], data: bytes) -> bool:
    """Create ``path`` holding ``data`` (synced), whole or not at all: True when this call made it, False when
    something was already there (left as it is). Raises OSError (nothing left behind)."""
    p = Path(path)
    tmp = _temporary(p, data, sync=True)
    try:
        os.link(tmp, p)
        return True
    except FileExistsError:
        return False
    finally:
        _unlink(tmp)


def set_aside(path: str | os.PathLike[str]) -> Path:
    """Rename whatever is at ``path`` (a file, a link, a folder: never followed) to
    ``<path>.damaged-<UTC time>-<pid>`` beside it, and return the new path. Raises OSError."""
    p = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(100):
        new = p.with_name(f"{p.name}.damaged-{stamp}-{os.getpid()}{f'-{n}' if n else ''}")
        if not os.path.lexists(new):
            os.rename(p, new)
            return new
    raise FileExistsError(f"{p}: no free name to set it aside")
