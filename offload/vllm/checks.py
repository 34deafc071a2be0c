"""Start-up checks of kvxfer's vLLM backend: every key of ``kv_connector_extra_config`` it or vLLM reads, the
counters file, the host memory the tier needs and the executor kind against the engine's device.

Pure Python over the values vLLM hands over (no vLLM import). Each refusal is one ``ExtraConfigError`` (a
ValueError) naming the key and its value, or an ``UnsupportedFeatureError`` (a ValueError) naming a feature vLLM
handed over that kvxfer does not copy; a key neither vLLM's offloading nor kvxfer reads is not refused (other
connectors and specs add their own) but reported by ``check_extra``, with the closest known key, so a misspelt
``blocks_per_chunks`` is not silently ignored.
"""
from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..files.atomic import path_refusal

__all__ = ["KVXFER_KEYS", "VLLM_KEYS", "ExtraConfigError", "UnsupportedFeatureError", "available_memory",
           "caches_device", "check_blocks_per_chunk", "check_executor_device", "check_extra", "check_host_memory",
           "check_stats_path", "stats_path"]

KVXFER_KEYS = ("kvxfer_executor", "kvxfer_shared_region", "kvxfer_stats_path", "kvxfer_verify")
# the keys vLLM 0.32's offloading connector, its CPU and tiering specs and its spec factory read
VLLM_KEYS = ("spec_name", "spec_module_path", "cpu_bytes_to_use", "blocks_per_chunk", "block_size", "eviction_policy",
             "cache_policy_module_path", "store_threshold", "max_tracker_size", "canonical_layout", "offload_prompt_only",
             "self_describing_kv_events", "secondary_tiers", "backpressure")
_PSEUDO_FS = ("/proc", "/sys", "/dev")  # no place for a file kvxfer replaces whole


class UnsupportedFeatureError(ValueError):
    """vLLM handed over something this module does not copy; raised at start-up, naming the feature."""

    def __init__(self, feature: str, detail: str):
        self.feature, self.detail = feature, detail
        super().__init__(f"kvxfer offloading does not support {feature}: {detail}")


class ExtraConfigError(ValueError):
    """A ``kv_connector_extra_config`` value kvxfer's backend cannot use; names the key (``field``), the value and
    the reason, in one line."""

    def __init__(self, field: str, value: Any, reason: str):
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"kv_connector_extra_config[{field!r}] = {_short(value)}: {reason}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _positive_int(extra: Mapping[str, Any], key: str) -> None:
    value = extra.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ExtraConfigError(key, value, "must be a positive integer (vLLM would truncate a float or a string)")


def check_extra(extra: Mapping[str, Any], known: Iterable[str] = (), world_size: int = 1) -> list[str]:
    """Check the keys kvxfer reads and the types of vLLM's sizing keys; return one warning per key that neither
    vLLM's offloading, kvxfer nor ``known`` (keys a subclass reads) names. Raises ExtraConfigError: an unknown
    ``kvxfer_*`` key, a non-boolean ``kvxfer_shared_region``/``kvxfer_verify``, an unreadable ``kvxfer_executor``, a
    ``kvxfer_stats_path`` that one of ``world_size`` ranks cannot write (``check_stats_path``), a
    ``cpu_bytes_to_use`` that is not a positive number, a ``blocks_per_chunk``/``block_size`` that is not a positive
    integer."""
    names = (*VLLM_KEYS, *KVXFER_KEYS, *known)
    warnings = []
    for key in extra:
        if not isinstance(key, str):
            raise ExtraConfigError(str(key), extra[key], "keys must be strings")
        if key.startswith("kvxfer_") and key not in KVXFER_KEYS:
            raise ExtraConfigError(key, extra[key], f"unknown kvxfer key (known: {', '.join(KVXFER_KEYS)})")
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            warnings.append(f"kv_connector_extra_config[{key!r}]: neither vLLM's offloading nor kvxfer reads this key, "
                            f"so it is ignored{hint}")
    for key, value in extra.items():
        if _deeper_than(value, _MAX_DEPTH):
            raise ExtraConfigError(key, "...", f"nested more than {_MAX_DEPTH} levels deep: not a configuration")
    for key in ("kvxfer_shared_region", "kvxfer_verify"):
        if extra.get(key) is not None and not isinstance(extra[key], bool):
            raise ExtraConfigError(key, extra[key], "must be true or false")
    cpu = extra.get("cpu_bytes_to_use")
    if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, (int, float))
                            or (isinstance(cpu, float) and not math.isfinite(cpu)) or cpu < 1):
        raise ExtraConfigError("cpu_bytes_to_use", cpu, "must be a positive number of bytes")
    if cpu is not None and cpu >= 2**63:
        raise ExtraConfigError("cpu_bytes_to_use", cpu, "more bytes than any machine holds (at most 2**63 - 1)")
    for key in ("blocks_per_chunk", "block_size"):
        _positive_int(extra, key)
    _check_executor(extra.get("kvxfer_executor"))
    check_stats_path(extra.get("kvxfer_stats_path"), world_size)
    return warnings


