"""Cost of the drafters on one CUDA GPU against the target's decode step (issue 12: drafters on the GPU).

Seeded random weights in bf16 drawn on the device:
- target: a full-size named config (--model, default OLMoE-1B-7B; its own expert copies freed once the engine's store
  holds them) in the AR engine with every expert resident (C = E, exact routing,
  `scripts/bench_engine.py`'s all-resident row): ms per decoded token, teacher-forced windows of --prompt
  untimed and --target-tokens timed random tokens in a static cache of --max-seq-len positions;
- AR drafter (unless --no-ar): the OLMo-1B-0724 geometry (dense, 16 layers, hidden 2048) with the target's
  vocabulary (50304 for OLMoE) on the static runtime
  (`specmoe.drafters.static_ar`: one CUDA graph per drafted token, static cache of --max-seq-len positions),
  per block of k drafts for each k in --ks, after a prompt of --prompt random tokens; with --eager also the
  same steps without graphs, and (unless --no-hf) the transformers drafter (`runtime="hf"`) on the same weights;
- DFlash drafter: a `DFlashDraftModel` for the target's hidden size reading --dflash-target-layers target
  layers, block --dflash-block (anchor + block - 1 masks), --dflash-layers layers, on the static runtime (one CUDA
  graph per block), fed random context features; likewise --eager and the transformers drafter.
Each static drafter runs once per --backends entry, in the same rounds: "fused" (its layers on the target
decoders' fused Triton kernels, checked at build time: the row's "fused" says whether the check passed) and
"torch" (the torch ops those kernels are checked against); rows `ar_fused_k8`, `ar_torch_k8`, `dflash_fused`, ...
A drafter block is `propose(k)` and `commit` (accepted k // 2, so the position advances by k // 2 + 1), up to the
drafter's host synchronisation, with the stream idle at the start. Configurations run in rounds, interleaved
(round 0 warms up and is dropped), --blocks blocks per round; each drafter is reset on a fresh prompt at the start
of a round. Reported: ms per block and per drafter step (a graph replay: k - 1 + the one or two committed tokens
the cache lacks for the AR drafter, one for DFlash), the achieved bandwidth (bytes a step must read: weights and
the written KV positions / ms), and ratios to the target's ms per token with 95% intervals (paired t-test on log
latency over rounds).

    PYTHONPATH=. python3 scripts/bench_drafters.py --out runs/bench_drafters --no-hf
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import measure_bandwidth, ratio_ci  # noqa: E402

from specmoe.drafters import DFlashDrafter, HFAutoregressiveDrafter, StaticARDrafter, StaticDFlashDrafter  # noqa: E402
from specmoe.drafters.dflash_model import DFlashDraftModel, build_target_layer_ids, dflash_config  # noqa: E402
from specmoe.engines import EngineConfig, build_engine  # noqa: E402
from specmoe.engines.helpers import free_routed_experts, random_model_on_device  # noqa: E402
from specmoe.files import write_text_atomic  # noqa: E402
from specmoe.routing import Calibration, preset  # noqa: E402

# allenai/OLMo-1B-0724-hf's geometry
OLMO_1B_0724 = dict(vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, clip_qkv=None,
                    tie_word_embeddings=True, pad_token_id=1, bos_token_id=None, eos_token_id=50279)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--target-tokens", type=int, default=32)
    p.add_argument("--ks", type=int, nargs="+", default=[8, 16])
    p.add_argument("--dflash-block", type=int, default=16)
    p.add_argument("--dflash-target-layers", type=int, default=5)
    p.add_argument("--dflash-layers", type=int, default=5)
    p.add_argument("--dflash-heads", type=int, default=16)
    p.add_argument("--dflash-kv-heads", type=int, default=4)
    p.add_argument("--dflash-inter", type=int, default=6144)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--eager", action="store_true", help="also the static drafters without CUDA graphs (fused "
                   "kernels where they pass their check)")
    p.add_argument("--backends", nargs="+", default=["fused", "torch"], choices=["fused", "torch"],
                   help="the static drafters' layer kernels, each a row in the same rounds")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers drafters")
    p.add_argument("--no-target", action="store_true", help="skip the target's step (no ratios)")
    p.add_argument("--model", default="olmoe-1b-7b", help="the target: a named config of specmoe.models (e.g. "
                   "qwen3.6-35b-a3b with --dflash-layers 6 --dflash-target-layers 8 --no-ar, the paper's Qwen3.6 "
                   "setting)")
    p.add_argument("--no-ar", action="store_true", help="skip the AR drafter (OLMo-1B-0724's geometry with the "
                   "target's vocabulary)")
    return p.parse_args(argv)


def bytes_of(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def ar_step_bytes(drafter: StaticARDrafter, position: int) -> int:
    """Weights one AR drafter step reads (the embedding row aside) and its attention's KV rows."""
    dec = drafter.decoder
    c = dec.geometry
    weights = bytes_of(dec.lm_head, dec.final_norm, *[t for layer in dec.layers for t in layer.values()])
    return weights + 2 * c.num_layers * c.num_kv_heads * (position + 1) * c.head_dim * dec.k_cache.element_size()


