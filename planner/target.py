"""Where a plan will run. Every platform difference the planner knows of is a pure function of a Target."""
from __future__ import annotations

from enum import StrEnum
from typing import ClassVar

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ._model import Spec
from .errors import TargetError
from .spec import Location


class Platform(StrEnum):
    """The platform a plan is made for: CUDA, ROCm or the host CPU."""

    CUDA = "cuda"
    ROCM = "rocm"
    CPU = "cpu"


class CopyApi(StrEnum):
    """The driver call an executor lowers each chunk to."""

    CUDA_BATCH_V2 = "cuMemcpyBatchAsync_v2"  # CUDA >= 13.0: no failIdx
    CUDA_BATCH = "cuMemcpyBatchAsync"  # CUDA 12.8 ABI: with failIdx
    CUDA_PER_RANGE = "cuMemcpyAsync"  # below 12.8: one call per range, same semantics
    HIP_BATCH = "hipMemcpyBatchAsync"  # ROCm >= 7.1
    HIP_PER_RANGE = "hipMemcpyAsync"  # older or unknown ROCm
    MEMCPY = "memcpy"  # host-only reference


def hip_version(major: int, minor: int, patch: int = 0) -> int:
    """HIP's runtime version encoding: major*10,000,000 + minor*100,000 + patch (7.2.2 build 53211 -> 70253211)."""
    return major * 10_000_000 + minor * 100_000 + patch


def cuda_version(major: int, minor: int) -> int:
    """CUDA driver version encoding: 1000*major + 10*minor (12.8 -> 12080)."""
    return major * 1000 + minor * 10


def parse_runtime_version(platform: str, value: object) -> int:
    """A Target's ``runtime_version`` from what a user writes: the encoded integer the runtime reports
    (CUDA ``cuDriverGetVersion`` 13000, HIP ``hipRuntimeGetVersion`` 70253211), or a ``"major.minor"`` string
    ("13.0", "12.8", "7.16", "7.2"). Raises TargetError with the encoding when the value cannot be meant."""
    rocm = platform == Platform.ROCM.value
    encoding = ("HIP encodes major*10,000,000 + minor*100,000 + build (7.2 is 70200000, ROCm 7.2.2 reports "
                "70253211): pass that integer, hip_version(7, 2) or \"7.2\"") if rocm else (
                "CUDA encodes 1000*major + 10*minor (13.0 is 13000, 12.8 is 12080): pass that integer, "
                "cuda_version(13, 0) or \"13.0\"")
    if isinstance(value, str):
        parts = value.strip().split(".")
        if not all(p.isdigit() for p in parts) or len(parts) < 2:
            raise TargetError("runtime_version", value, f"expected \"major.minor\" or an integer; {encoding}")
        if len(parts) > 2:
            raise TargetError("runtime_version", value, "a three-part version is ambiguous: HIP's third field is a "
                              "build number, not a patch level (ROCm 7.2.2 reports 70253211), and CUDA has none; "
                              "pass the full integer the runtime reports, or \"major.minor\"")
        major, minor = int(parts[0]), int(parts[1])
        if not 0 < major < 100 or minor > (99 if rocm else 9):
            raise TargetError("runtime_version", value, f"not a plausible version; {encoding}")
        return hip_version(major, minor) if rocm else cuda_version(major, minor)
    if isinstance(value, float):
        raise TargetError("runtime_version", value, f"floats are ambiguous (7.1 or 7.10?); {encoding}")
    if isinstance(value, bool):
        raise TargetError("runtime_version", value, "expected an integer or \"major.minor\", got bool")
    if not isinstance(value, int):
        return value  # type: ignore[return-value]  # pydantic reports the type
    if value == 0 or platform == Platform.CPU.value or value < 0:
        return value
    low, high = (hip_version(1, 0), hip_version(100, 0)) if rocm else (cuda_version(1, 0), cuda_version(100, 0))
    if not low <= value < high:
        raise TargetError("runtime_version", value, f"not a plausible {'HIP' if rocm else 'CUDA'} version; {encoding}")
    return value


