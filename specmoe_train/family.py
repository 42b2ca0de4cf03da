"""The family pipeline: build the three models, train them, save the checkpoints, measure them.

Layout of a family directory (the shipped one is ``specmoe/assets/family``):
  target/          OlmoeForCausalLM checkpoint (config, sharded bf16 safetensors, the family's tokenizer)
  ar_drafter/      OlmoForCausalLM checkpoint (tied embeddings; it uses target/'s tokenizer)
  dflash_drafter/  DFlash drafter checkpoint (Qwen3 config with dflash_config; no embeddings or head)
  split.json       corpus split: files, sizes and sha256 per part, token counts and stream hashes
  metrics.json     the measurements of `evaluate_family` and the training record
  curves.csv       training loss every `log_every` steps
"""

from __future__ import annotations

import csv
import json
import platform
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from specmoe.drafters.dflash_model import DFlashDraftModel
from specmoe.models import ModelSourceError
from .configs import FAMILY_PRESETS, FamilyConfig, ar_drafter_config, dflash_drafter_config, target_config
from .corpus import load_corpus, spaced_windows, spread_windows, windows
from .evaluate import (accept_at_function, ar_accept_runs, dflash_accept_lengths, dflash_block_nll,
                       greedy_continuation, perplexity, routing_locality, tau_from_runs)
from .tokenizer import EOS, MASK, PAD

MAX_SHARD = "12MB"
SLICE = {"windows": 4, "length": 129}  # the fixed held-out slice the asset tests recompute


def build_models(fc: FamilyConfig, tokenizer, device, dtype):
    """Fresh seeded models: (target, ar_drafter, dflash_drafter) in `dtype` on `device`."""
    from transformers import OlmoeForCausalLM, OlmoForCausalLM

    vocab, eos, pad, mask = len(tokenizer), tokenizer.convert_tokens_to_ids(EOS), \
        tokenizer.convert_tokens_to_ids(PAD), tokenizer.convert_tokens_to_ids(MASK)
    torch.manual_seed(fc.seed)
    tcfg = target_config(fc, vocab, eos, pad)
    target = OlmoeForCausalLM(tcfg)
    torch.manual_seed(fc.seed + 1)
    ar = OlmoForCausalLM(ar_drafter_config(fc, vocab, eos, pad))
    torch.manual_seed(fc.seed + 2)
    dflash = DFlashDraftModel(dflash_drafter_config(fc, tcfg, mask))
    return tuple(m.to(device=device, dtype=dtype) for m in (target, ar, dflash))


def save_family(directory: Path, target, ar, dflash, tokenizer) -> None:
    """Save the three checkpoints in bf16, sharded below MAX_SHARD per file."""
    for name, model in (("target", target), ("ar_drafter", ar), ("dflash_drafter", dflash)):
        path = directory / name
        if path.exists():
            shutil.rmtree(path)
        model.to(torch.bfloat16).save_pretrained(str(path), max_shard_size=MAX_SHARD)
        if name == "target":  # the drafters use the target's tokenizer
            tokenizer.save_pretrained(str(path))


def load_family(directory: str | Path, device="cpu", dtype=torch.float32):
    """(target, ar_drafter, dflash_drafter) from a family directory, offline, in eval mode."""
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    missing = [name for name in ("target", "ar_drafter", "dflash_drafter")
               if not (directory / name / "config.json").is_file()]
    if missing:
        raise ModelSourceError(f"{directory} is not a model family directory: no {', '.join(missing)} checkpoint")
    kw = dict(local_files_only=True, dtype=dtype)
    target = AutoModelForCausalLM.from_pretrained(str(directory / "target"), **kw)
    ar = AutoModelForCausalLM.from_pretrained(str(directory / "ar_drafter"), **kw)
    dflash = DFlashDraftModel.from_pretrained(str(directory / "dflash_drafter"), **kw)
    return tuple(m.to(device).eval() for m in (target, ar, dflash))


