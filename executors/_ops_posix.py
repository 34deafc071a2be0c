"""Files with POSIX calls: plans between host memory and files run as ``pread``/``pwrite`` on a pool of threads.

The storage path that needs no driver: a plan whose sources are file buffers and destinations host memory is a
read, the other way a write. Each range is one call (a merged range is one large I/O), ranges above
``piece_bytes`` are cut into pieces, and the pieces of a run are spread over ``threads`` threads so the reads (or
writes) of one plan overlap; the calls themselves release the GIL. Pieces that follow one another in a file (a
thread's consecutive pieces on one descriptor, each starting where the last ended) go in one vectored call
(``os.preadv``/``os.pwritev``, at most ``IOV_MAX`` buffers and ``piece_bytes`` bytes): one system call for a run of
ranges that lie end to end in the file but apart in memory. A file buffer binds to a ``FileBinding``
(``file_trust.FileBinding``: opened without following a link, created private to its owner, foreign files refused,
O_DIRECT on request), host memory to a numpy array or CPU tensor.

Each run does its I/O through descriptors of its own (``FileBinding.duplicate``: checked to be the file bound, and
closed once the run's pieces have finished): a descriptor closed behind the binding, whose number another file then
took, is refused before any I/O, and one closed during the run cannot send the run's bytes to another file.

What a result promises: ``wait()`` returns once every byte of every range has been read or written, and raises
ExecutorError naming the call (``pread``/``pwrite``), the plan's call and range and the errno for a failed call;
a read that comes up short (the file ends first) is a failure, never a success with fewer bytes. A failed run may
have moved other ranges (every piece is attempted; the error names the first failure in plan order).

Threads: one executor may be shared by any number of threads; runs are independent (pieces of concurrent runs
share the pool). ``close()`` waits for the pieces in flight and stops the pool; it must not race ``run``.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Layout, Location, TransferPlan

from ._base import After, Executor, ExecutorError, Stream, Transfer, stream_handle, transfers_after, wait_on_host
from ._binding import BoundMemory
from ._lowering import Lowered
from ._memory import BindingError, Memory, check_host_view, describe
from ._options import PosixOptions
from .file_trust import FileBinding  # where a file buffer lives (shared with the NIXL storage path)

READ, WRITE = "pread", "pwrite"
OnRead = Callable[[int, int, memoryview], None]  # (plan range, byte offset in it, the host bytes that landed)
IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)  # buffers one vectored call takes


@dataclass(frozen=True)
class FileMemory:
    """A FileBinding as bound memory: ``address`` is the file offset of buffer byte 0 (``file_offsets``)."""

    binding: FileBinding
    nbytes: int

    def __kvxfer_memory__(self) -> Memory:
        return Memory(self.binding.offset, self.nbytes, Location.FILE, None, None, not self.binding.readonly, self,
                      file_offsets=True)


class Registration:
    """Files opened by ``PosixFileExecutor.register``; ``deregister`` releases nothing (the caller closes files)."""

    def __init__(self, files: Mapping[str, FileBinding]):
        self.files = dict(files)

    def deregister(self) -> None:
        """Nothing to release: POSIX calls need no registration (kept for the storage executors' interface)."""


@dataclass(frozen=True)
class _Piece:
    op: str
    fd: int
    file_offset: int
    view: memoryview  # the host bytes read into or written from
    call: int
    index: int  # the plan range it belongs to
    at: int = 0  # where in that range it starts


@dataclass(eq=False, kw_only=True)
class PosixTransfer(Transfer):
    """A run in flight on the executor's threads: ``done()`` polls, ``wait()`` blocks and raises the first
    failure (in plan order). Calls finish together: ``call_done(i)`` is ``done()``."""

    futures: list[Future[ExecutorError | None]] = field(default_factory=list, repr=False)
    started: float = 0.0

    def done(self) -> bool:
        """Whether every piece has finished (polls; never blocks)."""
        return all(f.done() for f in self.futures)

    def wait(self) -> PosixTransfer:
        """Block until every piece has finished; raise the first failure's ExecutorError."""
        errors = [e for e in (f.result() for f in self.futures) if e is not None]
        if self.elapsed_s is None:
            self.elapsed_s = time.perf_counter() - self.started
        if errors:
            raise min(errors, key=lambda e: (e.chunk, e.descriptor or 0))
        return self

    def call_done(self, call: int) -> bool:
        """Whether call ``call`` has finished (all calls finish together)."""
        self._call(call)
        return self.done()

    def wait_call(self, call: int) -> PosixTransfer:
        """Block until call ``call`` (every call) has finished."""
        self._call(call)
        return self.wait()

    def stream_wait(self, stream: Stream, call: int = -1) -> None:
        """Wait on the host: no device work depends on file I/O here."""
        self._call(call)
        self.wait()


class PosixFileExecutor(Executor):
    """Host memory <-> files with ``pread``/``pwrite`` on ``threads`` threads (pieces of at most ``piece_bytes``).

    Bindings: file buffers to a ``FileBinding`` (``register`` or ``bind`` opens it for its buffer), host buffers to
    a numpy array or CPU tensor. ``calls`` and ``bytes_moved`` count the I/O calls issued and the bytes they moved
    since construction. Threads: see the module docstring.
    """

    def __init__(self, threads: int = 4, piece_bytes: int = 8 << 20):
        opts = PosixOptions(threads=threads, piece_bytes=piece_bytes)
        self.threads, self.piece_bytes = opts.threads, opts.piece_bytes
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="kvxfer-posix")
        self._count = threading.Lock()
        self.calls = 0
        self.bytes_moved = 0

    @classmethod
    def from_options(cls, options: Any) -> PosixFileExecutor:
        """An executor from ``PosixOptions``."""
        opts = options if isinstance(options, PosixOptions) else PosixOptions.model_validate(options)
        return cls(opts.threads, opts.piece_bytes)

    @property
    def synchronous(self) -> bool:
        """False: ``run`` hands the pieces to the threads and returns."""
        return False

    def check_memory(self, buf: Buffer, mem: Memory) -> None:
        """A file buffer must be bound to a FileBinding, any other to host memory numpy can view (BindingError)."""
        if buf.location is Location.FILE:
            if not isinstance(mem.owner, FileMemory):
                raise BindingError(buf.name, describe(mem.owner), "a file buffer binds to a FileBinding")
            return
        if mem.location is Location.FILE:
            raise BindingError(buf.name, "a file", f"the plan places this buffer in {buf.location.value} memory")
        check_host_view(buf, mem)

    def register(self, bindings: Mapping[str, Any], buffers: Layout | TransferPlan | Iterable[Buffer] | None = None
                 ) -> Registration:
        """Open every FileBinding of ``bindings`` for its buffer in ``buffers``; BindingError names a file that
        cannot be opened or trusted, or a binding that is not a file."""
        table = {b.name: b for b in (buffers.buffers if isinstance(buffers, (Layout, TransferPlan)) else buffers or ())}
        for name, fb in bindings.items():
            if not isinstance(fb, FileBinding):
                raise BindingError(name, describe(fb), "register files only (host memory needs no registration)")
            if name in table:
                fb.open(table[name])
            elif fb.fd is None:
                raise BindingError(name, repr(fb), "unknown buffer: pass the layout's buffers to open the file")
        return Registration(bindings)

    def _files(self, buffers: Any, bindings: Mapping[str, Any]) -> dict[str, Any]:
        table = {b.name: b for b in getattr(buffers, "buffers", buffers)}
        return {n: FileMemory(b.open(table[n]), table[n].nbytes) if isinstance(b, FileBinding) and n in table else b
                for n, b in bindings.items()}

    def bind(self, buffers: Layout | Sequence[Buffer], bindings: Mapping[str, Any]) -> BoundMemory:
        """As Executor.bind; FileBinding values are opened for their buffers and bound as files."""
        bound = super().bind(buffers, self._files(buffers, bindings))
        bound.extra["views"] = [m.view() if m is not None and m.view is not None else None for m in bound.memory]
        return bound

    def memory_for(self, plan: TransferPlan, memory: BoundMemory | Mapping[str, Any]) -> BoundMemory:
        """As Executor.memory_for; FileBinding values of a one-off run are opened and bound as files."""
        if not isinstance(memory, BoundMemory):
            memory = self._files(plan.buffers, memory)
        return super().memory_for(plan, memory)

    def run(self, plan: TransferPlan, memory: BoundMemory | Mapping[str, Any], stream: Stream = None,
            after: After = None, *, on_read: OnRead | None = None) -> PosixTransfer:
        """Read or write every range once every ``after`` transfer has finished; returns at once. Raises
        BindingError, PlanError or RunArgumentError before any I/O for a malformed plan, a range outside its bound
        buffer, a range that is not between a file and host memory, or a file whose descriptor was closed (or
        now refers to another file); ``wait()`` raises ExecutorError.

        ``on_read(range, at, view)``, when given, is called on the I/O thread as soon as a piece of a read has
        landed (``view``: the host bytes of range ``range`` from byte ``at``, at most ``piece_bytes``), while they
        are still in the cache: a caller checksums them there instead of in a second pass. It must return
        quickly (hand work on) and not raise; an exception it raises fails the run (ExecutorError for the
        piece)."""
        t0 = time.perf_counter()
        if stream is not None:
            stream_handle(stream)
        waits = transfers_after(after)
        bound = self.memory_for(plan, memory)
        low = bound.offsets(plan)
        fds = _RunFiles()  # holds one use for this call, and one per task submitted
        try:
            pieces = self._pieces(plan, bound, low, fds)
            pieces.sort(key=lambda p: (p.fd, p.file_offset))  # file order: pieces end to end share a vectored call
            wait_on_host(waits)
            out = PosixTransfer(nbytes=low.total_bytes, ranges=low.num_ranges, calls=low.num_calls, started=t0)
            per = -(-len(pieces) // self.threads) if pieces else 0
            for i in range(0, len(pieces), per or 1):
                fds.use()
                try:
                    future = self._pool.submit(self._move, pieces[i:i + per], on_read)
                except BaseException:
                    fds.release()
                    raise
                out.futures.append(future)
                future.add_done_callback(fds.release)
        finally:
            fds.release()
        return out

    def _pieces(self, plan: TransferPlan, bound: BoundMemory, low: Lowered, fds: _RunFiles) -> list[_Piece]:
        """Every range as pieces of at most ``piece_bytes`` (read or write by which side is the file), through the
        run's own descriptor of each file (``fds``); BindingError for a range with files or host memory on both
        sides, or a file whose descriptor was closed or now refers to another file."""
        is_file = np.array([isinstance(m.owner, FileMemory) if m is not None else False for m in bound.memory])
        src_buf, dst_buf = low.buffer_column("src"), low.buffer_column("dst")
        reads = is_file[src_buf]
        bad = reads == is_file[dst_buf]
        if bad.any():
            k = int(np.argmax(bad))
            both = "files" if reads[k] else "host memory"
            raise BindingError(plan.buffers[int(src_buf[k])].name, f"range {k}", f"source and destination are both "
                               f"{both}; a POSIX run moves bytes between a file and host memory")
        calls = np.searchsorted(low.call_offsets, np.arange(len(low.nbytes)), side="right") - 1
        views: list[Any] = bound.extra.get("views") or [m.view() if m is not None and m.view is not None else None
                                                        for m in bound.memory]
        out = []
        for k, (sb, db, so, do, n, read, call) in enumerate(zip(src_buf.tolist(), dst_buf.tolist(), low.src.tolist(),
                                                                 low.dst.tolist(), low.nbytes.tolist(), reads.tolist(),
                                                                 calls.tolist())):
            (fb, fo), (mb, mo) = ((sb, so), (db, do)) if read else ((db, do), (sb, so))
            fm: FileMemory = bound.memory[fb].owner
            fd = fds.of(fb, fm.binding, plan.buffers[fb].name)
            for at in range(0, n, self.piece_bytes):
                size = min(self.piece_bytes, n - at)
                out.append(_Piece(READ if read else WRITE, fd, fm.binding.offset + fo + at,
                                  memoryview(views[mb][mo + at:mo + at + size]), call, k, at))
        return out

    def _move(self, pieces: list[_Piece], on_read: OnRead | None = None) -> ExecutorError | None:
        """Run ``pieces`` in order, those end to end in a file in one vectored call; the first failure, or None.
        Every piece is attempted (a failed one stops only itself), so a failure never hides whether the others
        moved: a vectored call that fails is retried piece by piece, and the error names the piece that fails."""
        first: ExecutorError | None = None
        calls = moved = 0
        for batch in _batches(pieces, self.piece_bytes):
            if len(batch) > 1:
                try:
                    calls += _vectored(batch)
                    moved += sum(len(p.view) for p in batch)
                    first = first or _landed(batch, on_read)
                    continue
                except OSError:
                    pass
            for p in batch:
                try:
                    calls += _read(p) if p.op == READ else _write(p)
                    moved += len(p.view)
                except OSError as e:
                    why = f"{e.strerror or e}" + (f" (errno {e.errno})" if e.errno else "")
                    err = ExecutorError(p.op, p.call, p.index, f"{why} at file offset {p.file_offset}, "
                                        f"{len(p.view)} bytes", p.call)
                    first = first or err
                    continue
                first = first or _landed([p], on_read)
        with self._count:
            self.calls += calls
            self.bytes_moved += moved
        return first

    def close(self) -> None:
        """Wait for the pieces in flight and stop the threads."""
        self._pool.shutdown(wait=True)


class _RunFiles:
    """One run's own descriptors of its files (``FileBinding.duplicate``, one per file buffer it touches), closed
    when the last use is released: ``run`` holds one while it prepares and submits, each task submitted one until
    it has finished."""

    def __init__(self) -> None:
        self.fds: dict[int, int] = {}
        self._uses = 1
        self._lock = threading.Lock()

    def of(self, buffer: int, binding: FileBinding, name: str) -> int:
        """The run's descriptor of file buffer ``buffer`` (made the first time); BindingError for a binding closed,
        or whose descriptor now refers to another file."""
        fd = self.fds.get(buffer)
        if fd is None:
            if binding.fd is None:
                raise BindingError(name, repr(binding), "the file was closed; bind it again")
            fd = self.fds[buffer] = binding.duplicate()
        return fd

    def use(self) -> None:
        """One more use (a task about to be submitted)."""
        with self._lock:
            self._uses += 1

    def release(self, _: Any = None) -> None:
        """One use ended (a task finished: a future's done callback); the last closes every descriptor."""
        with self._lock:
            self._uses -= 1
            last = self._uses == 0
        if last:
            fds, self.fds = list(self.fds.values()), {}
            for fd in fds:
                os.close(fd)


def _read(p: _Piece) -> int:
    """Fill ``p.view`` from the file; OSError for a failed call or a short file (never fewer bytes as success)."""
    done, calls = 0, 0
    while done < len(p.view):
        got = os.preadv(p.fd, [p.view[done:]], p.file_offset + done)
        calls += 1
        if got == 0:
            raise OSError(0, f"short read: the file ends after {p.file_offset + done} bytes")
        done += got
    return calls


def _write(p: _Piece) -> int:
    """Write all of ``p.view`` to the file (a partial write is continued); OSError for a failed call."""
    done, calls = 0, 0
    while done < len(p.view):
        done += os.pwrite(p.fd, p.view[done:], p.file_offset + done)
        calls += 1
    return calls


def _landed(pieces: list[_Piece], on_read: OnRead | None) -> ExecutorError | None:
    """Hand the pieces of a read that landed to ``on_read`` (see ``PosixFileExecutor.run``); the first exception
    it raises, as the piece's ExecutorError."""
    if on_read is None or pieces[0].op != READ:
        return None
    for p in pieces:
        try:
            on_read(p.index, p.at, p.view)
        except Exception as e:  # the caller's hook: the run fails, the I/O thread goes on
            return ExecutorError(p.op, p.call, p.index, f"on_read failed: {type(e).__name__}: {e}", p.call)
    return None


def _batches(pieces: list[_Piece], max_bytes: int) -> list[list[_Piece]]:
    """``pieces`` in order, cut into batches whose pieces lie end to end in one file with one operation: each
    piece starts where the one before it ended, at most ``IOV_MAX`` pieces and ``max_bytes`` bytes a batch."""
    out: list[list[_Piece]] = []
    size = 0
    for p in pieces:
        last = out[-1][-1] if out else None
        if (last is not None and p.op == last.op and p.fd == last.fd and p.file_offset == last.file_offset + len(last.view)
                and len(out[-1]) < IOV_MAX and size + len(p.view) <= max_bytes):
            out[-1].append(p)
            size += len(p.view)
        else:
            out.append([p])
            size = len(p.view)
    return out


def _vectored(batch: list[_Piece]) -> int:
    """Read (``preadv``) or write (``pwritev``) a batch of pieces end to end in one file, from its first piece's
    offset; a partial transfer is continued from where it stopped. OSError for a failed call or a short file.
    Returns the calls made."""
    views = [p.view for p in batch]
    offset, calls = batch[0].file_offset, 0
    call = os.preadv if batch[0].op == READ else os.pwritev
    while views:
        done = call(batch[0].fd, views, offset)
        calls += 1
        if done == 0:
            raise OSError(0, f"short {'read' if call is os.preadv else 'write'}: nothing moved at file offset {offset}")
        offset += done
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]
    return calls
