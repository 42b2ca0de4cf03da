"""`specmoe sd`: speculative decoding with block-level expert selection, next to AR-PSR at the same expert memory.

A short form of `specmoe run experiments/sd.toml`: each flag below is a `--set` override of that config, and
the run directory (default runs/sd, or runs/sd-DIGEST with overrides) is a `specmoe run` directory that
resumes where it stopped and that `specmoe report` reads.

For every drafter and selector it runs the harness's speculative loop (`specmoe.harness.speculative_generate`)
greedily on the same prompts, with a pool of P experts per layer: tau (committed tokens per verification),
host-to-device copies per committed token, displaced router mass per committed token-layer, and the KL and
excess NLL of the committed positions against exact routing on the same prefix. AR decoding with PSR at C = P
(the paper's bonus for that residency, n = 1, A priority) runs on the same prompts for the same number of new
tokens; its copies count decoding only (demand and prefetch, the prompt excluded), like the speculative rows.
Drafting and target times are CPU wall times of the harness.

Prompts: the config's workload, the family's held-out evaluation slice (with `--model` of another model, windows
sampled from it under exact routing, seed + 2); the pool's warm set and PSR's
calibration come from windows sampled from the model (seed + 1), or from `--calibration FILE`. `--records`
also writes every verification block to RUN_DIR/blocks/ (input of `specmoe replay-sd --records`).
"""

from __future__ import annotations

import argparse

from specmoe.arguments import int_at_least
from specmoe.limits import MAX_COUNT, MAX_DRAFTS, MAX_THREADS, MAX_TOKENS


def _names(text: str) -> list[str]:
    return [n.strip() for n in str(text).split(",") if n.strip()]


def add_parser(sub) -> None:
    from .run import add_options

    parser = sub.add_parser("sd", help="speculative decoding with block-level expert selection vs AR-PSR "
                            "(specmoe run experiments/sd.toml)", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target: a family name (family, family/deepseek_v3, "
                        "family/qwen3_5_moe), named config, checkpoint directory or hub id (default: family)")
    parser.add_argument("--drafters", default=None, help="comma-separated: ar, dflash, synthetic (default ar,dflash)")
    parser.add_argument("--selectors", default=None,
                        help="comma-separated selector presets (default exact,acceptmoe,confidence_top1)")
    parser.add_argument("-k", type=int_at_least(1, MAX_DRAFTS), default=None, help="drafts per verification block (default 8)")
    parser.add_argument("--pool", "-P", type=int_at_least(1), default=None, help="pool experts per layer, and AR-PSR's C (default 32)")
    parser.add_argument("--prompts", type=int_at_least(1, MAX_COUNT), default=None, help="prompts (default 4)")
    parser.add_argument("--prompt-length", type=int_at_least(1, MAX_TOKENS), default=None, help="tokens per prompt (default 64)")
    parser.add_argument("--new-tokens", type=int_at_least(1, MAX_TOKENS), default=None, help="new tokens per prompt (default 64)")
    parser.add_argument("--calibration", default=None, help="calibration file (default: sampled from the model)")
    parser.add_argument("--calibration-windows", type=int_at_least(1, MAX_COUNT), default=None, help="sampled calibration windows (default 16)")
    parser.add_argument("--calibration-length", type=int_at_least(2, MAX_TOKENS), default=None, help="tokens per calibration window (default 128)")
    parser.add_argument("--ar-drafter", default=None, help="AR drafter checkpoint (default: the family's)")
    parser.add_argument("--dflash-drafter", default=None, help="DFlash drafter checkpoint (default: the family's)")
    parser.add_argument("--synthetic-acceptance", type=float, default=None,
                        help="the synthetic drafter's geometric acceptance rate (default 0.8)")
    parser.add_argument("--seed", type=int_at_least(0), default=None, help="seed (default 0)")
    parser.add_argument("--threads", type=int_at_least(1, MAX_THREADS), default=None, help="torch CPU threads (default 1)")
    parser.add_argument("--records", action="store_true", help="also write every verification block (RUN_DIR/blocks/)")
    add_options(parser)
    parser.set_defaults(func=main)


FLAGS = {"model": "model.source", "drafters": "sd.drafters", "selectors": "sd.selectors", "k": "sd.k",
         "prompts": "workload.count", "prompt_length": "workload.length", "new_tokens": "workload.new_tokens",
         "calibration": "calibration.file", "calibration_windows": "calibration.windows",
         "calibration_length": "calibration.length", "ar_drafter": "drafters.ar.path",
         "dflash_drafter": "drafters.dflash.path", "synthetic_acceptance": "drafters.synthetic.acceptance",
         "seed": "seed", "threads": "threads"}


def overrides(args) -> list[str]:
    """The config keys the flags set, as --set items (flags not given leave the config's values)."""
    from .run import as_override

    out = []
    for flag, key in FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            out.append(as_override(key, _names(value) if flag in ("drafters", "selectors") else value))
    if args.pool is not None:
        out += [as_override("sd.pool", args.pool), as_override("ar.capacity", args.pool)]
    if args.records:
        out.append(as_override("sd.records", True))
    if args.model is not None and not _family_target(args.model):  # the family's prompts are the family's tokens
        out.append(as_override("workload.source", "selfgen"))
    return out


def _family_target(source: str) -> bool:
    from pathlib import Path

    from specmoe.assets import family_source, family_target_dirs

    try:
        path = family_source(source)
    except ValueError:
        return False
    return Path(path or source).resolve() in {p.resolve() for p in family_target_dirs()}


def main(args) -> int:
    from .run import run_shipped

    return run_shipped("sd", args, overrides(args))