@torch.no_grad()
def slice_metrics(target, ar, dflash, stream: np.ndarray) -> dict:
    """Perplexities on the fixed slice: what `tests/test_assets.py` recomputes from the checkpoints."""
    starts, rows = spaced_windows(stream, SLICE["length"], SLICE["windows"])
    on_device = torch.from_numpy(rows).to(next(target.parameters()).device)
    return {"slice": dict(SLICE, starts=starts.tolist(), token_ids=rows.tolist()),
            "target_ppl": perplexity(target, on_device)["ppl"],
            "ar_drafter_ppl": perplexity(ar, on_device)["ppl"],
            "dflash_ppl_mean_nll": dflash_block_nll(target, dflash, on_device, anchors_per_window=4)["ppl_mean_nll"]}


def measure_tau(target, ar, dflash, stream: np.ndarray, prompts: int, prompt_len: int, new_tokens: int,
                ks: tuple[int, ...], batch_size: int = 32, crosscheck: int = 0, crosscheck_tokens: int = 64,
                log=print) -> dict:
    """tau of both drafters (dflash None: the AR drafter's only) at each k over the target's greedy
    continuations of held-out prompts."""
    device = next(target.parameters()).device
    # spaced as windows of prompt_len + 1 tokens: every prompt has its next token in the stream
    prompt_rows = torch.from_numpy(np.ascontiguousarray(spaced_windows(stream, prompt_len + 1, prompts)[1][:, :-1]))
    seqs = torch.cat([greedy_continuation(target, rows.to(device), new_tokens).cpu()
                      for rows in prompt_rows.split(batch_size)])
    k_max = max(ks)
    match = np.concatenate([ar_accept_runs(ar, rows) for rows in seqs.split(batch_size)])
    # from the last prompt token on: the walk's first root is the prompt's next token, the harness loop's
    # (the cross-check) the last prompt token
    accepted = None if dflash is None else np.concatenate([
        dflash_accept_lengths(target, dflash, rows, prompt_len - 1, k_max) for rows in seqs.split(batch_size)])
    result = {"prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens,
              "distinct_continuations": int(len({tuple(r) for r in seqs[:, prompt_len:].tolist()}))}
    for k in ks:
        result[f"k{k}"] = {"ar_drafter": tau_from_runs(match, None, prompt_len, k)}
        if accepted is not None:
            result[f"k{k}"]["dflash_drafter"] = tau_from_runs(None, accepted, prompt_len, k)  # capped at k
        log(f"tau k={k}: " + "  ".join(f"{name} {v['tau']:.3f}" for name, v in result[f"k{k}"].items()))
    if crosscheck:
        end = prompt_len + min(crosscheck_tokens, new_tokens)
        try:  # the harness's loop may not support the target (a cache it cannot roll back): keep tau
            result["crosscheck"] = tau_crosscheck(
                target, ar, dflash, prompt_rows[:crosscheck], seqs[:crosscheck, :end], match[:crosscheck, :end - 1],
                None if accepted is None else accepted[:crosscheck, :end], prompt_len, ks, log)
        except Exception as exc:
            result["crosscheck"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"FAILED crosscheck: {result['crosscheck']['error']}")
    return result


