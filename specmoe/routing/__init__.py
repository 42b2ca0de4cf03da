"""Routing core: policies, the logical expert cache, calibration, replay over recorded logits and the schedule floor
of a policy's copies."""

from .cache import EngineScoring, LogicalCache
from .calibration import Calibration, CalibrationBuilder, CalibrationError, TokenPrior, router_fingerprint
from .policy import KINDS, PRESETS, PolicyConfig, PolicyError, parse_policy, preset, psr_bonus
from .replay import ReplayResult, replay
from .schedule import schedule_floor
from .scoring import RouterScoring

__all__ = [
    "Calibration", "CalibrationBuilder", "CalibrationError", "EngineScoring", "KINDS", "LogicalCache", "PRESETS",
    "PolicyConfig", "PolicyError", "ReplayResult", "RouterScoring", "TokenPrior", "parse_policy", "preset",
    "psr_bonus", "replay", "router_fingerprint", "schedule_floor",
]
