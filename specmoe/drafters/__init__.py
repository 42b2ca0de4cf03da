"""Drafters for speculative decoding: the `Drafter` protocol, `DrafterConfig` / `build_drafter` (by name:
``ar``, ``dflash``, ``synthetic``; runtimes ``hf`` and ``static``), the DFlash-format block-diffusion drafter
model (`dflash_model`), and the static-cache GPU drafters (`static_ar`, `static_dflash`)."""

from specmoe.speculation import Drafter  # the protocol the drafters implement

from .base import DRAFTERS, RUNTIMES, DrafterConfig, DrafterError
from .build import build_drafter
from .dflash import DFlashDrafter
from .hf_autoregressive import HFAutoregressiveDrafter
from .static_ar import StaticARDrafter
from .static_dflash import StaticDFlashDrafter
from .synthetic import SyntheticDrafter

__all__ = [
    "DFlashDrafter", "DRAFTERS", "Drafter", "DrafterConfig", "DrafterError", "HFAutoregressiveDrafter", "RUNTIMES",
    "StaticARDrafter", "StaticDFlashDrafter", "SyntheticDrafter", "build_drafter",
]
