"""Drafters for speculative decoding: the `Drafter` protocol (defined in `specmoe.speculation`), `DrafterConfig`
/ `build_drafter` (by name from the `DRAFTERS` table: ``ar``, ``dflash``, ``synthetic``; runtimes ``hf`` and
``static``), `check_drafter_fits`, the DFlash-format block-diffusion drafter model (`dflash_model`), and the
static-cache GPU drafters (`static_ar`, `static_dflash`)."""

from specmoe.speculation import Drafter  # the protocol the drafters implement

from .base import RUNTIMES, DrafterError, check_drafter_fits
from .build import DRAFTERS, DrafterConfig, build_drafter
from .dflash import DFlashDrafter
from .hf_autoregressive import HFAutoregressiveDrafter
from .static_ar import StaticARDrafter
from .static_dflash import StaticDFlashDrafter
from .synthetic import SyntheticDrafter

__all__ = [
    "DFlashDrafter", "DRAFTERS", "Drafter", "DrafterConfig", "DrafterError", "HFAutoregressiveDrafter", "RUNTIMES",
    "StaticARDrafter", "StaticDFlashDrafter", "SyntheticDrafter", "build_drafter", "check_drafter_fits",
]