def dflash_block_bytes(drafter: StaticDFlashDrafter, anchor: int) -> int:
    """Weights one DFlash block reads and its attention's KV rows (anchor + block positions per layer)."""
    weights = bytes_of(drafter.fc, drafter.hidden_norm, drafter.norm, drafter.lm_head,  # wkv, bkv: views of wqkv
                       *[t for layer in drafter.layers for name, t in layer.items() if name not in ("wkv", "bkv")])
    kv = 2 * len(drafter.layers) * drafter.num_kv_heads * (anchor + drafter.block_size) * drafter.head_dim
    return weights + kv * drafter.k_cache.element_size()


class DrafterRun:
    """One drafter configuration: reset on a fresh prompt, then timed blocks of propose(k) + commit."""

    def __init__(self, drafter, k: int, prompt: int, vocab: int, width: int, seed: int):
        self.drafter, self.k, self.prompt, self.vocab, self.width = drafter, k, prompt, vocab, width
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator(device="cuda").manual_seed(seed)

    def _features(self, n: int):
        if not self.width:
            return None
        return torch.randn(n, self.width, device="cuda", generator=self.gen, dtype=torch.bfloat16)

    def round(self, blocks: int) -> dict:
        d, k = self.drafter, self.k
        tokens = torch.from_numpy(self.rng.integers(0, self.vocab, self.prompt))
        d.reset(tokens, self._features(self.prompt - 1))
        accepted = k // 2
        ms, steps = [], []
        for _ in range(blocks):
            rows = self._features(accepted + 1)
            cached = getattr(d, "cached", None)
            pending = len(d.tokens) - cached if cached is not None else 1
            torch.cuda.synchronize()
            t = time.perf_counter()
            drafts, _ = d.propose(k)
            d.commit(accepted, int(drafts[accepted]) ^ 1, rows)
            torch.cuda.synchronize()
            ms.append((time.perf_counter() - t) * 1e3)
            steps.append(pending + k - 1 if d.name == "ar" else 1)
        return {"ms": float(np.mean(ms)), "steps": float(np.mean(steps)), "position": len(d.tokens)}


