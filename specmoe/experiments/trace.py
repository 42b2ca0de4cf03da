"""`specmoe trace`: record a routing trace (router and pre-gate logits of exact routing) over a text file
(the file format: `specmoe.records.traces`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from specmoe.arguments import check_positions, int_at_least
from specmoe.files import check_output_file, read_utf8


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``trace`` to an argparse subparsers object (for specmoe.cli)."""
    p = subparsers.add_parser("trace", help="record router and pre-gate logits of exact routing over a text",
                              description="Record a routing trace (see specmoe.records.traces for the file format).")
    p.add_argument("--model", default="family",
                   help="a local checkpoint directory, 'family' for the shipped small OLMoE target or "
                        "'family/<member>' for a member's target (family/deepseek_v3, family/qwen3_5_moe)")
    p.add_argument("--text", required=True, help="a UTF-8 text file; tokenized with the model's tokenizer")
    p.add_argument("--out", required=True, help="output trace file (.safetensors)")
    p.add_argument("--window", type=int_at_least(1), default=1024,
                   help="tokens per recorded sequence (the last may be shorter; at most the model's positions)")
    p.add_argument("--max-tokens", type=int_at_least(1), default=65536, help="record at most this many tokens")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    import torch
    from transformers import AutoTokenizer

    from specmoe.harness import record_trace
    from specmoe.models import load_model, resolve_source

    source = Path(resolve_source(args.model))
    if not Path(source).is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {source}")
    check_output_file(args.out, "--out")
    text = read_utf8(args.text)
    # the harness's loader: same model class and pinned experts kernels as every other measurement
    model, _ = load_model(str(source), dtype=getattr(torch, args.dtype), device=args.device)
    check_positions(model, args.window, "--window")
    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    if len(tokenizer) == 0:
        raise ValueError(f"checkpoint directory {source} has no tokenizer files")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][: args.max_tokens]
    if not ids:
        raise ValueError(f"{args.text} holds no tokens")
    sequences = [torch.tensor(ids[i:i + args.window]) for i in range(0, len(ids), args.window)]
    trace = record_trace(model, sequences, model_source=str(args.model))
    trace.info["text"] = str(args.text)
    trace.save(args.out)
    print(f"wrote {args.out}: {trace.num_tokens} tokens in {len(sequences)} sequences, "
          f"L={trace.num_layers} E={trace.num_experts} K={trace.top_k}")
    return 0
