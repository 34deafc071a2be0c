"""kvxfer under vLLM's tiering (0.32): ``KvxferTieringOffloadingSpec`` and the storage tier ``KvxferFileTier``.

vLLM's ``TieringOffloadingSpec`` keeps a primary tier of host memory (a ``SharedOffloadRegion``, one per engine)
that secondary tiers in the scheduler process copy whole chunk rows out of ("cascade") and back into
("promotion"). ``KvxferTieringOffloadingSpec`` is that spec with kvxfer's worker for device <-> host, bound to
each rank's view of vLLM's region exactly where vLLM's own worker would put the cells, so vLLM's secondary tiers
(its ``fs`` tier, or kvxfer's) read and write the same chunks; it runs wherever kvxfer runs, vLLM's CPU build
included (where vLLM's own worker refuses the platform)::

    "kv_connector_extra_config": {
        "spec_name": "KvxferTieringOffloadingSpec", "spec_module_path": "kvxfer.offload.vllm",
        "cpu_bytes_to_use": 8 << 30,
        "secondary_tiers": [{"type": "KvxferFileTier", "module_path": "kvxfer.offload.vllm",
                             "root_dir": "/var/cache/kv", "capacity_bytes": 200 << 30}]}

``KvxferFileTier`` stores primary chunks in files through a ``ChunkStore`` (``kvxfer.offload.files.chunk_store``): integrity records
per chunk, durability before a store is reported done, bounded capacity with LRU eviction, files private to
their owner, a namespace per identity (``tier_identity``), warm restarts, and loads that check every chunk. Its
keys (``StoreConfig``): ``root_dir``, ``capacity_bytes`` (required), ``durability``, ``verify``, ``o_direct``,
``io_threads``, ``lock_timeout_s``, ``stats_path``; vLLM's ``locality`` too. Anything else is refused at start-up
with one line naming the key.

Importing this module imports neither vLLM nor torch; the classes are built on first access.
"""
from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Layout, Location

from ..build import assemble_worker
from ..files.chunk_store import ChunkStore, StoreConfig, StoreConfigError
from ..tier import HOST_BUFFER, Cell, Geometry, HostLayout, host_region
from . import import_vllm
from .caches import CacheMap, read_caches
from .checks import UnsupportedFeatureError, check_executor_device, check_extra, stats_path
from .spec import caches_device
from .worker import WorkerCore

FORMAT = "kvxfer-file-tier-1"  # the byte format of a stored chunk: a whole primary-tier row
TIER_KEYS = (*StoreConfig.model_fields, "locality")
_log = logging.getLogger(__name__)



def tier_config(config: Mapping[str, Any], tier_type: str = "KvxferFileTier") -> StoreConfig:
    """The file tier's settings from its ``secondary_tiers`` entry (vLLM's ``type``, ``module_path`` and
    ``backpressure`` already taken out, ``locality`` too): StoreConfigError whose field reads
    ``secondary_tiers[<type>].<key>`` for a missing, unknown or bad key."""
    try:
        return StoreConfig.model_validate(dict(config))
    except StoreConfigError as e:
        raise StoreConfigError(f"secondary_tiers[{tier_type}].{e.field}", e.value, e.reason) from None


def tier_identity(spec: Any, row_bytes: int, vllm_version: str) -> dict[str, Any]:
    """What a stored chunk's bytes mean, read from a vLLM offloading spec (its ``config``, ``blocks_per_chunk``)
    on the scheduler side: model, KV dtype, tokens per hash, blocks per chunk, row bytes, the KV-cache layout and
    groups, the canonical format or the parallel layout, vLLM's major.minor. Chunks stored under one identity are
    never read under another. The parallel sizes are left out only when the bytes are portable: vLLM's canonical
    layout with every layer parallelism-agnostic (then TP=2 and TP=1 share the namespace); anything else keeps
    TP, PP, PCP, DCP and world size, so another layout misses."""
    c = spec.config
    p = c.parallel
    portable = bool(c.canonical_layout and p.is_parallelism_agnostic)
    canonical = None
    if c.canonical_layout:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (  # type: ignore[import-not-found, unused-ignore]
            canonical_format_id,
        )

        canonical = canonical_format_id(c.kv_cache_layout)
    return {
        "format": FORMAT, "vllm": ".".join(vllm_version.split(".")[:2]), "model": c.model.name,
        "dtype": str(c.model.dtype), "tokens_per_hash": int(c.cache.tokens_per_hash),
        "blocks_per_chunk": int(spec.blocks_per_chunk), "row_bytes": int(row_bytes),
        "kv_cache_layout": c.kv_cache_layout, "canonical_format": canonical,
        "replicated_layout": bool(getattr(spec, "replicated_layout", c.replicated_layout)),
        "groups": [[int(g.tokens_per_block), list(g.layer_names)] for g in c.groups],
        "parallel": "portable" if portable else {"tp": p.tp_size, "pp": p.pp_size, "pcp": p.pcp_size,
                                                 "dcp": p.dcp_size, "world": p.world_size},
    }


