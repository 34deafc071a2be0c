"""The one CRC-32 of kvxfer's integrity checks (``offload.checksums.crc32``): ISA-L's where installed, zlib's
otherwise, the same values either way (so files and records written under one are read under the other)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.offload import checksums


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=5000), st.integers(0, 2**32 - 1), st.integers(0, 4999))
def test_isal_and_zlib_give_equal_values_whole_and_continued(data, start, cut):
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    assert isal_zlib.crc32(data, start) == zlib.crc32(data, start)
    cut = min(cut, len(data))
    assert isal_zlib.crc32(data[cut:], isal_zlib.crc32(data[:cut])) == zlib.crc32(data)
    assert checksums.crc32(data, start) == zlib.crc32(data, start)


def test_views_of_arrays_at_odd_offsets_sum_like_bytes():
    a = np.random.default_rng(0).integers(0, 256, (1 << 20) + 3, dtype=np.uint8)
    for lo in (0, 1, 3):
        assert checksums.crc32(a[lo:].data) == zlib.crc32(a[lo:].tobytes())


def test_the_choice_is_made_once_isal_where_installed_else_zlib(monkeypatch):
    name, fn = checksums.crc32_impl()
    try:
        import isal.isal_zlib as isal_zlib
        assert (name, fn) == ("isal", isal_zlib.crc32)
    except ImportError:
        assert (name, fn) == ("zlib", zlib.crc32)
    checksums.crc32_impl.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "isal.isal_zlib", None)  # as if not installed
    try:
        assert checksums.crc32_impl() == ("zlib", zlib.crc32)
        assert checksums.crc32(b"kvxfer") == zlib.crc32(b"kvxfer")
    finally:
        checksums.crc32_impl.cache_clear()
