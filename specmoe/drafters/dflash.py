"""The ``dflash`` drafter: a DFlash block-diffusion model (`dflash_model`) drafting a whole block per pass.

As in the public `dflash` package's own decoding loop: one forward pass per verification block from the
anchor (the root: the last committed token) followed by ``block_size - 1`` mask tokens, conditioned on the
target's hidden states after `target_layer_ids` at every committed position before the anchor. The drafter's
KV cache keeps only committed context: each pass appends the context features it has not seen (the prompt's
at the first block, afterwards the root and accepted drafts of the previous block, which the target
computed while verifying them) and the block, and the block's keys and values are cropped off right after.
k drafts are the first k of the pass (k <= block_size - 1)."""

from __future__ import annotations

import numpy as np
import torch

from specmoe.speculation import advance, crop_cache, prompt_tokens

from .base import DrafterError, greedy_confidence


def check_fits_target(model, target) -> None:
    """DrafterError unless the DFlash drafter `model` was made for a target of this geometry: hidden size,
    vocabulary (it reads the target's embeddings and writes through its LM head), target depth and layer ids."""
    config, tconfig = model.config, target.config
    depth = tconfig.num_hidden_layers
    problems = []
    if config.hidden_size != tconfig.hidden_size:
        problems.append(f"hidden size {config.hidden_size} (target {tconfig.hidden_size})")
    if config.vocab_size != tconfig.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} (target {tconfig.vocab_size})")
    if getattr(config, "num_target_layers", depth) != depth:
        problems.append(f"made for a target of {config.num_target_layers} layers (target has {depth})")
    if not all(0 <= i < depth for i in model.target_layer_ids):
        problems.append(f"target_layer_ids {list(model.target_layer_ids)} outside the target's layers 0..{depth - 1}")
    if model.mask_token_id is None or not 0 <= model.mask_token_id < tconfig.vocab_size:
        problems.append(f"mask token {model.mask_token_id} outside the vocabulary")
    if problems:
        raise DrafterError("the DFlash drafter does not fit the target: " + "; ".join(problems))


class DFlashDrafter:
    """Block drafting with a `DFlashDraftModel` and the target's embedding and LM head."""

    name = "dflash"
    fixed_cost_s = None

    def __init__(self, model, target):
        check_fits_target(model, target)
        self.model = model
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()
        self.target_layer_ids = tuple(int(i) for i in model.target_layer_ids)
        self.max_drafts = model.block_size - 1
        self.hidden_size, self.vocab_size = model.config.hidden_size, model.config.vocab_size
        self.device = next(model.parameters()).device
        self.tokens: list[int] = []
        self.cache = None
        self._pending = None  # context features not yet in the cache [n, len(layer_ids) * H]
        self._drafts: list[int] = []

    def _take_features(self, features, expected: int) -> torch.Tensor:
        width = len(self.target_layer_ids) * self.model.config.hidden_size
        if features is None and expected == 0:  # a one-token prompt: nothing before the first anchor
            features = torch.zeros(0, width)
        if features is None or tuple(features.shape) != (expected, width):
            got = None if features is None else tuple(features.shape)
            raise ValueError(f"the DFlash drafter needs the target's features [{expected}, {width}], got {got}")
        return features.to(self.device, next(self.model.parameters()).dtype)

    def reset(self, prompt: torch.Tensor, features: torch.Tensor | None = None) -> None:
        from transformers import DynamicCache

        self.tokens = prompt_tokens(prompt)
        self._pending = self._take_features(features, len(self.tokens) - 1)
        self.cache = DynamicCache()
        self._drafts = []

    @torch.no_grad()
    def propose(self, k: int) -> tuple[torch.Tensor, np.ndarray]:
        if not 1 <= k <= self.max_drafts:
            raise DrafterError(f"the DFlash drafter drafts 1..{self.max_drafts} tokens per pass, asked for {k}")
        anchor = len(self.tokens) - 1
        context = self.cache.get_seq_length()
        if context + self._pending.shape[0] != anchor:
            raise RuntimeError(f"DFlash context of {context} + {self._pending.shape[0]} positions before an anchor "
                               f"at {anchor}")
        block = self.model.block_size
        ids = torch.full((1, block), self.model.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = self.tokens[-1]
        positions = torch.arange(context, anchor + block, device=self.device)[None]
        hidden = self.model(positions, self.embed(ids), self._pending[None], past_key_values=self.cache)
        crop_cache(self.cache, anchor)  # keep the committed context, drop the block
        self._pending = self._pending[:0]
        tokens, confidences = greedy_confidence(self.head(hidden[0, 1:k + 1]))
        self._drafts = tokens.tolist()
        return tokens.cpu(), confidences.cpu().numpy()

    def commit(self, accepted: int, bonus_token: int, features: torch.Tensor | None = None) -> None:
        self.tokens = advance(self.tokens, self._drafts, accepted, bonus_token)
        self._pending = torch.cat([self._pending, self._take_features(features, accepted + 1)])
        self._drafts = []
