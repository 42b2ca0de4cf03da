"""The ``ar`` drafter: any transformers causal LM that shares the target's tokenizer and vocabulary (the
family's OLMo drafter; OLMo-1B-0724 for OLMoE), drafting greedily one token per forward over its own KV
cache, which is cropped back to the committed tokens after each verification."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specmoe.speculation import advance, crop_cache, prompt_tokens

from .base import DrafterError, greedy_confidence


def check_vocabulary(drafter, target) -> None:
    """DrafterError unless the drafter's vocabulary (config and output rows) is the target's."""
    sizes = {"drafter config": drafter.config.vocab_size, "target config": target.config.vocab_size,
             "drafter LM head": drafter.get_output_embeddings().weight.shape[0],
             "target LM head": target.get_output_embeddings().weight.shape[0]}
    if len(set(sizes.values())) != 1:
        raise DrafterError("the drafter's vocabulary does not fit the target's: "
                           + ", ".join(f"{name} {size}" for name, size in sizes.items()))


def check_tokenizer(drafter_dir, target_dir) -> None:
    """DrafterError if both checkpoint directories ship a tokenizer and the two map tokens to different ids
    (a drafter without its own tokenizer uses the target's, as the family's does)."""
    def tokenizer(directory):
        directory = Path(directory) if directory else None
        if directory is None or not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)

    drafter_tok, target_tok = tokenizer(drafter_dir), tokenizer(target_dir)
    if drafter_tok is not None and target_tok is not None and drafter_tok.get_vocab() != target_tok.get_vocab():
        raise DrafterError(f"the drafter's tokenizer ({drafter_dir}) is not the target's ({target_dir})")


class HFAutoregressiveDrafter:
    """Greedy autoregressive drafting with a transformers causal LM and a DynamicCache.

    The cache holds the committed tokens except the last ones not yet fed (the root, and after a fully
    accepted block also the last draft); `propose(k)` feeds those, then each draft but the last; `commit`
    crops the cache to the committed tokens it holds."""

    name = "ar"
    target_layer_ids: tuple[int, ...] = ()
    hidden_size = None  # reads no target features (vocab_size: set from the model)
    max_drafts = None
    fixed_cost_s = None

    def __init__(self, model, target):
        check_vocabulary(model, target)
        self.vocab_size = model.config.vocab_size
        self.model = model
        self.device = next(model.parameters()).device
        self.tokens: list[int] = []
        self.cache = None
        self._drafts: list[int] = []

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` after the cache; the next-token logits [1, V] of the last one."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        return self.model(input_ids=ids, past_key_values=self.cache, use_cache=True).logits[0, -1:]

    @torch.no_grad()
    def reset(self, prompt: torch.Tensor, features=None) -> None:
        from transformers import DynamicCache

        self.tokens = prompt_tokens(prompt)
        self.cache = DynamicCache(config=self.model.config)
        self._drafts = []
        if len(self.tokens) > 1:
            self._forward(self.tokens[:-1])

    @torch.no_grad()
    def propose(self, k: int) -> tuple[torch.Tensor, np.ndarray]:
        logits = self._forward(self.tokens[self.cache.get_seq_length():])
        drafts, confidences = [], []
        for i in range(k):
            token, confidence = greedy_confidence(logits)
            drafts.append(int(token[0]))
            confidences.append(float(confidence[0]))
            if i + 1 < k:
                logits = self._forward(drafts[-1:])
        self._drafts = drafts
        return torch.tensor(drafts, dtype=torch.long), np.array(confidences)

    def commit(self, accepted: int, bonus_token: int, features=None) -> None:
        self.tokens = advance(self.tokens, self._drafts, accepted, bonus_token)
        self._drafts = []
        crop_cache(self.cache, min(self.cache.get_seq_length(), len(self.tokens) - 1))
