"""Accepted jobs are drained on every way out Python sees: a worker or store closed by its owner runs its close
once; one its owner forgot is closed at interpreter exit, while the daemon threads that run its jobs still run."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kvxfer.offload.drain import drain_at_exit, drain_now

ROOT = Path(__file__).resolve().parents[1]


def test_a_close_runs_once_whoever_calls_it_first() -> None:
    calls: list[str] = []
    entry = drain_at_exit(lambda: calls.append("closed"), "a store")
    entry()
    entry()
    assert calls == ["closed"] and entry.done
    drain_now()  # closed already: the exit hook does not run it again
    assert calls == ["closed"]


def test_a_second_caller_waits_for_the_first_close_to_finish() -> None:
    started, release, order = threading.Event(), threading.Event(), []

    def close() -> None:
        started.set()
        release.wait(5)
        order.append("closed")

    entry = drain_at_exit(close)
    first = threading.Thread(target=entry)
    first.start()
    started.wait(5)
    second = threading.Thread(target=lambda: (entry(), order.append("second returned")))
    second.start()
    release.set()
    first.join(5)
    second.join(5)
    assert order == ["closed", "second returned"]


def test_drain_now_closes_the_newest_first_and_a_failing_close_stops_no_other(caplog: pytest.LogCaptureFixture) -> None:
    order: list[str] = []

    def fail() -> None:
        raise OSError("disk gone")

    keep = [drain_at_exit(lambda: order.append("worker"), "worker"), drain_at_exit(fail, "failing tier"),
            drain_at_exit(lambda: order.append("store"), "store")]
    with caplog.at_level(logging.WARNING, logger="kvxfer.offload"):
        drain_now()
    assert order == ["store", "worker"] and all(e.done for e in keep)
    assert "draining failing tier at exit failed" in caplog.text and "disk gone" in caplog.text


def test_a_forgotten_close_does_not_keep_its_owner_alive() -> None:
    import gc
    import weakref

    class Owner:
        def __init__(self) -> None:
            self.close = drain_at_exit(self.shutdown)

        def shutdown(self) -> None:
            pass

    owner = Owner()
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is None


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from kvxfer.executors import NumpyExecutor
    from kvxfer.offload.vllm import WorkerCore
    from tests.test_vllm_worker import _worker
    from tests.test_vllm_spec import V, _layers

    class Slow(NumpyExecutor):
        def run(self, plan, memory, stream=None, after=None):
            time.sleep(0.5)  # the store is still running when the script ends
            out = super().run(plan, memory, stream, after)
            Path({marker!r}).write_text(plan.direction.value)
            return out

    core = WorkerCore(_worker(_layers(1), Slow()), V.Result)
    assert core.submit_store(1, V.GPU([3], [1], [0]), V.CPU([2]))
    print("accepted", flush=True)
    # no core.shutdown(): the script simply ends
""")


def test_a_store_accepted_by_the_vllm_worker_is_drained_when_the_process_exits_without_shutdown(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    marker = tmp_path / "store-done"
    r = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), marker=str(marker))], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "accepted" in r.stdout
    assert marker.is_file() and marker.read_text() == "d2h"  # the lane thread finished the store before exit
