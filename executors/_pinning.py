"""Pin an existing host allocation by registering it with the driver (cudaHostRegister / hipHostRegister).

Registration goes in chunks of at most 64 GiB (a single call fails at 512 GiB or more) that end on block-row
boundaries, so a block never straddles two registrations. If any chunk fails, the chunks already registered
are unregistered and the region is reported as pageable; nothing stays half pinned. This avoids PyTorch's
caching host allocator, which rounds each pinned allocation up to a power of two (100 GB becomes 128 GB).
The driver is the platform's: hipHostRegister on ROCm, cudaHostRegister otherwise (``registrar_for``).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxfer.planner import Platform, import_optional

from ._memory import resolve

MAX_CHUNK_BYTES = 64 << 30


@dataclass(frozen=True)
class Registrar:
    """Driver calls for host registration: ``register(address, nbytes) -> code``, ``unregister(address) -> code``,
    ``error_name(code)``, and the API's name for messages."""

    api: str
    register: Callable[[int, int], int]
    unregister: Callable[[int], int]
    error_name: Callable[[int], str]


def cuda_registrar(flags: int = 0) -> Registrar:
    """cudaHostRegister through cuda-bindings' runtime module (``flags``: cudaHostRegister* bits)."""
    rt = import_optional("cuda.bindings.runtime", "pinning on CUDA")
    return Registrar("cudaHostRegister", lambda a, n: int(rt.cudaHostRegister(a, n, flags)[0]),
                     lambda a: int(rt.cudaHostUnregister(a)[0]),
                     lambda c: rt.cudaGetErrorName(rt.cudaError_t(c))[1].decode())


def hip_registrar(flags: int = 0, library: str | Path | None = None) -> Registrar:
    """hipHostRegister / hipHostUnregister through ctypes on libamdhip64, loaded as the HIP executor loads it
    (``library`` overrides the search; ``flags``: hipHostRegister* bits). Raises ExecutorError naming every
    library tried when none loads."""
    from ._ops_hip import load_hip

    lib = load_hip(library)
    register, unregister, error_name = lib.hipHostRegister, lib.hipHostUnregister, lib.hipGetErrorName
    register.argtypes, register.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint], ctypes.c_int
    unregister.argtypes, unregister.restype = [ctypes.c_void_p], ctypes.c_int
    error_name.argtypes, error_name.restype = [ctypes.c_int], ctypes.c_char_p

    def name(code: int) -> str:
        text = error_name(code)
        return text.decode() if text else f"hipError_t {code}"

    return Registrar("hipHostRegister", lambda a, n: int(register(a, n, flags)), lambda a: int(unregister(a)), name)


def registrar_for(platform: Platform | str) -> Registrar:
    """The host registration of ``platform``'s driver: hipHostRegister on ROCm, cudaHostRegister otherwise."""
    return hip_registrar() if Platform(platform) is Platform.ROCM else cuda_registrar()


def chunk_bounds(nbytes: int, row_bytes: int, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> list[tuple[int, int]]:
    """(offset, size) of each registration: whole rows, at most ``max_chunk_bytes``; the last ends at ``nbytes``."""
    if row_bytes <= 0 or row_bytes > max_chunk_bytes:
        raise ValueError(f"row_bytes = {row_bytes}: must be in (0, {max_chunk_bytes}] (a row never spans two chunks)")
    step = max_chunk_bytes // row_bytes * row_bytes
    return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]


@dataclass
class PinnedRegion:
    """The outcome of pinning: ``pinned`` (all chunks registered) or pageable with ``reason``.
    ``close()`` (or leaving a ``with`` block) unregisters what is registered."""

    address: int
    nbytes: int
    pinned: bool
    chunks: list[tuple[int, int]]
    reason: str | None = None
    _registrar: Registrar | None = field(default=None, repr=False)
    _owner: Any = field(default=None, repr=False)

    def close(self) -> None:
        """Unregister every registered chunk (last first). Raises RuntimeError naming a chunk that fails."""
        failures = []
        registrar = self._registrar
        while self.chunks and registrar is not None:  # chunks are only ever registered through a registrar
            addr, size = self.chunks.pop()
            code = registrar.unregister(addr)
            if code:
                failures.append(f"[{addr:#x}, +{size}): {registrar.error_name(code)} ({code})")
        self.pinned = False
        if failures:
            raise RuntimeError("host unregister failed for " + "; ".join(failures))

    def __enter__(self) -> PinnedRegion:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pin_host_memory(memory: Any, row_bytes: int, registrar: Registrar | None = None,
                    max_chunk_bytes: int = MAX_CHUNK_BYTES, *, platform: Platform | str | None = None) -> PinnedRegion:
    """Register ``memory`` (numpy array, CPU tensor, RawMemory or (address, nbytes)) chunk by chunk.

    ``row_bytes`` is one block row (every region's page of one block id, or the host buffer's block stride).
    ``registrar`` defaults to the driver of ``platform`` (``registrar_for``; None: the platform found,
    ``detect_platform``). On a failed chunk, the chunks before it are unregistered and a PinnedRegion with
    ``pinned=False`` and the driver's error as ``reason`` is returned (not raised): the caller decides whether
    pageable memory is acceptable.
    """
    bound = resolve(memory, "memory")
    if registrar is None:
        if platform is None:
            from .config import detect_platform
            platform = detect_platform()
        registrar = registrar_for(platform)
    region = PinnedRegion(bound.address, bound.nbytes, False, [], None, registrar, bound.owner)
    for i, (off, size) in enumerate(chunk_bounds(bound.nbytes, row_bytes, max_chunk_bytes)):
        code = registrar.register(bound.address + off, size)
        if code:
            reason = (f"{registrar.api} failed on chunk {i} [{off}, +{size}): {registrar.error_name(code)} ({code}); "
                      f"unregistered the {len(region.chunks)} chunk(s) before it, the region stays pageable")
            region.close()
            region.reason = reason
            return region
        region.chunks.append((bound.address + off, size))
    region.pinned = True
    return region
