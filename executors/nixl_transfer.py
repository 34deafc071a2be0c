"""NIXL transfer handles of one plan in flight: posting, polling with a deadline, release, precise failure."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .base import ExecutorError

SPIN_S = 2e-3  # busy-poll this long before sleeping: small transfers finish within it
SLEEP_S = 2e-4


def poll_until(ready: Callable[[], bool], timeout_s: float) -> bool:
    """Call ``ready`` until it returns True (-> True) or ``timeout_s`` passes (-> False)."""
    start = time.perf_counter()
    while not ready():
        waited = time.perf_counter() - start
        if waited > timeout_s:
            return False
        if waited > SPIN_S:
            time.sleep(SLEEP_S)
    return True


def reason(e: BaseException) -> str:
    """A NIXL exception as text; the binding's exception class names the status (nixlNotFoundError, ...)."""
    return f"{type(e).__name__}: {e}"


class Inflight:
    """The transfer handles of one run, by call index. Memory in ``keep`` stays referenced until they finish.

    Any failure (rejected post, a transfer in ERR, a deadline passed) first gives the other calls at most
    ``drain_s`` to stop touching memory, releases the handles that stopped, then raises ExecutorError; the
    same error is raised again by every later ``poll``/``wait``, so a failed plan never reads as done. So
    ``wait()`` returns or raises within ``timeout_s + drain_s``. Calls still in flight when the drain gives up
    are never released: their memory stays referenced here and ``registrations`` are marked unusable.
    """

    def __init__(self, agent: Any, t0: float, timeout_s: float, keep: list[Any], notifs: tuple[bytes, ...], *,
                 drain_s: float = 1.0, registrations: list[Any] | None = None, notify: bool = True):
        self.agent, self.t0, self.timeout_s, self.keep, self.notifs = agent, t0, timeout_s, keep, notifs
        self.drain_s, self.registrations = drain_s, list(registrations or [])
        self.notify = notify  # False: the tags only name the calls (storage backends take no notifications)
        self.stuck: dict[int, Any] = {}  # calls that outlived the drain: handles kept, memory kept
        self.pending: dict[int, Any] = {}
        self.posted = 0
        self.error: ExecutorError | None = None
        self.elapsed: float | None = None

    def post(self, call: int, make: Callable[[], Any], what: str) -> None:
        """Create the transfer with ``make()`` and post it; raises ExecutorError if NIXL rejects either step."""
        try:
            handle = make()
        except Exception as e:  # the binding raises one class per nixl status
            self._fail("initialize_xfer", call, f"{what}: {reason(e)}")
        self.pending[call] = handle
        self.posted += 1
        try:
            state = self.agent.transfer(handle, self.notifs[call] if self.notify else b"")
        except Exception as e:
            state = reason(e)
        if state == "DONE":
            self._release(call)
        elif state != "PROC":
            self._fail("transfer", call, f"{what}: posting returned {state}")

    def _state(self, call: int) -> str:
        try:
            return str(self.agent.check_xfer_state(self.pending[call]))
        except Exception as e:
            return reason(e)

    def _release(self, call: int) -> None:
        self.pending.pop(call).release()

    def poll(self) -> bool:
        """True once every call is DONE; raises ExecutorError for a call in ERR (or any earlier failure)."""
        if self.error is not None:
            raise self.error
        for call in sorted(self.pending):
            state = self._state(call)
            if state == "DONE":
                self._release(call)
            elif state != "PROC":
                self._fail("check_xfer_state", call, f"transfer {self.notifs[call].decode()} ended in {state}")
        if not self.pending and self.elapsed is None:
            self.elapsed = time.perf_counter() - self.t0
            self.keep = []
        return not self.pending

    def call_done(self, call: int) -> bool:
        """True once call ``call`` is DONE (NIXL calls finish independently); raises like ``poll``."""
        self.poll()
        return call not in self.pending

    def wait_call(self, call: int) -> None:
        """Poll until call ``call`` is DONE; ExecutorError when ``timeout_s`` passes first."""
        if not poll_until(lambda: self.call_done(call), self.timeout_s):
            self._fail("check_xfer_state", call, f"transfer {self.notifs[call].decode()} still in progress after "
                       f"{self.timeout_s}s")

    def wait(self) -> float | None:
        """Poll until done; ExecutorError when ``timeout_s`` passes first. Returns seconds since run()."""
        if not poll_until(self.poll, self.timeout_s):
            call = min(self.pending)
            self._fail("check_xfer_state", call, f"transfer {self.notifs[call].decode()} still in progress after "
                       f"{self.timeout_s}s ({len(self.pending)} calls unfinished)")
        return self.elapsed

    def _fail(self, what: str, call: int, why: str) -> None:
        """Drain the other calls (at most ``drain_s``), release what stopped, record and raise the error."""
        timed_out = "still in progress" in why  # that call may itself still be moving bytes: drain it too
        failed = None if timed_out else self.pending.pop(call, None)
        others = dict(self.pending)
        drained = poll_until(lambda: all(self._state(c) != "PROC" for c in others), self.drain_s)
        stopped = {c: h for c, h in others.items() if drained or self._state(c) != "PROC"}
        self.stuck = {c: h for c, h in others.items() if c not in stopped}
        leftover = []
        for h in ([failed] if failed is not None else []) + list(stopped.values()):
            try:
                h.release()
            except Exception as e:
                leftover.append(reason(e))
        self.pending = {}
        note = f"; {len(others)} other calls " + ("drained" if not self.stuck else
                                                  f"given {self.drain_s}s to drain, {len(self.stuck)} still running")
        if leftover:
            note += f"; release failed: {leftover[0]}"
        if self.stuck:  # bytes may still move: keep the memory referenced, never reuse or deregister it
            for reg in self.registrations:
                reg.mark_unusable()
            note += "; their memory stays referenced and its registration is marked unusable"
        elif not leftover:
            self.keep = []  # nothing in flight references the memory any more
        self.error = ExecutorError(what, call, None, f"{why} ({self.posted} of {len(self.notifs)} calls posted"
                                   f"{note if others or self.stuck else ''}); destination bytes may be partly written",
                                   issued_chunks=self.posted)
        raise self.error
