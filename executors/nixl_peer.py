"""A small bootstrap for two NIXL agents: exchange metadata over any multiprocessing Connection (a socket
pair, a Pipe, or a loopback socket from multiprocessing.connection), and a child process that holds the
remote side's buffers. No NIXL listener thread is involved. Descriptions cross as ``PeerInfo`` JSON bytes
(``send_bytes``/``recv_bytes``, never pickled), so a peer cannot make this process run code; the commands to
the child below are pickled, the child being this package's own process.

The child is a fresh interpreter (``python -m kvxfer.executors.nixl_peer --serve FD``) talking over an
inherited socket pair: nothing is forked from a process that runs UCX threads, and the caller's
``__main__`` is never re-imported. ``python -m kvxfer.executors.nixl_peer`` runs a load (READ) and a store
(WRITE) against a peer process over loopback and checks the bytes against the NumPy executor.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from .nixl_memory import MAX_PEER_INFO_BYTES, PeerInfo, PeerInfoError, Registration, RemoteBuffer

if TYPE_CHECKING:  # ops_nixl imports nixl lazily, but importing it here would load the executor for every peer
    from ._ops_nixl import NixlExecutor

LOOPBACK_ENV = {"UCX_TLS": "self,sm,tcp", "UCX_NET_DEVICES": "lo"}


def _recv(conn: Any, timeout_s: float, what: str) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no {what} from the peer within {timeout_s}s")
    return conn.recv()


def exchange(executor: NixlExecutor, conn: Connection, registration: Registration | None,
             timeout_s: float = 30.0) -> tuple[str, dict[str, RemoteBuffer]]:
    """Send this agent's description (``describe`` of ``registration``: name, metadata, segments) and load the
    peer's. Both sides call it. Returns the peer's agent name and its buffers as RemoteBuffers by name; a
    malformed or oversized description raises PeerInfoError naming the field."""
    conn.send_bytes(executor.describe(registration or Registration(executor.agent, {}, [], [])))
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no metadata from the peer within {timeout_s}s")
    try:
        blob = conn.recv_bytes(MAX_PEER_INFO_BYTES)
    except OSError as e:  # recv_bytes refuses a message above the limit
        raise PeerInfoError("blob", "message", f"unreadable or larger than {MAX_PEER_INFO_BYTES} bytes ({e})") from None
    info = PeerInfo.decode(blob)
    return info.agent, executor.add_peer(info)


def _serve(conn: Any) -> None:
    """Child process: own agent, random-filled buffers, then answer read/write/notifs/close commands."""
    from ._ops_nixl import NixlExecutor

    sizes, seed, options = conn.recv()

    ex = NixlExecutor(options)
    rng = np.random.default_rng(seed)
    arrays = {n: np.zeros(size, np.uint8) if seed is None else rng.integers(0, 256, size, dtype=np.uint8)
              for n, size in sizes.items()}
    peer_name, _ = exchange(ex, conn, ex.register(arrays))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "close":
                ex.close()
                conn.send(("ok", None))
                return
            if cmd == "read":
                conn.send(("ok", arrays[args[0]].copy()))
            elif cmd == "write":
                arrays[args[0]][:] = args[1]
                conn.send(("ok", None))
            elif cmd == "notifs":
                ex.wait_notifs(peer_name, args[0], args[1])
                conn.send(("ok", None))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except Exception as e:  # report to the parent instead of dying silently
            conn.send(("error", f"{type(e).__name__}: {e}"))


class PeerProcess:
    """A spawned process whose NIXL agent holds buffers ``sizes`` (name -> bytes), random from ``seed``
    (zeros when ``seed`` is None).

    ``remote`` maps its buffer names to RemoteBuffers for ``executor`` (which learns the peer's metadata,
    and tells the peer its own, including ``registration``). Use as a context manager or call ``close()``.
    """

    def __init__(self, executor: Any, sizes: Mapping[str, int], registration: Registration | None = None, *,
                 seed: int | None = 0, env: Mapping[str, str] | None = None, options: Mapping[str, Any] | None = None,
                 timeout_s: float = 60.0):
        parent, child = socket.socketpair()
        self.conn, self.timeout_s = Connection(parent.detach()), timeout_s
        fd = child.fileno()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvxfer.executors.nixl_peer", "--serve", str(fd)],
                                     pass_fds=(fd,), env={**os.environ, **LOOPBACK_ENV, **(env or {})})
        child.close()
        try:
            self.conn.send((dict(sizes), seed, dict(options or {})))
            self.agent_name, self.remote = exchange(executor, self.conn, registration, timeout_s)
        except BaseException:
            self.proc.kill()
            raise

    def _process_state(self) -> str:
        """What became of the peer process, in words, for error messages."""
        code = self.proc.poll()
        if code is not None:
            return f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "?"
        if state in ("T", "t"):
            return f"is stopped (process {self.proc.pid}, state {state}: SIGSTOP or a debugger)"
        return f"is running (process {self.proc.pid}) but did not answer"

    def _ask(self, *msg: Any) -> Any:
        if self.conn.closed:
            raise RuntimeError(f"peer {self.agent_name!r} was closed (PeerProcess.close()); start a new one")
        try:
            self.conn.send(msg)
            status, value = _recv(self.conn, self.timeout_s, f"answer to {msg[0]!r}")
        except (EOFError, OSError, TimeoutError) as e:
            raise RuntimeError(f"peer {self.agent_name!r} {self._process_state()}: {e}") from None
        if status != "ok":
            raise RuntimeError(f"peer {self.agent_name!r}: {value}")
        return value

    def read(self, name: str) -> np.ndarray:
        """A copy of the peer's buffer ``name``."""
        return np.asarray(self._ask("read", name), dtype=np.uint8)

    def write(self, name: str, data: np.ndarray) -> None:
        """Overwrite the peer's buffer ``name`` with ``data`` (as bytes); RuntimeError if the peer fails or does not answer."""
        self._ask("write", name, np.asarray(data, dtype=np.uint8))

    def wait_notifs(self, notifs: Iterable[bytes], timeout_s: float | None = None) -> None:
        """Block until the peer has received every notification in ``notifs`` from the executor's agent."""
        self._ask("notifs", list(notifs), timeout_s or self.timeout_s)

    def close(self) -> None:
        """Ask the peer to deregister and exit; kill it if it does not within ``timeout_s``."""
        try:
            if self.proc.poll() is None:
                self._ask("close")
                self.proc.wait(self.timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.conn.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def demo(regions: int = 4, blocks: int = 64, page_bytes: int = 4096) -> None:
    """Load (READ) and store (WRITE) runs of 8 blocks against a peer process; check bytes; print."""
    from kvxfer.planner import plan_transfer, presets

    from ._ops_nixl import NixlExecutor
    from ._ops_numpy import NumpyExecutor

    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)
    layout = presets.kv_layout(regions, blocks, page_bytes)
    host, dev_bufs = layout.buffers[0], layout.buffers[1:]
    rng = np.random.default_rng(0)
    dev = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in dev_bufs}
    ex = NixlExecutor(progress_thread=False)  # wait() polls; only the peer needs a progress thread
    with PeerProcess(ex, {host.name: host.nbytes}, ex.register(dev, dev_bufs)) as peer:
        for direction in ("h2d", "d2h"):
            plan = plan_transfer(layout, presets.mapping("runs8", blocks // 4, blocks, direction))
            want = {**{k: v.copy() for k, v in dev.items()}, host.name: peer.read(host.name)}
            NumpyExecutor().run(plan, want)
            t = ex.run(plan, {**dev, **peer.remote}).wait()
            peer.wait_notifs(t.notifs)
            same = all(np.array_equal(want[k], v) for k, v in {**dev, host.name: peer.read(host.name)}.items())
            print(f"{plan!r}: {t.op} with {t.peer}, {(t.elapsed_s or 0.0) * 1e3:.2f} ms, bytes {'match' if same else 'DIFFER'}")
            if not same:
                raise SystemExit(1)
    ex.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        _serve(Connection(int(sys.argv[2])))
    else:
        demo()
