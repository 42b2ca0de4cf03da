#!/usr/bin/env python3
"""Reproducible, seeded training of the small model family (MoE target, AR drafter, DFlash drafter) and of
its members (DeepSeek-V3 and Qwen3.5-MoE targets on the same corpus and tokenizer, Qwen's DFlash drafter).

  prepare        build the corpus here (split by file, tokenizer, uint16 token streams) into --corpus
  train          train + save + measure the family from a built corpus (the H200 run: --preset h200)
  train-members  train + save + measure the members (the H200 run: --preset h200, about 8 minutes in all)
  pack           flatten a trained directory into at most 8 files below 16 MiB (for the device's $OUT)
  install        unpack such files into a family directory (default: specmoe/assets/family)
  evaluate       re-measure a family directory (any device) and, with --replay, routing-policy replays

The shipped family was made by (see specmoe/assets/family/metrics.json, "reproduce"):
  python scripts/train_family.py prepare --corpus .corpus --tokenizer specmoe/assets/family/target
  python scripts/train_family.py train --corpus .corpus --out runs/family --preset h200 \
      --target-steps N --drafter-steps M
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specmoe.assets import FAMILY as ASSETS, FAMILY_MEMBERS, family_path  # noqa: E402
from specmoe.files import write_text_atomic  # noqa: E402
from specmoe_train.configs import FAMILY_PRESETS, MEMBER_PRESETS  # noqa: E402

BIG = 1 << 20  # files above 1 MiB travel on their own, the rest in one tar
MAX_PACKED_FILES, MAX_PACKED_BYTES = 8, 16 << 20  # what the device returns under $OUT


def _logger(path: Path):
    """A log function printing a timestamped line and appending it to `path`."""
    log_file = open(path, "a")

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()
    return log


def cmd_prepare(args) -> None:
    from specmoe_train.corpus import build_corpus

    split = None
    if args.split:
        split = json.loads(Path(args.split).read_text())
    roots = {name: Path(path) for name, path in (item.split("=", 1) for item in args.root)} if args.root else None
    result = build_corpus(args.corpus, tokenizer_dir=args.tokenizer, split=split, roots=roots)
    print(json.dumps(result["tokens"], indent=1))


def cmd_train(args) -> None:
    from specmoe_train.family import run_family

    Path(args.out).mkdir(parents=True, exist_ok=True)
    metrics = run_family(args.corpus, args.out, args.preset, args.target_steps, args.drafter_steps,
                         args.device, _logger(Path(args.out) / "train.log"), args.time_limit)
    print(json.dumps({k: metrics[k] for k in ("training", "slice", "wall_seconds")}, indent=1, default=str))


def _member_steps(items) -> dict:
    """--steps NAME=T[,D] entries as member -> (target steps, DFlash drafter steps)."""
    steps = {}
    for item in items or ():
        name, _, counts = item.partition("=")
        if name not in FAMILY_MEMBERS or not counts:
            raise ValueError(f"--steps takes MEMBER=TARGET_STEPS[,DFLASH_STEPS] with MEMBER one of "
                             f"{', '.join(FAMILY_MEMBERS)}, got {item!r}")
        values = [int(v) for v in counts.split(",")]
        steps[name] = (values[0], values[1] if len(values) > 1 else None)
    return steps


def cmd_train_members(args) -> None:
    from specmoe_train.members import run_members

    Path(args.out).mkdir(parents=True, exist_ok=True)
    metrics = run_members(args.corpus, args.out, args.ar_drafter, args.preset, args.device,
                          _logger(Path(args.out) / "members_train.log"), args.time_limit,
                          tuple(args.member) if args.member else None, _member_steps(args.steps))
    summary = {name: {"steps": {k: v["steps"] for k, v in m["training"].items()}, "bytes": m["bytes"],
                      "slice": {k: v for k, v in m.get("slice", {}).items() if k != "starts"}}
               for name, m in metrics["members"].items()}
    print(json.dumps({"members": summary, "wall_seconds": metrics["wall_seconds"]}, indent=1, default=str))


def cmd_pack(args) -> None:
    src, dst = Path(args.family), Path(args.out)
    dst.mkdir(parents=True, exist_ok=True)
    small = []
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = path.relative_to(src).as_posix()
        if path.stat().st_size > BIG:
            (dst / rel.replace("/", "__")).write_bytes(path.read_bytes())
        else:
            small.append((path, rel))
    with tarfile.open(dst / "family_small.tar", "w") as tar:
        for path, rel in small:
            tar.add(str(path), arcname=rel)
    packed = sorted(dst.iterdir())
    print("\n".join(f"{p.name} {p.stat().st_size}" for p in packed))
    too_big = [p.name for p in packed if p.stat().st_size >= MAX_PACKED_BYTES]
    if len(packed) > MAX_PACKED_FILES or too_big:
        raise ValueError(f"packed into {len(packed)} files (at most {MAX_PACKED_FILES}), files of 16 MiB or more: "
                         f"{too_big or 'none'}")


def cmd_install(args) -> None:
    src, dst = Path(args.packed), Path(args.family)
    dst.mkdir(parents=True, exist_ok=True)
    with tarfile.open(src / "family_small.tar") as tar:
        tops = {name.split("/")[0] for name in tar.getnames()} | {p.name.split("__")[0] for p in src.iterdir()}
        for top in tops & {*FAMILY_MEMBERS, *(d for d in FAMILY_MEMBERS.values() if d)}:
            if (dst / top).is_dir():  # a member's checkpoint is replaced whole (no stale shards)
                shutil.rmtree(dst / top)
        tar.extractall(dst, filter="data")
    for path in src.iterdir():
        if "__" in path.name:
            target = dst / path.name.replace("__", "/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    print(f"installed into {dst}")


def cmd_evaluate_member(args) -> None:
    """`evaluate --member NAME`: the member's fixed slice (and with --locality its routing locality) at --dtype
    on --device, checked against the record, into members_metrics.json with --write."""
    import torch

    from specmoe_train.corpus import load_corpus
    from specmoe_train.family import EVAL_SETTINGS, measure_locality
    from specmoe_train.members import load_member, member_slice_metrics

    family = Path(args.family)
    metrics_path = family / "members_metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {"members": {}}
    entry = metrics["members"].setdefault(args.member, {})
    streams = load_corpus(args.corpus)
    target, dflash = load_member(family, args.member, args.device, getattr(torch, args.dtype))
    target.set_experts_implementation("eager")
    recomputed = member_slice_metrics(target, dflash, streams["evaluation"])
    if "starts" in entry.get("slice", {}) and entry["slice"]["starts"] != recomputed["starts"]:
        raise ValueError("the corpus's evaluation stream does not give the recorded slice")
    entry[f"slice_{args.device}_{args.dtype}"] = {k: v for k, v in recomputed.items() if k != "starts"}
    print(json.dumps({args.member: {"recorded": entry.get("slice"), "here": entry[f"slice_{args.device}_{args.dtype}"]}},
                     indent=1))
    if args.locality:
        st = EVAL_SETTINGS[args.preset]
        entry[f"locality_{args.device}_{args.dtype}"] = measure_locality(
            target, streams["evaluation"], st["locality_sequences"], st["locality_length"], 16)
    if args.write:
        write_text_atomic(metrics_path, json.dumps(metrics, indent=1))


def cmd_evaluate(args) -> None:
    import torch

    if args.member:
        return cmd_evaluate_member(args)

    from specmoe_train.corpus import load_corpus
    from specmoe_train.family import EVAL_SETTINGS, evaluate_family, load_family
    from specmoe_train.replay_metrics import replay_metrics

    family = Path(args.family)
    streams = load_corpus(args.corpus)
    metrics_path = family / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    dtype = getattr(torch, args.dtype)
    target, ar, dflash = load_family(family, args.device, dtype)
    if args.slice:  # recompute the fixed slice here (float32) and record its tokens next to the training run's values
        from specmoe_train.family import slice_metrics

        recomputed = slice_metrics(target, ar, dflash, streams["evaluation"])
        if "slice" not in metrics.get("slice", {}):  # none recorded, or the record of a failed measurement
            metrics["slice"] = recomputed
        recorded = metrics["slice"]
        if recorded["slice"]["starts"] != recomputed["slice"]["starts"]:
            raise ValueError("the corpus's evaluation stream does not give the recorded slice")
        recorded["slice"]["token_ids"] = recomputed["slice"]["token_ids"]
        metrics[f"slice_{args.device}_{args.dtype}"] = {k: v for k, v in recomputed.items() if k != "slice"}
        print(json.dumps(metrics[f"slice_{args.device}_{args.dtype}"], indent=1))
    if args.locality:
        from specmoe_train.family import measure_locality

        st = EVAL_SETTINGS[args.preset]
        metrics[f"locality_{args.device}_{args.dtype}"] = measure_locality(
            target, streams["evaluation"], st["locality_sequences"], st["locality_length"], 16)
    if args.replay:
        metrics["replay"] = replay_metrics(target, streams, family_name=str(family))
        print(json.dumps(metrics["replay"], indent=1))
    if args.full:
        metrics[f"evaluation_{args.device}"] = evaluate_family(target, ar, dflash, streams, EVAL_SETTINGS[args.preset])
    if args.write:
        write_text_atomic(metrics_path, json.dumps(metrics, indent=1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--corpus", default=".corpus")
    p.add_argument("--tokenizer", default=None, help="reuse the tokenizer in this directory instead of training one")
    p.add_argument("--split", default=None, help="rebuild from a recorded split.json (checks every file's hash)")
    p.add_argument("--root", action="append", help="NAME=PATH: where source NAME lives on this machine")
    p.set_defaults(func=cmd_prepare)
    p = sub.add_parser("train")
    p.add_argument("--corpus", default=".corpus")
    p.add_argument("--out", default="runs/family")
    p.add_argument("--preset", default="h200", choices=sorted(FAMILY_PRESETS))
    p.add_argument("--target-steps", type=int, default=None)
    p.add_argument("--drafter-steps", type=int, default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--time-limit", type=float, default=None, help="skip measurements after this many seconds")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("train-members")
    p.add_argument("--corpus", default=".corpus")
    p.add_argument("--out", default="runs/members")
    p.add_argument("--preset", default="h200", choices=sorted(MEMBER_PRESETS))
    p.add_argument("--member", action="append", choices=sorted(FAMILY_MEMBERS), help="train only these (repeat)")
    p.add_argument("--steps", action="append", help="MEMBER=T[,D]: explicit target (and DFlash drafter) steps")
    p.add_argument("--ar-drafter", default=str(family_path("ar_drafter")),
                   help="the family's AR drafter measured against every member (the corpus's tokenizer)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--time-limit", type=float, default=None, help="skip measurements after this many seconds")
    p.set_defaults(func=cmd_train_members)
    p = sub.add_parser("pack")
    p.add_argument("--family", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_pack)
    p = sub.add_parser("install")
    p.add_argument("--packed", required=True)
    p.add_argument("--family", default=str(ASSETS))
    p.set_defaults(func=cmd_install)
    p = sub.add_parser("evaluate")
    p.add_argument("--family", default=str(ASSETS))
    p.add_argument("--corpus", default=".corpus")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--preset", default="h200", choices=sorted(FAMILY_PRESETS))
    p.add_argument("--replay", action="store_true")
    p.add_argument("--locality", action="store_true", help="routing locality of the target at --dtype")
    p.add_argument("--slice", action="store_true", help="recompute the fixed held-out slice and record its tokens")
    p.add_argument("--full", action="store_true")
    p.add_argument("--member", choices=sorted(FAMILY_MEMBERS), default=None,
                   help="measure this member instead (--slice implied, --locality; members_metrics.json)")
    p.add_argument("--write", action="store_true", help="write the results into the family's metrics.json")
    p.set_defaults(func=cmd_evaluate)
    args = parser.parse_args(argv)
    bad_roots = [item for item in args.root or () if "=" not in item] if args.command == "prepare" else []
    if bad_roots:
        parser.error(f"--root takes NAME=PATH, got {bad_roots[0]!r}")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as exc:  # CorpusError and ModelSourceError are ValueErrors
        print(f"train_family.py {args.command}: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
