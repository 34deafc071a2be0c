"""TransferPlan: the immutable, columnar, pointer-free result of planning."""
from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from . import files
from ._model import Spec
from .errors import PlanError
from .spec import Buffer, Direction, Location
from .target import AccessOrder, CopyApi, PlanOptions, Target

SCHEMA_VERSION = 1
COLUMNS: dict[str, np.dtype] = files.PLAN_COLUMNS


class Runs:
    """A run-length encoded column: ``values[i]`` repeated ``lengths[i]`` times. Dense on first access."""

    __slots__ = ("values", "lengths")

    def __init__(self, values: np.ndarray, lengths: np.ndarray):
        self.values, self.lengths = np.asarray(values), np.asarray(lengths, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.lengths.sum())

    def dense(self, dtype: Any = None) -> np.ndarray:
        return np.repeat(self.values if dtype is None else self.values.astype(dtype), self.lengths)


def dense(col: np.ndarray | Runs, dtype: Any = None) -> np.ndarray:
    return col.dense(dtype) if isinstance(col, Runs) else col


class LocationHint(Spec):
    """CUmemLocation: where an operand lives (type code DEVICE=1, HOST=2) and the device ordinal."""

    location: Location
    id: int = Field(default=0, ge=0, lt=2**31)

    @property
    def code(self) -> int:
        return 1 if self.location is Location.DEVICE else 2


