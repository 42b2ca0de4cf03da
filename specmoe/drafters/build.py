"""A drafter by name: its configuration (`DrafterConfig`), the one table of drafters (`DRAFTERS`: name ->
builder) and `build_drafter`, which makes the drafter of a config for a transformers target (see base.py for
the protocol's rules, the names and the runtimes)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specmoe.assets import FAMILY_MEMBERS, family_path, family_target_dirs, member_dflash_path
from specmoe.kernels import BACKENDS
from specmoe.speculation import Drafter

from .base import ATTENTIONS, COST_MODES, RUNTIMES, DrafterError


@dataclass(frozen=True)
class DrafterConfig:
    """A drafter by name, with what building it needs.

    path: checkpoint directory of ``ar`` or ``dflash`` (None: the shipped family's drafter for the target,
    `family_drafter_path`). Synthetic: `acceptance` is the rate of a geometric acceptance profile (draft d is committed with probability
    acceptance^d), or `commit_probs` a table q_1 >= q_2 >= ... of the probability that draft d is committed
    (drafts beyond the table are wrong); `seed` seeds its draws (combined with the prompt, so a request's
    drafts do not depend on the order of requests); `cost_s` is the drafting time per block, which
    `cost_mode` "charge" only accounts (reported as drafting time, no wall time passes) and "spin" also
    spends (reported the same, and `propose` busy-waits that long on the host, so a run's wall clock and
    the copies' overlap see it).

    runtime (``ar``, ``dflash``): "hf" (transformers modules), "static" (static KV cache and CUDA graphs; eager
    on the CPU) or "auto" (static on a CUDA device where the architecture is supported, else hf);
    max_seq_len: positions of the static cache (prompt + new tokens + one block); cuda_graphs: capture the
    static drafter's step (False: eager launches, for debugging); attention: "auto" (split-KV on CUDA with
    Triton, else SDPA), "split_kv" or "sdpa" for the static drafter; backend: the static drafter's layers on the
    fused Triton kernels ("triton"; "auto": on CUDA with Triton, each checked against its torch reference at
    build time, the torch ops where a check fails) or on their torch references ("torch")."""

    name: str
    path: str | None = None
    acceptance: float = 0.8
    commit_probs: tuple[float, ...] | None = None
    seed: int = 0
    cost_s: float = 0.0
    cost_mode: str = "charge"
    runtime: str = "auto"
    max_seq_len: int = 4096
    cuda_graphs: bool = True
    attention: str = "auto"
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.name not in DRAFTERS:
            raise DrafterError(f"unknown drafter {self.name!r}; expected one of {', '.join(DRAFTERS)}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise DrafterError(f"acceptance must be in [0, 1], got {self.acceptance!r}")
        if self.commit_probs is not None:
            probs = tuple(float(p) for p in self.commit_probs)
            if not probs or not all(0.0 <= p <= 1.0 for p in probs) or any(b > a for a, b in zip(probs, probs[1:])):
                raise DrafterError(f"commit_probs must be a non-empty, non-increasing table of probabilities, "
                                   f"got {self.commit_probs!r}")
            object.__setattr__(self, "commit_probs", probs)
        if not 0.0 <= self.cost_s < math.inf:
            raise DrafterError(f"cost_s must be a finite number >= 0, got {self.cost_s!r}")
        if self.cost_mode not in COST_MODES:
            raise DrafterError(f"cost_mode must be one of {COST_MODES}, got {self.cost_mode!r}")
        if self.runtime not in RUNTIMES:
            raise DrafterError(f"runtime must be one of {RUNTIMES}, got {self.runtime!r}")
        if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise DrafterError(f"max_seq_len must be an integer >= 2, got {self.max_seq_len!r}")
        if self.attention not in ATTENTIONS:
            raise DrafterError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.backend not in BACKENDS:
            raise DrafterError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def family_drafter_path(name: str, target_source: str | None = None) -> Path:
    """The shipped family's checkpoint of drafter `name` ("ar" or "dflash") for a target (its resolved
    checkpoint directory, `model.specmoe_source`): one AR drafter drafts for every family target (one
    tokenizer); a DFlash drafter reads its own target's features, so a family member's target gets the member's
    DFlash drafter (DrafterError where it has none), any other target the OLMoE target's."""
    if name == "ar":
        return family_path("ar_drafter")
    source = Path(target_source) if target_source else None
    if source is not None and source.is_dir() and source.resolve() in family_target_dirs():
        path = member_dflash_path(source)
        if path is None:
            members = ", ".join(f"family/{m}" for m, d in FAMILY_MEMBERS.items() if d)
            raise DrafterError(f"the shipped family has no DFlash drafter for the target {source}; give a drafter "
                               f"path (drafters.dflash.path), or use a target that has one (family, {members})")
        return path
    return family_path("dflash_drafter")


