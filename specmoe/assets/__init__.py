"""The shipped small model family (`family/`: the OLMoE target, AR drafter, DFlash drafter, tokenizer, metrics,
and the members: more trained targets of other architectures on the same tokenizer and corpus), read offline by
the runtime; `specmoe_train` made it.

Model sources name them: "family" is the OLMoE target, "family/<member>" a member's target (`family_source`).
"""

from __future__ import annotations

from pathlib import Path

FAMILY = Path(__file__).resolve().parent / "family"

# member -> its DFlash drafter's directory name (None: the member has no DFlash drafter of its own)
FAMILY_MEMBERS: dict[str, str | None] = {"deepseek_v3": None, "qwen3_5_moe": "qwen3_5_moe_dflash"}

_CHECKPOINTS = ("target", "ar_drafter", "dflash_drafter", *FAMILY_MEMBERS,
                *(d for d in FAMILY_MEMBERS.values() if d))


def family_path(name: str = "target") -> Path:
    """Directory of a shipped checkpoint of the small family: 'target', 'ar_drafter', 'dflash_drafter', a
    member's target ('deepseek_v3', 'qwen3_5_moe') or a member's DFlash drafter ('qwen3_5_moe_dflash')."""
    if name not in _CHECKPOINTS:
        raise ValueError(f"no shipped family checkpoint {name!r}; known: {', '.join(_CHECKPOINTS)}")
    return FAMILY / name


def family_source(source: str) -> Path | None:
    """The checkpoint directory a model source names: "family" (the OLMoE target) or "family/<member>" (a
    member's target); None for any other source. ValueError for an unknown member, listing the names."""
    source = str(source)
    if source == "family":
        return family_path("target")
    if not source.startswith("family/"):
        return None
    member = source[len("family/"):].strip("/")
    if member not in FAMILY_MEMBERS:
        raise ValueError(f"unknown family member {member!r} in model source {source!r}; the family's model "
                         f"sources: {', '.join(family_sources())}")
    return family_path(member)


def family_sources() -> tuple[str, ...]:
    """Every model source naming a shipped target: 'family' and 'family/<member>'."""
    return ("family", *(f"family/{m}" for m in FAMILY_MEMBERS))


def family_target_dirs() -> tuple[Path, ...]:
    """The resolved directories of the family's targets (all share the family's tokenizer and held-out slice)."""
    return tuple(family_source(s).resolve() for s in family_sources())


def member_dflash_path(target_dir) -> Path | None:
    """The DFlash drafter directory that goes with a family target directory: the OLMoE target's
    'dflash_drafter', a member's own (None where the member has none, or `target_dir` is no family target)."""
    resolved = Path(target_dir).resolve()
    if resolved == family_path("target").resolve():
        return family_path("dflash_drafter")
    for member, drafter in FAMILY_MEMBERS.items():
        if resolved == family_path(member).resolve():
            return family_path(drafter) if drafter else None
    return None
