"""Drafters for speculative decoding: the `Drafter` protocol, `DrafterConfig` / `build_drafter` (by name:
``ar``, ``dflash``, ``synthetic``), and the DFlash-format block-diffusion drafter model (`dflash_model`)."""

from .base import DRAFTERS, Drafter, DrafterConfig, DrafterError, build_drafter, crop_cache
from .dflash import DFlashDrafter
from .hf_autoregressive import HFAutoregressiveDrafter
from .synthetic import SyntheticDrafter

__all__ = [
    "DFlashDrafter", "DRAFTERS", "Drafter", "DrafterConfig", "DrafterError", "HFAutoregressiveDrafter",
    "SyntheticDrafter", "build_drafter", "crop_cache",
]
