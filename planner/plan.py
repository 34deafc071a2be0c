"""TransferPlan: the immutable, columnar, pointer-free result of planning."""
from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from ._model import IntTuple
from .bounds import check_call_offsets, check_dtype, check_indices, check_inside, check_length, check_runs, check_sizes
from .errors import PlanError
from .files import PLAN_COLUMNS, PlanFileError, check_int, int_array, parse_json, plan_fields, read_bytes, read_npz, validate
from .frozen import freeze
from .runs import Column, Runs, runs_of
from .spec import Buffer, Direction
from .target import CopyApi, PlanOptions, Target
from .target import CopyAttributes as CopyAttributes  # defined with the target (the driver's record); views
from .target import LocationHint as LocationHint  # import both from here too

SCHEMA_VERSION = 1
COLUMNS: dict[str, np.dtype] = PLAN_COLUMNS


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (one decimal, binary units)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class PlanColumn:
    """A read-only column of a TransferPlan, one entry per range (a run-length column expands on first read)."""

    def __init__(self, doc: str):
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, plan: None, owner: type) -> PlanColumn: ...
    @overload
    def __get__(self, plan: TransferPlan, owner: type) -> np.ndarray: ...
    def __get__(self, plan: TransferPlan | None, owner: type) -> np.ndarray | PlanColumn:
        return self if plan is None else plan.column(self.name)