def tiering_geometry(kv_caches: Any, caches: CacheMap, *, num_chunks: int, blocks_per_chunk: int, row_bytes: int,
                     rank_offset: int) -> Geometry:
    """The cells of ``caches`` where vLLM's tiering worker keeps them in a ``SharedOffloadRegion`` row: each
    KV tensor in ``kv_caches.tensors`` order gets ``blocks_per_chunk`` pages, from ``rank_offset`` (this rank's
    slot: rank x its page size) in the direct layout, from the row's start in the canonical layout, whose pages
    are the canonical ones (the largest of the tensor's refs). Raises UnsupportedFeatureError where kvxfer's
    layout would differ from vLLM's: a ref page other than its tensor's in the direct layout, a canonical page
    other than kvxfer's, cells that overrun the row."""
    k, canonical = blocks_per_chunk, caches.layout is HostLayout.CANONICAL
    pages = [int(t.page_size_bytes) for t in kv_caches.tensors]
    if canonical:  # vLLM's canonical cell: the largest canonical page among the tensor's refs
        largest = [0] * len(pages)
        for group in kv_caches.group_data_refs:
            for ref in group:
                if ref.mapping is not None:
                    largest[ref.tensor_idx] = max(largest[ref.tensor_idx], int(ref.mapping.canonical_page_size_bytes))
        pages = [c or p for c, p in zip(largest, pages)]
    used = {t.name: t for t in caches.device.tensors}
    cells, at = [], 0 if canonical else rank_offset
    for i, page in enumerate(pages):
        t = used.get(f"t{i}")
        if t is not None:
            want = t.page_bytes * caches.tp.size if canonical and t.sharing.value == "sharded" else t.page_bytes
            if want != page:
                raise UnsupportedFeatureError("a layer page other than its host cell's page under tiering",
                                              f"tensor {i}: kvxfer would lay out {want}-byte pages, vLLM's region "
                                              f"{page}-byte pages")
            cells.append(Cell(tensor=t.name, rank=None if canonical else caches.tp.rank, offset_bytes=at,
                              page_bytes=page))
        at += k * page
    if at > row_bytes:
        raise UnsupportedFeatureError("cells that overrun the primary tier's row",
                                      f"{at} bytes of cells in a {row_bytes}-byte row")
    return Geometry(num_chunks=num_chunks, blocks_per_chunk=k, row_stride_bytes=row_bytes, layout=caches.layout,
                    cells=tuple(cells))


def _worker_layout(caches: CacheMap, geometry: Geometry) -> Layout:
    regions = tuple(host_region(t, geometry, caches.tp).model_copy(update={"name": name}) for name, t in caches.refs)
    host = Buffer(name=HOST_BUFFER, nbytes=geometry.nbytes, location=Location.HOST)
    return Layout(buffers=(*caches.device.buffers, host), regions=regions, num_groups=caches.num_groups)


def _warn_unpinned(reason: str) -> None:
    _log.warning("kvxfer: pinning vLLM's primary tier failed (%s); it stays pageable", reason)


_LAZY = {
    "KvxferTieringOffloadingSpec": (
        "vLLM's ``TieringOffloadingSpec`` (a host-memory primary tier in vLLM's ``SharedOffloadRegion`` and the\n"
        "``secondary_tiers`` of its config: vLLM's ``fs``, ``KvxferFileTier``, ...) whose worker is kvxfer's,\n"
        "bound to each rank's view of that region where vLLM's worker keeps the cells, so that the scheduler-side\n"
        "tiers read and write the same chunks; it runs on vLLM's CPU build too. The ``kvxfer_*`` keys of\n"
        "``KvxferOffloadingSpec`` apply (``kvxfer_shared_region`` must stay true: the region is vLLM's)."),
    "KvxferFileTier": (
        "vLLM's ``SecondaryTierManager`` over a kvxfer ``ChunkStore``: ``lookup`` answers from the store's index\n"
        "(never blocks), stores and loads run as merged file I/O on the store's thread, a chunk that fails its\n"
        "check is a miss (the promotion reports the keys that did load), a store is done once durable. Keys of\n"
        "its ``secondary_tiers`` entry: those of ``StoreConfig`` and vLLM's ``locality``."),
}


__all__ = ["FORMAT", "TIER_KEYS", "tier_classes", "tier_config", "tier_identity", "tiering_geometry", *_LAZY]


