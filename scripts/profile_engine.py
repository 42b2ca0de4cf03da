"""Where a decode step's GPU time goes: the engine as `build_engine` makes it with default settings, every expert
resident (one CUDA graph per token where the policy routes on the device), a named full-size config with seeded
random weights on the GPU; ms/token over --tokens teacher-forced tokens at --position, then the kernels of 16
tokens under torch's profiler (`kernel_timeline.kernel_table`: their count per token, their time as recorded and as
they could run, which programmatic dependent launch's early starts make differ, and the GPU's busy time).

    PYTHONPATH=. python3 scripts/profile_engine.py --model qwen3.6-35b-a3b [--out runs/profile.txt]

With --drafter, the static AR drafter instead (OLMo-1B-0724's geometry with --model's vocabulary, seeded random
bf16 weights, on the fused kernels as `StaticARDrafter` chooses them by default, one CUDA graph per step): a
prompt of --position random tokens, blocks of 16 drafts (`bench_drafters.DrafterRun`); ms per step, the bytes a step reads
(`bench_drafters.ar_step_bytes`) over the measured bandwidth (a device-to-device copy) against that time, and the
kernel table of one block's 16 steps.

    PYTHONPATH=. python3 scripts/profile_engine.py --drafter --model olmoe-1b-7b --position 2048
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench scripts beside it (--drafter)

from specmoe.drafters import StaticARDrafter  # noqa: E402
from specmoe.engines import EngineConfig, build_engine  # noqa: E402
from specmoe.engines.helpers import random_model_on_device  # noqa: E402
from specmoe.engines.kernel_timeline import kernel_table  # noqa: E402
from specmoe.offload import ExpertResidency, ExpertStore  # noqa: E402
from specmoe.routing import Calibration, preset  # noqa: E402


class Transcript:
    """Output lines printed as they come and kept, written to a file at the end (--out)."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, *parts) -> None:
        text = " ".join(str(p) for p in parts)
        print(text, flush=True)
        self.lines.append(text)

    def save(self, path: str | None) -> None:
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text("\n".join(self.lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.6-35b-a3b", help="a named config of specmoe.models")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--position", type=int, default=256, help="first position of the timed tokens")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--out", default=None, help="also write the output to this file")
    ap.add_argument("--drafter", action="store_true", help="profile the static AR drafter's step instead")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_engine.py needs a CUDA device")
    say = Transcript()
    if args.drafter:
        profile_drafter(args, say)
        say.save(args.out)
        return
    t0 = time.time()
    model, adapter = random_model_on_device(args.model, 0, torch.bfloat16, "cuda")
    store = ExpertStore.from_model(model, adapter, release=True)
    g = adapter
    engine = build_engine(model, preset("exact_lru", g.num_experts, g.top_k),
                          Calibration.uniform(g.num_moe_layers, g.num_experts, g.vocab_size),
                          EngineConfig(max_seq_len=args.max_seq_len),
                          residency=ExpertResidency(store, g.num_experts, "cuda"))
    say(f"{args.model}: set up in {time.time() - t0:.0f} s; kernels {engine.kernels}")
    tokens = np.random.default_rng(1).integers(0, g.vocab_size, args.tokens)
    for _ in range(2):  # the first run warms up
        result = engine.teacher_forced(tokens, first_position=args.position)
    say(f"ms/token {result.ms[result.timed].mean():.3f} (routing: {result.info['routing']})")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.teacher_forced(tokens[:16], first_position=args.position)
        torch.cuda.synchronize()
    text, per_token, busy = kernel_table(prof, 16, 30)
    say(f"kernels per token {per_token:.1f}, GPU busy {busy:.3f} ms per token")
    say(text)
    say.save(args.out)


def profile_drafter(args, say: Transcript, k: int = 16, blocks: int = 8) -> None:
    """--drafter (module docstring)."""
    from bench_drafters import OLMO_1B_0724, DrafterRun, ar_step_bytes
    from bench_common import measure_bandwidth
    from torch.profiler import ProfilerActivity, profile
    from transformers import OlmoConfig, OlmoForCausalLM

    from specmoe.models import named_config

    vocab = named_config(args.model).vocab_size
    if args.position + blocks * (k // 2 + 1) + k + 1 > args.max_seq_len:
        raise SystemExit(f"--position {args.position} and {blocks} blocks of {k} drafts do not fit --max-seq-len "
                         f"{args.max_seq_len}")
    torch.manual_seed(0)
    bandwidth = measure_bandwidth("cuda")
    with torch.device("cuda"):
        model = OlmoForCausalLM(OlmoConfig(**{**OLMO_1B_0724, "vocab_size": vocab})).to(torch.bfloat16).eval()
    drafter = StaticARDrafter(model, model, max_seq_len=args.max_seq_len)
    say(f"AR drafter (OLMo-1B-0724 geometry, vocabulary {vocab}); notes {drafter.notes}; "
        f"launches {drafter.decoder.launch}")
    run = DrafterRun(drafter, k, args.position, vocab, 0, seed=0)  # bench_drafters' blocks: k drafts, k // 2 kept
    run.round(2)  # warm-up (graph capture)
    timed = run.round(blocks)
    step_ms = timed["ms"] / timed["steps"]
    floor_ms = ar_step_bytes(drafter, args.position + blocks * (k // 2 + 1) // 2) / bandwidth * 1e3
    say(f"step {step_ms:.3f} ms; bytes floor {floor_ms:.3f} ms at {bandwidth / 1e9:.0f} GB/s: "
        f"{floor_ms / step_ms:.0%} of the bandwidth")
    rng = np.random.default_rng(0)
    drafter.reset(torch.from_numpy(rng.integers(0, vocab, args.position)), None)
    drafter.commit(k // 2, int(drafter.propose(k)[0][k // 2]) ^ 1)  # then a block of k steps, 1 pending
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        drafter.propose(k)
        torch.cuda.synchronize()
    text, per_step, busy = kernel_table(prof, k, 30)
    say(f"kernels per step {per_step:.1f}, GPU busy {busy:.3f} ms per step")
    say(text)


if __name__ == "__main__":
    main()
