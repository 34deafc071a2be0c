"""vLLM's names this wing builds on, imported once, after the version check (``version.import_vllm``): the one place
their import paths are written, so a vLLM release that moves one changes this module only. Importing it imports
vLLM; without vLLM (or with a release this wing does not support) it raises ImportError with the install hint.
"""
from __future__ import annotations

from .logs import log_through_vllm
from .version import import_vllm

VLLM_VERSION = str(import_vllm().__version__)  # before the first import from vLLM below
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

__all__ = ["VLLM_VERSION", "CPUOffloadingSpec", "JobResult", "Locality", "LookupResult", "Medium", "OffloadingConnector",
           "OffloadingConnectorWorker", "OffloadingManager", "OffloadingWorker", "OffloadingWorkerMetadata",
           "RequestOffloadingContext", "SecondaryTierManager", "SharedOffloadRegion", "TieringOffloadingSpec",
           "TransferResult", "canonical_format_id", "get_current_vllm_config_or_none", "get_inner_dp_world_group",
           "get_world_group"]