def _ci(row: dict, key: str) -> str:
    if key not in row:
        return "–"
    r = row[key]
    return f"{r['ratio']:.2f} ({r['lo']:.2f}–{r['hi']:.2f})"


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_drafters needs a CUDA device")
    from transformers import OlmoConfig, OlmoForCausalLM

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join(sys.argv), "args": vars(args), "errors": [],
              "time": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "python": platform.python_version()}}
    import transformers

    report["machine"]["transformers"] = transformers.__version__

    def save():
        write_text_atomic(out_dir / "bench_drafters.json", json.dumps(report, indent=1, default=float))

    torch.manual_seed(args.seed)
    report["bandwidth_Bps"] = measure_bandwidth("cuda")
    target, adapter = random_model_on_device(args.model, args.seed, torch.bfloat16, "cuda")
    L, E, K, V = adapter.num_moe_layers, adapter.num_experts, adapter.top_k, adapter.vocab_size
    window = args.prompt + args.target_tokens
    reach = args.prompt + max((k // 2 + 1) * args.blocks + k + 1 for k in [*args.ks, args.dflash_block])
    if max(window, reach) > args.max_seq_len:
        raise SystemExit(f"--prompt, --target-tokens, --ks, --dflash-block and --blocks reach position "
                         f"{max(window, reach)}, beyond --max-seq-len {args.max_seq_len}")
    engine = None
    if not args.no_target:
        engine = build_engine(target, preset("exact_lru", E, K), Calibration.uniform(L, E, V),
                              EngineConfig(max_seq_len=args.max_seq_len), store=None)
        report["target_notes"] = engine.notes
        report["target_kernels"] = engine.kernels  # launch parameters and their source (cache, tuned, defaults)
    report["target_experts_freed_GB"] = free_routed_experts(target) / 1e9  # the engine reads its store

    with torch.device("cuda"):
        ar_model = None if args.no_ar else \
            OlmoForCausalLM(OlmoConfig(**{**OLMO_1B_0724, "vocab_size": V})).to(torch.bfloat16).eval()
        ids = build_target_layer_ids(L, args.dflash_target_layers)  # DFlash's spacing: [1, 4, 7, 10, 13] for 5
        df_config = dflash_config(target.config, num_layers=args.dflash_layers, block_size=args.dflash_block,
                                  mask_token_id=V - 1, intermediate_size=args.dflash_inter,
                                  num_attention_heads=args.dflash_heads, num_key_value_heads=args.dflash_kv_heads,
                                  target_layer_ids=ids)
        df_model = DFlashDraftModel(df_config).to(torch.bfloat16).eval()
    report["dflash"] = {"target_layer_ids": ids, "layers": args.dflash_layers, "block": args.dflash_block,
                        "heads": args.dflash_heads, "kv_heads": args.dflash_kv_heads, "inter": args.dflash_inter,
                        "params": sum(p.numel() for p in df_model.parameters())}
    if ar_model is not None:
        report["ar"] = {"config": f"OLMo-1B-0724, vocabulary {V}", "params": sum(p.numel() for p in ar_model.parameters())}
    width = len(ids) * target.config.hidden_size
    static = dict(max_seq_len=args.max_seq_len)
    runs: dict[str, DrafterRun] = {}
    backend = {"fused": "triton", "torch": "torch"}
    builders = {kind: lambda m, cls, b=backend[kind]: cls(m, target, backend=b, **static) for kind in args.backends}
    if args.eager:
        builders["eager"] = lambda m, cls: cls(m, target, cuda_graphs=False, backend="triton", **static)
    for kind, make in builders.items():
        df = make(df_model, StaticDFlashDrafter)
        report[f"notes_{kind}"] = {"dflash": df.notes}
        if ar_model is not None:
            ar = make(ar_model, StaticARDrafter)
            report[f"notes_{kind}"]["ar"] = ar.notes
            for k in args.ks:
                runs[f"ar_{kind}_k{k}"] = DrafterRun(ar, k, args.prompt, V, 0, args.seed + k)
        runs[f"dflash_{kind}"] = DrafterRun(df, args.dflash_block - 1, args.prompt, V, width, args.seed)
    if not args.no_hf:
        for k in ([] if ar_model is None else args.ks):
            runs[f"ar_hf_k{k}"] = DrafterRun(HFAutoregressiveDrafter(ar_model, target), k, args.prompt, V, 0,
                                             args.seed + k)
        runs["dflash_hf"] = DrafterRun(DFlashDrafter(df_model, target), args.dflash_block - 1, args.prompt, V, width,
                                       args.seed)
    save()
    print("set up; bandwidth GB/s", report["bandwidth_Bps"] / 1e9, flush=True)

    rng = np.random.default_rng(args.seed + 100)
    rounds = {name: [] for name in ["target_step", *runs] if name != "target_step" or engine is not None}
    steps, positions = {name: [] for name in runs}, {name: [] for name in runs}
    for r in range(args.rounds + 1):
        if engine is not None:
            try:
                res = engine.teacher_forced(rng.integers(0, V, window), prompt_len=args.prompt)
                if r:
                    rounds["target_step"].append(res.summary()["ms_mean"])
            except Exception as exc:
                report["errors"].append(f"target: {exc!r}\n{traceback.format_exc()[-1500:]}")
        for name, run in runs.items():
            try:
                res = run.round(args.blocks)
                if r:
                    rounds[name].append(res["ms"])
                    steps[name].append(res["steps"])
                    positions[name].append(res["position"])
            except Exception as exc:
                report["errors"].append(f"{name}: {exc!r}\n{traceback.format_exc()[-1500:]}")
        if r:
            print(f"round {r}:", {n: round(v[-1], 3) for n, v in rounds.items() if v}, flush=True)
    bandwidth = report["bandwidth_Bps"]
    rows = {}
    target_ms = rounds.get("target_step") or []
    if target_ms:
        rows["target_step"] = {"ms_per_token": float(np.mean(target_ms)), "rounds_ms": target_ms}
    for name, run in runs.items():
        ms = rounds[name]
        if not ms:
            continue
        step_ms = float(np.mean(ms)) / float(np.mean(steps[name]))
        row = {"ms_per_block": float(np.mean(ms)), "k": run.k, "steps_per_block": float(np.mean(steps[name])),
               "ms_per_step": step_ms, "rounds_ms": ms, "mean_final_position": float(np.mean(positions[name]))}
        mid = args.prompt + args.blocks * (run.k // 2 + 1) // 2
        if isinstance(run.drafter, StaticARDrafter):
            row["achieved_GBps"] = ar_step_bytes(run.drafter, mid) / step_ms / 1e6
            row["fused"] = run.drafter.decoder.fused
        elif isinstance(run.drafter, StaticDFlashDrafter):
            row["achieved_GBps"] = dflash_block_bytes(run.drafter, mid) / step_ms / 1e6
            row["fused"] = run.drafter.fused
        if "achieved_GBps" in row:
            row["bandwidth_fraction"] = row["achieved_GBps"] * 1e9 / bandwidth
        if target_ms and len(target_ms) == len(ms):
            row["block_over_target_step"] = ratio_ci(ms, target_ms)
            per_step = [m / s for m, s in zip(ms, steps[name])]
            row["step_over_target_step"] = ratio_ci(per_step, target_ms)
        rows[name] = row
    report["rows"] = rows
    save()
    lines = ["| configuration | layers | ms per block | steps per block | ms per step | achieved GB/s (of peak) | "
             "block / target step (95% CI) | step / target step (95% CI) |", "|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        if name == "target_step":
            lines.append(f"| target step ({args.model} all resident) | – | – | – | {row['ms_per_token']:.3f} | – | 1 | 1 |")
            continue
        gbps = f"{row['achieved_GBps']:.0f} ({row['bandwidth_fraction']:.0%})" if "achieved_GBps" in row else "–"
        layers = {True: "fused", False: "torch"}.get(row.get("fused"), "–")
        lines.append(f"| {name} | {layers} | {row['ms_per_block']:.3f} | {row['steps_per_block']:.1f} | {row['ms_per_step']:.3f} "
                     f"| {gbps} | {_ci(row, 'block_over_target_step')} | {_ci(row, 'step_over_target_step')} |")
    table = "\n".join(lines)
    write_text_atomic(out_dir / "bench_drafters.md", f"{report['machine']}\n\n{table}\n")
    print(table)
    if report["errors"]:
        print("errors:", *report["errors"], sep="\n")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
