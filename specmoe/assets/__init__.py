"""The shipped small model family (`family/`: target, AR drafter, DFlash drafter, tokenizer, metrics), read
offline by the runtime; `specmoe_train` made it."""

from __future__ import annotations

from pathlib import Path

FAMILY = Path(__file__).resolve().parent / "family"


def family_path(name: str = "target") -> Path:
    """Directory of a shipped checkpoint of the small family: 'target', 'ar_drafter' or 'dflash_drafter'."""
    return FAMILY / name