def _tiering_worker_class(base: Any) -> type:
    """KvxferTieringWorker over vLLM's ``OffloadingWorker``: ``WorkerCore``'s behaviour over vLLM's region, which it
    releases once drained; it keeps the wall times of its last 32 load submissions (the restore timeline)."""

    class KvxferTieringWorker(WorkerCore, base):  # type: ignore[misc]
        """The worker over vLLM's region (``WorkerCore``'s behaviour); releases the region once it has drained."""

        def __init__(self, region: Any, *args: Any, **kw: Any):
            super().__init__(*args, **kw)
            self.region = region
            self.stats.load_submitted = []  # type: ignore[attr-defined]  # wall times, for the restore timeline

        def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            times: list[float] = self.stats.load_submitted  # type: ignore[attr-defined]
            times[:] = [*times[-31:], time.time()]
            return super().submit_load(job_id, src_spec, dst_spec)

        def shutdown(self) -> None:
            try:
                super().shutdown()
            finally:
                del self.worker  # vLLM unmaps the region only once nothing views its memory
                gc.collect()
                self.region.cleanup()

    return KvxferTieringWorker


def _check_tiering_extra(config: Any) -> None:
    """The tiering spec's start-up checks of ``kv_connector_extra_config`` (warnings logged, refusals raised)."""
    extra = config.extra_config
    for warning in check_extra(extra, (), config.parallel.world_size):
        _log.warning("kvxfer: %s", warning)
    if extra.get("kvxfer_shared_region") is False:
        raise UnsupportedFeatureError("kvxfer_shared_region false under tiering",
                                      "the primary tier is vLLM's shared region, read by the secondary tiers")
    if extra.get("kvxfer_verify"):
        raise UnsupportedFeatureError("kvxfer_verify under tiering", "the secondary tiers write host chunks "
                                      "(promotions) that the worker did not store, so it holds no checksum of them")


def _tiering_worker(spec: Any, kv_caches: Any, vllm: Mapping[str, Any]) -> Any:
    """The KvxferTieringWorker of tiering ``spec`` over vLLM's ``kv_caches``, bound to this rank's view of vLLM's
    region; ``vllm``: the vLLM classes it needs (``SharedOffloadRegion``, ``TransferResult``, the worker class)."""
    import torch

    p, extra = spec.config.parallel, spec.extra_config
    kind = caches_device(spec, kv_caches)
    check_executor_device(extra.get("kvxfer_executor"), kind)
    rank = 0 if spec.replicated_layout else p.rank
    region = vllm["SharedOffloadRegion"](engine_id=spec._engine_id, num_chunks=spec.num_chunks, rank=rank,
                                         kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
                                         cpu_page_size=spec.cpu_page_size_per_worker)
    try:
        canonical = bool(spec.config.canonical_layout)
        if canonical:
            spec._validate_canonical_refs(kv_caches)  # vLLM's certification: portable bytes or a refusal
        caches = read_caches(kv_caches, rank=p.rank, world_size=p.world_size, canonical=canonical,
                             replicated=bool(spec.replicated_layout))
        geometry = tiering_geometry(kv_caches, caches, num_chunks=spec.num_chunks, blocks_per_chunk=spec.blocks_per_chunk,
                                    row_bytes=spec.kv_bytes_per_chunk, rank_offset=rank * spec.cpu_page_size_per_worker)
        memory = region.base_tensor.numpy().view(np.uint8)
        worker = assemble_worker(_worker_layout(caches, geometry), caches.device, (geometry, memory, None),
                                 extra.get("kvxfer_executor"), tp=caches.tp, pin=kind == "cuda", strict_pin=False,
                                 on_unpinned=_warn_unpinned)
    except BaseException:
        region.cleanup()
        raise
    _log.info("kvxfer tiering worker: rank %d/%d on vLLM's primary tier (%d chunks of %d block(s), %d regions)",
              p.rank, p.world_size, spec.num_chunks, spec.blocks_per_chunk, len(caches.refs))
    out = vllm["worker"](region, worker, vllm["TransferResult"], stream=torch.cuda.current_stream if kind == "cuda" else None,
                         stats_path=stats_path(extra.get("kvxfer_stats_path"), p.rank, p.world_size))
    out.stats.host_tier = "vllm-tiering"
    return out


def _tiering_spec_class(base: Any, vllm: Mapping[str, Any]) -> type:
    """KvxferTieringOffloadingSpec over vLLM's ``TieringOffloadingSpec``, whose workers are ``_tiering_worker``'s."""

    class KvxferTieringOffloadingSpec(base):  # type: ignore[misc]
        __doc__ = _LAZY["KvxferTieringOffloadingSpec"]

        def __init__(self, config: Any):
            _check_tiering_extra(config)
            super().__init__(config)

        def get_worker(self, kv_caches: Any) -> Any:
            if getattr(self, "_worker", None) is None:
                self._worker = _tiering_worker(self, kv_caches, vllm)
            return self._worker

    return KvxferTieringOffloadingSpec


