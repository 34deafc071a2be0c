"""What verification costs a file-tier load (issue 41): ``FileTier`` on the POSIX executor restoring a job of 8
regions x 512 pages of 32 KiB (128 MiB, chunks of one page) from a file the page cache holds (``--cold``: from
the disk, the file's pages dropped before every read), with ``verify`` on (each piece checksummed as it lands,
and, for comparison, every chunk in a pass after the read) and off, against one ``preadv`` of the same bytes
into one buffer. The four are sampled in turn (best of ``--reps``), so load from other processes falls on all
of them alike.

    .venv/bin/python benchmarks/bench_tier_verify.py [--reps 7] [--dir /var/tmp] [--threads 1] [--cold]

Prints the CRC-32 in use, the times, load / read for each, and verification's share of the verified load,
(verified - unverified) / verified.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from kvxfer.executors import FileBinding, PosixFileExecutor
from kvxfer.offload import checksums, tier_layout
from kvxfer.offload.files import FileTier
from kvxfer.planner import BlockMapping, plan_transfer

from timing import fastest_s  # this folder: on sys.path when the script runs

REGIONS, BLOCKS, PAGE = 8, 512, 32 << 10


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--threads", type=int, default=1, help="the POSIX executor's I/O threads")
    ap.add_argument("--cold", action="store_true", help="drop the file's pages before every read (from the disk)")
    args = ap.parse_args()
    lay = tier_layout(REGIONS, BLOCKS, PAGE)
    mem = np.random.default_rng(0).integers(0, 256, lay.buffers[0].nbytes, dtype=np.uint8)
    ids = np.arange(BLOCKS)
    spill = plan_transfer(lay, BlockMapping(direction="d2h", src_ids=ids, dst_ids=ids))
    restore = plan_transfer(lay, BlockMapping(direction="h2d", src_ids=ids, dst_ids=ids))
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "file0.kv"
        ex = PosixFileExecutor(threads=args.threads)
        tier = FileTier(ex, lay, {"file0": FileBinding(path, create=True)}, {"mem": mem}, durability="none",
                        chunk_bytes=PAGE)
        tier.spill(spill).raise_for_error()
        into = np.empty(mem.nbytes, np.uint8)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)

        def drop() -> None:
            if args.cold:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        def read() -> None:
            drop()
            got = os.preadv(fd, [into], 0)
            if got != into.nbytes:
                raise OSError(f"short read: {got}")

        landed = tier._landed

        def load(verify: bool, as_read: bool = True) -> None:
            drop()
            tier.verify = verify
            tier._landed = landed if as_read else lambda job: None  # type: ignore[method-assign]
            tier.restore(restore).raise_for_error()

        t = fastest_s({"read": read, "verified": lambda: load(True), "after": lambda: load(True, False),
                         "unverified": lambda: load(False)}, args.reps)
        os.close(fd)
        tier.close()
        ex.close()
    mib = mem.nbytes / (1 << 20)
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), f"crc32: {checksums.crc32_impl()[0]}, {mib:.0f} MiB, "
          f"chunks of {PAGE >> 10} KiB, {args.threads} I/O thread(s), best of {args.reps}, "
          f"{'from the disk (pages dropped before each read)' if args.cold else 'from the page cache'}")
    print(f"one preadv {t['read'] * 1e3:.1f} ms; load verified {t['verified'] * 1e3:.1f} ms "
          f"({t['read'] / t['verified']:.2f}x the read), unverified {t['unverified'] * 1e3:.1f} ms "
          f"({t['read'] / t['unverified']:.2f}x); verification {(t['verified'] - t['unverified']) / t['verified']:.0%} "
          "of the verified load")
    print(f"the same load checksummed in a pass after the read (before this change): {t['after'] * 1e3:.1f} ms "
          f"({t['read'] / t['after']:.2f}x the read; verification {(t['after'] - t['unverified']) / t['after']:.0%})")


if __name__ == "__main__":
    main()
