"""Which adapter serves which architecture, the named configs, and `load_model`.

A model source is either a local checkpoint directory (config.json + *.safetensors, as written by
save_pretrained; nothing is downloaded), the name of a config with seeded random weights (NAMED_CONFIGS), or
the name of a shipped family target ("family", "family/<member>": `resolve_source`). The config's model_type
picks the adapter.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch import nn

from specmoe.assets import family_path, family_source, family_sources

from .adapter import ModelSourceError, MoEAdapter
from .checkpoint import dequantized_state_dict, fp8_quantized, round_experts_to_fp8
from .deepseek_v3 import DEEPSEEK_V3_CONFIGS, DeepseekV3Adapter, build_random_deepseek_v3
from .olmoe import OLMOE_CONFIGS, OlmoeAdapter, build_random_olmoe
from .qwen3_5_moe import QWEN3_5_MOE_CONFIGS, Qwen35MoeAdapter, build_random_qwen3_5_moe


class Architecture(NamedTuple):
    """How specmoe builds one architecture: its adapter from a config, its transformers classes, the
    builder of a model with seeded random weights (config, seed, dtype, device) -> model, and the engines'
    decoder (a class with `from_model(model, max_seq_len)` and `from_checkpoint(path, max_seq_len, device,
    dtype)` implementing `specmoe.models.decoder.Decoder`; None where the engines do not support it yet)."""

    adapter: Callable
    model_class: type
    config_class: type
    build_random: Callable
    decoder: type | None = None


def _olmoe() -> Architecture:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from .olmoe_decode import OlmoeDecoder

    return Architecture(OlmoeAdapter.from_config, OlmoeForCausalLM, OlmoeConfig, build_random_olmoe, OlmoeDecoder)


def _deepseek_v3() -> Architecture:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from .deepseek_v3_decode import DeepseekV3Decoder

    return Architecture(DeepseekV3Adapter.from_config, DeepseekV3ForCausalLM, DeepseekV3Config,
                        build_random_deepseek_v3, DeepseekV3Decoder)


def _qwen3_5_moe(image_text: bool) -> Architecture:
    """Qwen3.5-MoE: the text model (model_type qwen3_5_moe_text, what Qwen3_5MoeForCausalLM.save_pretrained
    writes) or the shipped image-text model (qwen3_5_moe), whose text part Qwen3_5MoeForCausalLM loads; one
    decoder for both (`Qwen35MoeDecoder`, Gated DeltaNet on the torch path)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from .qwen3_5_moe_decode import Qwen35MoeDecoder

    return Architecture(Qwen35MoeAdapter.from_config, Qwen3_5MoeForCausalLM,
                        Qwen3_5MoeConfig if image_text else Qwen3_5MoeTextConfig, build_random_qwen3_5_moe,
                        Qwen35MoeDecoder)


# model_type -> Architecture
ARCHITECTURES: dict[str, Architecture] = {"olmoe": _olmoe(), "deepseek_v3": _deepseek_v3(),
                                          "qwen3_5_moe_text": _qwen3_5_moe(False),
                                          "qwen3_5_moe": _qwen3_5_moe(True)}

# name -> (model_type, config keyword arguments)
NAMED_CONFIGS: dict[str, tuple[str, dict]] = {
    **{name: ("olmoe", kwargs) for name, kwargs in OLMOE_CONFIGS.items()},
    **{name: ("deepseek_v3", kwargs) for name, kwargs in DEEPSEEK_V3_CONFIGS.items()},
    **{name: ("qwen3_5_moe_text", kwargs) for name, kwargs in QWEN3_5_MOE_CONFIGS.items()},
}

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def named_config(name: str):
    """The transformers config of a named model (see NAMED_CONFIGS)."""
    if name not in NAMED_CONFIGS:
        raise ModelSourceError(f"unknown named config {name!r}; known: {', '.join(NAMED_CONFIGS)}")
    model_type, kwargs = NAMED_CONFIGS[name]
    config_class = ARCHITECTURES[model_type].config_class
    return config_class(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in kwargs.items()})