class CopyAttributes(Spec):
    """One CUmemcpyAttributes / hipMemcpyAttributes record."""

    src_access_order: AccessOrder
    src_location: LocationHint
    dst_location: LocationHint
    flags: int = Field(default=0, ge=0, lt=2**32)  # C unsigned int

    def short(self) -> str:
        def loc(h: LocationHint) -> str:
            return f"dev{h.id}" if h.location is Location.DEVICE else "host"
        return f"{self.src_access_order.value} {loc(self.src_location)}->{loc(self.dst_location)} flags {self.flags:#x}"


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class TransferPlan:
    """Merged byte ranges as read-only columns, chunked into driver calls, with the attributes to pass.

    Ranges are ``(buffer index, offset)`` pairs into ``buffers``; no raw pointers. Ranges are in canonical
    order (destination buffer, destination offset) unless a call boundary option groups them otherwise.
    ``call_offsets`` has one more entry than there are calls; call ``i`` covers ranges
    ``call_offsets[i]:call_offsets[i+1]``. ``attr`` indexes ``attrs``; a call passes attributes only when
    ``passes_attrs`` (numAttrs = the number of attribute runs in that call).
    """

    __slots__ = ("direction", "target", "options", "api", "buffers", "regions", "region_page_bytes", "attrs", "passes_attrs",
                 "requested_copies", "call_offsets", "_store", "_fingerprint")

    def __init__(self, *, direction: Direction, target: Target, options: PlanOptions, buffers: tuple[Buffer, ...],
                 regions: tuple[str, ...], attrs: tuple[CopyAttributes, ...], requested_copies: int,
                 call_offsets: np.ndarray, columns: dict[str, np.ndarray | Runs], passes_attrs: bool | None = None,
                 api: CopyApi | None = None, region_page_bytes: tuple[int, ...] | None = None):
        set_ = object.__setattr__
        set_(self, "direction", Direction(direction))
        set_(self, "target", target)
        set_(self, "options", options)
        set_(self, "api", CopyApi(api) if api is not None else target.copy_api)
        set_(self, "buffers", tuple(buffers))
        set_(self, "regions", tuple(regions))
        set_(self, "region_page_bytes", tuple(int(p) for p in region_page_bytes or ()))
        if self.region_page_bytes and len(self.region_page_bytes) != len(self.regions):
            raise PlanError("region_page_bytes", len(self.region_page_bytes), f"expected one per region ({len(self.regions)})")
        set_(self, "attrs", tuple(attrs))
        set_(self, "passes_attrs", target.passes_attrs if passes_attrs is None else bool(passes_attrs))
        set_(self, "requested_copies", int(requested_copies))
        n = None
        store: dict[str, np.ndarray | Runs] = {}
        for name, dtype in COLUMNS.items():
            col = columns[name]
            if isinstance(col, Runs):  # kept run-length encoded until first read (columns constant per region)
                col = Runs(col.values.astype(dtype), col.lengths)
                col.values.flags.writeable = col.lengths.flags.writeable = False
            else:
                col = np.ascontiguousarray(col, dtype=dtype)
                if col.ndim != 1:
                    raise PlanError(name, f"shape {col.shape}", "columns are one-dimensional")
                col.flags.writeable = False
            if n is not None and len(col) != n:
                raise PlanError(name, len(col), f"column length differs from {n}")
            n = len(col)
            store[name] = col
        set_(self, "_store", store)
        co = np.ascontiguousarray(call_offsets, dtype=np.int64)
        if co.ndim != 1 or len(co) < 1 or co[0] != 0 or co[-1] != n or np.any(np.diff(co) <= 0):
            raise PlanError("call_offsets", co.tolist()[:8], f"must rise strictly from 0 to {n}")
        co.flags.writeable = False
        set_(self, "call_offsets", co)
        set_(self, "_fingerprint", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("TransferPlan is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("TransferPlan is immutable")

    def _column(self, name: str) -> np.ndarray:
        col = self._store[name]
        if isinstance(col, Runs):
            col = col.dense()
            col.flags.writeable = False
            self._store[name] = col
        return col

    def column_runs(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(values, lengths) of a column's runs of equal values, without expanding run-length columns."""
        col = self._store[name]
        if isinstance(col, Runs):
            keep = col.lengths > 0
            return col.values[keep], col.lengths[keep]
        if len(col) == 0:
            return col, np.zeros(0, dtype=np.int64)
        starts = np.flatnonzero(np.concatenate(([True], col[1:] != col[:-1])))
        return col[starts], np.diff(np.append(starts, len(col)))

    def buffers_used(self, side: str) -> np.ndarray:
        """Sorted indices of the buffers read (``side="src"``) or written (``"dst"``) by any range."""
        if side not in ("src", "dst"):
            raise PlanError("side", side, "expected 'src' or 'dst'")
        return np.unique(self.column_runs(f"{side}_buf")[0])

    def check(self) -> TransferPlan:
        """Verify that every range lies inside its buffers and every index points into its table; returns self.

        Plans from ``plan_transfer`` hold by construction; this guards plans read from files or built by hand.
        Raises PlanError naming the column, the range index and the value.
        """
        nbuf = len(self.buffers)
        sizes = np.array([b.nbytes for b in self.buffers] or [0], dtype=np.uint64)
        for col, limit in (("src_buf", nbuf), ("dst_buf", nbuf), ("region", len(self.regions)), ("attr", len(self.attrs))):
            values, lengths = self.column_runs(col)
            bad = (values < 0) | (values >= limit)
            if bad.any():
                i = int(np.argmax(bad))
                raise PlanError(col, int(values[i]), f"out of range (the plan has {limit})", int(lengths[:i].sum()))
        nb = self.nbytes
        if len(nb) and int(nb.min()) == 0:
            i = int(np.argmin(nb))
            raise PlanError("nbytes", 0, "empty range", i)
        for side in ("src", "dst"):
            off, buf = getattr(self, f"{side}_offset"), getattr(self, f"{side}_buf")
            end = off + nb  # uint64: a wrap shows up as end < off
            bad = (end < off) | (end > sizes[buf])
            if bad.any():
                i = int(np.argmax(bad))
                raise PlanError(f"{side}_offset", int(off[i]), f"range of {int(nb[i])} bytes runs past buffer "
                                f"{self.buffers[int(buf[i])].name!r} of {int(sizes[buf[i]])} bytes", i)
        return self

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def num_ranges(self) -> int:
        return len(self._store["nbytes"])

    @property
    def num_calls(self) -> int:
        return len(self.call_offsets) - 1

    @property
    def stored_nbytes(self) -> int:
        """Bytes held by the plan's arrays as stored (run-length columns count their runs, not their length)."""
        total = self.call_offsets.nbytes
        for col in self._store.values():
            total += col.values.nbytes + col.lengths.nbytes if isinstance(col, Runs) else col.nbytes
        return total

    @property
    def call_sizes(self) -> np.ndarray:
        return np.diff(self.call_offsets)

    @property
    def total_bytes(self) -> int:
        values, lengths = self.column_runs("nbytes")
        return int((values * lengths.astype(np.uint64)).sum(dtype=np.uint64))

    def calls(self) -> Iterator[slice]:
        for i in range(self.num_calls):
            yield slice(int(self.call_offsets[i]), int(self.call_offsets[i + 1]))

    def attr_runs(self, call: int) -> tuple[np.ndarray, np.ndarray]:
        """For call ``call``: (attribute ids, first descriptor of each within the call) -- attrs/attrsIdxs."""
        a = self.attr[self.call_offsets[call]:self.call_offsets[call + 1]]
        if len(a) == 0:
            return a[:0].astype(np.int64), np.zeros(0, dtype=np.int64)
        starts = np.flatnonzero(np.concatenate(([True], a[1:] != a[:-1])))
        return a[starts].astype(np.int64), starts.astype(np.int64)

    # ---- identity ----------------------------------------------------------------------------------------
    def _header(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "direction": self.direction.value,
            "target": self.target.model_dump(mode="json"),
            "options": self.options.model_dump(mode="json", exclude_defaults=True),
            "api": self.api.value,
            "passes_attrs": self.passes_attrs,
            "buffers": [b.model_dump(mode="json") for b in self.buffers],
            "regions": list(self.regions),
            "region_page_bytes": list(self.region_page_bytes),
            "attrs": [a.model_dump(mode="json") for a in self.attrs],
            "requested_copies": self.requested_copies,
        }

    @property
    def fingerprint(self) -> str:
        """sha256 over the header and the little-endian columns; identical on any machine and process."""
        if self._fingerprint is None:
            h = hashlib.sha256(json.dumps(self._header(), sort_keys=True, separators=(",", ":")).encode())
            for name in COLUMNS:
                h.update(name.encode())
                h.update(getattr(self, name).tobytes())
            h.update(self.call_offsets.astype("<i8").tobytes())
            object.__setattr__(self, "_fingerprint", h.hexdigest())
        return self._fingerprint

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransferPlan) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        n, calls = self.num_ranges, self.num_calls
        return (f"TransferPlan({self.direction.value} {self.target.label}: {self.requested_copies} -> "
                f"{n} range{'s' if n != 1 else ''}, {calls} call{'s' if calls != 1 else ''}, {_fmt_bytes(self.total_bytes)})")

    # ---- views (planner/inspect.py) ---------------------------------------------------------------------
    def explain(self, **kw: Any) -> str:
        """Deterministic fixed-width text: header and range table. See kvxfer.planner.inspect.explain."""
        from .inspect import explain
        return explain(self, **kw)

    def _repr_html_(self) -> str:
        from .inspect import to_html
        return to_html(self)

    def __rich__(self) -> Any:
        from .inspect import to_rich
        return to_rich(self)

    def stats(self) -> dict[str, Any]:
        from .inspect import stats
        return stats(self)

    # ---- serialization -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = self._header()
        d["call_offsets"] = self.call_offsets.tolist()
        d["columns"] = {name: getattr(self, name).tolist() for name in COLUMNS}
        d["fingerprint"] = self.fingerprint
        return d

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | None = None) -> TransferPlan:
        """A plan from ``to_dict()`` output, strictly checked (kvxfer.planner.files); ``source`` names the file
        in errors. Raises PlanFileError (a PlanError) naming the field, index and value."""
        f = files.plan_fields(d, source)
        if f["schema_version"] != SCHEMA_VERSION:
            raise files.PlanFileError("schema_version", f["schema_version"],
                                      f"this kvxfer reads plan schema {SCHEMA_VERSION}", source=source)
        for key, enum in (("direction", Direction), ("api", CopyApi)):
            if f[key] not in [m.value for m in enum]:
                raise files.PlanFileError(key, f[key], f"expected one of {[m.value for m in enum]}", source=source)
        try:
            plan = cls(
                direction=Direction(f["direction"]), target=files.validate(Target, f["target"], "target", source),
                options=files.validate(PlanOptions, f["options"], "options", source),
                buffers=tuple(files.validate(Buffer, b, "buffers", source, i) for i, b in enumerate(f["buffers"])),
                regions=tuple(f["regions"]), region_page_bytes=f["region_page_bytes"],
                attrs=tuple(files.validate(CopyAttributes, a, "attrs", source, i) for i, a in enumerate(f["attrs"])),
                requested_copies=f["requested_copies"], passes_attrs=f["passes_attrs"], api=CopyApi(f["api"]),
                call_offsets=f["call_offsets"], columns=f["columns"]).check()
        except PlanError as e:
            raise files.PlanFileError.wrap(e, source) from None
        want = f["fingerprint"]
        if want is not None and want != plan.fingerprint:
            raise files.PlanFileError("fingerprint", want, f"does not match the plan's content ({plan.fingerprint})",
                                      source=source)
        return plan

    @classmethod
    def from_json(cls, text: str | bytes, source: str | None = None) -> TransferPlan:
        return cls.from_dict(files.parse_json(text, source), source)

    def to_npz_bytes(self) -> bytes:
        buf = io.BytesIO()
        header = json.dumps(self._header() | {"fingerprint": self.fingerprint})
        np.savez_compressed(buf, header=np.frombuffer(header.encode(), dtype=np.uint8),
                            call_offsets=self.call_offsets, **{n: getattr(self, n) for n in COLUMNS})
        return buf.getvalue()

    @classmethod
    def from_npz_bytes(cls, data: bytes, source: str | None = None) -> TransferPlan:
        return cls.from_dict(files.read_npz(data, source), source)

    def save(self, path: str | Path) -> Path:
        """Write JSON (``.json``) or compressed numpy (``.npz``)."""
        path = Path(path)
        if path.suffix == ".npz":
            path.write_bytes(self.to_npz_bytes())
        else:
            path.write_text(self.to_json(indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> TransferPlan:
        """Read a plan file written by ``save`` (``.npz``, else JSON). Raises PlanFileError naming the file."""
        data = files.read_bytes(path, "plan file")
        read = cls.from_npz_bytes if Path(path).suffix == ".npz" else cls.from_json
        return read(data, str(path))


for _name in COLUMNS:
    setattr(TransferPlan, _name, property(lambda self, _n=_name: self._column(_n),
                                          doc=f"Read-only column ``{_name}`` ({COLUMNS[_name]}), one entry per range."))
del _name
