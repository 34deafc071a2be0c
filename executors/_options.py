"""Typed options of each backend (frozen pydantic models; unknown keys are refused), and ConfigError.

Nothing here imports a driver: config files and the CLI validate options without loading a backend.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvxfer.planner import PlanError, shorten, suggest


class ConfigError(PlanError):
    """Bad executor configuration; names the field and value (a PlanError so validation reports it as is)."""


MAX_DESCRIPTORS_LIMIT = 2**32 - 1  # no call takes more descriptors: a larger cap is a typo, never a limit


def _config_error(err: ValidationError, model: Any = None) -> ConfigError:
    """pydantic's first error as a ConfigError whose field is the dotted path to the bad value."""
    first = err.errors(include_url=False)[0]
    path = ".".join(str(p) for p in first["loc"])
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # raised by a validator, or by a nested model naming its own field
        field = path if not cause.field or path.endswith(cause.field) else ".".join(p for p in (path, cause.field) if p)
        return ConfigError(field, cause.value, cause.reason)
    if first["type"] == "extra_forbidden":
        known = _known_keys(model, first["loc"][:-1])
        key = first["loc"][-1]
        return ConfigError(path, shorten(first.get("input")), f"unknown key {key!r}{suggest(key, known)}")
    msg = first["msg"]
    return ConfigError(path or "config", shorten(first.get("input")), msg[0].lower() + msg[1:])


def _known_keys(model: Any, parents: tuple[Any, ...]) -> list[str]:
    """The field names of the (nested) options model at ``parents``, for "did you mean" hints."""
    for p in parents:
        field = getattr(model, "model_fields", {}).get(p)
        ann = getattr(field, "annotation", None)
        model = next((a for a in (ann, *getattr(ann, "__args__", ())) if isinstance(a, type) and issubclass(a, BaseModel)),
                     None)
    return list(getattr(model, "model_fields", {}))


class Options(BaseModel):
    """Frozen, extra-forbidding options whose validation errors are ConfigErrors naming the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _config_error(e, type(self)) from None

    @classmethod
    def model_validate(cls, obj: Any, **kw: Any) -> Any:
        """As pydantic's ``model_validate``, but a validation error is raised as a ConfigError naming the field."""
        try:
            return super().model_validate(obj, **kw)
        except ValidationError as e:
            raise _config_error(e, cls) from None


class NumpyOptions(Options):
    """numpy: ranges below ``small_range_bytes`` move in window groups (gathers and scatters of one size); ranges
    of ``bulk_range_bytes`` or more move through torch's foreach copy when torch is imported (None, the default:
    never; it pays on the main thread only, see ``_ops_numpy``); the rest by memmove with the GIL held. With
    ``copier`` (the default) and numba installed, every range moves instead through one compiled call per job that
    releases the GIL (``kvxfer[fast]``), on ``copier_threads`` threads."""

    small_range_bytes: int = Field(default=16 << 10, ge=0)
    bulk_range_bytes: int | None = Field(default=None, ge=1)
    copier: bool = True  # the batched GIL-free copier (``_host_copy``) where numba is installed; False: the paths above
    copier_threads: int = Field(default=1, ge=1, le=64)  # threads one job's copy runs on (the caller's among them)


class CudaOptions(Options):
    """cuda-batch: device ordinal; ``max_descriptors`` per call (None = no limit)."""

    device: int = Field(default=0, ge=0)
    max_descriptors: int | None = Field(default=None, ge=0, le=MAX_DESCRIPTORS_LIMIT)


class HipOptions(Options):
    """hip-batch: device ordinal; ``library`` overrides the libamdhip64 search (a non-standard install);
    ``max_descriptors`` per call (None = 8,192, where ROCm faults; 0 = no limit)."""

    device: int = Field(default=0, ge=0)
    library: str | None = None
    max_descriptors: int | None = Field(default=None, ge=0, le=MAX_DESCRIPTORS_LIMIT)


class TritonOptions(Options):
    """triton: ``small_range_bytes`` is auto's threshold (a load goes to the kernel when at least half of its
    bytes move in ranges no larger); ``tile_bytes`` is the bytes one program copies per
    step (power of two); ``num_programs`` caps the grid (None = 4 per SM, or the tile count if smaller)."""

    device: int = Field(default=0, ge=0)
    small_range_bytes: int = Field(default=28 * 1024, ge=0)
    tile_bytes: int = Field(default=8192, ge=16, le=1 << 16)
    num_programs: int | None = Field(default=None, gt=0)

    @field_validator("tile_bytes")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ConfigError("tile_bytes", v, "must be a power of two")
        return v


class PosixOptions(Options):
    """posix: ``threads`` that run a plan's pieces (a plan's reads or writes overlap across them);
    ``piece_bytes``: ranges above this are cut into pieces of at most this size."""

    threads: int = Field(default=4, ge=1, le=256)
    piece_bytes: int = Field(default=8 << 20, ge=4096)


class NixlOptions(Options):
    """nixl: agent ``name`` (default kvxfer-<random>), backends, threads. ``poll_timeout_s`` bounds wait() and
    wait_notifs(); after a failure or timeout, the other calls get at most ``drain_timeout_s`` more to stop."""

    name: str | None = Field(default=None, min_length=1, pattern=r"^[^\x00]*$")  # a C string for NIXL: no NUL
    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = Field(default=0, ge=0)
    progress_thread: bool = True  # a pure initiator may turn it off: wait() polls, and the thread spins
    telemetry: bool = False
    poll_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)  # inf would wait forever
    drain_timeout_s: float = Field(default=1.0, ge=0, allow_inf_nan=False)