_MAX_DEPTH = 32  # a configuration value nested deeper is refused before anything recurses into it


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value``'s dicts, lists and tuples nest more than ``limit`` levels (walked without recursion)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, Mapping):
            items: Iterable[Any] = v.values()
        elif isinstance(v, (list, tuple)):
            items = v
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((x, depth + 1) for x in items)
    return False


def _check_executor(value: Any) -> None:
    if value is not None and not isinstance(value, (Mapping, str, os.PathLike)):
        raise ExtraConfigError("kvxfer_executor", value, "must be an executor config: a dict such as {'kind': 'auto'} "
                               "or the path of a .toml/.json file")
    from kvxfer.executors import ExecutorConfig

    try:
        ExecutorConfig.load(value)
    except (ValueError, OSError) as e:
        raise ExtraConfigError("kvxfer_executor", value, str(e)) from None


def stats_path(value: Any, rank: int = 0, world_size: int = 1) -> Path | None:
    """Where rank ``rank`` writes its counters: ``value`` itself, or with ``.rank<r>`` before the suffix when there is
    more than one rank (None when no path is set)."""
    if value is None or value == "":
        return None
    p = Path(value)
    return p.with_suffix(f".rank{rank}{p.suffix}") if world_size > 1 else p


def check_stats_path(value: Any, world_size: int = 1) -> None:
    """Refuse a ``kvxfer_stats_path`` the workers could not replace whole after each step: not a path, a directory
    or another non-regular file at it (for any rank), a folder that does not exist, a path under /proc, /sys or
    /dev, a folder this process cannot create a file in (tried with a probe file, removed at once)."""
    if value is None or value == "":
        return
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise ExtraConfigError("kvxfer_stats_path", value, "must be a file path (a string)")
    why = path_refusal(os.fspath(value)) if isinstance(os.fspath(value), str) else None
    if why is not None:
        raise ExtraConfigError("kvxfer_stats_path", value, why)
    try:
        _check_stats_folder(value, world_size)
    except OSError as e:
        raise ExtraConfigError("kvxfer_stats_path", value, f"cannot be used: {e.strerror}") from None


def _check_stats_folder(value: Any, world_size: int) -> None:
    folder = Path(value).parent
    real = os.path.realpath(folder)
    if any(real == d or real.startswith(d + os.sep) for d in _PSEUDO_FS):
        raise ExtraConfigError("kvxfer_stats_path", value, f"is under {real}, which holds no regular files")
    if not folder.is_dir():
        raise ExtraConfigError("kvxfer_stats_path", value, f"the folder {str(folder)!r} does not exist (or is not a folder)")
    for rank in range(world_size):
        path = stats_path(value, rank, world_size) or Path(value)
        if path.is_dir():
            raise ExtraConfigError("kvxfer_stats_path", value, f"{str(path)!r} is a directory; name a file in it")
        if path.exists() and not path.is_file():
            raise ExtraConfigError("kvxfer_stats_path", value, f"{str(path)!r} is not a regular file (the counters "
                                   "replace the file at this path whole)")
    probe = folder / f".kvxfer-stats-probe.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ExtraConfigError("kvxfer_stats_path", value, f"cannot create a file in {str(folder)!r}: {e.strerror}") from None
    os.close(fd)
    os.unlink(probe)


