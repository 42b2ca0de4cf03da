"""`specmoe calibrate`: warm set, token prior and logit range of a model, from held-out text.

The text must be held out from every evaluation; the file records where it came from. Sources:
- `--text FILE...`: plain text, tokenized with the checkpoint's tokenizer (or `--tokenizer DIR`);
- `--tokens FILE.npy`: a 1-D array of token ids;
- `--selfgen N`: N windows sampled from the model itself under exact routing (seeded), for models without text.
The token stream is cut into non-overlapping windows of `--length` tokens (at most `--windows` of them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from specmoe.arguments import check_positions, int_at_least
from specmoe.files import check_output_file, read_utf8


def token_windows(stream: np.ndarray, length: int, limit: int | None = None) -> list[np.ndarray]:
    """Non-overlapping windows of `length` tokens from a 1-D token stream (the tail shorter than 2 dropped),
    the first `limit` of them (None: all)."""
    if length < 2:
        raise ValueError(f"window length must be at least 2, got {length}")
    if limit is not None and limit < 1:
        raise ValueError(f"the window limit must be at least 1 (or None for all), got {limit}")
    stream = np.asarray(stream, dtype=np.int64).reshape(-1)
    windows = [stream[s:s + length].copy() for s in range(0, stream.size - length + 1, length)]
    tail = stream[len(windows) * length:]
    if len(tail) >= 2:
        windows.append(tail)
    return windows if limit is None else windows[:limit]


def text_tokens(texts: list[str], tokenizer_dir: str) -> np.ndarray:
    """The token ids of `texts` (strings) one after the other, by the tokenizer in `tokenizer_dir`."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"no tokenizer in {tokenizer_dir}: pass --tokenizer DIR or use --tokens/--selfgen ({exc})") from None
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
    return np.asarray(ids, dtype=np.int64)


def load_token_file(path: str | Path) -> np.ndarray:
    """A 1-D array of integer token ids from a .npy file (ValueError naming the file otherwise)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no token file {path}")
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"token file {path} is not a .npy array ({exc})") from None
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        got = f"a {ids.dtype} array of shape {ids.shape}" if isinstance(ids, np.ndarray) else type(ids).__name__
        raise ValueError(f"token file {path} must hold a 1-D array of integer token ids, got {got}")
    return ids.astype(np.int64)


def add_parser(sub) -> None:
    parser = sub.add_parser("calibrate", help="calibrate the routing policies of a model on held-out text",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="checkpoint directory, named config, or family / family/<member> (the shipped targets)")
    parser.add_argument("--seed", type=int, default=0, help="weights of a named config, and selfgen sampling")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", nargs="+", metavar="FILE", help="held-out plain-text files")
    source.add_argument("--tokens", metavar="FILE.npy", help="held-out token ids (1-D .npy)")
    source.add_argument("--selfgen", type=int_at_least(1), metavar="N", help="N windows sampled from the model itself")
    parser.add_argument("--tokenizer", help="tokenizer directory for --text (default: the checkpoint's)")
    parser.add_argument("--length", type=int_at_least(2), default=256,
                        help="tokens per window (default 256; at most the model's positions)")
    parser.add_argument("--windows", type=int_at_least(1), default=None, help="use at most this many windows")
    parser.add_argument("--describe", default=None, help="what the text is (recorded in the file)")
    parser.add_argument("--out", required=True, help="output file (.safetensors)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=main)


def main(args) -> int:
    from specmoe.harness import collect_calibration, sample_selfgen
    from specmoe.models import load_model, resolve_source

    check_output_file(args.out, "--out")
    ids = load_token_file(args.tokens) if args.tokens else None
    texts = [read_utf8(name) for name in args.text] if args.text else None
    model, adapter = load_model(args.model, seed=args.seed)
    check_positions(model, args.length, "--length")
    if args.selfgen is not None:
        windows = sample_selfgen(model, args.selfgen, args.length, seed=args.seed + 1,
                                 progress=not args.no_progress).windows
        what = f"{args.selfgen} windows of {args.length} tokens sampled from the model, seed {args.seed + 1}"
    elif ids is not None:
        windows = token_windows(ids, args.length, args.windows)
        what = f"token ids from {Path(args.tokens).resolve()}"
    else:
        windows = token_windows(text_tokens(texts, args.tokenizer or resolve_source(args.model)), args.length, args.windows)
        what = "text files " + ", ".join(str(Path(f).resolve()) for f in args.text)
    if not windows:
        raise ValueError("the held-out text gave no window of at least 2 tokens")
    calibration = collect_calibration(model, adapter, windows, {"text": args.describe or what},
                                      progress=not args.no_progress)
    path = calibration.save(args.out)
    info = calibration.provenance
    print(f"calibration of {info['model']} on {info['tokens']} tokens ({len(windows)} windows) -> {path}")
    print(f"mean logit range per layer: {np.round(calibration.delta, 3).tolist()}")
    return 0