def tau_crosscheck(target, ar, dflash, prompts, seqs, match, accepted, prompt_len, ks, log) -> dict:
    """Run the harness's speculative loop (exact selection, every expert in the pool) on a few prompts and
    compare it with the teacher-forced walk: the committed tokens against the greedy continuation, and at every
    root of the loop whose block lies inside the continuation, the accepted length against the walk's."""
    from specmoe.drafters import DFlashDrafter, HFAutoregressiveDrafter
    from specmoe.harness import speculative_generate
    from specmoe.models import adapter_for
    from specmoe.speculation import SpeculativeConfig, tau
    from specmoe.verifiers import selector_preset

    adapter = adapter_for(target.config)
    new = seqs.shape[1] - prompt_len
    out = {"prompts": int(prompts.shape[0]), "new_tokens": int(new)}
    for k in ks:
        config = SpeculativeConfig(selector_preset("exact"), k=k, pool_size=adapter.num_experts, max_new_tokens=new)
        drafters = [("ar_drafter", HFAutoregressiveDrafter(ar, target))]
        if dflash is not None:
            drafters.append(("dflash_drafter", DFlashDrafter(dflash, target)))
        for name, drafter in drafters:
            verifications = block_tokens = blocks = agreeing = same_tokens = 0
            for b in range(prompts.shape[0]):
                res = speculative_generate(target, adapter, drafter, prompts[b], config, divergence=False)
                verifications += res.verifications
                block_tokens += res.counts()["block_committed"]
                same_tokens += int(torch.equal(res.tokens, seqs[b, prompt_len:prompt_len + res.tokens.numel()]))
                accept_at = accept_at_function(match if name == "ar_drafter" else None,
                                               None if name == "ar_drafter" else accepted, b, k)
                for root, a in zip(res.roots, res.accepted):
                    if root + k + 1 <= seqs.shape[1] and accept_at(root) >= 0:
                        blocks += 1
                        agreeing += int(min(int(accept_at(root)), k) == a)
            check = {"loop_tau": tau(block_tokens, verifications), "blocks": blocks, "blocks_agreeing": agreeing,
                     "prompts_with_identical_tokens": same_tokens}
            out[f"k{k}_{name}"] = check
            log(f"crosscheck k={k} {name}: loop tau {check['loop_tau']:.3f}, walk agrees on {agreeing}/{blocks} "
                f"blocks, identical tokens {same_tokens}/{prompts.shape[0]}")
    return out


def measure_locality(target, stream: np.ndarray, sequences: int, length: int, batch_size: int) -> dict:
    from specmoe.harness import record_trace

    rows = spread_windows(stream, length, sequences)
    trace = record_trace(target, [torch.from_numpy(row) for row in rows], batch_size=batch_size)
    return routing_locality(trace)


def evaluate_family(target, ar, dflash, streams: dict, settings: dict, log=print,
                    deadline: float | None = None) -> dict:
    """Every held-out measurement, each skipped (and said so) once `deadline` (time.time()) has passed (dflash
    None: a target without a DFlash drafter, a member's)."""
    metrics: dict = {"settings": settings}
    evaluation = streams["evaluation"]

    def stage(name, fn):
        if deadline is not None and time.time() > deadline:
            metrics[name] = {"skipped": "out of time"}
            log(f"skipped {name}: out of time")
            return
        t0 = time.time()
        try:
            metrics[name] = fn()
            metrics[name]["seconds"] = round(time.time() - t0, 1)
        except Exception as exc:  # a failed measurement must not lose the others or the checkpoints
            metrics[name] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"FAILED {name}: {type(exc).__name__}: {exc}")

    rows = torch.from_numpy(windows(evaluation, settings["ppl_window"] + 1)[: settings["ppl_max_windows"]])
    stage("perplexity", lambda: {"target": perplexity(target, rows, settings["batch_size"]),
                                 "ar_drafter": perplexity(ar, rows, settings["batch_size"])} | ({} if dflash is None else {
                                 "dflash_drafter": dflash_block_nll(target, dflash, rows[: settings["dflash_windows"]],
                                                                    batch_size=settings["batch_size"])}))
    stage("tau", lambda: measure_tau(target, ar, dflash, evaluation, settings["tau_prompts"], settings["prompt_len"],
                                     settings["new_tokens"], tuple(settings["ks"]), settings["batch_size"],
                                     settings["crosscheck"], settings["crosscheck_tokens"], log))
    stage("locality", lambda: measure_locality(target, evaluation, settings["locality_sequences"],
                                               settings["locality_length"], settings["batch_size"]))
    return metrics


