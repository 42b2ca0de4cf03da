"""Make the routing trace and calibration that `scripts/bench_engine.py --trace` follows.

From a trained model (default: the shipped family target; --model names another member's checkpoint): a
calibration on the first 128 windows of 512 tokens of the corpus's
calibration split, and a trace of `--sequences` sequences of `--length` tokens of the evaluation split
(sequence i starts at token 4096 i; default 4 x 512, enough for a prompt of a few hundred tokens plus the
decoded window). The corpus comes from `python3 scripts/train_family.py prepare --corpus .corpus ...`.

    python3 scripts/make_bench_trace.py --corpus .corpus --out .device-carry
    python3 scripts/make_bench_trace.py --corpus .corpus --out .device-carry --model DIR --name deepseek_v3
        # writes deepseek_v3_calib.safetensors and deepseek_v3_trace.safetensors
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from specmoe.experiments.calibrate import token_windows  # noqa: E402
from specmoe.harness import collect_calibration, record_trace  # noqa: E402
from specmoe.models import load_model  # noqa: E402
from specmoe.assets import family_path  # noqa: E402
from specmoe_train.corpus import load_corpus  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=".corpus")
    parser.add_argument("--out", default=".device-carry")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the family target)")
    parser.add_argument("--name", default="", help="file name prefix: NAME_calib.safetensors, NAME_trace...")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = load_corpus(args.corpus, ("calibration", "evaluation"))  # no training split needed
    source = args.model or str(family_path("target"))
    model, adapter = load_model(source)
    prefix = f"{args.name}_" if args.name else ""
    windows = token_windows(parts["calibration"], 512, 128)
    calibration = collect_calibration(model, adapter, windows, {
        "text": "family corpus, calibration split, first 128 windows of 512 tokens"})
    calibration.save(out / f"{prefix}calib.safetensors")
    evaluation = parts["evaluation"]
    if not 1 <= args.length <= 4096 or args.sequences < 1 or args.sequences * 4096 > len(evaluation):
        raise SystemExit(f"--length must be 1..4096 and --sequences at most {len(evaluation) // 4096}")
    sequences = [torch.as_tensor(evaluation[i * 4096:i * 4096 + args.length]) for i in range(args.sequences)]
    record_trace(model, sequences, model_source=source).save(out / f"{prefix}trace.safetensors")
    print(f"wrote {out / f'{prefix}calib.safetensors'} and {out / f'{prefix}trace.safetensors'}")


if __name__ == "__main__":
    main()
