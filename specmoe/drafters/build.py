"""`build_drafter`: the drafter of a `DrafterConfig` for a transformers target (see base.py for the protocol,
the names and the runtimes)."""

from __future__ import annotations

from pathlib import Path

import torch

from specmoe.speculation import Drafter
from specmoe.traces import family_path

from .base import DrafterConfig, DrafterError


def family_drafter_path(name: str) -> Path:
    """The shipped family's checkpoint of drafter `name` ("ar" or "dflash")."""
    return family_path({"ar": "ar_drafter", "dflash": "dflash_drafter"}[name])


def build_drafter(config: DrafterConfig, target) -> Drafter:
    """The drafter of `config` for `target` (a transformers MoE causal LM, on its device and dtype).

    ``ar`` and ``dflash`` load their checkpoint (refusing one that does not fit the target: DrafterError) and
    run with the config's runtime (``auto``: ``static`` on a CUDA device where the architecture is
    supported, else ``hf``); ``synthetic`` drafts from exact routing's greedy continuation computed with
    `target` itself."""
    if config.name == "synthetic":
        from specmoe.harness import exact_continuation

        from .synthetic import SyntheticDrafter

        return SyntheticDrafter(exact_continuation(target), target.config.vocab_size, config.acceptance,
                                config.commit_probs, config.seed, config.cost_s, config.cost_mode)
    path = Path(config.path) if config.path else family_drafter_path(config.name)
    if not (path / "config.json").is_file():
        raise DrafterError(f"no {config.name} drafter checkpoint at {path} (config.json missing)")
    param = next(target.parameters())
    static = dict(max_seq_len=config.max_seq_len, cuda_graphs=config.cuda_graphs, attention=config.attention)
    if config.name == "ar":
        from transformers import AutoModelForCausalLM

        from .hf_autoregressive import HFAutoregressiveDrafter, check_tokenizer
        from .static_ar import ARCHITECTURES, StaticARDrafter

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=param.dtype, local_files_only=True)
        check_tokenizer(path, getattr(target, "specmoe_source", None) or target.name_or_path)
        model = model.to(param.device).eval()
        if _static(config.runtime, param.device, model.config.model_type in ARCHITECTURES):
            return StaticARDrafter(model, target, **static)
        return HFAutoregressiveDrafter(model, target)
    from .dflash import DFlashDrafter
    from .dflash_model import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(str(path), dtype=param.dtype, local_files_only=True)
    model = model.to(param.device).eval()
    layer_types = getattr(model.config, "layer_types", None) or []
    if _static(config.runtime, param.device, all(t == "full_attention" for t in layer_types)):
        from .static_dflash import StaticDFlashDrafter

        return StaticDFlashDrafter(model, target, **static)
    return DFlashDrafter(model, target)


def _static(runtime: str, device: torch.device, supported: bool) -> bool:
    """Whether a drafter runs on the static runtime: asked for, or "auto" on CUDA for a supported model."""
    return runtime == "static" or (runtime == "auto" and device.type == "cuda" and supported)
