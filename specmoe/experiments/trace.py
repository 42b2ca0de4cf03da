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
    check_output_file(args.out, "--out")
    ids = text_ids(args.model, args.text)[: args.max_tokens]
    trace = record_tokens(args.model, ids, args.window, args.dtype, args.device)
    trace.info["text"] = str(args.text)
    trace.save(args.out)
    print(f"wrote {args.out}: {trace.num_tokens} tokens in {trace.sequence_starts.size} sequences, "
          f"L={trace.num_layers} E={trace.num_experts} K={trace.top_k}")
    return 0


def text_ids(model_source: str, text_file: str) -> list[int]:
    """The token ids of a UTF-8 text file, by the tokenizer of the checkpoint `model_source` names."""
    from transformers import AutoTokenizer

    from specmoe.models import resolve_source

    source = Path(resolve_source(model_source))
    if not source.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {source}")
    text = read_utf8(text_file)
    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    if len(tokenizer) == 0:
        raise ValueError(f"checkpoint directory {source} has no tokenizer files")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if not ids:
        raise ValueError(f"{text_file} holds no tokens")
    return ids


def record_tokens(model_source: str, ids, window: int, dtype: str = "float32", device: str = "cpu"):
    """A Trace of exact routing of the checkpoint `model_source` names over the token ids `ids`, cut into
    sequences of `window` tokens (the last may be shorter): what `specmoe trace` and `specmoe stats` record."""
    import torch

    from specmoe.harness import record_trace
    from specmoe.models import load_model, resolve_source

    source = Path(resolve_source(model_source))
    if not source.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {source}")
    if len(ids) == 0:
        raise ValueError("no tokens to record")
    # the harness's loader: same model class and pinned experts kernels as every other measurement
    model, _ = load_model(str(source), dtype=getattr(torch, dtype), device=device)
    check_positions(model, window, "--window")
    ids = [int(i) for i in ids]
    sequences = [torch.tensor(ids[i:i + window]) for i in range(0, len(ids), window)]
    return record_trace(model, sequences, model_source=str(model_source))