def build_drafter(config: DrafterConfig, target) -> Drafter:
    """The drafter of `config` for `target` (a transformers MoE causal LM, on its device and dtype): the
    builder of `config.name` in `DRAFTERS`."""
    return DRAFTERS[config.name](config, target)


def _checkpoint(config: DrafterConfig, target) -> Path:
    """The checkpoint directory of an ``ar`` or ``dflash`` config (None: the shipped family's drafter for
    `target`, `family_drafter_path`)."""
    path = Path(config.path) if config.path else family_drafter_path(config.name,
                                                                     getattr(target, "specmoe_source", None))
    if not (path / "config.json").is_file():
        raise DrafterError(f"no {config.name} drafter checkpoint at {path} (config.json missing)")
    return path


def _static_options(config: DrafterConfig) -> dict:
    return dict(max_seq_len=config.max_seq_len, cuda_graphs=config.cuda_graphs, attention=config.attention,
                backend=config.backend)


def build_ar(config: DrafterConfig, target) -> Drafter:
    """``ar``: a transformers causal LM checkpoint with the target's tokenizer (DrafterError otherwise), on the
    static runtime (`static_ar`) or transformers' (`hf_autoregressive`) as `config.runtime` says."""
    from transformers import AutoModelForCausalLM

    from .hf_autoregressive import HFAutoregressiveDrafter, check_tokenizer
    from .static_ar import ARCHITECTURES, StaticARDrafter

    path, param = _checkpoint(config, target), next(target.parameters())
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=param.dtype, local_files_only=True)
    check_tokenizer(path, getattr(target, "specmoe_source", None) or target.name_or_path)
    model = model.to(param.device).eval()
    if _static(config.runtime, param.device, model.config.model_type in ARCHITECTURES):
        return StaticARDrafter(model, target, **_static_options(config))
    return HFAutoregressiveDrafter(model, target)


def build_dflash(config: DrafterConfig, target) -> Drafter:
    """``dflash``: a DFlash-format block drafter checkpoint conditioned on the target's features, on the static
    runtime (`static_dflash`, full-attention layers only) or transformers' (`dflash`)."""
    from .dflash import DFlashDrafter
    from .dflash_model import DFlashDraftModel

    path, param = _checkpoint(config, target), next(target.parameters())
    model = DFlashDraftModel.from_pretrained(str(path), dtype=param.dtype, local_files_only=True)
    model = model.to(param.device).eval()
    layer_types = getattr(model.config, "layer_types", None) or []
    if _static(config.runtime, param.device, all(t == "full_attention" for t in layer_types)):
        from .static_dflash import StaticDFlashDrafter

        return StaticDFlashDrafter(model, target, **_static_options(config))
    return DFlashDrafter(model, target)


def build_synthetic(config: DrafterConfig, target) -> Drafter:
    """``synthetic``: exact routing's greedy continuation computed with `target` itself, drafts committed with
    the config's acceptance profile."""
    from specmoe.harness import exact_continuation

    from .synthetic import SyntheticDrafter

    return SyntheticDrafter(exact_continuation(target), target.config.vocab_size, config.acceptance,
                            config.commit_probs, config.seed, config.cost_s, config.cost_mode)


# The drafters by name: name -> builder(config, target) -> Drafter. A new drafter is one entry here.
DRAFTERS = {"ar": build_ar, "dflash": build_dflash, "synthetic": build_synthetic}


def _static(runtime: str, device: torch.device, supported: bool) -> bool:
    """Whether a drafter runs on the static runtime: asked for, or "auto" on CUDA for a supported model."""
    return runtime == "static" or (runtime == "auto" and device.type == "cuda" and supported)
