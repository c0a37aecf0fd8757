"""Shared state and decisions of PagedWeight: page table, KV blocks, scheduler, planners (numpy only)."""
from policies.apformat import ap_block_bytes, byte_table, lut_bytes, plane_bytes
from policies.calibration import Calibration, CalibrationError, model_fingerprint
from policies.contract import NoopPolicy, Observation, Plan, Policy, RoutingReadout, Transition
from policies.page_table import BlockId, PageTable, PageTableError, PlaneState
from policies.registry import PolicyError, available, get, parse_policy_args

__all__ = [
    "ap_block_bytes", "byte_table", "lut_bytes", "plane_bytes",
    "Calibration", "CalibrationError", "model_fingerprint",
    "NoopPolicy", "Observation", "Plan", "Policy", "RoutingReadout", "Transition",
    "BlockId", "PageTable", "PageTableError", "PlaneState",
    "available", "get", "parse_policy_args", "PolicyError",
]
