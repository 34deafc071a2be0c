"""Opening files a process may not have made itself: no links followed, nothing foreign trusted, bounded locks.

A file the process did not create may have been planted: a symbolic link at the path (its target would be
overwritten), a hard link to a file elsewhere (a write through this name changes that file: a spill overwrites
it, records truncate it), a file of another user (who could read the spilled KV and forge chunks: CRC-32 is not a
MAC), or one others may write. ``open_file`` never follows a symbolic link at the last path component and creates
files private to their owner (0600, O_EXCL); ``untrusted`` says why an existing file must be refused unless the
caller opts in; ``lock_file`` takes an exclusive advisory lock with a bounded wait (``timeout_refusal`` says why a
wait bound bounds nothing). The NIXL file binding (``nixl_memory.FileBinding``), the offload layer's integrity
records and its shared host regions all use these, so one file gets one verdict wherever it is opened.

One opt-in, ``allow_foreign``, accepts a file whose provenance the caller vouches for: another user's, one others
may write, or one with more than one name (hard links). These are the same question (could someone else reach
these bytes by another route?), and one flag keeps one key per file in every configuration that names a file.
"""
from __future__ import annotations

import fcntl
import math
import os
import stat
import time
from pathlib import Path
from typing import Any


class TimeoutValueError(ValueError):
    """A wait bound that bounds nothing (nan, infinite, not a number): names the field, the value and why."""

    def __init__(self, field: str, value: Any, reason: str):
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field} = {value!r}: {reason}")


def open_file(path: str | os.PathLike[str], flags: int, *, create: bool, mode: int = 0o600) -> tuple[int, bool]:
    """Open ``path`` with ``flags`` without following a symbolic link at its last component (openat on the
    parent directory with O_NOFOLLOW). With ``create``, a missing file is created with O_EXCL and ``mode``
    (private to the owner by default). Returns ``(fd, created)``; raises OSError (ELOOP for a link,
    FileNotFoundError for a missing file)."""
    p = Path(path)
    parent = os.open(p.parent if str(p.parent) else ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC
        if create:
            try:
                return os.open(p.name, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=parent), True
            except FileExistsError:  # there already: opened below, without following a link, then checked
                pass
        return os.open(p.name, flags, dir_fd=parent), False
    finally:
        os.close(parent)


def untrusted(st: os.stat_result, allow_foreign: bool = False) -> str | None:
    """Why an existing file with status ``st`` must not be trusted, or None: not a regular file (or block device),
    owned by another user, writable by its group or others, or reachable by more than one name (``st_nlink`` > 1:
    hard links); ``allow_foreign`` accepts the last three."""
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        return f"not a regular file (mode {stat.filemode(st.st_mode)})"
    if allow_foreign:
        return None
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this process's user (uid {os.geteuid()}): another user could read or forge it"
    if st.st_mode & 0o022:
        return f"writable by {'others' if st.st_mode & 0o002 else 'its group'} (mode {stat.filemode(st.st_mode)})"
    if st.st_nlink > 1:
        return f"a file with {st.st_nlink} names (hard links): a write here changes the file under its other names"
    return None


def timeout_refusal(timeout_s: object) -> str | None:
    """Why ``timeout_s`` cannot bound a wait, or None: it must be a real number (not a bool) and finite (nan never
    compares past a deadline, and an infinite one is no bound). Zero and negative numbers mean "do not wait"."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        return f"expected a number of seconds, got {type(timeout_s).__name__}"
    if not math.isfinite(timeout_s):
        return "must be a finite number of seconds (nan or infinity would wait forever)"
    return None


def lock_file(fd: int, timeout_s: float) -> bool:
    """Take an exclusive advisory lock (flock) on ``fd``, waiting at most ``timeout_s`` seconds; False if another
    open file description still holds it then (another process, or another open of the file in this one).
    Raises TimeoutValueError (field ``timeout_s``) for a bound that bounds nothing, before trying the lock."""
    why = timeout_refusal(timeout_s)
    if why is not None:
        raise TimeoutValueError("timeout_s", timeout_s, why)
    deadline, pause = time.monotonic() + max(timeout_s, 0.0), 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, 0.05)