def adapter_for(config) -> MoEAdapter:
    """The adapter of a model with this transformers config; a clear error for unsupported or dense ones."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        if not any(getattr(config, key, 0) for key in _EXPERT_COUNT_KEYS):
            raise ModelSourceError(f"config of model type {model_type!r} has no MoE layers: specmoe routes "
                                   "Mixture-of-Experts models only")
        raise ModelSourceError(f"no specmoe adapter for model type {model_type!r}; supported: "
                               f"{', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[model_type].adapter(config)


def decoder_for(config) -> type:
    """The engines' decoder class of a model with this transformers config (see `Architecture.decoder`)."""
    adapter_for(config)  # unsupported and dense models: the adapter's clear errors
    decoder = ARCHITECTURES[config.model_type].decoder
    if decoder is None:
        raise ModelSourceError(f"the engines have no decoder for model type {config.model_type!r} yet; "
                               f"supported: {', '.join(k for k, a in ARCHITECTURES.items() if a.decoder)}")
    return decoder


def _as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        value = getattr(torch, dtype, None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"unknown torch dtype {dtype!r}")
        return value
    return dtype


def load_model(source: str, *, seed: int = 0, dtype=torch.float32, device="cpu",
               experts_implementation: str | None = "eager") -> tuple[nn.Module, MoEAdapter]:
    """Load (model in eval mode, adapter) from a checkpoint directory or a named config.

    seed: the random weights of a named config (ignored for a directory). experts_implementation: pinned
    on the model ("eager" by default; None keeps transformers' choice), because generate() may switch
    kernels between prefill and decode and paired comparisons must run the same arithmetic. The source is
    kept as `model.specmoe_source` (calibration provenance). A name in NAMED_CONFIGS is a named config even
    if a directory of that name exists (write ./name to load the directory); "family" and "family/<member>"
    name the shipped family's targets (`resolve_source`).

    FP8 (a config with an FP8 quantization_config): a checkpoint's FP8 weights are dequantised to `dtype`
    (transformers' own classes then run them); a named FP8 config's routed experts are rounded to FP8 values.
    The model's config keeps the quantization_config, so `ExpertStore.from_model` makes an FP8 store."""
    dtype = _as_dtype(dtype)
    source = str(source)
    if source not in NAMED_CONFIGS:
        source = resolve_source(source)
    if source in NAMED_CONFIGS:
        config = named_config(source)
        adapter = adapter_for(config)
        model = ARCHITECTURES[config.model_type].build_random(config, seed, dtype, device)
        if fp8_quantized(config):
            round_experts_to_fp8(model, adapter)
        label = f"{source} (random weights, seed {seed})"
    else:
        config = _checkpoint_config(Path(source))
        adapter = adapter_for(config)
        model_class = ARCHITECTURES[config.model_type].model_class
        try:
            if fp8_quantized(config):  # dequantised here: transformers' FP8 path needs accelerate and a GPU
                model = _load_dequantized(model_class, config, adapter, source, dtype).to(device)
            else:
                model = model_class.from_pretrained(source, dtype=dtype, local_files_only=True).to(device)
        except Exception as exc:  # a truncated or corrupt weights file: safetensors' and transformers' errors
            raise ModelSourceError(f"cannot load the weights of checkpoint directory {source}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        label = str(Path(source).resolve())
    if experts_implementation is not None:
        model.set_experts_implementation(experts_implementation)
    model.eval()
    model.specmoe_source = label
    return model, adapter


def resolve_source(source) -> str:
    """A model source as `load_model` reads it, the one resolver of every command's model argument: the shipped
    family's names ("family" is the OLMoE target, "family/<member>" a member's target, see
    `specmoe.assets.family_source`) become their checkpoint directories; a hub id ("owner/name", not an existing
    path) becomes its snapshot directory in the local Hugging Face hub cache (`hub_snapshot`, nothing is
    downloaded); any other source (a named config, a directory) is returned as given. ModelSourceError for an
    unknown or uninstalled member and for a hub id that is not cached."""
    try:
        path = family_source(str(source))
    except ValueError as exc:
        raise ModelSourceError(str(exc)) from None
    if path is None:
        source = str(source)
        if source not in NAMED_CONFIGS and HUB_ID.fullmatch(source) and not Path(source).exists():
            return hub_snapshot(source)
        return source
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"the family target {source!r} is not installed ({path} has no config.json): train it "
                               "with scripts/train_family.py train-members and install it (see docs/family.md)")
    return str(path)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # "owner/name", e.g. allenai/OLMoE-1B-7B-0924


