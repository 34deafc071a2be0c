"""FileTier stays consistent with ``verify=False`` too: checksums off skip only the CRC, never the consistency.

- A spill killed (SIGKILL, in a subprocess) after its data reached the file but before its records never
  restores as success: the records of the chunks it writes are cleared before any data is written.
- A file truncated and extended again under a restore (it then reads as zeros) is refused.
- A record forged with an epoch near 2^64 never becomes the next spill's epoch, and spill() never raises.
- A lock timeout that is not a finite number of seconds is refused, naming the key.
- A plan column written by its holder between the tier's checks and its I/O changes nothing the tier does: the
  tier reads each column once, into a copy it alone holds.

Each runs on kvxfer's POSIX executor, and on NIXL's POSIX backend where nixl-cu13 is installed.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvxfer.executors import FileBinding
from kvxfer.offload.files.file_tier import (
    HEADER_BYTES,
    RECORD,
    FileTier,
    IntegrityError,
    TierConfigError,
    TierError,
    tier_layout,
)
from kvxfer.planner import BlockMapping, plan_transfer

ROOT = Path(__file__).resolve().parents[1]
REGIONS, BLOCKS, PAGE = 2, 8, 4096
SLOTS, TO = [0, 1, 2, 3], [4, 5, 6, 7]


def _executor(kind: str):
    if kind == "nixl":
        pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed (pip install 'kvxfer[nixl]')")
        from kvxfer.executors.nixl_peer import LOOPBACK_ENV

        for k, v in LOOPBACK_ENV.items():
            os.environ.setdefault(k, v)
    from kvxfer.executors import get_executor

    return get_executor({"kind": kind, "nixl": {"backends": ["POSIX"]}} if kind == "nixl" else {"kind": kind})


@pytest.fixture(params=["posix", "nixl"])
def executor(request):
    ex = _executor(request.param)
    yield ex
    ex.close()


def _layout():
    return tier_layout(REGIONS, BLOCKS, PAGE)


def _tier(executor, disk: Path, mem: np.ndarray, **kw) -> FileTier:
    return FileTier(executor, _layout(), {"file0": FileBinding(disk / "file0.kv", create=True)}, {"mem": mem},
                    chunk_bytes=PAGE, verify=False, **kw)


def _spill_plan():
    return plan_transfer(_layout(), BlockMapping(direction="d2h", src_ids=SLOTS, dst_ids=SLOTS))


def _restore_plan():
    return plan_transfer(_layout(), BlockMapping(direction="h2d", src_ids=SLOTS, dst_ids=TO))


def _pattern(byte: int) -> np.ndarray:
    mem = np.zeros(_layout().buffers[0].nbytes, np.uint8)
    blocks = mem.reshape(REGIONS, BLOCKS, PAGE)
    blocks[:, SLOTS] = byte
    return mem


# the child: spill pattern A, then pattern B through an executor that SIGKILLs the process at ``point``
CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    import test_file_tier_consistency as t

    disk, kind, point = sys.argv[1], sys.argv[2], sys.argv[3]

    class Killing:
        def __init__(self, inner): self.inner = inner
        def __getattr__(self, name): return getattr(self.inner, name)
        def run(self, plan, memory, stream=None, after=None):
            if point == "before data":
                os.kill(os.getpid(), signal.SIGKILL)
            transfer = self.inner.run(plan, memory)
            if point == "after data":
                transfer.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return transfer

    ex = t._executor(kind)
    mem = t._pattern(0xA1)
    from pathlib import Path
    with t._tier(ex, Path(disk), mem) as tier:
        tier.spill(t._spill_plan()).raise_for_error()
    mem[:] = t._pattern(0xB2)
    with t._tier(Killing(ex), Path(disk), mem) as tier:
        r = tier.spill(t._spill_plan()).raise_for_error()
        print(json.dumps({{"epoch": r.epoch}}), flush=True)
        if point == "after records":
            os.kill(os.getpid(), signal.SIGKILL)
""").format(tests=str(ROOT / "tests"))


@pytest.mark.parametrize("kind", ["posix", "nixl"])
@pytest.mark.parametrize("point", ["before data", "after data", "after records"])
def test_a_spill_killed_before_its_records_never_restores_as_success_without_checksums(tmp_path, kind, point):
    if kind == "nixl":
        _executor(kind).close()  # skips without nixl-cu13
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), kind, point], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    ex = _executor(kind)
    try:
        mem = np.full(_layout().buffers[0].nbytes, 0x5A, np.uint8)
        with _tier(ex, tmp_path, mem) as tier:
            r = tier.restore(_restore_plan())
        got = mem.reshape(REGIONS, BLOCKS, PAGE)[:, TO]
        if point == "after records":  # the spill finished: its bytes are the ones restored
            assert r.success and (got == 0xB2).all(), r
        elif point == "after data":  # B's bytes sit under no record of theirs: never restored as success
            assert not r.success and isinstance(r.error, IntegrityError), r
            assert "last spill did not finish" in str(r.error)
        else:  # the spill had begun: its chunks hold no record until it finishes
            assert not r.success and "last spill did not finish" in str(r.error), r
    finally:
        ex.close()


class _CutsAndExtendsBeforeReading:
    """The tier's executor, except that the file is truncated to 0 and extended back just before each read."""

    def __init__(self, inner, victim: Path):
        self.inner, self.victim = inner, victim

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, plan, memory, stream=None, after=None):
        size = self.victim.stat().st_size
        os.truncate(self.victim, 0)
        os.truncate(self.victim, size)
        return self.inner.run(plan, memory)


def test_a_file_cut_and_extended_again_under_a_read_is_refused_without_checksums(executor, tmp_path):
    mem = _pattern(0xC3)
    with _tier(executor, tmp_path, mem) as tier:
        tier.spill(_spill_plan()).raise_for_error()
    mem[:] = 0x11
    cutting = _CutsAndExtendsBeforeReading(executor, tmp_path / "file0.kv")
    with _tier(cutting, tmp_path, mem) as tier:
        r = tier.restore(_restore_plan())
    assert not r.success and isinstance(r.error, TierError) and r.error.step == "file check after reading", r
    assert "file0.kv" in str(r.error)


def test_a_record_forged_with_an_epoch_near_2_64_is_never_the_next_epoch_and_spill_never_raises(executor, tmp_path):
    mem = _pattern(0xD4)
    with _tier(executor, tmp_path, mem) as tier:
        tier.spill(_spill_plan()).raise_for_error()
    forged = np.zeros(1, dtype=RECORD)
    forged["epoch"] = 2**64 - 2
    fd = os.open(f"{tmp_path / 'file0.kv'}.kvxsum", os.O_RDWR)
    try:  # the record of chunk 14 (region 1, file block 6), one the spills do not write
        os.pwrite(fd, forged.tobytes(), HEADER_BYTES + 14 * RECORD.itemsize)
    finally:
        os.close(fd)
    with _tier(executor, tmp_path, mem) as tier:
        epochs = [tier.spill(_spill_plan()) for _ in range(2)]
        assert all(r.success for r in epochs), epochs
        assert all(r.epoch is not None and r.epoch < 2**62 for r in epochs) and epochs[0].epoch < epochs[1].epoch
        assert tier.restore(_restore_plan()).success
        r = tier.restore(plan_transfer(_layout(), BlockMapping(direction="h2d", src_ids=[6], dst_ids=[7])))
        assert not r.success and "forged or corrupted" in str(r.error), r


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, "5", True])
def test_a_lock_timeout_that_is_not_a_finite_number_of_seconds_is_refused_naming_the_key(executor, tmp_path, value):
    with pytest.raises(TierConfigError) as e:
        _tier(executor, tmp_path, _pattern(0), lock_timeout_s=value)
    assert isinstance(e.value, ValueError) and e.value.field == "lock_timeout_s"
    assert str(e.value).startswith(f"lock_timeout_s = {value!r}: must be a finite number of seconds")
    assert not (tmp_path / "file0.kv").exists()  # refused before any file is made


class WritesThePlan:
    """An executor that writes the caller's ``plan`` (column ``name``, range ``index``, through a torch alias, which
    writes what numpy will not) just before it runs a plan: a holder of the plan writing it between the tier's
    checks and its I/O."""

    def __init__(self, inner, plan, name: str, index: int, value: int):
        self.inner, self.plan, self.name, self.index, self.value = inner, plan, name, index, value

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, plan, memory, stream=None, after=None):
        import warnings

        torch = pytest.importorskip("torch")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the column is read-only to numpy
            torch.from_numpy(self.plan.column(self.name))[self.index] = self.value
        return self.inner.run(plan, memory)


@pytest.mark.parametrize("op", ["restore", "spill"])
def test_a_column_written_between_the_tiers_checks_and_its_io_changes_nothing_it_does(executor, tmp_path, op):
    """Slots 0-3 of each region hold pattern A, slots 4-7 pattern B (verify=False: no CRC to catch a mix-up). Range 0
    of the job is moved to slots 4-7 after the tier checked it: a restore must still bring A (the chunks whose
    records were checked), a spill must still write slots 0-3 (the chunks whose records it writes), and slots 4-7
    must keep B."""
    pytest.importorskip("torch")
    slots_b = [4, 5, 6, 7]
    mem = _pattern(0xA1)
    mem.reshape(REGIONS, BLOCKS, PAGE)[:, slots_b] = 0xB2
    with _tier(executor, tmp_path, mem) as tier:
        tier.spill(plan_transfer(_layout(), BlockMapping(direction="d2h", src_ids=SLOTS + slots_b,
                                                         dst_ids=SLOTS + slots_b))).raise_for_error()
    if op == "restore":
        plan, side = _restore_plan(), "src_offset"
        mem[:] = 0
    else:
        plan, side = _spill_plan(), "dst_offset"
        mem.reshape(REGIONS, BLOCKS, PAGE)[:, SLOTS] = 0xC3
    assert plan.num_ranges == REGIONS and int(plan.column(side)[0]) == 0  # one range per region, region 0 first
    with _tier(WritesThePlan(executor, plan, side, 0, 4 * PAGE), tmp_path, mem) as tier:
        getattr(tier, op)(plan).raise_for_error()
    if op == "restore":
        assert (mem.reshape(REGIONS, BLOCKS, PAGE)[:, TO] == 0xA1).all(), "restored bytes of chunks it did not check"
        return
    back = np.zeros_like(mem)
    with _tier(executor, tmp_path, back) as tier:
        tier.restore(plan_transfer(_layout(), BlockMapping(direction="h2d", src_ids=SLOTS + slots_b,
                                                           dst_ids=SLOTS + slots_b))).raise_for_error()
    got = back.reshape(REGIONS, BLOCKS, PAGE)
    assert (got[:, SLOTS] == 0xC3).all(), "the spill's bytes are not where its records say"
    assert (got[:, slots_b] == 0xB2).all(), "the spill overwrote chunks it holds no record for"
