"""The project's golden plans: one file per case under tests/golden/, checked by the golden_plan fixture.

Shapes follow real restores (118 regions x 256 blocks, Kimi's 61 regions with a 4096 cap) where the size
matters, and small layouts where only the shape does. Rewrite with ``pytest --update-golden`` after an
intended planner change and review the diff of tests/golden/.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.planner import (
    BlockMapping,
    Case,
    Direction,
    PlanOptions,
    Platform,
    Target,
    cuda_version,
    hip_version,
    presets,
)

KiB = 1024


def rocm(major: int, minor: int, patch: int = 0) -> Target:
    return Target(platform=Platform.ROCM, runtime_version=hip_version(major, minor, patch))


def cuda(major: int, minor: int) -> Target:
    return Target(platform=Platform.CUDA, runtime_version=cuda_version(major, minor))


def case(pattern: str, regions: int, n: int, blocks: int, target: Target, page: int = 32 * KiB,
         direction: str = "h2d", **options) -> Case:
    return Case(layout=presets.kv_layout(regions, blocks, page), mapping=presets.mapping(pattern, n, blocks, direction),
                target=target, options=PlanOptions(**options))


def small(target: Target, direction: str = "h2d", pattern: str = "runs8", **options) -> Case:
    """4 regions x 64 blocks of 4 KiB, 16 pairs: two runs of 8 per region (8 ranges)."""
    return case(pattern, 4, 16, 64, target, 4 * KiB, direction, **options)


def shared(src_ids: list[int], dst_ids: list[int], target: Target) -> Case:
    """One device allocation and one host allocation for all regions, so ranges can merge across regions."""
    return Case(layout=presets.kv_layout(4, 16, 4 * KiB, shared_device=True),
                mapping=BlockMapping(direction=Direction.H2D, src_ids=src_ids, dst_ids=dst_ids), target=target)


HIP_GATES = {
    "unknown": Target(platform=Platform.ROCM), "7.1": rocm(7, 1), "7.2.0": rocm(7, 2), "7.2.2-53211": rocm(7, 2, 53211),
    "7.3": rocm(7, 3), "7.12": rocm(7, 12), "7.13": rocm(7, 13), "7.13-26193": rocm(7, 13, 26193),
    "7.14": rocm(7, 14), "7.15": rocm(7, 15), "7.16": rocm(7, 16), "8.0": rocm(8, 0),
}

CASES = {
    # seed shapes: 118 regions x 256 block pairs of 32 KiB
    "seed-118x256-contiguous-h2d-rocm7.16": lambda: case("contiguous", 118, 256, 512, rocm(7, 16)),
    "seed-118x256-descending-h2d-rocm7.16": lambda: case("descending", 118, 256, 512, rocm(7, 16)),
    "seed-118x256-interleaved-h2d-rocm7.16": lambda: case("interleaved", 118, 256, 512, rocm(7, 16)),
    "seed-118x256-runs8-h2d-rocm7.2": lambda: case("runs8", 118, 256, 512, rocm(7, 2)),
    "seed-118x16-fragmented-h2d-rocm7.16": lambda: case("fragmented", 118, 16, 64, rocm(7, 16)),
    # call caps: Kimi (61 regions) at 4096 descriptors, and ROCm's default 8192
    "kimi-61x135-fragmented-h2d-rocm7.2.2-cap4096": lambda: case("fragmented", 61, 135, 512, rocm(7, 2, 53211),
                                                                 max_descriptors=4096),
    "cap8192-65x128-fragmented-h2d-rocm7.16": lambda: case("fragmented", 65, 128, 256, rocm(7, 16), 4 * KiB),
    # every HIP version gate (batch API, numAttrs, prefer-CE flag)
    **{f"hip-{v}-runs8-h2d": (lambda t=t: small(t)) for v, t in HIP_GATES.items()},
    "hip-7.16-runs8-d2h": lambda: small(rocm(7, 16), "d2h"),
    "hip-7.16-descending-d2h": lambda: small(rocm(7, 16), "d2h", "descending"),
    # CUDA: per-range fallback below 12.8, the 12.8 batch ABI, the 13.0 v2 ABI
    "cuda-12.4-runs8-h2d": lambda: small(cuda(12, 4)),
    "cuda-12.8-runs8-h2d": lambda: small(cuda(12, 8)),
    "cuda-13.0-runs8-h2d": lambda: small(cuda(13, 0)),
    "cuda-13.0-interleaved-d2h-overlap": lambda: small(cuda(13, 0), "d2h", "interleaved",
                                                       prefer_overlap_with_compute=True),
    # one shared device allocation: ranges merge across region boundaries
    "shared-device-all-blocks-one-range": lambda: shared(list(range(16)), list(range(16)), rocm(7, 16)),
    "shared-device-tail-head-merge": lambda: shared([14, 15, 0, 1], [14, 15, 0, 1], cuda(13, 0)),
    # options
    "options-no-coalesce-cpu": lambda: small(Target(), coalesce=False),
    "options-max-range-bytes-rocm7.16": lambda: small(rocm(7, 16), max_range_bytes=12 * KiB),
    "options-max-descriptors-3-cuda13": lambda: small(cuda(13, 0), max_descriptors=3),
    "empty-mapping-rocm7.16": lambda: Case(layout=presets.kv_layout(2, 8, 4 * KiB), target=rocm(7, 16),
                                           mapping=BlockMapping(direction=Direction.H2D, src_ids=np.zeros(0, np.int64),
                                                                dst_ids=np.zeros(0, np.int64))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(golden_plan, name: str) -> None:
    golden_plan(CASES[name](), name)


def test_suite_covers_what_the_project_promises() -> None:
    assert len(CASES) >= 20
    assert set(HIP_GATES) == {"unknown", "7.1", "7.2.0", "7.2.2-53211", "7.3", "7.12", "7.13", "7.13-26193", "7.14",
                              "7.15", "7.16", "8.0"}
