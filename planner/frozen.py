"""Read-only arrays that no holder can make writeable again: how a plan keeps its columns immutable in fact.

numpy lets anyone set ``flags.writeable = True`` on an array that owns its memory, or on a view of a writeable
array (reached through ``.base``). A frozen array owns no memory and its base exports no writeable buffer, so
that flag, every view of it, ``np.asarray``, ``np.frombuffer`` and ``memoryview`` all stay read-only:

* small arrays are copied into an immutable ``bytes`` object (a copy costs less than a wrapper below 64 KiB);
* larger ones are wrapped as they are (no copy): their base is a ``_Frozen`` object that exposes the memory
  through a read-only ``__array_interface__`` and keeps the writeable array it came from alive privately.
  Whoever freezes an array hands it over: nothing else may write it afterwards (the planner freezes only
  arrays it made, and the plan constructor freezes copies of the caller's).

Raw addresses (``ctypes``) and private attributes are outside any guarantee, as with every Python object.
"""
from __future__ import annotations

import numpy as np

_COPY_BELOW = 1 << 16  # bytes: below this a copy into ``bytes`` is cheaper than building a wrapper


class _Frozen:
    """The base of a large frozen array: a read-only view of ``_memory`` for numpy, and nothing else (the
    interface is made afresh on each read, so changing the dict numpy was handed changes nothing)."""

    __slots__ = ("_memory", "_typestr")

    def __init__(self, arr: np.ndarray, dtype: np.dtype) -> None:
        self._memory, self._typestr = arr, dtype.str  # the memory is kept alive only, never exposed writeable

    @property
    def __array_interface__(self) -> dict[str, object]:
        a = self._memory
        return {"shape": a.shape, "typestr": self._typestr, "data": (a.ctypes.data, True), "strides": None,
                "version": 3}


def freeze(arr: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
    """``arr``, reinterpreted as ``dtype`` of the same item size when given, as a frozen array.

    The caller hands ``arr`` over: it must not write ``arr`` afterwards. An array over immutable memory already
    (frozen, or unpickled by numpy over a ``bytes`` object it owns) is made read-only where it is not, and kept."""
    dtype = arr.dtype if dtype is None else dtype
    base = arr.base
    if isinstance(base, np.ndarray) and isinstance(base.base, _Frozen) and not arr.flags.writeable:
        return arr if arr.dtype == dtype else arr.view(dtype)  # a view of a frozen array (a pooled column)
    if arr.nbytes < _COPY_BELOW:  # a copy: frozen or not, the result is
        return np.frombuffer(arr.tobytes(), dtype=dtype)
    views, bottom = _chain(arr)
    if isinstance(bottom, (bytes, _Frozen)):
        for a in views:
            a.flags.writeable = False  # numpy leaves the arrays it unpickles writeable: they never are again
        return arr if arr.dtype == dtype else arr.view(dtype)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return np.asarray(_Frozen(arr, dtype))


def is_frozen(arr: np.ndarray) -> bool:
    """Whether ``arr`` is a frozen array: read-only, and so is every array it views, down to immutable memory
    (a ``bytes`` object or a ``_Frozen``)."""
    views, bottom = _chain(arr)
    return isinstance(bottom, (bytes, _Frozen)) and not any(a.flags.writeable for a in views)


def _chain(arr: np.ndarray) -> tuple[list[np.ndarray], object]:
    """(``arr`` and the arrays it views, the object at the bottom: None for an array that owns its memory)."""
    views = [arr]
    base = arr.base
    while isinstance(base, np.ndarray):
        views.append(base)
        base = base.base
    return views, base
