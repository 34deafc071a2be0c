"""Target runtime versions: "major.minor" strings, encoded integers kept whole, implausible ones refused."""
from __future__ import annotations

import pytest

from kvxfer.planner import CopyApi, Target, TargetError, cuda_version, hip_version


@pytest.mark.parametrize("platform,text,encoded,label", [
    ("cuda", "13.0", cuda_version(13, 0), "cuda-13.0"), ("cuda", "12.8", cuda_version(12, 8), "cuda-12.8"),
    ("rocm", "7.16", hip_version(7, 16), "rocm-7.16"), ("rocm", "7.2", hip_version(7, 2), "rocm-7.2"),
    ("rocm", " 7.1 ", hip_version(7, 1), "rocm-7.1"),
])
def test_major_minor_strings(platform, text, encoded, label):
    t = Target(platform=platform, runtime_version=text)
    assert t.runtime_version == encoded and t.label == label
    assert t == Target(platform=platform, runtime_version=encoded)


def test_full_build_integers_are_kept():
    t = Target(platform="rocm", runtime_version=70253211)  # ROCm 7.2.2 as hipRuntimeGetVersion reports it
    assert t.runtime_version == 70253211 and t.copy_api is CopyApi.HIP_BATCH


@pytest.mark.parametrize("platform,value,hint", [
    ("cuda", 13, "13.0 is 13000"), ("cuda", 128, "cuda_version(13, 0)"), ("cuda", 10**6, "1000*major"),
    ("rocm", 7, "7.2 is 70200000"), ("rocm", 716, "hip_version(7, 2)"), ("rocm", 10**9, "major*10,000,000"),
    ("rocm", "7.2.2", "build number"), ("cuda", "12.8.1", "three-part"), ("cuda", "12.10", "not a plausible"),
    ("cuda", "13", "major.minor"), ("rocm", 7.2, "floats are ambiguous"), ("cuda", False, "got bool"),
])
def test_implausible_versions_show_the_encoding(platform, value, hint):
    with pytest.raises(TargetError, match="runtime_version") as info:
        Target(platform=platform, runtime_version=value)
    assert hint in str(info.value)


def test_unknown_and_cpu_versions_stay_accepted():
    assert Target(platform="cuda", runtime_version=0).label == "cuda-unknown"
    assert Target(platform="cpu").runtime_version == 0
