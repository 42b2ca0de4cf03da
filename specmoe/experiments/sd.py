"""`specmoe sd`: speculative decoding with block-level expert selection, next to AR-PSR at the same expert memory.

For every drafter and selector it runs the harness's speculative loop (`specmoe.harness.speculative_generate`)
greedily on the same prompts, with a pool of P experts per layer, and prints one row per pair: tau
(committed tokens per verification), host-to-device copies per committed token, displaced router mass per
committed token-layer, and the KL and excess NLL of the committed positions against exact routing on the same
prefix. AR decoding with PSR at C = P (the paper's bonus for that residency, n = 1, A priority) runs on the
same prompts for the same number of new tokens; its copies count decoding only (demand and prefetch, the
prompt excluded), like the speculative rows. Drafting and target times are CPU wall times of the harness.

Prompts: on the shipped family, consecutive pieces of the evaluation-split windows recorded in its
metrics.json (the fixed held-out slice); on another model, windows sampled from it under exact routing. The
pool's warm set and PSR's calibration come from windows sampled from the model (other seeds), as in `demo`,
or from `--calibration FILE`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd
    import torch

from specmoe.arguments import check_positions, int_at_least
from specmoe.files import check_output_file, file_sha256, write_text_atomic
from specmoe.limits import MAX_COUNT, MAX_DRAFTS, MAX_THREADS, MAX_TOKENS
from specmoe.assets import family_path, family_target_dirs

COLUMNS = ["drafter", "selector", "tau", "copies_per_token", "displaced_per_token_layer", "kl", "excess_nll",
           "committed", "verifications", "draft_ms_per_token", "target_ms_per_token"]


def family_prompts(count: int, length: int) -> list[torch.Tensor]:
    """`count` prompts of `length` tokens: consecutive pieces of the family's held-out slice windows, the
    first piece of every window first."""
    import torch

    slice_ = json.loads((family_path().parent / "metrics.json").read_text())["slice"]["slice"]
    windows = slice_["token_ids"]
    pieces = [torch.tensor(w[i * length:(i + 1) * length]) for i in range(len(windows[0]) // length) for w in windows]
    if not 1 <= count <= len(pieces):
        raise ValueError(f"the family's held-out slice gives 1..{len(pieces)} prompts of {length} tokens, "
                         f"asked for {count}")
    return pieces[:count]


def sd_prompts(model, count: int, length: int, seed: int) -> tuple[list[torch.Tensor], str]:
    """The prompts and a description of where they come from (see the module docstring)."""
    from specmoe.harness import sample_selfgen

    if length < 1 or count < 1:
        raise ValueError(f"need at least one prompt of at least one token, got {count} x {length}")
    if Path(model.specmoe_source) in family_target_dirs():  # the family's targets share its tokenizer
        return family_prompts(count, length), "family evaluation slice (metrics.json)"
    windows = sample_selfgen(model, count, max(length, 2), seed=seed + 3).windows
    return [w[:length] for w in windows], f"sampled from the model, seed {seed + 3}"


def run_ar(model, adapter, policy, calibration, prompts, new_tokens: int, stop_tokens) -> dict:
    """AR greedy decoding of every prompt under `policy`: one table row (copies from the logical caches)."""
    from specmoe.harness import copy_stats, divergence_from_exact, greedy_decode, patch_model, unpatch

    sums = {"copies": 0.0, "displaced": 0.0, "kl_sum": 0.0, "excess_nll_sum": 0.0, "positions": 0, "seconds": 0.0}
    for prompt in prompts:
        context = patch_model(model, adapter, policy, calibration)
        started = time.perf_counter()
        tokens, logprobs = greedy_decode(model, prompt, new_tokens, stop_tokens, after_prefill=context.clear_counters)
        sums["seconds"] += time.perf_counter() - started
        stats = copy_stats(context)
        unpatch(model)
        sums["copies"] += stats["copies"] * stats["tokens"]
        sums["displaced"] += stats["displaced_mass"] * stats["tokens"]
        divergence = divergence_from_exact(model, adapter, prompt, tokens, logprobs)
        for key in ("kl_sum", "excess_nll_sum", "positions"):
            sums[key] += divergence[key]
    n = max(sums["positions"], 1)
    return {"drafter": "none (AR)", "selector": policy.name, "tau": 1.0, "copies_per_token": sums["copies"] / n,
            "displaced_per_token_layer": sums["displaced"] / (n * adapter.num_moe_layers),
            "kl": sums["kl_sum"] / n, "excess_nll": sums["excess_nll_sum"] / n, "committed": sums["positions"],
            "verifications": sums["positions"], "draft_ms_per_token": 0.0,
            "target_ms_per_token": 1e3 * sums["seconds"] / n}


def run_sd(model_source: str, *, drafters=("ar", "dflash"), selectors=("exact", "acceptmoe", "confidence_top1"),
           k: int = 8, pool_size: int = 32, prompts: int = 4, prompt_length: int = 64, new_tokens: int = 64,
           calibration_windows: int = 16, calibration_length: int = 128, calibration_file: str | None = None,
           drafter_paths: dict | None = None, synthetic_acceptance: float = 0.8, seed: int = 0,
           threads: int | None = None, records_dir: str | None = None) -> tuple[pd.DataFrame, dict]:
    """Run the comparison; returns the table and a dict describing the run (with per-row acceptance)."""
    import pandas as pd
    import torch

    from specmoe.records import BlockRecords
    from specmoe.drafters import DrafterConfig, build_drafter
    from specmoe.harness import collect_calibration, sample_selfgen, speculative_generate
    from specmoe.harness.patch import model_scoring
    from specmoe.speculation import SpeculativeConfig, summarize
    from specmoe.models import load_model
    from specmoe.routing import Calibration, preset, psr_bonus
    from specmoe.verifiers import selector_preset

    if threads:
        torch.set_num_threads(threads)
    started = time.time()
    configs = [DrafterConfig(name, path=(drafter_paths or {}).get(name), acceptance=synthetic_acceptance, seed=seed)
               for name in drafters]
    sd_config = [SpeculativeConfig(selector_preset(name), k=k, pool_size=pool_size, max_new_tokens=new_tokens)
                 for name in selectors]
    model, adapter = load_model(model_source, seed=seed)
    # the last block of a request starts at its last committed token and reads k positions past it
    check_positions(model, prompt_length + new_tokens + k, "--prompt-length + --new-tokens + -k")
    check_positions(model, calibration_length, "--calibration-length")
    built = [build_drafter(config, model) for config in configs]  # a drafter that does not fit fails here
    for drafter in built:
        sd_config[0].check(adapter, drafter)
    stop_tokens = tuple(t for t in [model.config.eos_token_id] if isinstance(t, int))
    sd_config = [dataclasses.replace(config, stop_tokens=stop_tokens) for config in sd_config]
    prompt_list, prompt_text = sd_prompts(model, prompts, prompt_length, seed)
    if calibration_file:
        calibration = Calibration.load(calibration_file)
        calibration_text = f"file {calibration_file} (sha256 {file_sha256(calibration_file)})"
    else:
        held_out = sample_selfgen(model, calibration_windows, calibration_length, seed=seed + 1)
        calibration_text = (f"{calibration_windows} windows of {calibration_length} tokens sampled from the exact model, "
                            f"seed {seed + 1}")
        calibration = collect_calibration(model, adapter, held_out.windows, {"text": calibration_text})
    rows, acceptance = [], {}
    for drafter_config, drafter in zip(configs, built):
        for config in sd_config:
            results = [speculative_generate(model, adapter, drafter, prompt, config, calibration=calibration,
                                            record=records_dir is not None) for prompt in prompt_list]
            summary = summarize(results)
            rows.append({"drafter": drafter_config.name, "selector": config.selector.name, **{
                key: summary[key] for key in COLUMNS[2:-1]}, "target_ms_per_token": summary["verify_ms_per_token"]})
            acceptance[f"{drafter_config.name}/{config.selector.name}"] = {
                key: summary[key] for key in ("acceptance_by_position", "accepted_hist", "moves_per_token")}
            if records_dir is not None:
                BlockRecords.from_requests(
                    [r.blocks for r in results], top_k=adapter.top_k, vocab_size=adapter.vocab_size,
                    model=model.specmoe_source, fingerprint=adapter.fingerprint(model),
                    selector=config.selector.to_dict(), drafter=drafter_config.name, pool_size=pool_size,
                    groups=adapter.groups, scoring=model_scoring(model, adapter),
                    info={"prompts": prompt_text, "calibration": calibration_text},
                ).save(Path(records_dir) / f"blocks_{drafter_config.name}_{config.selector.kind}.safetensors")
    policy = preset("psr", pool_size, adapter.top_k, bonus=psr_bonus(pool_size, adapter.num_experts))
    rows.append(run_ar(model, adapter, policy, calibration, prompt_list, new_tokens, stop_tokens))
    info = {"model": model.specmoe_source, "layers": adapter.num_moe_layers, "experts": adapter.num_experts,
            "top_k": adapter.top_k, "k": k, "pool_size": pool_size, "prompts": len(prompt_list),
            "prompt_length": prompt_length, "new_tokens": new_tokens, "prompt_source": prompt_text,
            "calibration": calibration_text, "seed": seed, "threads": torch.get_num_threads(),
            "acceptance": acceptance, "seconds": round(time.time() - started, 1)}
    return pd.DataFrame(rows, columns=COLUMNS), info


def _names(text: str, what: str, known) -> tuple[str, ...]:
    names = tuple(n.strip() for n in str(text).split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown) or '(none given)'}; expected some of {', '.join(known)}")
    return names


def add_parser(sub) -> None:
    parser = sub.add_parser("sd", help="speculative decoding with block-level expert selection vs AR-PSR",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target checkpoint directory, named config or family target "
                        "(family, family/deepseek_v3, family/qwen3_5_moe; default: family)")
    parser.add_argument("--drafters", default="ar,dflash", help="comma-separated: ar, dflash, synthetic (default ar,dflash)")
    parser.add_argument("--selectors", default="exact,acceptmoe,confidence_top1",
                        help="comma-separated selector presets (default exact,acceptmoe,confidence_top1)")
    parser.add_argument("-k", type=int_at_least(1, MAX_DRAFTS), default=8, help="drafts per verification block (default 8)")
    parser.add_argument("--pool", "-P", type=int_at_least(1), default=32, help="pool experts per layer, and AR-PSR's C (default 32)")
    parser.add_argument("--prompts", type=int_at_least(1, MAX_COUNT), default=4, help="prompts (default 4)")
    parser.add_argument("--prompt-length", type=int_at_least(1, MAX_TOKENS), default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--new-tokens", type=int_at_least(1, MAX_TOKENS), default=64, help="new tokens per prompt (default 64)")
    parser.add_argument("--calibration", default=None, help="calibration file (default: sampled from the model)")
    parser.add_argument("--calibration-windows", type=int_at_least(1, MAX_COUNT), default=16, help="sampled calibration windows (default 16)")
    parser.add_argument("--calibration-length", type=int_at_least(2, MAX_TOKENS), default=128, help="tokens per calibration window (default 128)")
    parser.add_argument("--ar-drafter", default=None, help="AR drafter checkpoint (default: the family's)")
    parser.add_argument("--dflash-drafter", default=None, help="DFlash drafter checkpoint (default: the family's)")
    parser.add_argument("--synthetic-acceptance", type=float, default=0.8,
                        help="the synthetic drafter's geometric acceptance rate (default 0.8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int_at_least(1, MAX_THREADS), default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--records", action="store_true", help="also write every verification block (block records)")
    parser.add_argument("--out", default="runs/sd", help="directory for results.csv / results.json (default runs/sd)")
    parser.set_defaults(func=main)


def main(args) -> int:
    import pandas as pd

    from specmoe.drafters import DRAFTERS
    from specmoe.models import default_model
    from specmoe.verifiers import SELECTORS

    out = Path(args.out)
    for name in ("results.csv", "results.json"):  # before the computation: a file in the way fails now
        check_output_file(out / name)
    if args.records:  # the block records go into out/blocks, which must be (or become) a writable directory
        check_output_file(out / "blocks" / "blocks_DRAFTER_SELECTOR.safetensors", "block records file")
    table, info = run_sd(
        args.model or default_model(), drafters=_names(args.drafters, "drafter", DRAFTERS),
        selectors=_names(args.selectors, "selector", SELECTORS), k=args.k, pool_size=args.pool, prompts=args.prompts,
        prompt_length=args.prompt_length, new_tokens=args.new_tokens, calibration_windows=args.calibration_windows,
        calibration_length=args.calibration_length, calibration_file=args.calibration,
        drafter_paths={"ar": args.ar_drafter, "dflash": args.dflash_drafter},
        synthetic_acceptance=args.synthetic_acceptance, seed=args.seed, threads=args.threads,
        records_dir=str(out / "blocks") if args.records else None)
    write_text_atomic(out / "results.csv", table.to_csv(index=False))
    write_text_atomic(out / "results.json", json.dumps({"info": info, "rows": table.to_dict("records")}, indent=2))
    print(f"model: {info['model']}  (L={info['layers']}, E={info['experts']}, K={info['top_k']})")
    print(f"k={info['k']}, P=C={info['pool_size']}; {info['prompts']} prompts x {info['prompt_length']} tokens "
          f"({info['prompt_source']}), {info['new_tokens']} new tokens each; copies per committed token, "
          "KL / excess NLL against exact routing per committed position")
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"results: {out / 'results.csv'}  ({info['seconds']} s)")
    return 0
