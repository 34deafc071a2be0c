"""vLLM's tiering without vLLM: the primary tier's cells where vLLM's region puts them (``tiering_geometry``,
``worker_layout``), the tiering spec's start-up checks, and the file tier's settings, identity and store
(``tier_config``, ``tier_identity``, ``open_store``). The classes vLLM loads are ``tiers``' (which imports vLLM).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Layout, Location

from ..files.chunk_store import ChunkStore, StoreConfig, StoreConfigError, namespace
from ..files.identity import choose_identity, model_fingerprint
from ..files.shared_store import SharedChunkStore
from ..tier import HOST_BUFFER, Cell, Geometry, HostLayout, host_region
from .caches import CacheMap
from .checks import UnsupportedFeatureError, check_extra
from .version import traits

__all__ = ["FORMAT", "TIER_KEYS", "check_tiering_extra", "open_store", "tier_config", "tier_identity", "tiering_geometry",
           "worker_layout"]

FORMAT = "kvxfer-file-tier-1"  # the byte format of a stored chunk: a whole primary-tier row
TIER_KEYS = (*StoreConfig.model_fields, "locality", "enable_kv_events")
_log = logging.getLogger("kvxfer.offload.vllm.tiers")


def tier_config(config: Mapping[str, Any], tier_type: str = "KvxferFileTier") -> StoreConfig:
    """The file tier's settings from its ``secondary_tiers`` entry (vLLM's ``type``, ``module_path`` and
    ``backpressure`` already taken out, ``locality`` too): StoreConfigError whose field reads
    ``secondary_tiers[<type>].<key>`` for a missing, unknown or bad key."""
    try:
        return StoreConfig.model_validate(dict(config))
    except StoreConfigError as e:
        raise StoreConfigError(f"secondary_tiers[{tier_type}].{e.field}", e.value, e.reason) from None


def tier_identity(spec: Any, row_bytes: int, vllm_version: str, *, legacy: bool = False) -> dict[str, Any]:
    """What a stored chunk's bytes mean, read from a vLLM offloading spec (its ``config``, ``blocks_per_chunk``)
    on the scheduler side: the model's content (``model_fingerprint``: config and weights, so a moved folder keeps
    its chunks and another model never reads them; a hub id as it is), KV dtype, tokens per hash, blocks per chunk,
    row bytes, the KV-cache layout and groups, the canonical format or the parallel layout, what vLLM's keys mean
    (``VllmTraits.key_family``: one family for 0.32 to 0.34, so a store outlives an upgrade among them).
    Chunks stored under one identity are never read under another. The parallel sizes are left out only when
    every rank's bytes are the same whatever the layout: vLLM's canonical layout with every layer
    parallelism-agnostic ("portable"), or the replicated single-copy layout (MLA: "replicated"); anything else
    keeps TP, PP, PCP, DCP and world size, so another layout misses. ``legacy``: the identity earlier releases
    wrote (the model's path, vLLM's major.minor, the replicated layout keyed on its sizes), to find their stores."""
    c = spec.config
    p = c.parallel
    replicated = bool(getattr(spec, "replicated_layout", c.replicated_layout))
    portable = bool(c.canonical_layout and p.is_parallelism_agnostic)
    canonical = None
    if c.canonical_layout:
        from .api import canonical_format_id  # vLLM's: only a canonical layout has a format id

        canonical = canonical_format_id(c.kv_cache_layout)
    parallel: Any = {"tp": p.tp_size, "pp": p.pp_size, "pcp": p.pcp_size, "dcp": p.dcp_size, "world": p.world_size}
    if portable:
        parallel = "portable"
    elif replicated and not legacy:
        parallel = "replicated"
    return {
        "format": FORMAT,
        **({"vllm": ".".join(vllm_version.split(".")[:2])} if legacy else {"vllm_keys": traits(vllm_version).key_family}),
        "model": c.model.name if legacy else model_fingerprint(c.model.name),
        "dtype": str(c.model.dtype), "tokens_per_hash": int(c.cache.tokens_per_hash),
        "blocks_per_chunk": int(spec.blocks_per_chunk), "row_bytes": int(row_bytes),
        "kv_cache_layout": c.kv_cache_layout, "canonical_format": canonical, "replicated_layout": replicated,
        "groups": [[int(g.tokens_per_block), list(g.layer_names)] for g in c.groups], "parallel": parallel,
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


def worker_layout(caches: CacheMap, geometry: Geometry) -> Layout:
    """The worker's Layout over vLLM's primary tier: the device buffers, one host buffer of ``geometry.nbytes`` (this
    rank's view of the region), one region per ref of ``caches`` in its cell."""
    regions = tuple(host_region(t, geometry, caches.tp).model_copy(update={"name": name}) for name, t in caches.refs)
    host = Buffer(name=HOST_BUFFER, nbytes=geometry.nbytes, location=Location.HOST)
    return Layout(buffers=(*caches.device.buffers, host), regions=regions, num_groups=caches.num_groups)


def check_tiering_extra(config: Any) -> None:
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


def open_store(spec: Any, primary_kv_view: memoryview, tier_type: str, row_bytes: int, config: Mapping[str, Any],
                executor_for: Callable[[StoreConfig], Any], vllm_version: str) -> ChunkStore | SharedChunkStore:
    """The file tier's ChunkStore over vLLM's primary tier view (one contiguous buffer of ``row_bytes`` rows), with
    its ``secondary_tiers`` settings; a bad setting raises StoreConfigError naming the key as the config spells it."""
    settings = tier_config(config, tier_type)
    rows = np.asarray(primary_kv_view)
    if not rows.flags.c_contiguous or rows.ctypes.data != np.frombuffer(primary_kv_view, np.uint8).ctypes.data:
        raise UnsupportedFeatureError("a primary tier that is not one contiguous buffer", repr(rows.shape))
    identity = choose_identity(settings.root_dir, tier_identity(spec, row_bytes, vllm_version),
                               tier_identity(spec, row_bytes, vllm_version, legacy=True), namespace)
    try:
        kind = SharedChunkStore if settings.shared else ChunkStore  # several engines on one root_dir, or one
        store: ChunkStore | SharedChunkStore = kind(settings, rows.view(np.uint8), row_bytes, identity,
                                                    executor=executor_for(settings))
    except StoreConfigError as e:  # one line naming the key as the tier's config spells it
        raise StoreConfigError(f"secondary_tiers[{tier_type}].{e.field}", e.value, e.reason) from None
    _log.info("kvxfer file tier: %s, %d slots of %d bytes (%d found)", store.folder, store.slots, row_bytes,
              store.stats.found)
    return store
