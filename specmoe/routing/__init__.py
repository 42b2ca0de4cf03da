"""Routing core: policies, the logical expert cache, calibration and replay over recorded logits."""

from .cache import LogicalCache
from .calibration import Calibration, CalibrationBuilder, CalibrationError, TokenPrior, router_fingerprint
from .policy import KINDS, PRESETS, PolicyConfig, PolicyError, preset
from .replay import RoutingTrace, replay

__all__ = [
    "Calibration", "CalibrationBuilder", "CalibrationError", "KINDS", "LogicalCache", "PRESETS",
    "PolicyConfig", "PolicyError", "RoutingTrace", "TokenPrior", "preset", "replay", "router_fingerprint",
]