def _cgroup_left() -> int | None:
    """Bytes this process's cgroup (v2) may still take, when it has a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
        return None if limit == "max" else max(int(limit) - int(used), 0)
    except (OSError, ValueError):
        return None


def available_memory(directory: str | None = None) -> tuple[int, str]:
    """(bytes, what they are) this machine can give a new host tier now: /proc/meminfo's MemAvailable, what the
    process's cgroup limit leaves, and for a shared region the free space of its ``directory`` (a tmpfs), whichever
    is least."""
    avail, what = -1, "MemAvailable"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if avail < 0:
        avail, what = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical memory"
    left = _cgroup_left()
    if left is not None and left < avail:
        avail, what = left, "left under this process's cgroup memory limit"
    if directory is not None:
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if free < avail:
            avail, what = free, f"free space in {directory}"
    return avail, what


def check_host_memory(needed_bytes: int, cpu_bytes_to_use: Any, directory: str | None = None) -> None:
    """Refuse a host tier of ``needed_bytes`` (made from ``cpu_bytes_to_use``) that this machine cannot hold now
    (``available_memory``), before anything is allocated: a private tier would fail in numpy, a shared region would
    fault (SIGBUS) while its pages are committed."""
    avail, what = available_memory(directory)
    if needed_bytes > avail:
        raise ExtraConfigError("cpu_bytes_to_use", cpu_bytes_to_use,
                               f"this rank's host tier needs {needed_bytes / 2**30:.2f} GiB ({needed_bytes} B), but only "
                               f"{avail / 2**30:.2f} GiB is available ({what}); lower cpu_bytes_to_use")


def check_executor_device(value: Any, device: str) -> None:
    """Refuse an executor kind that cannot copy KV caches on ``device`` ("cpu": vLLM's CPU build), naming the
    configured kind and the device, instead of an import or driver error later."""
    from kvxfer.executors import BACKENDS, ExecutorConfig

    kind = ExecutorConfig.load(value).kind
    if device == "cpu" and kind in BACKENDS and BACKENDS[kind].gpu:  # auto is not in the table: it picks numpy here
        raise ExtraConfigError("kvxfer_executor", value, f"this engine's KV caches are on cpu, which a {kind.value} executor "
                               "cannot copy; use {'kind': 'numpy'} or {'kind': 'auto'}")


def check_blocks_per_chunk(extra: Mapping[str, Any], blocks_per_chunk: int, tokens_per_block: int,
                           max_model_len: int | None) -> None:
    """Refuse a chunk longer than the model's ``max_model_len``: no request could fill one, so nothing would ever
    be offloaded. Names the key that set the chunk (``blocks_per_chunk`` or ``block_size``)."""
    tokens = blocks_per_chunk * tokens_per_block
    if max_model_len is None or tokens <= max_model_len:
        return
    key = "block_size" if extra.get("block_size") is not None else "blocks_per_chunk"
    raise ExtraConfigError(key, extra.get(key, blocks_per_chunk),
                           f"a chunk of {blocks_per_chunk} block(s) of {tokens_per_block} tokens holds {tokens} tokens, more "
                           f"than the model's max_model_len {max_model_len}: no chunk would ever fill, so nothing would be "
                           "offloaded")


def caches_device(spec: Any, kv_caches: Any) -> str:
    """The device type of vLLM's ``kv_caches`` ("cpu" or "cuda"), after refusing others and a host tier of 0 chunks
    (UnsupportedFeatureError naming the feature); shared by kvxfer's specs."""
    kind = str(kv_caches.tensors[0].tensor.device.type) if kv_caches.tensors else "cpu"
    if kind not in ("cpu", "cuda"):
        raise UnsupportedFeatureError(f"KV caches on {kind!r} devices", "kvxfer runs on the CPU, CUDA and ROCm")
    if spec.num_chunks <= 0:
        raise UnsupportedFeatureError("a host tier of 0 chunks",
                                      f"cpu_bytes_to_use {spec.extra_config.get('cpu_bytes_to_use')} holds no chunk")
    return kind
