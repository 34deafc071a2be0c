"""kvxfer.planner: pure planning of KV-cache block transfers. Imports numpy and pydantic only."""
from .case import Case
from .diff import diff_plans, equivalent
from .errors import LayoutError, MappingError, PlanError, TargetError
from .files import PlanFileError
from .layout import Layout
from .plan import COLUMNS, SCHEMA_VERSION, CopyAttributes, LocationHint, TransferPlan
from .planning import plan_transfer
from .spec import BlockMapping, Buffer, Direction, Fragment, Location, Placement, Region
from .target import AccessOrder, CopyApi, PlanOptions, Platform, Target, cuda_version, hip_version

__all__ = [
    "AccessOrder", "BlockMapping", "Case", "Buffer", "COLUMNS", "CopyApi", "CopyAttributes", "Direction", "Fragment", "Layout",
    "LayoutError", "Location", "LocationHint", "MappingError", "Placement", "PlanError", "PlanOptions", "Platform",
    "Region", "SCHEMA_VERSION", "PlanFileError", "Target", "TargetError", "TransferPlan", "cuda_version", "diff_plans",
    "equivalent", "hip_version", "plan_transfer",
]