def _file_tier_class(base: Any, vllm: Mapping[str, Any]) -> type:
    """KvxferFileTier over vLLM's ``SecondaryTierManager``: the scheduler-side calls on a ChunkStore."""
    Locality, LookupResult, JobResult = vllm["Locality"], vllm["LookupResult"], vllm["JobResult"]

    class KvxferFileTier(base):  # type: ignore[misc]
        __doc__ = _LAZY["KvxferFileTier"]
        medium = vllm["Medium"].STORAGE

        def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                     backpressure_detector: Any = None, **config: Any):
            super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
            locality = config.pop("locality", None)
            self.locality = Locality(locality) if locality is not None else None
            self.store = _open_store(offloading_spec, primary_kv_view, tier_type, self.block_size_bytes, config,
                                     self.storage_executor, vllm["version"])

        def storage_executor(self, settings: StoreConfig) -> Any:
            """The executor the store runs its files on; None (here): kvxfer's POSIX executor on ``io_threads``
            threads, made and closed by the store. A subclass may supply another (a NIXL storage executor)."""
            return None

        def lookup(self, key: bytes, req_context: Any) -> Any:
            return LookupResult.HIT if self.store.lookup(key) else LookupResult.MISS

        def submit_store(self, job_metadata: Any) -> None:
            self.store.submit_store(job_metadata.job_id, list(job_metadata.keys), job_metadata.chunk_ids)

        def submit_load(self, job_metadata: Any) -> None:
            self.store.submit_load(job_metadata.job_id, list(job_metadata.keys), job_metadata.chunk_ids)

        def get_finished_jobs(self) -> list[Any]:
            return [JobResult(job_id=r.job_id, success=r.success, transfer_time=r.seconds, transfer_bytes=r.nbytes,
                              successful_keys=None if r.success else (tuple(r.done_keys) or None))
                    for r in self.store.poll()]

        def has_pending_work(self) -> bool:
            return self.store.pending

        def touch(self, keys: Sequence[bytes], req_context: Any) -> None:
            self.store.touch(keys)

        def on_new_request(self, req_context: Any) -> Any:
            return vllm["RequestOffloadingContext"]()

        def drain_jobs(self) -> None:
            self.store.drain()

        def shutdown(self) -> None:
            self.store.close()  # drains: every store submitted is durable (or failed) before the engine goes

    return KvxferFileTier


def _open_store(spec: Any, primary_kv_view: memoryview, tier_type: str, row_bytes: int, config: Mapping[str, Any],
                executor_for: Any, vllm_version: str) -> ChunkStore:
    """The file tier's ChunkStore over vLLM's primary tier view (one contiguous buffer of ``row_bytes`` rows), with
    its ``secondary_tiers`` settings; a bad setting raises StoreConfigError naming the key as the config spells it."""
    settings = tier_config(config, tier_type)
    rows = np.asarray(primary_kv_view)
    if not rows.flags.c_contiguous or rows.ctypes.data != np.frombuffer(primary_kv_view, np.uint8).ctypes.data:
        raise UnsupportedFeatureError("a primary tier that is not one contiguous buffer", repr(rows.shape))
    identity = tier_identity(spec, row_bytes, vllm_version)
    try:
        store = ChunkStore(settings, rows.view(np.uint8), row_bytes, identity, executor=executor_for(settings))
    except StoreConfigError as e:  # one line naming the key as the tier's config spells it
        raise StoreConfigError(f"secondary_tiers[{tier_type}].{e.field}", e.value, e.reason) from None
    _log.info("kvxfer file tier: %s, %d slots of %d bytes (%d found)", store.folder, store.slots, row_bytes,
              store.stats.found)
    return store


@functools.cache
def tier_classes() -> dict[str, type]:
    """Build the vLLM-facing classes (imports vLLM; once per process)."""
    vllm = import_vllm()
    from vllm.v1.kv_offload import base  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.kv_offload.cpu.shared_offload_region import (  # type: ignore[import-not-found, unused-ignore]
        SharedOffloadRegion,
    )
    from vllm.v1.kv_offload.tiering import base as tiering  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # type: ignore[import-not-found, unused-ignore]

    names: dict[str, Any] = {n: getattr(base, n) for n in ("Locality", "LookupResult", "Medium", "RequestOffloadingContext",
                                                            "TransferResult")}
    names |= {"JobResult": tiering.JobResult, "SharedOffloadRegion": SharedOffloadRegion, "version": str(vllm.__version__),
              "worker": _tiering_worker_class(base.OffloadingWorker)}
    return {"KvxferTieringOffloadingSpec": _tiering_spec_class(TieringOffloadingSpec, names),
            "KvxferFileTier": _file_tier_class(tiering.SecondaryTierManager, names)}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return tier_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