EVAL_SETTINGS = {
    "h200": dict(ppl_window=512, ppl_max_windows=100_000, batch_size=32, dflash_windows=256, tau_prompts=64, prompt_len=128,
                 new_tokens=128, ks=[8, 16], crosscheck=2, crosscheck_tokens=64, locality_sequences=64, locality_length=512),
    "tiny": dict(ppl_window=32, ppl_max_windows=8, batch_size=4, dflash_windows=4, tau_prompts=2, prompt_len=16, new_tokens=12,
                 ks=[2, 4], crosscheck=1, crosscheck_tokens=8, locality_sequences=2, locality_length=32),
}


def write_curves(path: Path, rows: list[dict]) -> None:
    keys = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def environment(device) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def run_family(corpus_dir: str | Path, out_dir: str | Path, preset: str = "h200", target_steps: int | None = None,
               drafter_steps: int | None = None, device: str = "cuda", log: Callable[[str], None] = print,
               time_limit_s: float | None = None) -> dict:
    """Train the whole family from a built corpus, save it under `out_dir` and measure it."""
    from transformers import AutoTokenizer

    from .train import set_determinism, train_drafters, train_target

    t_start = time.time()
    fc = FAMILY_PRESETS[preset].with_steps(target_steps, drafter_steps)
    set_determinism(fc.seed)
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    corpus_dir, out = Path(corpus_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    streams = load_corpus(corpus_dir)
    split = json.loads((corpus_dir / "split.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(corpus_dir / "tokenizer"), local_files_only=True)
    target, ar, dflash = build_models(fc, tokenizer, dev, dtype)
    log(f"target {sum(p.numel() for p in target.parameters())/1e6:.2f}M params, "
        f"ar {sum(p.numel() for p in ar.parameters())/1e6:.2f}M, dflash {sum(p.numel() for p in dflash.parameters())/1e6:.2f}M")

    record_t = train_target(target, streams["train"], fc, dev, log, heldout=streams["evaluation"])
    record_d = train_drafters(target, ar, dflash, streams["train"], fc, dev, log, heldout=streams["evaluation"])
    write_curves(out / "curves.csv", record_t.pop("rows") + record_d.pop("rows"))
    save_family(out, target, ar, dflash, tokenizer)
    (out / "split.json").write_text(json.dumps(split, sort_keys=True, separators=(",", ":")))
    metrics = {"preset": preset, "config": fc.to_dict(), "environment": environment(dev),
               "training": {"target": record_t, "drafters": record_d},
               "reproduce": f"python scripts/train_family.py train --preset {preset} --target-steps "
                            f"{record_t['steps']} --drafter-steps {record_d['steps']}",
               "corpus": {part: split["tokens"][part] for part in split["tokens"]}}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    log(f"saved checkpoints after {time.time() - t_start:.0f}s")

    # measure the saved checkpoints: bf16 weights, run in float32 for the fixed slice, in `dtype` otherwise
    try:
        t32, a32, d32 = load_family(out, dev, torch.float32)
        t32.set_experts_implementation("eager")  # grouped_mm kernels are for bf16 on the GPU
        metrics["slice"] = slice_metrics(t32, a32, d32, streams["evaluation"])
        del t32, a32, d32
    except Exception as exc:  # keep the checkpoints and the other measurements
        metrics["slice"] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"FAILED slice: {metrics['slice']['error']}")
    target, ar, dflash = load_family(out, dev, dtype)
    if dev.type == "cuda":
        target.set_experts_implementation(record_t["experts_implementation"])
    deadline = t_start + time_limit_s if time_limit_s else None
    metrics["evaluation"] = evaluate_family(target, ar, dflash, streams, EVAL_SETTINGS[preset], log, deadline)
    metrics["evaluation"]["dtype"] = str(dtype).replace("torch.", "")
    metrics["wall_seconds"] = round(time.time() - t_start, 1)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics
