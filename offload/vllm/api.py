"""vLLM's names this wing builds on, imported once, after the version check (``version.import_vllm``): the one place
their import paths are written, so a vLLM release that moves one changes this module only. Importing it imports
vLLM; without vLLM (or with a release this wing does not support) it raises ImportError with the install hint.
"""
from __future__ import annotations

from typing import Any

from .logs import log_through_vllm
from .version import import_vllm, traits

VLLM_VERSION = str(import_vllm().__version__)  # before the first import from vLLM below
TRAITS = traits(VLLM_VERSION)  # what this release's interface has: every version difference is read from here
log_through_vllm()  # vLLM has configured its logger on import: kvxfer's start-up lines go to the engine's log

# ruff: noqa: E402 (vLLM's imports follow the version check)
from vllm.config import get_current_vllm_config_or_none  # type: ignore[import-not-found, unused-ignore]
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (  # type: ignore[import-not-found, unused-ignore]
    canonical_format_id,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # type: ignore[import-not-found, unused-ignore]
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # type: ignore[import-not-found, unused-ignore]
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # type: ignore[import-not-found, unused-ignore]
    OffloadingConnector,
)
from vllm.distributed.parallel_state import (  # type: ignore[import-not-found, unused-ignore]
    get_inner_dp_world_group,
    get_world_group,
)
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found, unused-ignore]
    Locality,
    LookupResult,
    Medium,
    OffloadingManager,
    OffloadingWorker,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import (  # type: ignore[import-not-found, unused-ignore]
    SharedOffloadRegion,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # type: ignore[import-not-found, unused-ignore]
from vllm.v1.kv_offload.tiering.base import (  # type: ignore[import-not-found, unused-ignore]
    JobResult,
    SecondaryTierManager,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # type: ignore[import-not-found, unused-ignore]

DevicePointers: Any = None  # 0.34 on: the flat pointer arrays its workers take (None before)
KVCacheAccess: Any = None  # 0.34 on: the flags of the connector's kv_cache_access (None before)
if TRAITS.device_pointers:
    from vllm.v1.kv_offload.base import DevicePointers  # type: ignore[import-not-found, no-redef, unused-ignore]
if TRAITS.kv_cache_access:
    from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[import-not-found, no-redef, unused-ignore]

__all__ = ["TRAITS", "VLLM_VERSION", "CPUOffloadingSpec", "DevicePointers", "JobResult", "KVCacheAccess", "Locality",
           "LookupResult", "Medium", "OffloadingConnector",
           "OffloadingConnectorWorker", "OffloadingManager", "OffloadingWorker", "OffloadingWorkerMetadata",
           "RequestOffloadingContext", "SecondaryTierManager", "SharedOffloadRegion", "TieringOffloadingSpec",
           "TransferResult", "canonical_format_id", "get_current_vllm_config_or_none", "get_inner_dp_world_group",
           "get_world_group"]

# the storage tier's events and metrics (``tiers``, ``events``, ``metrics``)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # type: ignore[import-not-found, unused-ignore]
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found, unused-ignore]
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
)

__all__ += ["OffloadingConnectorStats", "OffloadingCounterMetadata", "OffloadingEvent", "OffloadingGaugeMetadata",
            "OffloadingHistogramMetadata"]
