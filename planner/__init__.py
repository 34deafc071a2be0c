"""kvxfer.planner: pure planning of KV-cache block transfers. Imports numpy and pydantic only."""
from .case import Case
from .errors import LayoutError, MappingError, PlanError, TargetError
from .layout import Layout
from .plan import COLUMNS, SCHEMA_VERSION, CopyAttributes, LocationHint, TransferPlan
from .planning import plan_transfer
from .spec import BlockMapping, Buffer, Direction, Fragment, Location, Placement, Region
from .target import AccessOrder, CopyApi, PlanOptions, Platform, Target, cuda_version, hip_version

__all__ = [
    "AccessOrder", "BlockMapping", "Case", "Buffer", "COLUMNS", "CopyApi", "CopyAttributes", "Direction", "Fragment", "Layout",
    "LayoutError", "Location", "LocationHint", "MappingError", "Placement", "PlanError", "PlanOptions", "Platform",
    "Region", "SCHEMA_VERSION", "Target", "TargetError", "TransferPlan", "cuda_version", "hip_version",
    "plan_transfer",
]
