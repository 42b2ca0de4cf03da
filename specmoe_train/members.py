"""The family's members: targets of other architectures (DeepSeek-V3, Qwen3.5-MoE) trained from scratch on the
family's corpus with its tokenizer, a member's own DFlash drafter against its frozen target, the bf16
checkpoints, and their measurements (the family's AR drafter drafts for every member).

Layout, inside a family directory (next to the OLMoE family's files, which it leaves alone):
  deepseek_v3/          DeepseekV3ForCausalLM checkpoint (config, bf16 safetensors, the family's tokenizer)
  qwen3_5_moe/          Qwen3_5MoeForCausalLM (text) checkpoint, the same
  qwen3_5_moe_dflash/   its DFlash drafter (`specmoe.assets.FAMILY_MEMBERS` says which member has one)
  members_metrics.json  per member: config, training record, sizes, slice and held-out measurements
  members_curves.csv    training loss every `log_every` steps (column "member")
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from specmoe.assets import FAMILY_MEMBERS
from specmoe.drafters.dflash_model import DFlashDraftModel
from specmoe.models import ARCHITECTURES, ModelSourceError
from .configs import MEMBER_PRESETS, MemberConfig, member_config, member_dflash_config
from .corpus import load_corpus, spaced_windows
from .evaluate import dflash_block_nll, perplexity
from .family import EVAL_SETTINGS, MAX_SHARD, SLICE, environment, evaluate_family, write_curves
from .tokenizer import EOS, MASK, PAD


def build_member(mc: MemberConfig, tokenizer, device, dtype):
    """A fresh seeded member: (target, its DFlash drafter or None) in `dtype` on `device` (a DeepSeek-V3
    router's selection bias stays in float32)."""
    vocab, eos, pad, mask = len(tokenizer), tokenizer.convert_tokens_to_ids(EOS), \
        tokenizer.convert_tokens_to_ids(PAD), tokenizer.convert_tokens_to_ids(MASK)
    torch.manual_seed(mc.train.seed)
    config = member_config(mc, vocab, eos, pad)
    target = ARCHITECTURES[mc.architecture].model_class(config).to(device=device, dtype=dtype)
    _float32_biases(target)
    dflash = None
    if mc.dflash:
        torch.manual_seed(mc.train.seed + 2)
        dflash = DFlashDraftModel(member_dflash_config(mc, config, mask)).to(device=device, dtype=dtype)
    return target, dflash


def _float32_biases(model) -> None:
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias = module.e_score_correction_bias.float()


def save_member(directory: Path, name: str, target, dflash, tokenizer) -> dict:
    """Save a member's checkpoints in bf16 (selection biases in float32), sharded below MAX_SHARD per file,
    the target with the family's tokenizer; returns the bytes of weights per checkpoint."""
    sizes = {}
    for sub, model in ((name, target), (FAMILY_MEMBERS[name], dflash)):
        if model is None:
            continue
        path = directory / sub
        if path.exists():
            shutil.rmtree(path)
        model.to(torch.bfloat16)
        _float32_biases(model)
        model.save_pretrained(str(path), max_shard_size=MAX_SHARD)
        if model is target:
            tokenizer.save_pretrained(str(path))
        sizes[sub] = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return sizes


def load_member(directory: str | Path, name: str, device="cpu", dtype=torch.float32):
    """(target, its DFlash drafter or None) of member `name` from a family directory, offline, in eval mode."""
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    if name not in FAMILY_MEMBERS:
        raise ModelSourceError(f"unknown family member {name!r}; known: {', '.join(FAMILY_MEMBERS)}")
    subs = [name] + ([FAMILY_MEMBERS[name]] if FAMILY_MEMBERS[name] else [])
    missing = [sub for sub in subs if not (directory / sub / "config.json").is_file()]
    if missing:
        raise ModelSourceError(f"{directory} has no {', '.join(missing)} checkpoint of the member {name}")
    kw = dict(local_files_only=True, dtype=dtype)
    target = AutoModelForCausalLM.from_pretrained(str(directory / name), **kw).to(device).eval()
    dflash = None
    if FAMILY_MEMBERS[name]:
        dflash = DFlashDraftModel.from_pretrained(str(directory / FAMILY_MEMBERS[name]), **kw).to(device).eval()
    return target, dflash


@torch.no_grad()
def member_slice_metrics(target, dflash, stream: np.ndarray) -> dict:
    """Perplexities on the family's fixed held-out slice (what the tests recompute from the checkpoints)."""
    starts, rows = spaced_windows(stream, SLICE["length"], SLICE["windows"])
    on_device = torch.from_numpy(rows).to(next(target.parameters()).device)
    out = {"starts": starts.tolist(), "target_ppl": perplexity(target, on_device)["ppl"]}
    if dflash is not None:
        out["dflash_ppl_mean_nll"] = dflash_block_nll(target, dflash, on_device, anchors_per_window=4)["ppl_mean_nll"]
    return out


def train_member(mc: MemberConfig, name: str, streams: dict, tokenizer, dev, dtype, log) -> tuple:
    """Train one member (target, then its DFlash drafter against the frozen target): (target, dflash, record,
    curve rows)."""
    from .train import BiasBalance, train_drafters, train_target

    target, dflash = build_member(mc, tokenizer, dev, dtype)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    log(f"{name}: target {count(target) / 1e6:.2f}M params"
        + (f", dflash {count(dflash) / 1e6:.2f}M" if dflash is not None else ""))
    balance = BiasBalance(target, mc.bias_update_rate, mc.sequence_balance_coef) if mc.balance == "bias_update" \
        else None
    prefixed = lambda msg: log(f"{name}: {msg}")  # noqa: E731
    record = {"target": train_target(target, streams["train"], mc.train, dev, prefixed, streams["evaluation"],
                                     balance=balance)}
    rows = record["target"].pop("rows")
    if dflash is not None:
        record["dflash_drafter"] = train_drafters(target, None, dflash, streams["train"], mc.train, dev, prefixed)
        rows += record["dflash_drafter"].pop("rows")
    return target, dflash, record, [{"member": name, **row} for row in rows]


def run_members(corpus_dir: str | Path, out_dir: str | Path, ar_drafter: str | Path, preset: str = "h200",
                device: str = "cuda", log: Callable[[str], None] = print, time_limit_s: float | None = None,
                members: tuple[str, ...] | None = None, steps: dict | None = None) -> dict:
    """Train the members from a built corpus (all of them first), save them under `out_dir`, then measure
    each with the family's AR drafter `ar_drafter` (a checkpoint directory with the corpus's tokenizer).
    steps: member -> (target steps, DFlash drafter steps), None entries keep the preset's timing probe."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .train import set_determinism

    t_start = time.time()
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    corpus_dir, out = Path(corpus_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    streams = load_corpus(corpus_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(corpus_dir / "tokenizer"), local_files_only=True)
    names = members or tuple(MEMBER_PRESETS[preset])
    configs = {}
    for name in names:
        mc = MEMBER_PRESETS[preset][name]
        target_steps, drafter_steps = (steps or {}).get(name, (None, None))
        configs[name] = replace(mc, train=mc.train.with_steps(target_steps, drafter_steps))
    metrics = {"preset": preset, "environment": environment(dev) | {"fla": _fla_version()}, "members": {}}
    curves = []
    for name, mc in configs.items():
        set_determinism(mc.train.seed)
        target, dflash, record, rows = train_member(mc, name, streams, tokenizer, dev, dtype, log)
        curves += rows
        sizes = save_member(out, name, target, dflash, tokenizer)
        metrics["members"][name] = {"config": mc.to_dict(), "training": record, "bytes": sizes}
        log(f"{name}: saved {sizes} after {time.time() - t_start:.0f}s")
        del target, dflash
    metrics["reproduce"] = "python scripts/train_family.py train-members --preset " + preset + "".join(
        f" --steps {name}={m['training']['target']['steps']}"
        + (f",{m['training']['dflash_drafter']['steps']}" if "dflash_drafter" in m["training"] else "")
        for name, m in metrics["members"].items())
    write_curves(out / "members_curves.csv", curves)
    (out / "members_metrics.json").write_text(json.dumps(metrics, indent=1))

    ar = AutoModelForCausalLM.from_pretrained(str(ar_drafter), local_files_only=True, dtype=dtype).to(dev).eval()
    deadline = t_start + time_limit_s if time_limit_s else None
    for name in configs:
        entry = metrics["members"][name]
        try:  # the fixed slice in float32, as the family's
            t32, d32 = load_member(out, name, dev, torch.float32)
            t32.set_experts_implementation("eager")
            entry["slice"] = member_slice_metrics(t32, d32, streams["evaluation"])
            del t32, d32
        except Exception as exc:  # keep the checkpoints and the other measurements
            entry["slice"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{name}: FAILED slice: {entry['slice']['error']}")
        target, dflash = load_member(out, name, dev, dtype)
        if dev.type == "cuda":
            target.set_experts_implementation(entry["training"]["target"]["experts_implementation"])
        prefixed = lambda msg, name=name: log(f"{name}: {msg}")  # noqa: E731
        entry["evaluation"] = evaluate_family(target, ar, dflash, streams, member_eval_settings(preset),
                                              prefixed, deadline)
        entry["evaluation"]["dtype"] = str(dtype).replace("torch.", "")
        del target, dflash
    metrics["wall_seconds"] = round(time.time() - t_start, 1)
    (out / "members_metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics


def member_eval_settings(preset: str) -> dict:
    """The family's evaluation settings for a member: the harness's speculative loop cross-checks one prompt
    (time; a target with Gated DeltaNet layers too: the loop rolls their states back itself,
    `specmoe.harness.recurrent`)."""
    return dict(EVAL_SETTINGS[preset], crosscheck=min(1, EVAL_SETTINGS[preset]["crosscheck"]))


def _fla_version() -> str | None:
    """flash-linear-attention's version where importable (transformers' Gated DeltaNet then uses its kernels)."""
    try:
        import fla

        return getattr(fla, "__version__", "unknown")
    except Exception:  # not installed, or it fails to import here (then transformers uses the torch path too)
        return None
