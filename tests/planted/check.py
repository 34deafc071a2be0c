"""Planted bugs and the tests that catch them: each patch here plants one bug a mutation round found the suite
missing; ``CATCHES`` names the test that must fail with it.

    python tests/planted/check.py [PATCH ...]

copies the checkout's files (tracked and untracked, not ignored) into a temporary folder, applies each patch there,
runs its catching test against that copy (kvxfer imported from the copy), and prints whether it was caught. Exit
status 1 when a patch no longer applies or its test passes with the bug planted. ``tests/test_planted.py`` runs it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PACKAGES = ("planner", "executors", "offload", "testing", "cli")


def _named(path: str, name: str) -> list[str]:
    """The pytest arguments that run the tests of ``path`` whose names hold ``name``."""
    return [path, "-k", name]


CATCHES = {  # patch -> the test (a file and a -k expression) that fails with it
    "35-lowering-bound-from-memory.patch":
        _named("tests/test_plan_bound_rules.py",
               "test_an_offset_written_after_the_check_is_bounded_by_the_declared_size_not_the_memory"),
    "35-bound-adds-offset-and-size-in-uint64.patch":
        _named("tests/test_plan_bound_rules.py", "test_an_offset_whose_end_wraps_uint64_is_refused"),
    "35-attr-id-equal-to-table-size-accepted.patch":
        _named("tests/test_exec_cuda.py",
               "test_an_attribute_id_equal_to_its_tables_size_written_after_the_check_is_refused_before_any_call"),
    "35-quick-bound-assumes-largest-range-fits-every-buffer.patch":
        _named("tests/test_plan_bound_rules.py", "test_a_range_longer_than_the_smallest_buffer_it_touches"),
    "35-numpy-memmove-pieces-read-the-first-piece.patch":
        _named("tests/test_exec_numpy.py",
               "test_ranges_of_several_memmove_pieces_move_each_piece_from_its_own_source_bytes"),
    "35-calls-cut-from-the-plan-start.patch":
        _named("tests/test_planner_build.py",
               "test_calls_are_cut_at_each_call_group_and_every_cap_ranges_from_its_start"),
    "36-slots-found-on-reopening-left-free.patch":
        _named("tests/test_chunk_store_damage.py", "test_slots_found_on_reopening_are_never_given_to_a_later_store"),
    "36-checksum-recorded-for-a-failed-store.patch":
        _named("tests/test_vllm_worker.py",
               "test_a_store_that_failed_records_no_checksum_so_a_load_of_its_chunk_is_refused"),
    "36-failed-load-keys-still-hits.patch":
        _named("tests/test_vllm_store_rules.py", "test_the_keys_of_a_failed_load_miss_until_stored_anew"),
    "36-one-group-failed-load-reported-as-failed-receive.patch":
        _named("tests/test_vllm_store_rules.py", "test_a_failed_load_is_reported_as_load_error_blocks_with_one_group"),
}


def copy_checkout(dest: Path) -> None:
    """The checkout's files (tracked and untracked, not ignored) under ``dest``, and ``dest/.tree/kvxfer`` linking
    each package folder (the repository has no kvxfer/ folder: setuptools maps each one)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    tree = dest / ".tree" / "kvxfer"
    tree.mkdir(parents=True)
    for p in PACKAGES:
        os.symlink(dest / p, tree / p)


def caught(patch: str) -> tuple[bool, str]:
    """(whether the patch's catching test fails with the bug planted, what happened)."""
    with tempfile.TemporaryDirectory(prefix="kvxfer-planted-") as tmp:
        dest = Path(tmp)
        copy_checkout(dest)
        applied = subprocess.run(["git", "apply", str(HERE / patch)], cwd=dest, capture_output=True, text=True)
        if applied.returncode:
            return False, f"does not apply: {applied.stderr.strip()}"
        env = dict(os.environ, PYTHONPATH=str(dest / ".tree"))
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *CATCHES[patch]],
                             cwd=dest, env=env, capture_output=True, text=True, timeout=600)
        last = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
        return run.returncode == 1, last  # 1: tests failed (not 2, an error before any ran, nor 5, none collected)


def main(argv: list[str]) -> int:
    missed = 0
    for patch in argv or sorted(CATCHES):
        ok, what = caught(patch)
        missed += not ok
        print(f"{'caught' if ok else 'MISSED'}  {patch}: {what}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
