"""Memory for ``kvxfer run``: buffers mapped lazily, content only where the plan reads or writes, and a check of
every byte against the oracle that keeps no second copy of the buffers.

- Host buffers are private anonymous mappings: a page nothing touches is never backed by memory (it reads as
  zero). Device buffers are zeroed device memory; on a GPU run host buffers are pinned, which backs them whole.
- Every 4 KiB page that a copy of the oracle or a range of the plan reads or writes starts with seeded
  pseudo-random bytes: Philox keyed by (seed, buffer index), counting 32-byte blocks from the buffer's start,
  so the check can produce any byte's initial value again instead of keeping it. Every other byte is zero.
- The check covers every byte of every buffer: each destination piece of the oracle holds the bytes of its
  source piece, and every byte no piece writes still holds its initial value (sources included, so a stray
  write into them is caught too). It walks each buffer in windows and drops the pages of a host window once
  checked, so checking adds about one window to the resident memory.

Resident memory thus peaks near the bytes of the touched pages (the plan's sources and destinations: about
twice the bytes it moves when they lie in different buffers) plus a few windows.
"""
from __future__ import annotations

import errno
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

PAGE_BYTES = 4096
WINDOW_BYTES = 2 << 20  # one window of a check, and the largest piece of content made at once
GATHER_BYTES = 1 << 20  # small pieces compared per gather (the index arrays are 8 bytes per byte)
SMALL_PIECE_BYTES = 4096  # pieces up to this size are compared by gathers, larger ones by slices
PROGRESS_S = 2.0  # at most one progress line per this many seconds in each stage

Echo = Callable[..., None]


def size_text(nbytes: int) -> str:
    """2147483648 -> '2.0 GiB' (binary units, one decimal)."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"


class Progress:
    """Progress lines on stderr for one stage: ``step(done)`` prints '<what>: <done> of <total>' at most every
    PROGRESS_S seconds, and nothing for a stage that ends sooner."""

    def __init__(self, echo: Echo, what: str, total_bytes: int):
        self.echo, self.what, self.total = echo, what, total_bytes
        self.last = time.monotonic()

    def step(self, done_bytes: int) -> None:
        """Report ``done_bytes`` of the stage's total if the last line is old enough."""
        now = time.monotonic()
        if now - self.last >= PROGRESS_S:
            self.last = now
            self.echo(f"{self.what}: {size_text(done_bytes)} of {size_text(self.total)}", err=True)


# ---- the pieces: what the oracle copies, and the pages content goes into -------------------------------------
@dataclass(frozen=True)
class Pieces:
    """Copies as columns with buffer indices into the plan's buffers: ``nbytes[i]`` bytes from ``src_buf[i]``
    at ``src_offset[i]`` to ``dst_buf[i]`` at ``dst_offset[i]``."""

    src_buf: np.ndarray
    src_offset: np.ndarray
    dst_buf: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray

    @classmethod
    def of(cls, names: tuple[str, ...], buffers: list[str], src_buf: np.ndarray, src_offset: np.ndarray,
           dst_buf: np.ndarray, dst_offset: np.ndarray, nbytes: np.ndarray) -> Pieces:
        """Columns whose buffer indices point into ``names``, re-indexed into ``buffers`` (the plan's) and with
        repeated rows (aliased regions list their copies twice) and empty pieces dropped."""
        index = {n: i for i, n in enumerate(buffers)}
        remap = np.array([index[n] for n in names] or [0], np.int64)
        rows = np.stack([remap[np.asarray(src_buf, np.int64)], np.asarray(src_offset, np.int64),
                         remap[np.asarray(dst_buf, np.int64)], np.asarray(dst_offset, np.int64),
                         np.asarray(nbytes, np.int64)], axis=1) if len(nbytes) else np.zeros((0, 5), np.int64)
        rows = np.unique(rows[rows[:, 4] > 0], axis=0)
        return cls(*(np.ascontiguousarray(rows[:, j]) for j in range(5)))

    @property
    def total_bytes(self) -> int:
        """Bytes the pieces write."""
        return int(self.nbytes.sum())


