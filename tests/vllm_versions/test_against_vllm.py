"""kvxfer's vLLM backend against vLLM 0.33's and 0.34's own classes and worker code (``make test-vllm-versions``:
each release's wheel unpacked into its own folder, first on ``PYTHONPATH`` over .venv-vllm, the 0.32 CPU build's
environment). They have no CPU build, so no engine runs here: their offloading modules, their CPU worker with a
recording copy kernel (benchmarks/crosscheck_vllm_worker.py) and their connector hooks do. Skipped under 0.32 (the
engine tests cover it) and without vLLM."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")
if vllm.__version__.startswith("0.32"):
    pytest.skip("vLLM 0.32 is covered by make test-vllm; these run with 0.33 or 0.34 on PYTHONPATH",
                allow_module_level=True)

from kvxfer.offload.vllm.api import TRAITS, VLLM_VERSION, OffloadingWorker  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_the_running_release_is_the_one_on_the_path_and_its_traits_are_read() -> None:
    assert VLLM_VERSION == vllm.__version__ and TRAITS.release == ".".join(VLLM_VERSION.split(".")[:2])
    import vllm.v1.kv_offload.base as base

    assert TRAITS.device_pointers == hasattr(base, "DevicePointers")
    assert TRAITS.expedited == ("expedited" in inspect.signature(OffloadingWorker.submit_load).parameters)
    assert TRAITS.fs_worker == (Path(vllm.__file__).parent / "v1/kv_offload/fs/worker.py").exists()


def test_kvxfers_workers_implement_every_abstract_method_with_the_releases_parameters() -> None:
    from kvxfer.offload.vllm.spec import KvxferOffloadingWorker
    from kvxfer.offload.vllm.tiers import KvxferTieringWorker

    for cls in (KvxferOffloadingWorker, KvxferTieringWorker):
        assert not getattr(cls, "__abstractmethods__", None), cls.__abstractmethods__
        for name in ("submit_store", "submit_load", "get_finished", "wait", "shutdown"):
            theirs = list(inspect.signature(getattr(OffloadingWorker, name)).parameters)
            ours = list(inspect.signature(getattr(cls, name)).parameters)
            assert len(ours) >= len(theirs), (cls, name, ours, theirs)
            if "expedited" in theirs:
                assert "expedited" in ours


def test_the_cross_check_against_the_releases_own_cpu_worker_gives_equal_bytes_and_no_more_ranges() -> None:
    from crosscheck_vllm_worker import run

    t = run(jobs=150, seed=1)
    assert t.jobs > 100 and t.mismatches == 0 and t.over == 0
    assert t.ranges <= t.descriptors and t.bytes > 0
    if TRAITS.expedited:
        assert t.expedited > 0


def test_the_connector_hooks_answer_with_the_releases_own_flags() -> None:
    if not TRAITS.kv_cache_access:
        pytest.skip(f"vLLM {VLLM_VERSION} has no kv_cache_access")
    from vllm.config.kv_transfer import KVCacheAccess

    from kvxfer.offload.vllm.connector import KvxferOffloadingConnector as C

    cfg = SimpleNamespace(kv_connector_extra_config={"kvxfer_executor": {"kind": "nixl"}})
    assert C.kv_cache_access(cfg) == KVCacheAccess.REGISTERS and C.kv_cache_access(cfg).needs_single_chunk()
    assert C.kv_cache_access(SimpleNamespace(kv_connector_extra_config={})) == KVCacheAccess.IN_PROCESS
    assert C.supports_sleep_mode(cfg) is False
    conn = object.__new__(C)  # may_load_async reads only the request
    ask = SimpleNamespace(kv_transfer_params=None, block_hashes=[b"h"], skip_reading_external_kv=False)
    assert conn.may_load_async(ask) is True
    assert conn.may_load_async(SimpleNamespace(kv_transfer_params=None, block_hashes=[b"h"],
                                               skip_reading_external_kv=True)) is False


def _source_of(path: Path, name: str) -> str:
    text = path.read_text()
    start = text.index(f"def {name}(")
    end = text.find("\ndef ", start + 1)
    return text[start:end if end > 0 else None]


def test_block_hashing_and_offload_keys_read_the_same_as_in_032() -> None:
    """The store identity names one key family for 0.32 to 0.34: their hashing and key layout must agree."""
    here = Path(vllm.__file__).parent
    base = Path(subprocess.run([sys.executable, "-c", "import vllm, os; print(os.path.dirname(vllm.__file__))"],
                               capture_output=True, text=True, env=_env_without_path(), check=True).stdout.strip())
    assert base != here
    for rel, name in (("v1/core/kv_cache_utils.py", "hash_block_tokens"), ("v1/kv_offload/base.py", "make_offload_key")):
        assert _source_of(base / rel, name) == _source_of(here / rel, name), (rel, name)


def _env_without_path() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


_WRITE = """
import sys, json, numpy as np
from types import SimpleNamespace as N
from kvxfer.offload.files.chunk_store import ChunkStore
from kvxfer.offload.vllm.api import VLLM_VERSION
from kvxfer.offload.vllm.tiering import tier_identity
from vllm.v1.kv_offload.base import make_offload_key
spec = N(config=N(model=N(name="org/m", dtype="float16"), cache=N(tokens_per_hash=16),
         parallel=N(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, world_size=1, is_parallelism_agnostic=False),
         canonical_layout=False, kv_cache_layout="NHD", replicated_layout=False,
         groups=(N(tokens_per_block=16, layer_names=("l0",)),)), blocks_per_chunk=1, replicated_layout=False)