class TransferPlan:
    """Merged byte ranges as read-only columns, chunked into driver calls, with the attributes to pass.

    Ranges are ``(buffer index, offset)`` pairs into ``buffers``; no raw pointers. Ranges are in canonical
    order (destination buffer, destination offset) unless a call boundary option groups them otherwise.
    ``call_offsets`` has one more entry than there are calls; call ``i`` covers ranges
    ``call_offsets[i]:call_offsets[i+1]``. ``attr`` indexes ``attrs``; a call passes attributes only when
    ``passes_attrs`` (numAttrs = the number of attribute runs in that call). ``aliases`` lists (alias, region)
    name pairs: regions naming the same bytes as an earlier region, whose copies that region's ranges make.
    ``region_writers`` holds each region's (num_writers, writer_index) on a store where some region sets its
    own writer rotation (empty otherwise: ``options`` says it all).
    """

    __slots__ = ("direction", "target", "options", "api", "buffers", "regions", "region_page_bytes", "attrs", "passes_attrs",
                 "requested_copies", "call_offsets", "aliases", "region_writers", "_store", "_dense", "_fingerprint", "_checked")
    direction: Direction
    target: Target
    options: PlanOptions
    api: CopyApi
    buffers: tuple[Buffer, ...]
    regions: tuple[str, ...]
    region_page_bytes: tuple[int, ...]
    attrs: tuple[CopyAttributes, ...]
    passes_attrs: bool
    requested_copies: int
    call_offsets: np.ndarray
    aliases: tuple[tuple[str, str], ...]
    region_writers: tuple[tuple[int, int], ...]
    _store: dict[str, Column]
    _dense: dict[str, np.ndarray]
    _fingerprint: str | None
    _checked: bool

    src_buf = PlanColumn("Source buffer index (int32) of every range, into ``buffers``.")
    src_offset = PlanColumn("Source byte offset (uint64) of every range within its buffer.")
    dst_buf = PlanColumn("Destination buffer index (int32) of every range, into ``buffers``.")
    dst_offset = PlanColumn("Destination byte offset (uint64) of every range within its buffer.")
    nbytes = PlanColumn("Size in bytes (uint64) of every range.")
    region = PlanColumn("Region index (int32) of every range's first byte, into ``regions``.")
    attr = PlanColumn("Attribute index (uint16) of every range, into ``attrs``.")

    def __init__(self, *, direction: Direction, target: Target, options: PlanOptions, buffers: tuple[Buffer, ...],
                 regions: tuple[str, ...], attrs: tuple[CopyAttributes, ...], requested_copies: int,
                 call_offsets: np.ndarray, columns: Mapping[str, Column], passes_attrs: bool | None = None,
                 api: CopyApi | None = None, region_page_bytes: Sequence[int] | None = None,
                 aliases: Sequence[Sequence[str]] | None = None,
                 region_writers: Sequence[Sequence[int]] | None = None):
        """A plan from fields given by hand (or read from a file), every one converted and checked: each column
        (a list, an array or ``Runs``) and ``call_offsets`` must hold integers that fit the column's dtype (no
        floats, bools, negative or wrapping values), columns one length and call offsets rising from 0 to it.
        Raises PlanError naming the field (the column), the index and the value. The plan keeps copies of
        the caller's arrays, never the arrays themselves."""
        regions = tuple(regions)
        rpb = region_page_bytes
        rpb = rpb if type(rpb) is IntTuple else tuple(_checked(list(rpb or ()), "region_page_bytes", np.dtype(np.int64)).tolist())
        if rpb and len(rpb) != len(regions):
            raise PlanError("region_page_bytes", len(rpb), f"expected one per region ({len(regions)})")
        pairs = tuple((str(a), str(b)) for a, b in aliases or ())
        unknown = sorted({n for pair in pairs for n in pair} - set(regions)) if pairs else []
        if unknown:
            raise PlanError("aliases", unknown, "not regions of the plan")
        writers = _writers(region_writers, len(regions))
        store: dict[str, Column] = {}
        for name, dtype in COLUMNS.items():
            col = columns[name]
            if isinstance(col, Runs):  # kept run-length encoded until first read (columns constant per region)
                store[name] = Runs(_checked(col.values, f"{name}.values", dtype),
                                   _checked(col.lengths, f"{name}.lengths", np.dtype(np.int64)))
            else:
                store[name] = freeze(_checked(col, name, dtype))
        self._setup(Direction(direction), target, options, CopyApi(api) if api is not None else target.copy_api,
                    tuple(buffers), regions, rpb, tuple(attrs),
                    target.passes_attrs if passes_attrs is None else bool(passes_attrs),
                    _checked_int(requested_copies, "requested_copies"), pairs, writers, store,
                    freeze(_checked(call_offsets, "call_offsets", np.dtype(np.int64))), shape=True)

    @classmethod
    def planned(cls, *, direction: Direction, target: Target, options: PlanOptions, buffers: tuple[Buffer, ...],
                regions: tuple[str, ...], attrs: tuple[CopyAttributes, ...], requested_copies: int,
                call_offsets: np.ndarray, columns: Mapping[str, Column], region_page_bytes: tuple[int, ...],
                aliases: tuple[tuple[str, str], ...], region_writers: tuple[tuple[int, int], ...],
                api: CopyApi, passes_attrs: bool) -> TransferPlan:
        """For the planner: a plan from fields it built, in their final types (non-negative integer columns, call
        offsets rising from 0; ``api`` and ``passes_attrs`` the target's). The plan takes ownership of the
        arrays (nobody may write them afterwards) and freezes them. The plan counts as checked (``check``): the
        planner's construction proves what ``check`` verifies, and executors still bound every value they use."""
        store: dict[str, Column] = {}
        for name, dtype in COLUMNS.items():
            col = columns[name]
            if isinstance(col, Runs):  # never handed out as such (read through runs_of copies or expansion)
                store[name] = col if col.values.dtype == dtype else Runs(col.values.astype(dtype), col.lengths)
            else:  # same-size integers: reinterpreted (the planner's values are non-negative)
                store[name] = freeze(col, dtype) if col.dtype.itemsize == dtype.itemsize else freeze(col.astype(dtype))
        plan = object.__new__(cls)
        plan._setup(direction, target, options, api, buffers, regions, region_page_bytes, attrs, passes_attrs,
                    requested_copies, aliases, region_writers, store, freeze(call_offsets), shape=False, checked=True)
        return plan

    def _setup(self, direction: Direction, target: Target, options: PlanOptions, api: CopyApi,
               buffers: tuple[Buffer, ...], regions: tuple[str, ...], region_page_bytes: tuple[int, ...],
               attrs: tuple[CopyAttributes, ...], passes_attrs: bool, requested_copies: int,
               aliases: tuple[tuple[str, str], ...], region_writers: tuple[tuple[int, int], ...],
               store: dict[str, Column], call_offsets: np.ndarray, shape: bool, checked: bool = False) -> None:
        """Every field, from values already in their final form (the one place a plan's fields are set); then,
        with ``shape``, the shape (``check_shape``). ``checked``: the verdict of ``check`` is known (True)."""
        set_ = object.__setattr__
        set_(self, "direction", direction)
        set_(self, "target", target)
        set_(self, "options", options)
        set_(self, "api", api)
        set_(self, "buffers", buffers)
        set_(self, "regions", regions)
        set_(self, "region_page_bytes", region_page_bytes)
        set_(self, "attrs", attrs)
        set_(self, "passes_attrs", passes_attrs)
        set_(self, "requested_copies", requested_copies)
        set_(self, "aliases", aliases)
        set_(self, "region_writers", region_writers)
        set_(self, "_store", store)
        set_(self, "call_offsets", call_offsets)
        set_(self, "_dense", {})
        set_(self, "_fingerprint", None)
        set_(self, "_checked", checked)
        if shape:
            self.check_shape()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickling and ``copy``: the fields as built; the copy's arrays are frozen again (see ``_restore``)."""
        return _restore, ((self.direction, self.target, self.options, self.api, self.buffers, self.regions,
                           self.region_page_bytes, self.attrs, self.passes_attrs, self.requested_copies,
                           self.aliases, self.region_writers, dict(self._store), self.call_offsets),)

    def copy(self) -> TransferPlan:
        """This plan over arrays only the copy holds: every column and ``call_offsets`` read once, into new frozen
        memory (as a pickle or ``copy.copy`` makes it). A consumer that reads a plan more than once (a file tier
        checks chunks, writes records and runs I/O from the same ranges) works on such a copy: no holder of the
        plan (a ``torch.from_numpy`` alias of a column, a subclass) can change a value between its reads. Call it
        as ``TransferPlan.copy(plan)``, so a subclass cannot stand in. The copy is not checked yet (``check``);
        PlanError for fields of the wrong shape."""
        return _restore(TransferPlan.__reduce__(self)[1][0])

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("TransferPlan is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("TransferPlan is immutable")

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` (one of COLUMNS) as a read-only array; a run-length column is expanded once."""
        col = self._stored(name)
        if not isinstance(col, Runs):
            return col
        dense = self._dense.get(name)
        if dense is None:  # two threads may both expand: equal arrays, either kept
            dense = self._dense[name] = freeze(col.dense())
        check_dtype(name, dense, COLUMNS[name])
        check_length(name, len(dense), len(col))
        return dense

    def column_runs(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(values, lengths) of a column's runs of equal values, without expanding run-length columns."""
        return runs_of(self._stored(name))

    def _stored(self, name: str) -> Column:
        """Column ``name`` as stored, after the shape rule (``bounds.check_dtype`` / ``check_runs``: a column of
        another type, or runs whose values and lengths differ in length, raise PlanError rather than numpy's
        IndexError or ValueError wherever they are read). O(runs) for a run-length column, else O(1)."""
        col = self._store[name]
        if isinstance(col, Runs):
            check_runs(name, col.values, col.lengths, COLUMNS[name])
        else:
            check_dtype(name, col, COLUMNS[name])
        return col

    def buffers_used(self, side: str) -> np.ndarray:
        """Sorted indices of the buffers read (``side="src"``) or written (``"dst"``) by any range."""
        if side not in ("src", "dst"):
            raise PlanError("side", side, "expected 'src' or 'dst'")
        return np.unique(self.column_runs(f"{side}_buf")[0])

    def check_shape(self) -> None:
        """Raise PlanError unless every column has ``num_ranges`` entries and ``call_offsets`` rises strictly
        from 0 to ``num_ranges`` (the constructor ensures both; ``planned`` takes them on trust). O(columns +
        calls). A column whose length differs from the others' is named (``nbytes`` counts as one of them)."""
        lengths = {name: len(self._stored(name)) for name in COLUMNS}
        counts = list(lengths.values())
        n = max(set(counts), key=lambda v: (counts.count(v), v == lengths["nbytes"]))  # the length most columns have
        for name, m in lengths.items():
            check_length(name, m, n)
        check_call_offsets(self.call_offsets, n)

    def check(self) -> TransferPlan:
        """Verify the plan, once: returns self, or raises PlanError naming the column, the range index and the value.

        The one validator of a plan's content, applying the bound rules of ``kvxfer.planner.bounds`` (which
        lowering applies again to the values it reads): every column of its dtype and one length, and call
        offsets rising from 0 to it; every buffer, region and attribute index inside its table; no range empty or
        of 2^63 bytes or more; every range inside its buffers' declared sizes (a wrapping sum included). The
        verdict is kept (a plan is immutable): later calls return at once. Plans from ``plan_transfer`` hold by
        construction; this guards plans read from files, unpickled or built by hand. Executors call it before they run
        a plan, and then bound only the values they use (which a holder writing a column after the check would
        change).
        """
        if self._checked:
            return self
        self.check_shape()
        nbuf = len(self.buffers)
        for col, limit in (("src_buf", nbuf), ("dst_buf", nbuf), ("region", len(self.regions)), ("attr", len(self.attrs))):
            check_indices(col, *self.column_runs(col), limit)
        check_sizes(*self.column_runs("nbytes"))
        sizes = np.array([b.nbytes for b in self.buffers] or [0], dtype=np.uint64)
        names = [b.name for b in self.buffers]
        n, nbytes = self.num_ranges, np.repeat(*self.column_runs("nbytes"))  # the runs just bounded, expanded
        for side in ("src", "dst"):
            offsets = self.column(f"{side}_offset")
            check_length(f"{side}_offset", len(offsets), n)
            check_inside(side, offsets, nbytes, np.repeat(*self.column_runs(f"{side}_buf")), sizes, names)
        object.__setattr__(self, "_checked", True)
        return self

    @property
    def checked(self) -> bool:
        """Whether ``check`` has passed for this plan (or the planner built it, which proves the same)."""
        return self._checked

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def num_ranges(self) -> int:
        """Number of ranges in the plan."""
        return len(self._stored("nbytes"))

    @property
    def num_calls(self) -> int:
        """Number of driver calls in the plan."""
        return len(self._call_offsets()) - 1

    def _call_offsets(self) -> np.ndarray:
        """``call_offsets`` after the shape rule's dtype check (PlanError rather than numpy's errors wherever read)."""
        check_dtype("call_offsets", self.call_offsets, np.dtype(np.int64))
        return self.call_offsets

    @property
    def stored_nbytes(self) -> int:
        """Bytes held by the plan's arrays as stored (run-length columns count their runs, not their length)."""
        total = self.call_offsets.nbytes
        for col in self._store.values():
            total += col.values.nbytes + col.lengths.nbytes if isinstance(col, Runs) else col.nbytes
        return total

    @property
    def call_sizes(self) -> np.ndarray:
        """Ranges per call."""
        return np.diff(self._call_offsets())

    @property
    def total_bytes(self) -> int:
        """Bytes moved by all ranges together."""
        values, lengths = self.column_runs("nbytes")
        return int((values * lengths.astype(np.uint64)).sum(dtype=np.uint64))

    def calls(self) -> Iterator[slice]:
        """One slice of the range columns per call, in order."""
        co = self._call_offsets().tolist()
        for i in range(len(co) - 1):
            yield slice(co[i], co[i + 1])

    def attr_runs(self, call: int) -> tuple[np.ndarray, np.ndarray]:
        """For call ``call``: (attribute ids, first descriptor of each within the call) -- attrs/attrsIdxs."""
        self.check_shape()
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
        } | ({"aliases": [list(p) for p in self.aliases]} if self.aliases else {}) | (
            {"region_writers": [list(w) for w in self.region_writers]} if self.region_writers else {})

    @property
    def fingerprint(self) -> str:
        """sha256 over the header and the little-endian columns; identical on any machine and process.

        Run-length columns are hashed piece by piece as if expanded, never expanded whole nor kept expanded."""
        if self._fingerprint is not None:
            return self._fingerprint
        h = hashlib.sha256(json.dumps(self._header(), sort_keys=True, separators=(",", ":")).encode())
        for name, dtype in COLUMNS.items():
            h.update(name.encode())
            col = self._stored(name)
            for piece in col.chunks() if isinstance(col, Runs) else (col,):
                h.update(np.ascontiguousarray(piece, dtype=dtype).data)
        h.update(np.ascontiguousarray(self._call_offsets(), dtype="<i8").data)
        digest = h.hexdigest()
        object.__setattr__(self, "_fingerprint", digest)
        return digest

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransferPlan) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        n, calls = self.num_ranges, self.num_calls
        return (f"TransferPlan({self.direction.value} {self.target.label}: {self.requested_copies} -> "
                f"{n} range{'s' if n != 1 else ''}, {calls} call{'s' if calls != 1 else ''}, {format_bytes(self.total_bytes)})")

    def _viewable(self) -> None:
        """Before a view reads the columns: the plan's check (once per plan) and its shape (always: O(columns +
        calls)), so a plan that fails either raises its PlanError rather than numpy's errors."""
        self.check()
        self.check_shape()

    # ---- views: the one documented lazy edge, plan -> render (render imports plan at module level) ----------
    def explain(self, **kw: Any) -> str:
        """Deterministic fixed-width text: header and range table. See kvxfer.planner.render.explain. The views
        (``explain``, HTML, rich, ``stats``) check the plan first (``check``: PlanError for a plan that fails it)."""
        from .render import explain
        self._viewable()
        return explain(self, **kw)

    def _repr_html_(self) -> str:
        from .render import to_html
        self._viewable()
        return to_html(self)

    def __rich__(self) -> Any:
        from .render import to_rich
        self._viewable()
        return to_rich(self)

    def stats(self) -> dict[str, Any]:
        """Numbers about the plan as JSON-ready values; see kvxfer.planner.render.stats."""
        from .render import stats
        self._viewable()
        return stats(self)

    # ---- serialization -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: the header, ``call_offsets``, every column as a list, and the fingerprint."""
        self.check_shape()
        d = self._header()
        d["call_offsets"] = self.call_offsets.tolist()
        d["columns"] = {name: self.column(name).tolist() for name in COLUMNS}
        d["fingerprint"] = self.fingerprint
        return d

    def to_json(self, indent: int | None = None) -> str:
        """``to_dict()`` as JSON text (``indent`` None: one line)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | None = None) -> TransferPlan:
        """A plan from ``to_dict()`` output, strictly checked (kvxfer.planner.files); ``source`` names the file
        in errors. Raises PlanFileError (a PlanError) naming the field, index and value."""
        f = plan_fields(d, source)
        if f["schema_version"] != SCHEMA_VERSION:
            raise PlanFileError("schema_version", f["schema_version"],
                                      f"this kvxfer reads plan schema {SCHEMA_VERSION}", source=source)
        for key, enum in (("direction", Direction), ("api", CopyApi)):
            if f[key] not in [m.value for m in enum]:
                raise PlanFileError(key, f[key], f"expected one of {[m.value for m in enum]}", source=source)
        try:
            plan = cls(
                direction=Direction(f["direction"]), target=validate(Target, f["target"], "target", source),
                options=validate(PlanOptions, f["options"], "options", source),
                buffers=tuple(validate(Buffer, b, "buffers", source, i) for i, b in enumerate(f["buffers"])),
                regions=tuple(f["regions"]), region_page_bytes=f["region_page_bytes"],
                attrs=tuple(validate(CopyAttributes, a, "attrs", source, i) for i, a in enumerate(f["attrs"])),
                requested_copies=f["requested_copies"], passes_attrs=f["passes_attrs"], api=CopyApi(f["api"]),
                call_offsets=f["call_offsets"], aliases=f["aliases"], region_writers=f["region_writers"],
                columns=f["columns"]).check()
        except PlanError as e:
            raise PlanFileError.wrap(e, source) from None
        want = f["fingerprint"]
        if want is not None and want != plan.fingerprint:
            raise PlanFileError("fingerprint", want, f"does not match the plan's content ({plan.fingerprint})",
                                      source=source)
        return plan

    @classmethod
    def from_json(cls, text: str | bytes, source: str | None = None) -> TransferPlan:
        """A plan from ``to_json()`` text, checked as ``from_dict``; raises PlanFileError."""
        return cls.from_dict(parse_json(text, source), source)

    def to_npz_bytes(self) -> bytes:
        """The plan as a compressed numpy archive: the JSON header (with fingerprint), ``call_offsets`` and every column."""
        self.check_shape()
        buf = io.BytesIO()
        header = json.dumps(self._header() | {"fingerprint": self.fingerprint})
        np.savez_compressed(buf, header=np.frombuffer(header.encode(), dtype=np.uint8),
                            call_offsets=self.call_offsets, **{n: self.column(n) for n in COLUMNS})  # type: ignore[arg-type]
        return buf.getvalue()

    @classmethod
    def from_npz_bytes(cls, data: bytes, source: str | None = None) -> TransferPlan:
        """A plan from ``to_npz_bytes()`` output, checked as ``from_dict``; raises PlanFileError."""
        return cls.from_dict(read_npz(data, source), source)

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
        data = read_bytes(path, "plan file")
        read = cls.from_npz_bytes if Path(path).suffix == ".npz" else cls.from_json
        return read(data, str(path))


def _restore(fields: tuple[Any, ...]) -> TransferPlan:
    """A plan from ``TransferPlan.__reduce__``'s fields (a pickle or a copy): every array is copied into memory
    the new plan alone holds, then frozen (an unpickler may hand over arrays over buffers its caller keeps
    writing: pickle protocol 5's out-of-band buffers, shared memory), run-length columns rebuilt, and the shape
    checked as the constructor checks it. The copy is not checked yet (``check`` runs before it is executed)."""
    (direction, target, options, api, buffers, regions, region_page_bytes, attrs, passes_attrs, requested_copies,
     aliases, region_writers, store, call_offsets) = fields
    frozen: dict[str, Column] = {}
    for name, col in store.items():
        if isinstance(col, Runs):
            frozen[name] = Runs(freeze(np.array(col.values)), freeze(np.array(col.lengths, dtype=np.int64)))
        else:
            frozen[name] = freeze(np.array(col))
    plan = object.__new__(TransferPlan)
    plan._setup(direction, target, options, api, buffers, regions, region_page_bytes, attrs, passes_attrs,
                requested_copies, aliases, region_writers, frozen,
                freeze(np.array(call_offsets, dtype=np.int64)), shape=True)
    return plan


def _checked(value: Any, field: str, dtype: np.dtype) -> np.ndarray:
    """``value`` as a new one-dimensional array of ``dtype``, every entry an integer that fits it; PlanError
    naming the field, the index and the value otherwise."""
    if isinstance(value, (list, tuple)) and not set(map(type, value)) <= {int}:
        value = np.array(value, dtype=object)  # numpy integers among them are integers; anything else is named
    try:
        return int_array(value, field, dtype, None)
    except PlanFileError as e:
        raise PlanError(e.field, e.value, e.reason, e.index) from None


def _checked_int(value: Any, field: str) -> int:
    try:
        return check_int(value, field, None)
    except PlanFileError as e:
        raise PlanError(e.field, e.value, e.reason, e.index) from None


def _writers(region_writers: Sequence[Sequence[int]] | None, num_regions: int) -> tuple[tuple[int, int], ...]:
    """``region_writers`` as (num_writers, writer_index) pairs, one per region (or none): integers with
    1 <= num_writers < 2^63 and 0 <= writer_index < num_writers. PlanError naming the pair otherwise."""
    out: list[tuple[int, int]] = []
    for i, pair in enumerate(region_writers or ()):
        try:
            w, k = pair
        except (TypeError, ValueError):
            raise PlanError("region_writers", pair, "expected a (num_writers, writer_index) pair", i) from None
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (w, k)):
            raise PlanError("region_writers", pair, "expected a pair of integers", i)
        w, k = int(w), int(k)
        if not 1 <= w < 1 << 63 or not 0 <= k < w:
            raise PlanError("region_writers", (w, k), "expected 1 <= num_writers < 2^63 and 0 <= writer_index < num_writers", i)
        out.append((w, k))
    if out and len(out) != num_regions:
        raise PlanError("region_writers", len(out), f"expected one per region ({num_regions})")
    return tuple(out)