HIP_BATCH_MIN = hip_version(7, 1)
HIP_ATTRS_MIN = hip_version(7, 13)  # 7.2.1-7.2.3 reject numAttrs > 0
HIP_PREFER_CE_MIN = hip_version(7, 16)  # batches run as a blit kernel unless hipMemcpyFlagExtPreferCE
HIP_MAX_DESCRIPTORS = 8192  # larger batches fault on ROCm
CUDA_BATCH_MIN = cuda_version(12, 8)
CUDA_BATCH_V2_MIN = cuda_version(13, 0)

HIP_FLAG_PREFER_CE = 0x100
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1


class AccessOrder(StrEnum):
    """Source access order; ``code`` is the CUmemcpySrcAccessOrder / hipMemcpySrcAccessOrder value."""

    STREAM = "stream"  # stores: the source is the live GPU cache, read in stream order
    DURING_API_CALL = "during_api_call"
    ANY = "any"  # loads: host memory no stream writes, so the driver may pipeline

    @property
    def code(self) -> int:
        """The C enum value (stream 1, during_api_call 2, any 3)."""
        return {"stream": 1, "during_api_call": 2, "any": 3}[self.value]


class Target(Spec):
    """Platform and runtime version (CUDA driver style 12080, HIP style 71600000; 0 = unknown).

    ``runtime_version`` also accepts ``"major.minor"`` ("13.0", "7.16"); integers that cannot be an encoded
    version (``13`` for CUDA 13.0) raise TargetError showing the encoding. See parse_runtime_version.
    """

    _error: ClassVar = TargetError
    _lenient: ClassVar = frozenset({"runtime_version"})  # its floats and bools get parse_runtime_version's hint
    platform: Platform = Platform.CPU
    runtime_version: int = Field(default=0, ge=0)

    @field_validator("runtime_version", mode="before")
    @classmethod
    def _version(cls, value: object, info: ValidationInfo) -> object:
        platform = info.data.get("platform")
        return parse_runtime_version(platform.value if isinstance(platform, Platform) else str(platform), value)

    @property
    def label(self) -> str:
        """Short name for messages and tables: ``cpu``, ``cuda-12.8``, ``rocm-7.16`` (``-unknown`` for version 0)."""
        v = self.runtime_version
        if self.platform is Platform.CPU:
            return "cpu"
        if v == 0:
            return f"{self.platform.value}-unknown"
        if self.platform is Platform.ROCM:
            major, minor, patch = v // 10_000_000, v // 100_000 % 100, v % 100_000
            return f"rocm-{major}.{minor}" + (f".{patch}" if patch else "")
        return f"cuda-{v // 1000}.{v % 1000 // 10}"

    @property
    def copy_api(self) -> CopyApi:
        """The copy API the target's runtime version offers: the newest batch ABI it has, else per-range copies
        (memcpy on CPU)."""
        v = self.runtime_version
        if self.platform is Platform.CUDA:
            return (CopyApi.CUDA_BATCH_V2 if v >= CUDA_BATCH_V2_MIN
                    else CopyApi.CUDA_BATCH if v >= CUDA_BATCH_MIN else CopyApi.CUDA_PER_RANGE)
        if self.platform is Platform.ROCM:
            return CopyApi.HIP_BATCH if v >= HIP_BATCH_MIN else CopyApi.HIP_PER_RANGE
        return CopyApi.MEMCPY

    @property
    def default_max_descriptors(self) -> int | None:
        """The call size cap when PlanOptions leaves it open: 8,192 on ROCm (larger batches fault), else None (no cap)."""
        return HIP_MAX_DESCRIPTORS if self.platform is Platform.ROCM else None

    @property
    def passes_attrs(self) -> bool:
        """Whether batch calls pass attributes (numAttrs > 0). Unknown ROCm counts as the oldest."""
        if self.platform is Platform.ROCM:
            return self.runtime_version >= HIP_ATTRS_MIN
        return self.platform is Platform.CUDA and self.copy_api is not CopyApi.CUDA_PER_RANGE

    def flags(self, prefer_overlap_with_compute: bool = False) -> int:
        """The attribute flags for this target: prefer-overlap-with-compute when asked, plus prefer-CE on ROCm 7.16 and later."""
        f = FLAG_PREFER_OVERLAP_WITH_COMPUTE if prefer_overlap_with_compute else 0
        if self.platform is Platform.ROCM and self.runtime_version >= HIP_PREFER_CE_MIN:
            f |= HIP_FLAG_PREFER_CE
        return f

    def gates(self) -> tuple[tuple[str, bool], ...]:
        """Every version gate this target sits on one side of; executors compare these with the runtime found."""
        v = self.runtime_version
        if self.platform is Platform.ROCM:
            return (("hip>=7.1 batch", v >= HIP_BATCH_MIN), ("hip>=7.13 attrs", v >= HIP_ATTRS_MIN),
                    ("hip>=7.16 prefer-ce", v >= HIP_PREFER_CE_MIN))
        if self.platform is Platform.CUDA:
            return (("cuda>=12.8 batch", v >= CUDA_BATCH_MIN), ("cuda>=13.0 batch_v2", v >= CUDA_BATCH_V2_MIN))
        return ()

    def __str__(self) -> str:
        return self.label


