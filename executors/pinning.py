"""Pin an existing host allocation by registering it with the driver (cudaHostRegister / hipHostRegister).

Registration goes in chunks of at most 64 GiB (a single call fails at 512 GiB or more) that end on block-row
boundaries, so a block never straddles two registrations. If any chunk fails, the chunks already registered
are unregistered and the region is reported as pageable; nothing stays half pinned. This avoids PyTorch's
caching host allocator, which rounds each pinned allocation up to a power of two (100 GB becomes 128 GB).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .memory import resolve

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
    try:
        from cuda.bindings import runtime as rt  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError as e:
        raise ImportError(f"pinning on CUDA needs cuda-bindings: pip install 'kvxfer[cuda]' ({e})") from None
    return Registrar("cudaHostRegister", lambda a, n: int(rt.cudaHostRegister(a, n, flags)[0]),
                     lambda a: int(rt.cudaHostUnregister(a)[0]),
                     lambda c: rt.cudaGetErrorName(rt.cudaError_t(c))[1].decode())


def hip_registrar(flags: int = 0) -> Registrar:
    """hipHostRegister through hip-python (``flags``: hipHostRegister* bits)."""
    try:
        from hip import hip  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError as e:
        raise ImportError(f"pinning on ROCm needs hip-python: pip install 'kvxfer[rocm]' ({e})") from None

    def code(result: Any) -> int:
        return int(result[0] if isinstance(result, tuple) else result)

    def name(c: int) -> str:
        n = hip.hipGetErrorName(c)
        n = n[0] if isinstance(n, tuple) else n
        return n.decode() if isinstance(n, bytes) else str(n)

    return Registrar("hipHostRegister", lambda a, n: code(hip.hipHostRegister(a, n, flags)),
                     lambda a: code(hip.hipHostUnregister(a)), name)


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
                    max_chunk_bytes: int = MAX_CHUNK_BYTES) -> PinnedRegion:
    """Register ``memory`` (numpy array, CPU tensor, RawMemory or (address, nbytes)) chunk by chunk.

    ``row_bytes`` is one block row (every region's page of one block id, or the host buffer's block stride).
    ``registrar`` defaults to cudaHostRegister. On a failed chunk, the chunks before it are unregistered and a
    PinnedRegion with ``pinned=False`` and the driver's error as ``reason`` is returned (not raised): the
    caller decides whether pageable memory is acceptable.
    """
    bound = resolve(memory, "memory")
    registrar = registrar if registrar is not None else cuda_registrar()
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
