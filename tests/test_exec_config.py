"""ExecutorConfig sources and precedence, the name table, and auto's choice (decided on real range sizes)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvxfer.executors import BACKENDS, ExecutorError, NumpyExecutor, RawMemory
from kvxfer.executors.config import (
    AutoExecutor,
    ConfigError,
    ExecutorConfig,
    ExecutorKind,
    choose_executor,
    executor_class,
    get_executor,
)
from kvxfer.planner import BlockMapping, Location, Platform, Target, plan_transfer, presets

from .shims.build import build, compiler
from .shims.cases import assert_same, expected, host_buffers


def test_defaults_and_validation():
    c = ExecutorConfig()
    assert c.kind is ExecutorKind.AUTO and c.max_descriptors is None and c.triton.small_range_bytes == 28 * 1024
    with pytest.raises(ConfigError, match="colour = 'red': unknown key 'colour'"):
        ExecutorConfig(colour="red")
    with pytest.raises(ConfigError, match=r"hip.device = -1"):
        ExecutorConfig.model_validate({"hip": {"device": -1}})
    with pytest.raises(ConfigError, match="triton.tile_bytes = 3000: must be a power of two"):
        ExecutorConfig(triton={"tile_bytes": 3000})
    with pytest.raises(ConfigError, match="kind = 'cuda'"):
        ExecutorConfig(kind="cuda")
    with pytest.raises(ValueError, match="frozen"):
        c.kind = ExecutorKind.NUMPY


def test_sources_and_precedence(tmp_path):
    toml = tmp_path / "x.toml"
    toml.write_text('[executor]\nkind = "hip-batch"\nmax_descriptors = 4096\n[executor.hip]\nlibrary = "/a.so"\n')
    js = tmp_path / "x.json"
    js.write_text(json.dumps({"kind": "numpy", "triton": {"tile_bytes": 4096}}))
    assert ExecutorConfig.load(toml, env={}).hip.library == "/a.so"
    assert ExecutorConfig.load(js, env={}).triton.tile_bytes == 4096
    env = {"KVXFER_EXECUTOR_CONFIG": str(toml), "KVXFER_MAX_DESCRIPTORS": "2048"}
    c = ExecutorConfig.load(env=env)  # file < environment
    assert (c.kind, c.max_descriptors, c.hip.library) == (ExecutorKind.HIP_BATCH, 2048, "/a.so")
    c = ExecutorConfig.load(env=dict(env, KVXFER_EXECUTOR="triton"), kind="numpy", hip__library="/b.so")  # env < args
    assert (c.kind, c.max_descriptors, c.hip.library) == (ExecutorKind.NUMPY, 2048, "/b.so")
    with pytest.raises(ConfigError, match="KVXFER_MAX_DESCRIPTORS = 'lots': .*environment variable KVXFER_MAX_DESCRIPTORS sets max_descriptors"):
        ExecutorConfig.load(env={"KVXFER_MAX_DESCRIPTORS": "lots"})
    with pytest.raises(ConfigError, match="KVXFER_REPLAN = 'maybe'"):
        ExecutorConfig.load(env={"KVXFER_REPLAN": "maybe"})
    with pytest.raises(ConfigError, match="no such file"):
        ExecutorConfig.load(tmp_path / "missing.toml", env={})


def test_name_table_is_lazy_and_complete():
    assert set(BACKENDS) == set(ExecutorKind) - {ExecutorKind.AUTO}
    assert (BACKENDS[ExecutorKind.NIXL].module, BACKENDS[ExecutorKind.NIXL].cls) == ("_ops_nixl", "NixlExecutor")
    assert all(b.load().__name__ == b.cls for b in BACKENDS.values())  # every module string names its module
    import kvxfer.executors as ex
    assert all(b.cls in ex.__all__ for b in BACKENDS.values())  # the package's lazy names come from the table
    assert ExecutorConfig(max_descriptors=4096).options_for("hip-batch").max_descriptors == 4096
    assert ExecutorConfig(nixl={"poll_timeout_s": 3}).options_for("nixl").poll_timeout_s == 3
    assert executor_class("numpy") is NumpyExecutor
    assert isinstance(get_executor({"kind": "numpy"}), NumpyExecutor)
    with pytest.raises(ConfigError, match="kind = 'auto': no executor class"):
        executor_class("auto")
    with pytest.raises(ConfigError, match="cuda.driver_lib = '/x.so': unknown key 'driver_lib'"):
        ExecutorConfig(cuda={"driver_lib": "/x.so"})  # test doubles are not configuration


def _pinned(layout):
    """Bindings whose host buffers claim to be pinned (RawMemory) and device buffers are plain arrays."""
    bufs = host_buffers(layout)
    return {k: (RawMemory(v.ctypes.data, v.nbytes, Location.HOST, pinned=True) if k == "cpu" else v)
            for k, v in bufs.items()}


def test_auto_choice_uses_merged_range_sizes_not_page_size():
    cfg = ExecutorConfig()
    layout = presets.kv_layout(4, 256, 4096)  # 4 KiB pages: small by page size
    cuda = Target(platform="cuda", runtime_version=13000)
    frag = plan_transfer(layout, presets.mapping("fragmented", 64, 256, "h2d"), cuda)
    cont = plan_transfer(layout, presets.mapping("contiguous", 64, 256, "h2d"), cuda)  # merges to 256 KiB ranges
    b = _pinned(layout)
    kind, why = choose_executor(cfg, frag, b, Platform.CUDA)
    assert kind is ExecutorKind.TRITON and "100% of the bytes move in merged ranges <= 28,672 B" in why
    kind, why = choose_executor(cfg, cont, b, Platform.CUDA)
    assert kind is ExecutorKind.CUDA_BATCH and "0% of the bytes move in merged ranges <= 28,672 B" in why
    # decided by bytes, not by counting ranges: one large range outweighs many small ones
    mixed_ids = np.concatenate([np.arange(0, 128, 2), np.arange(160, 256)])  # mean range ~10 KiB, 60% of bytes in one
    mixed = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=mixed_ids, dst_ids=mixed_ids), cuda)
    assert mixed.num_ranges > 64 and choose_executor(cfg, mixed, b, Platform.CUDA)[0] is ExecutorKind.CUDA_BATCH
    small = ExecutorConfig(triton={"small_range_bytes": 1024})
    assert choose_executor(small, frag, b, Platform.CUDA)[0] is ExecutorKind.CUDA_BATCH
    pageable = host_buffers(layout)  # numpy: pinning unknown
    assert "not known to be pinned" in choose_executor(cfg, frag, pageable, Platform.CUDA)[1]
    store = plan_transfer(layout, presets.mapping("fragmented", 64, 256, "d2h"), cuda)
    assert choose_executor(cfg, store, b, Platform.CUDA) == (ExecutorKind.CUDA_BATCH, choose_executor(cfg, store, None, Platform.CUDA)[1])
    assert "d2h" in choose_executor(cfg, store, b, Platform.CUDA)[1]
    assert choose_executor(cfg, frag, b, Platform.ROCM)[0] is ExecutorKind.HIP_BATCH
    assert choose_executor(cfg, frag, b, Platform.CPU)[0] is ExecutorKind.NUMPY
    assert choose_executor(ExecutorConfig(kind="hip-batch"), frag, b, Platform.CUDA) == (ExecutorKind.HIP_BATCH, "configured: kind = hip-batch")


def test_auto_executor_runs_on_cpu_and_explains():
    ex = get_executor(ExecutorConfig(cuda={}, hip={}))
    if ex.platform is not Platform.CPU:
        pytest.skip("a GPU runtime is present")
    layout = presets.kv_layout(2, 32, 128)
    plan = plan_transfer(layout, presets.mapping("runs8", 8, 32, "d2h"))
    bufs = host_buffers(layout)
    want = expected(plan, bufs)
    ex.run(plan, bufs).wait()
    assert_same(bufs, want)
    assert ex.last_choice[0] is ExecutorKind.NUMPY and ex.explain(plan).startswith("executor: numpy (no GPU runtime")


@pytest.mark.skipif(compiler() is None, reason="no C compiler (cc) to build the driver shim")
def test_auto_with_a_cuda_shim_uses_cuda_batch_and_its_target(tmp_path):
    from kvxfer.executors import CudaBatchExecutor

    from .shims.runtime import ShimCudaRuntime
    lib = build("fake_cuda", tmp_path)
    shim = CudaBatchExecutor(ShimCudaRuntime(lib, 12080))
    ex = AutoExecutor(ExecutorConfig(), Platform.CUDA, executors={ExecutorKind.CUDA_BATCH: shim})
    assert isinstance(ex, AutoExecutor) and ex.platform is Platform.CUDA and ex.target.label == "cuda-12.8"
    layout = presets.kv_layout(2, 32, 64 * 1024)
    plan = plan_transfer(layout, presets.mapping("runs8", 8, 32, "d2h"), ex.target)
    bufs = host_buffers(layout)
    want = expected(plan, bufs)
    ex.run(plan, bufs).wait()
    assert_same(bufs, want)
    assert ex.last_choice[0] is ExecutorKind.CUDA_BATCH
    ex.close()


def test_get_executor_applies_the_same_precedence(tmp_path, monkeypatch):
    from kvxfer.executors import NumpyExecutor
    from kvxfer.executors.config import get_executor
    cfg = tmp_path / "x.json"
    cfg.write_text('{"kind": "numpy"}')
    monkeypatch.delenv("KVXFER_EXECUTOR", raising=False)
    assert isinstance(get_executor(cfg), NumpyExecutor)
    assert isinstance(get_executor({"kind": "numpy"}), NumpyExecutor)
    monkeypatch.setenv("KVXFER_EXECUTOR", "hip-batch")  # the environment overrides a file or dict...
    monkeypatch.setenv("KVXFER_HIP_LIBRARY", str(tmp_path / "no-such-libamdhip64.so"))
    with pytest.raises(ExecutorError, match="no-such-libamdhip64"):
        get_executor({"kind": "numpy"})
    assert isinstance(get_executor(ExecutorConfig(kind="numpy")), NumpyExecutor)  # ...not a model given as is


def test_auto_binds_once_for_the_executor_it_chooses():
    ex = AutoExecutor(ExecutorConfig(), Platform.CPU)
    layout = presets.kv_layout(2, 32, 128)
    bufs = host_buffers(layout, seed=2)
    bound = ex.bind(layout, bufs)
    for direction in ("d2h", "h2d"):
        plan = plan_transfer(layout, presets.mapping("runs8", 8, 32, direction))
        want = expected(plan, bufs)
        ex.run(plan, bound).wait()
        assert_same(bufs, want)
    assert ex.last_choice[0] is ExecutorKind.NUMPY and ExecutorKind.NUMPY in bound.extra  # bound once for numpy
    sub = bound.extra[ExecutorKind.NUMPY]
    bound.close()
    assert sub.closed and not bound.extra  # closed with it; the closed binding keeps nothing


def test_config_files_of_unknown_type_are_refused_by_suffix(tmp_path):
    path = tmp_path / "executor.yaml"
    path.write_text("kind: numpy\n")
    with pytest.raises(ConfigError, match=r"executor.yaml.*unknown config file type '.yaml': use a .toml or .json file"):
        ExecutorConfig.load(path)


def test_get_executor_takes_keyword_overrides_over_file_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "executor.json"
    path.write_text('{"kind": "auto", "max_descriptors": 4}')
    monkeypatch.setenv("KVXFER_EXECUTOR", "auto")
    ex = get_executor(path, kind="numpy")
    assert type(ex).__name__ == "NumpyExecutor"
    with pytest.raises(ConfigError, match="overrides"):
        get_executor(ExecutorConfig(), kind="numpy")


def test_unknown_option_key_suggests_the_known_one():
    with pytest.raises(ConfigError, match=r"triton.small_range_byte = 1: unknown key 'small_range_byte' \(did you mean 'small_range_bytes'\?\)"):
        ExecutorConfig.model_validate({"triton": {"small_range_byte": 1}})
