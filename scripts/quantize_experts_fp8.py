"""Write an FP8 copy of a local checkpoint directory: its routed experts in float8 e4m3 with 128 x 128 block
`weight_scale_inv` (the layout of DeepSeek-V3's and Qwen's FP8 releases), every other tensor and file as it was,
config.json with an FP8 quantization_config (`specmoe.models.fp8_checkpoint.quantize_experts_fp8`).

    PYTHONPATH=. python3 scripts/quantize_experts_fp8.py SOURCE_DIR DESTINATION_DIR
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="checkpoint directory (config.json + *.safetensors, per-expert layout)")
    ap.add_argument("destination", help="directory to write the FP8 copy to")
    args = ap.parse_args(argv)
    from specmoe.models.fp8_checkpoint import quantize_experts_fp8

    count = quantize_experts_fp8(args.source, args.destination)
    print(f"wrote {args.destination}: {count} expert matrices in FP8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