def spans(buf: np.ndarray, offset: np.ndarray, nbytes: np.ndarray, b: int, align: int = 1) -> np.ndarray:
    """The byte intervals ``[start, end)`` of buffer ``b`` that the given pieces cover, widened to multiples of
    ``align``, merged and sorted: an (n, 2) int64 array."""
    sel = buf == b
    start = offset[sel] // align * align
    end = -(-(offset[sel] + nbytes[sel]) // align) * align
    if not len(start):
        return np.zeros((0, 2), np.int64)
    o = np.argsort(start, kind="stable")
    start, end = start[o], np.maximum.accumulate(end[o])
    new = np.concatenate(([True], start[1:] > end[:-1]))
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(start)) - 1
    return np.stack([start[first], end[last]], axis=1)


def touched_pages(sizes: list[int], *pieces: Pieces) -> list[np.ndarray]:
    """Per buffer (``sizes``: their bytes), the whole pages (PAGE_BYTES, the last one cut at the buffer's end)
    that any of ``pieces`` reads or writes, as merged intervals."""
    cols = {f: np.concatenate([getattr(p, f) for p in pieces]) for f in
            ("src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes")}
    buf = np.concatenate((cols["src_buf"], cols["dst_buf"]))
    offset = np.concatenate((cols["src_offset"], cols["dst_offset"]))
    nbytes = np.concatenate((cols["nbytes"], cols["nbytes"]))
    out = [spans(buf, offset, nbytes, b, PAGE_BYTES) for b in range(len(sizes))]
    for intervals, size in zip(out, sizes):
        np.minimum(intervals, size, out=intervals)
    return out


def independent(pieces: Pieces, names: list[str]) -> bool:
    """Whether the order of ``pieces`` cannot change the result (``kvxfer.testing.independent``)."""
    from kvxfer.testing import Copies
    from kvxfer.testing import independent as order_free

    return order_free(Copies(tuple(names), pieces.src_buf, pieces.src_offset, pieces.dst_buf, pieces.dst_offset,
                             pieces.nbytes, np.zeros(len(pieces.nbytes), np.int64)))


