"""kvxfer's storage-tier counters as vLLM metrics (``/metrics`` of ``vllm serve``, ``LLM.get_metrics()``).

vLLM's tiering manager collects each secondary tier's ``get_stats()`` once per engine step and exposes the names
its ``build_metric_definitions`` declared, through Prometheus. ``METRICS`` is that declaration (one table: name,
kind, labels, meaning, unit); ``TierMeter`` turns the store's counters and the jobs finished since the last call
into increments.

Units that survive vLLM's reader: ``LLM.get_metrics()`` reads counters and histogram counts as whole numbers, so
a time summed in seconds would read 0 for a sub-second total. Times here are milliseconds (a counter of the total
and a histogram per job, whose buckets start at 0.1 ms), bytes are bytes, and the rest are counts. Every metric
carries the label ``tier`` (the tier's type, ``KvxferFileTier``); misses carry ``cause`` and transfers
``direction`` (``store``: host memory to the files, ``load``: the files to host memory).

The JSON counters file (``stats_path``) stays as it was; this module only adds the engine's view. Pure: vLLM's
metadata classes and stats object are handed in, so this module imports no vLLM.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["JOB_MS_BUCKETS", "METRICS", "MISS_CAUSES", "Metric", "TierMeter", "metric_definitions"]

PREFIX = "vllm:kvxfer_tier_"
JOB_MS_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0)
MISS_CAUSES = ("absent", "integrity", "unavailable")
DIRECTIONS = ("store", "load")


@dataclass(frozen=True)
class Metric:
    """One metric: ``kind`` counter, gauge or histogram; ``labels`` after ``tier``; ``doc`` says what and in
    which unit."""

    name: str
    kind: str
    doc: str
    labels: tuple[str, ...] = ()


METRICS = tuple(Metric(PREFIX + n, k, d, lab) for n, k, d, lab in (
    ("lookups", "counter", "Chunk lookups the kvxfer storage tier answered (never blocking: from its index).", ()),
    ("hits", "counter", "Chunk lookups the kvxfer storage tier answered with a hit.", ()),
    ("misses", "counter", "Chunks the kvxfer storage tier could not serve, by cause: absent (a lookup found no "
     "chunk), integrity (a load refused the chunk: torn, stale or corrupted; dropped), unavailable (a load did "
     "not get it otherwise: no longer stored, or the read failed).", ("cause",)),
    ("bytes", "counter", "Bytes the kvxfer storage tier's jobs moved, by direction.", ("direction",)),
    ("chunks", "counter", "Chunks moved by the kvxfer storage tier's jobs, by direction.", ("direction",)),
    ("io_ms", "counter", "Milliseconds the kvxfer storage tier's jobs took on its thread, summed, by direction.",
     ("direction",)),
    ("job_ms", "histogram", "Milliseconds each kvxfer storage-tier job took on the store's thread, by direction.",
     ("direction",)),
    ("failed_jobs", "counter", "kvxfer storage-tier jobs that failed (a load: some chunk not loaded), by direction.",
     ("direction",)),
    ("evictions", "counter", "Chunks the kvxfer storage tier evicted (least recently used) to make room.", ()),
    ("integrity_refusals", "counter", "Chunks the kvxfer storage tier refused: at a load (checksum, record or "
     "epoch) and, when it opened, index entries of stores that never finished.", ()),
    ("skipped", "counter", "Chunks a store could not place (every slot busy being loaded).", ()),
    ("io_calls", "counter", "Data reads and writes the kvxfer storage tier issued.", ()),
    ("syncs", "counter", "fdatasync calls the kvxfer storage tier made.", ()),
    ("stored_chunks", "gauge", "Chunks the kvxfer storage tier holds now.", ()),
    ("capacity_chunks", "gauge", "Chunks the kvxfer storage tier can hold (capacity_bytes / chunk bytes).", ()),
))
_BY_NAME = {m.name: m for m in METRICS}
# counters read from the store's own cumulative counters (StoreStats): metric suffix -> the StoreStats fields summed
_FROM_STATS = {"lookups": ("lookups",), "hits": ("hits",), "evictions": ("evictions",),
               "integrity_refusals": ("integrity_misses", "discarded"), "skipped": ("skipped",),
               "io_calls": ("io_calls",), "syncs": ("syncs",)}


def metric_definitions(counter: Callable[..., Any], gauge: Callable[..., Any],
                       histogram: Callable[..., Any]) -> dict[str, Any]:
    """vLLM's metadata for ``METRICS``: ``counter``, ``gauge`` and ``histogram`` are its metadata classes
    (keywords ``documentation``, ``labelnames``; ``buckets`` for a histogram)."""
    out = {}
    for m in METRICS:
        labels = ("tier", *m.labels)
        if m.kind == "histogram":
            out[m.name] = histogram(documentation=m.doc, labelnames=labels, buckets=JOB_MS_BUCKETS)
        else:
            out[m.name] = (counter if m.kind == "counter" else gauge)(documentation=m.doc, labelnames=labels)
    return out


class TierMeter:
    """The increments of ``METRICS`` since the last ``take``, for the tier labelled ``tier``.

    ``job`` records one finished job (from the results the store's ``poll`` returns); ``misses`` adds keys a
    load could not serve; ``take(stats, stored, capacity)`` returns ``(name, kind, labelvalues, value)`` samples:
    counters as increments (only those that moved), gauges as they are now, one histogram sample per job.
    Threading: one thread (the tier's owner) calls every method."""

    def __init__(self, tier: str):
        self.tier = tier
        self._seen: dict[str, float] = {}
        self._samples: list[tuple[str, str, tuple[str, ...], float]] = []
        self._counts: dict[tuple[str, tuple[str, ...]], float] = {}

    def job(self, direction: str, *, success: bool, chunks: int, nbytes: int, seconds: float) -> None:
        """Count one finished job moving ``chunks`` chunks and ``nbytes`` bytes in ``seconds``."""
        ms = seconds * 1e3
        self._add("chunks", chunks, direction)
        self._add("bytes", nbytes, direction)
        self._add("io_ms", ms, direction)
        if not success:
            self._add("failed_jobs", 1, direction)
        self._samples.append((PREFIX + "job_ms", "histogram", (self.tier, direction), ms))

    def misses(self, cause: str, n: int) -> None:
        """Count ``n`` chunks not served, for ``cause`` (one of MISS_CAUSES)."""
        if cause not in MISS_CAUSES:
            raise ValueError(f"cause = {cause!r}: one of {', '.join(MISS_CAUSES)}")
        self._add("misses", n, cause)

    def take(self, stats: Mapping[str, Any], stored: int, capacity: int) -> list[tuple[str, str, tuple[str, ...], float]]:
        """The samples since the last call; ``stats``: the store's cumulative counters (StoreStats fields),
        ``stored``/``capacity``: chunks held and chunks that fit."""
        for suffix, fields in _FROM_STATS.items():
            now = float(sum(stats.get(f, 0) for f in fields))
            self._add(suffix, max(now - self._seen.get(suffix, 0.0), 0.0))  # a counter never goes back
            self._seen[suffix] = now
        lookups = float(stats.get("lookups", 0)) - float(stats.get("hits", 0))
        self._add("misses", max(lookups - self._seen.get("absent", 0.0), 0.0), "absent")
        self._seen["absent"] = lookups
        out = [(name, _BY_NAME[name].kind, labels, v) for (name, labels), v in self._counts.items() if v]
        out += self._samples
        out += [(PREFIX + "stored_chunks", "gauge", (self.tier,), float(stored)),
                (PREFIX + "capacity_chunks", "gauge", (self.tier,), float(capacity))]
        self._counts, self._samples = {}, []
        return out

    def _add(self, suffix: str, value: float, *labels: str) -> None:
        key = (PREFIX + suffix, (self.tier, *labels))
        self._counts[key] = self._counts.get(key, 0.0) + value