class PlanOptions(Spec):
    """How to plan.

    coalesce: merge byte-contiguous copies. max_descriptors: call size cap (None = target default, 0 =
    unlimited). max_range_bytes: split longer ranges. prefer_overlap_with_compute: the CUDA/HIP flag.
    num_writers / writer_index: on stores of replicated data, write only canonical pages with
    page % num_writers == writer_index (loads read everything). regions_per_call: cut calls at region
    boundaries (one call per N regions, e.g. per layer) so completion can be reported per layer; merging
    then stays inside a call.
    """

    _error: ClassVar = TargetError
    coalesce: bool = True
    max_descriptors: int | None = Field(default=None, ge=0)
    max_range_bytes: int | None = Field(default=None, gt=0)
    prefer_overlap_with_compute: bool = False
    num_writers: int = Field(default=1, ge=1)
    writer_index: int = Field(default=0, ge=0)
    regions_per_call: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _writer(self) -> PlanOptions:
        if self.writer_index >= self.num_writers:
            raise TargetError("writer_index", self.writer_index, f"must be below num_writers {self.num_writers}")
        return self

    def descriptor_cap(self, target: Target) -> int | None:
        """Descriptors allowed per call on ``target``: ``max_descriptors``, or the target's default when it is None; None means
        no cap (0 also means none)."""
        cap = target.default_max_descriptors if self.max_descriptors is None else self.max_descriptors
        return cap or None


class LocationHint(Spec):
    """CUmemLocation: where an operand lives (type code DEVICE=1, HOST=2) and the device ordinal."""

    location: Location
    id: int = Field(default=0, ge=0, lt=2**31)

    @property
    def code(self) -> int:
        """The C location type: 1 (device) or 2 (host)."""
        return 1 if self.location is Location.DEVICE else 2


class CopyAttributes(Spec):
    """One CUmemcpyAttributes / hipMemcpyAttributes record."""

    src_access_order: AccessOrder
    src_location: LocationHint
    dst_location: LocationHint
    flags: int = Field(default=0, ge=0, lt=2**32)  # C unsigned int

    def short(self) -> str:
        """One line for tables, e.g. ``any host->dev0 flags 0x0``."""
        def loc(h: LocationHint) -> str:
            return f"dev{h.id}" if h.location is Location.DEVICE else "host"
        return f"{self.src_access_order.value} {loc(self.src_location)}->{loc(self.dst_location)} flags {self.flags:#x}"