def hub_cache() -> str:
    """The Hugging Face hub cache directory, read from the environment now (HF_HUB_CACHE, else HF_HOME/hub,
    else ~/.cache/huggingface/hub), as huggingface_hub reads it at import."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def hub_snapshot(repo_id: str) -> str:
    """The snapshot directory of the model `repo_id` in the local hub cache, with HF_HUB_OFFLINE=1 semantics
    (`snapshot_download(..., local_files_only=True)`: nothing is downloaded); ModelSourceError in one line when
    it is not cached."""
    from huggingface_hub import snapshot_download

    cache = hub_cache()
    try:
        return snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except Exception as exc:  # LocalEntryNotFoundError, or a cache entry without a snapshot  # noqa: BLE001
        raise ModelSourceError(f"{repo_id!r} is not a checkpoint directory, a named config nor a model in the local "
                               f"Hugging Face hub cache {cache} ({type(exc).__name__}): download it first (e.g. "
                               f"`hf download {repo_id}`), or set HF_HUB_CACHE; specmoe does not download") from None


def _load_dequantized(model_class, config, adapter, source: str, dtype: torch.dtype) -> nn.Module:
    """The model of an FP8 checkpoint directory with every FP8 tensor dequantised (`dequantized_state_dict`);
    the image-text layout's text part under the text model's names. The model's config keeps the
    quantization_config (the FP8 store follows it), which transformers must not see while loading."""
    weights = dequantized_state_dict(source, dtype)
    prefix = getattr(adapter, "checkpoint_prefix", "model.")
    if prefix != "model.":  # e.g. Qwen3.5-MoE's shipped model.language_model.: the text model's model.
        weights = {"model." + k[len(prefix):] if k.startswith(prefix) else k: v for k, v in weights.items()
                   if k.startswith(prefix) or k.startswith("lm_head.")}
    quantization = config.quantization_config
    text = config.get_text_config()
    for c in {id(config): config, id(text): text}.values():
        if "quantization_config" in c.__dict__:
            del c.quantization_config
    model = model_class.from_pretrained(None, config=text if prefix != "model." else config, state_dict=weights,
                                        dtype=dtype)
    model.config.quantization_config = quantization
    return model


def _checkpoint_config(path: Path):
    """Check that `path` is a loadable checkpoint directory and read its config."""
    from transformers import AutoConfig

    if not path.exists():
        raise ModelSourceError(f"{str(path)!r} is not a checkpoint directory (no such path), a named config "
                               f"({', '.join(NAMED_CONFIGS)}) nor a family target ({', '.join(family_sources())})")
    if not path.is_dir():
        raise ModelSourceError(f"{path} is not a directory: a checkpoint is a directory with config.json and "
                               "*.safetensors weights")
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"checkpoint directory {path} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelSourceError(f"checkpoint directory {path} has a config.json but no weights (*.safetensors)")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def default_model() -> str:
    """The embedded default: the shipped trained target when present, else a seeded random tiny OLMoE."""
    shipped = family_path("target")
    return str(shipped) if (shipped / "config.json").is_file() else "olmoe-tiny"