ROW = 4096
mem = np.random.default_rng(int(sys.argv[3])).integers(0, 256, ROW * 4, dtype=np.uint8)
store = ChunkStore({"root_dir": sys.argv[1], "capacity_bytes": 16 * ROW}, mem, ROW, tier_identity(spec, ROW, VLLM_VERSION))
keys = [bytes(make_offload_key(bytes([i]) * 32, 0)) for i in range(4)]
if sys.argv[2] == "store":
    store.submit_store(1, keys, [0, 1, 2, 3])
    done = []
    while not done:
        done = store.poll()
    store.close()
    print(json.dumps({"version": VLLM_VERSION, "ok": [bool(r.success) for r in done]}))
else:
    mem[:] = 0
    found = [store.lookup(k) for k in keys]
    store.submit_load(2, keys, [0, 1, 2, 3])
    done = []
    while not done:
        done = store.poll()
    store.close()
    print(json.dumps({"version": VLLM_VERSION, "found": found, "digest": int(mem.astype(np.uint64).sum())}))
"""


def test_a_store_written_under_032_is_read_under_this_release(tmp_path: Path) -> None:
    """The same script stores four chunks under the 0.32 CPU build (no PYTHONPATH) and loads them here."""
    import json

    script = tmp_path / "store.py"
    script.write_text(_WRITE)
    root = tmp_path / "store"
    root.mkdir()
    w = subprocess.run([sys.executable, str(script), str(root), "store", "7"], capture_output=True, text=True,
                       env=_env_without_path(), timeout=300)
    assert w.returncode == 0, w.stderr[-2000:]
    wrote = json.loads(w.stdout.strip().splitlines()[-1])
    assert wrote["version"].startswith("0.32") and all(wrote["ok"])
    r = subprocess.run([sys.executable, str(script), str(root), "load", "7"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    read = json.loads(r.stdout.strip().splitlines()[-1])
    import numpy as np

    expected = int(np.random.default_rng(7).integers(0, 256, 4096 * 4, dtype=np.uint8).astype(np.uint64).sum())
    assert read["version"] == VLLM_VERSION and read["found"] == [True] * 4 and read["digest"] == expected