def within(intervals: np.ndarray, lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of ``intervals`` (sorted, disjoint) that fall in ``[lo, hi)``."""
    i = int(np.searchsorted(intervals[:, 1], lo, side="right"))
    j = int(np.searchsorted(intervals[:, 0], hi, side="left"))
    return [(max(int(s), lo), min(int(e), hi)) for s, e in intervals[i:j].tolist()]


def pattern(seed: int, b: int, lo: int, hi: int) -> np.ndarray:
    """The initial bytes ``[lo, hi)`` of buffer ``b``: the same for any window that covers them."""
    first = lo // 32
    words = -(-(hi - first * 32) // 8)
    gen = np.random.Philox(key=np.array([seed, b], np.uint64), counter=first)
    return gen.random_raw(words).view(np.uint8)[lo - first * 32:hi - first * 32]


# ---- the memory ---------------------------------------------------------------------------------------------
class RunMemory:
    """The plan's buffers, by name in ``arrays`` (numpy arrays over anonymous mappings, or torch tensors on a
    GPU run), with byte access by buffer index for filling and checking. Used by one thread."""

    def __init__(self, names: list[str], arrays: dict[str, Any], maps: dict[str, mmap.mmap]):
        self.names, self.arrays, self._maps = names, arrays, maps

    def read(self, b: int, lo: int, hi: int) -> np.ndarray:
        """Bytes ``[lo, hi)`` of buffer ``b`` on the host (a view of host memory, a copy of device memory)."""
        a = self.arrays[self.names[b]]
        part = a[lo:hi]
        return part if isinstance(part, np.ndarray) else part.cpu().numpy()

    def take(self, b: int, index: np.ndarray) -> np.ndarray:
        """The bytes of buffer ``b`` at the byte offsets ``index``, on the host."""
        a = self.arrays[self.names[b]]
        if isinstance(a, np.ndarray):
            taken: np.ndarray = a[index]
            return taken
        import torch

        return a[torch.from_numpy(index).to(a.device)].cpu().numpy()  # type: ignore[no-any-return]

    def write(self, b: int, lo: int, data: np.ndarray) -> None:
        """Write ``data`` at byte ``lo`` of buffer ``b``."""
        a = self.arrays[self.names[b]]
        if isinstance(a, np.ndarray):
            a[lo:lo + len(data)] = data
        else:
            import torch

            a[lo:lo + len(data)].copy_(torch.from_numpy(np.ascontiguousarray(data)))

    def release(self, b: int, lo: int, hi: int) -> None:
        """Give back the pages of ``[lo, hi)`` of a host mapping (they read as zero again); a no-op elsewhere."""
        m = self._maps.get(self.names[b])
        start = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE
        if m is not None and hi > start:
            m.madvise(mmap.MADV_DONTNEED, start, hi - start)


def _out_of_memory(name: str, nbytes: int, where: str, e: BaseException) -> MemoryError:
    why = errno.errorcode.get(e.errno, str(e.errno)) if isinstance(e, OSError) and e.errno else type(e).__name__
    return MemoryError(f"buffer {name!r}: cannot allocate {size_text(nbytes)} of {where} ({why})")


def allocate(buffers: list[Any], on_gpu: bool) -> RunMemory:
    """Zeroed memory for every buffer of a plan (``plan.buffers``): host buffers as private anonymous mappings
    (device buffers too unless ``on_gpu``), else torch tensors (device memory, pinned host memory). Raises
    MemoryError naming the buffer and its size when the machine (or its limits) cannot give it."""
    arrays: dict[str, Any] = {}
    maps: dict[str, mmap.mmap] = {}
    for buf in buffers:
        device = on_gpu and buf.location.value == "device"
        where = f"memory on cuda:{buf.device}" if device else ("pinned host memory" if on_gpu else "host memory")
        try:
            if on_gpu:
                import torch

                arrays[buf.name] = (torch.zeros(buf.nbytes, dtype=torch.uint8, device=f"cuda:{buf.device}") if device
                                    else torch.zeros(buf.nbytes, dtype=torch.uint8, pin_memory=True))
            elif buf.nbytes == 0:
                arrays[buf.name] = np.zeros(0, np.uint8)
            else:
                m = mmap.mmap(-1, buf.nbytes, flags=mmap.MAP_PRIVATE)
                maps[buf.name] = m
                arrays[buf.name] = np.frombuffer(m, dtype=np.uint8)
        except MemoryError as e:
            raise _out_of_memory(buf.name, buf.nbytes, where, e) from None
        except OSError as e:
            if e.errno != errno.ENOMEM:
                raise
            raise _out_of_memory(buf.name, buf.nbytes, where, e) from None
        except RuntimeError as e:  # torch's out-of-memory errors
            if "out of memory" not in str(e).lower():
                raise
            raise _out_of_memory(buf.name, buf.nbytes, where, e) from None
    return RunMemory([b.name for b in buffers], arrays, maps)


def fill(mem: RunMemory, touched: list[np.ndarray], seed: int, echo: Echo) -> None:
    """Write the initial pattern into every touched interval (``touched[b]``: buffer b's intervals)."""
    total = sum(int((t[:, 1] - t[:, 0]).sum()) for t in touched)
    progress, done = Progress(echo, "filling", total), 0
    for b, intervals in enumerate(touched):
        for start, end in intervals.tolist():
            for lo in range(start, end, WINDOW_BYTES):
                hi = min(lo + WINDOW_BYTES, end)
                mem.write(b, lo, pattern(seed, b, lo, hi))
                done += hi - lo
                progress.step(done)


# ---- the check ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mismatch:
    """Differing bytes of one buffer: how many, the first offset, and whether a copy writes that byte."""

    buffer: str
    count: int
    first_offset: int
    written: bool

    def line(self) -> str:
        """'  gpu.kv0: 512 bytes differ, first at offset 4096 (a copy's destination)'."""
        what = "a copy's destination" if self.written else "a byte no copy writes"
        return f"  {self.buffer}: {self.count} bytes differ, first at offset {self.first_offset} ({what})"


class _Tally:
    """Differing bytes per buffer: count and the first (lowest) offset seen."""

    def __init__(self) -> None:
        self.by_buffer: dict[int, tuple[int, int]] = {}

    def add(self, b: int, offsets: np.ndarray) -> None:
        """Count the differing byte ``offsets`` of buffer ``b``."""
        if offsets.size:
            count, first = self.by_buffer.get(b, (0, int(offsets.min())))
            self.by_buffer[b] = (count + int(offsets.size), min(first, int(offsets.min())))


def _pieces_differ(mem: RunMemory, p: Pieces, progress: Progress) -> _Tally:
    """The destination bytes of pieces that do not hold their source's bytes."""
    bad = _Tally()
    done = 0
    for i in np.flatnonzero(p.nbytes > SMALL_PIECE_BYTES).tolist():
        sb, so, db, do, n = (int(p.src_buf[i]), int(p.src_offset[i]), int(p.dst_buf[i]), int(p.dst_offset[i]),
                             int(p.nbytes[i]))
        for k in range(0, n, WINDOW_BYTES):
            m = min(WINDOW_BYTES, n - k)
            bad.add(db, np.flatnonzero(mem.read(db, do + k, do + k + m) != mem.read(sb, so + k, so + k + m)) + do + k)
        done += n
        progress.step(done)
    small = np.flatnonzero(p.nbytes <= SMALL_PIECE_BYTES)
    pairs = np.unique(np.stack([p.src_buf[small], p.dst_buf[small]], 1), axis=0).tolist() if small.size else []
    for sb, db in pairs:
        sel = small[(p.src_buf[small] == sb) & (p.dst_buf[small] == db)]
        for part in np.array_split(sel, max(1, int(p.nbytes[sel].sum()) // GATHER_BYTES)):
            n = p.nbytes[part]
            inner = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            dst = np.repeat(p.dst_offset[part], n) + inner
            bad.add(db, dst[mem.take(db, dst) != mem.take(sb, np.repeat(p.src_offset[part], n) + inner)])
            done += int(n.sum())
            progress.step(done)
    return bad


def check(mem: RunMemory, pieces: Pieces, touched: list[np.ndarray], seed: int, echo: Echo) -> list[Mismatch]:
    """Compare every byte of every buffer with what the oracle's ``pieces`` imply (see the module docstring);
    returns one Mismatch per buffer that differs (none: every byte matches). Host pages are given back as the
    check passes them, so run this last."""
    total = sum(len(a) for a in mem.arrays.values())
    written_bad = _pieces_differ(mem, pieces, Progress(echo, "checking copies", pieces.total_bytes))
    progress, done = Progress(echo, "checking every byte", total), 0
    other_bad = _Tally()
    for b, name in enumerate(mem.names):
        size = len(mem.arrays[name])
        written = spans(pieces.dst_buf, pieces.dst_offset, pieces.nbytes, b)
        for lo in range(0, size, WINDOW_BYTES):
            hi = min(lo + WINDOW_BYTES, size)
            got = mem.read(b, lo, hi)
            parts = within(touched[b], lo, hi)
            if not parts:  # nothing was put here and nothing may be written here: zero
                if got.any():
                    other_bad.add(b, np.flatnonzero(got) + lo)
            else:
                want = np.zeros(hi - lo, np.uint8)
                for s, e in parts:
                    want[s - lo:e - lo] = pattern(seed, b, s, e)
                for s, e in within(written, lo, hi):  # the copies' destinations were checked against their sources
                    want[s - lo:e - lo] = got[s - lo:e - lo]
                if not np.array_equal(got, want):
                    other_bad.add(b, np.flatnonzero(got != want) + lo)
            mem.release(b, lo, hi)
            done += hi - lo
            progress.step(done)
    out = []
    for b, name in enumerate(mem.names):
        w, o = written_bad.by_buffer.get(b), other_bad.by_buffer.get(b)
        if w or o:
            first = min(x[1] for x in (w, o) if x)
            out.append(Mismatch(name, sum(x[0] for x in (w, o) if x), first, w is not None and w[1] == first))
    return out
