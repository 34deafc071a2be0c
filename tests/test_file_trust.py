"""The file-trust helpers (kvxfer.executors.file_trust) and the three places that open files with them: the NIXL
file binding, the file tier's integrity records and the shared host region. A file reachable by another name (a
hard link) is refused unless the caller vouches for it (``allow_foreign``), and a wait bound that bounds nothing
(nan, infinity) is refused before anything waits. Runs without NIXL."""
from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from kvxfer.executors import BindingError, FileBinding, file_trust
from kvxfer.offload import FileTier, SharedRegion, SharedRegionError

from . import offload_bad_inputs as ob

PRECIOUS = b"someone's file, reachable from the spill folder by a second name"


def _precious(folder: Path) -> Path:
    target = folder / "precious"
    target.write_bytes(PRECIOUS)
    target.chmod(0o600)
    return target


def test_a_file_with_two_names_is_untrusted_unless_allowed(tmp_path):
    target = _precious(tmp_path)
    assert file_trust.untrusted(os.stat(target)) is None
    os.link(target, tmp_path / "alias")
    why = file_trust.untrusted(os.stat(target))
    assert why is not None and why.startswith("a file with 2 names (hard links)")
    assert file_trust.untrusted(os.stat(target), allow_foreign=True) is None


def test_a_spill_binding_never_writes_through_a_hard_link(tmp_path):
    target = _precious(tmp_path)
    os.link(target, tmp_path / "spill.kv")
    with pytest.raises(BindingError, match=r"a file with 2 names .*FileBinding\(allow_foreign=True\) accepts"):
        FileBinding(tmp_path / "spill.kv", create=True).open(ob.FILE_LAYOUT.buffers[1])
    assert target.read_bytes() == PRECIOUS  # neither extended nor opened for a spill
    fb = FileBinding(tmp_path / "spill.kv", create=True, allow_foreign=True).open(ob.FILE_LAYOUT.buffers[1])
    fb.close()  # the caller vouches for it: accepted


def test_integrity_records_never_truncate_a_hard_linked_file(tmp_path):
    target = _precious(tmp_path)
    os.link(target, tmp_path / "file0.kv.kvxsum")
    mem = np.zeros(ob.FILE_LAYOUT.buffers[0].nbytes, np.uint8)
    with pytest.raises(BindingError, match="integrity records a file with 2 names"):
        FileTier(ob.LocalFiles(), ob.FILE_LAYOUT, {"file0": FileBinding(tmp_path / "file0.kv", create=True)}, {"mem": mem})
    assert target.read_bytes() == PRECIOUS


def test_a_region_with_a_second_name_is_refused_and_accepted_when_allowed(tmp_path):
    r = SharedRegion.create("linked", ob.GEOMETRY, attachers=1, directory=tmp_path)
    os.link(tmp_path / "kvxfer-linked", tmp_path / "elsewhere")
    with pytest.raises(SharedRegionError, match=r"a file with 2 names .*allow_foreign=True\) accepts"):
        SharedRegion.attach("linked", tmp_path)
    SharedRegion.attach("linked", tmp_path, allow_foreign=True).close()
    r.close()


def test_a_rank_attaching_while_the_region_has_two_names_waits_and_gets_in(tmp_path, monkeypatch):
    """Between its link and its unlink a new region file has two names. Attachers check links under the attach
    lock, which the creator holds meanwhile, so a rank attaching at that moment waits and then gets in."""
    real_link, outcome = os.link, []

    def attach() -> None:
        try:
            SharedRegion.attach("racing", tmp_path).close()
            outcome.append("attached")
        except SharedRegionError as e:
            outcome.append(str(e))

    def link_then_let_a_rank_in(src, dst, **kw):
        real_link(src, dst, **kw)
        t = threading.Thread(target=attach, daemon=True)
        t.start()
        t.join(0.5)  # the rank opens the name now, while the file has two names
        threads.append(t)
    threads: list[threading.Thread] = []
    monkeypatch.setattr(os, "link", link_then_let_a_rank_in)
    creator = SharedRegion.create("racing", ob.GEOMETRY, attachers=1, directory=tmp_path)
    monkeypatch.undo()
    threads[0].join(60)
    creator.close()
    assert outcome == ["attached"], outcome


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), "1", True, None])
def test_a_wait_bound_that_bounds_nothing_is_refused_before_waiting(tmp_path, value):
    path = tmp_path / "locked"
    path.write_bytes(b"")
    holder, waiter = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a nan deadline would wait here forever
    try:
        with pytest.raises(file_trust.TimeoutValueError, match=r"^timeout_s = ") as e:
            file_trust.lock_file(waiter, value)
        assert e.value.field == "timeout_s" and isinstance(e.value, ValueError)
        assert not file_trust.lock_file(waiter, 0.0) and not file_trust.lock_file(waiter, -1)  # no wait at all
    finally:
        os.close(holder)
        os.close(waiter)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_region_attach_with_a_non_finite_lock_timeout_names_the_key(tmp_path, value):
    r = SharedRegion.create("nan", ob.GEOMETRY, attachers=1, directory=tmp_path)
    fd = os.open(tmp_path / "kvxfer-nan", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a stopped attacher holding the lock
    try:
        with pytest.raises(SharedRegionError, match=rf"lock_timeout_s = {value!r}: must be a finite number") as e:
            SharedRegion.attach("nan", tmp_path, lock_timeout_s=value)
        assert e.value.field == "lock_timeout_s"
    finally:
        os.close(fd)
        r.close()
