"""kvxfer's spec refusing at start-up, built by hand the way vLLM builds it (vLLM's OffloadingConfig, so
``make test-vllm`` only): each refusal one line naming the key and value, or the feature."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the spec subclasses vLLM's: run with `make test-vllm`")

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvxfer.offload.vllm import ExtraConfigError, KvxferOffloadingSpec, UnsupportedFeatureError


def _config(extra: dict[str, Any], *, world_size: int = 1, blocks_per_chunk: int = 1, replicated: bool = False) -> Any:
    parallel = OffloadingParallelConfig(rank=0, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1,
                                        dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                        data_parallel_rank_local=None, is_parallelism_agnostic=False)
    return OffloadingConfig(groups=(OffloadingGroupConfig(32, ("l0",), 0),), worker_kv_bytes_per_block=16384,
                            enable_kv_cache_events=False, extra_config={"cpu_bytes_to_use": 1 << 24, **extra},
                            engine_id="e0", model=OffloadingModelConfig("m", "float32"),
                            cache=OffloadingCacheConfig(32, blocks_per_chunk), parallel=parallel,
                            replicated_layout=replicated)


def test_a_well_formed_config_builds_the_spec() -> None:
    spec = KvxferOffloadingSpec(_config({"blocks_per_chunk": 2}, blocks_per_chunk=2))
    assert spec.num_chunks > 0 and spec.kvxfer_shared_region is False


@pytest.mark.parametrize("extra, world_size, fragment", [
    ({"kvxfer_stats_path": "/proc/self/s.json"}, 1, "['kvxfer_stats_path'] = '/proc/self/s.json': is under /proc"),
    ({"kvxfer_executor": 42}, 1, "['kvxfer_executor'] = 42: must be an executor config"),
    ({"blocks_per_chunk": 1.5}, 1, "['blocks_per_chunk'] = 1.5: must be a positive integer"),
])
def test_bad_keys_are_refused_in_one_line_naming_the_key(extra: dict[str, Any], world_size: int, fragment: str) -> None:
    with pytest.raises(ExtraConfigError) as e:
        KvxferOffloadingSpec(_config(extra, world_size=world_size))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_every_ranks_counters_path_is_checked(tmp_path: Path) -> None:
    (tmp_path / "s.rank1.json").mkdir()  # rank 1's file, with two ranks, is a directory
    with pytest.raises(ExtraConfigError, match=r"s\.rank1\.json' is a directory"):
        KvxferOffloadingSpec(_config({"kvxfer_stats_path": str(tmp_path / "s.json")}, world_size=2))


def test_checksums_with_the_replicated_single_copy_layout_are_refused() -> None:
    with pytest.raises(UnsupportedFeatureError, match="kvxfer_verify with the replicated single-copy layout"):
        KvxferOffloadingSpec(_config({"kvxfer_verify": True, "kvxfer_shared_region": True}, world_size=2,
                                     replicated=True))


def test_a_chunk_longer_than_the_models_max_len_is_refused_when_vllm_has_set_its_config() -> None:
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    object.__setattr__(config, "model_config", SimpleNamespace(max_model_len=480))
    with set_current_vllm_config(config), pytest.raises(ExtraConfigError, match=(
            r"\['blocks_per_chunk'\] = 16: a chunk of 16 block\(s\) of 32 tokens holds 512 tokens, more than the "
            "model's max_model_len 480")):
        KvxferOffloadingSpec(_config({"blocks_per_chunk": 16}, blocks_per_chunk=16))
