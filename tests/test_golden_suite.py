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
    Buffer,
    Case,
    Direction,
    Layout,
    Location,
    Placement,
    PlanOptions,
    Platform,
    Region,
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


def chunks(target: Target) -> Case:
    """Host chunks of 4 pages; logical start 2 makes the first chunk partial."""
    return Case(layout=presets.chunked_layout(4, 32, 1 * KiB, blocks_per_chunk=4), target=target,
                mapping=BlockMapping(direction=Direction.H2D, src_ids=[5, 1, 2], dst_ids=[9, 10, 11, 12, 13, 20, 21, 22],
                                     group_sizes=[8], group_starts=[2]))


def groups(target: Target) -> Case:
    """A hybrid model: 2 full-attention regions (group 0) and 2 sliding-window regions (group 1)."""
    layout = presets.chunked_layout(4, 32, 1 * KiB, blocks_per_chunk=2)
    regions = tuple(r.model_copy(update={"group": i // 2}) for i, r in enumerate(layout.regions))
    return Case(layout=layout.model_copy(update={"regions": regions}), target=target,
                mapping=BlockMapping(direction=Direction.H2D, src_ids=[3, 4, 7, 8], dst_ids=[0, 1, 2, 3, 30, 31],
                                     group_sizes=[4, 2], group_starts=[0, 1]))


def fragments(target: Target, **options) -> Case:
    """Tensor-parallel rank 1 of 2 stores its half of each canonical page: 4 tokens x 2 of 4 heads."""
    return Case(layout=presets.tp_fragment_layout(3, 16, tokens=4, heads=4, head_bytes=64, tp=2, rank=1),
                mapping=presets.mapping("runs8", 8, 16, "d2h"), target=target, options=PlanOptions(**options))


def mixed_writers(target: Target) -> Case:
    """Issue repro: a replicated region (2 writers, this rank index 0) and a rank-private one (every rank writes)
    store device pages 0-3 into 64-byte host rows: replicated pages 0 and 2, private pages 0-3 (6 pages)."""
    buffers = (Buffer(name="dev.repl", nbytes=32 * 8), Buffer(name="dev.priv", nbytes=32 * 8),
               Buffer(name="host", nbytes=64 * 8, location=Location.HOST))
    regions = (Region(name="repl", page_bytes=32, device=Placement(buffer="dev.repl"),
                      host=Placement(buffer="host", stride_bytes=64), num_writers=2, writer_index=0),
               Region(name="priv", page_bytes=32, device=Placement(buffer="dev.priv"),
                      host=Placement(buffer="host", byte_offset=32, stride_bytes=64), num_writers=1))
    return Case(layout=Layout(buffers=buffers, regions=regions), target=target,
                mapping=BlockMapping(direction=Direction.D2H, src_ids=[0, 1, 2, 3], dst_ids=[0, 1, 2, 3]))


def aliased(target: Target, direction: Direction) -> Case:
    """Two layers sharing one KV tensor: regions 'layer' and 'alias' name the same bytes; planned once."""
    layout = presets.kv_layout(3, 16, 1 * KiB)
    regions = layout.regions[:2] + (layout.regions[1].model_copy(update={"name": "alias"}),) + layout.regions[2:]
    return Case(layout=layout.model_copy(update={"regions": regions}), target=target,
                mapping=presets.mapping("runs8", 8, 16, direction.value))


def empty_group(target: Target) -> Case:
    """Three declared KV-cache groups; group 1 has no regions but still consumes its slice of the ids."""
    layout = presets.kv_layout(2, 16, 1 * KiB)
    regions = (layout.regions[0], layout.regions[1].model_copy(update={"group": 2}))
    return Case(layout=layout.model_copy(update={"regions": regions, "num_groups": 3}), target=target,
                mapping=BlockMapping(direction=Direction.H2D, src_ids=[0, 1, 2, 9, 10, 11], dst_ids=[4, 5, 6, 7, 8, 9],
                                     group_sizes=[2, 1, 3]))


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
    # the full layout model: host chunks, KV-cache groups, fragments, writer rotation, page-first, per-layer calls
    "layout-chunks-k4-start2-h2d-rocm7.16": lambda: chunks(rocm(7, 16)),
    "layout-groups-hybrid-h2d-cuda13": lambda: groups(cuda(13, 0)),
    "layout-tp2-rank1-fragments-d2h-cuda13": lambda: fragments(cuda(13, 0)),
    "layout-tp2-rank1-fragments-d2h-writers2-cuda13": lambda: fragments(cuda(13, 0), num_writers=2, writer_index=1),
    "layout-page-first-contiguous-h2d-rocm7.16": lambda: Case(
        layout=presets.page_first_layout(8, 32, 1 * KiB), mapping=presets.mapping("contiguous", 12, 32), target=rocm(7, 16)),
    "layout-per-layer-calls-cap1-h2d-rocm7.16": lambda: small(rocm(7, 16), regions_per_call=1, max_descriptors=1),
    "layout-mixed-writers-d2h-cuda13": lambda: mixed_writers(cuda(13, 0)),
    "layout-aliased-regions-h2d-rocm7.16": lambda: aliased(rocm(7, 16), Direction.H2D),
    "layout-aliased-regions-d2h-cuda13": lambda: aliased(cuda(13, 0), Direction.D2H),
    "layout-empty-group-h2d-rocm7.16": lambda: empty_group(rocm(7, 16)),
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
