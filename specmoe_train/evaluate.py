"""Held-out measurements of the family: perplexity, drafter acceptance (tau) and routing locality.

tau is measured for greedy speculative decoding: a verification commits the accepted drafts plus one
target token, tau = committed tokens per verification. Under greedy decoding the committed text is the
target's own greedy continuation G whatever the drafter proposes, and a draft is accepted only while all
drafts before it were, i.e. while the drafter's inputs are G itself. So the acceptance at every position
follows from teacher-forced passes over G: one pass of the AR drafter (its argmax at p against G[p+1]) and
one DFlash pass with a block at every anchor. `acceptance_tau` walks the verifications over those; the
harness's speculative loop (`specmoe.harness.speculative_generate` with exact selection) runs the real
draft-verify loop and serves as a cross-check of the walk (`family.tau_crosscheck`: they agree block by block
up to floating-point near-ties of the target).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from specmoe.speculation import tau
from specmoe.drafters.dflash_model import (block_attention_mask, block_input_ids, block_position_ids, block_targets,
                                     extract_context_feature)


def _batches(rows: torch.Tensor, batch_size: int):
    for lo in range(0, rows.shape[0], batch_size):
        yield rows[lo:lo + batch_size]


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 32) -> dict:
    """Next-token perplexity over windows [N, S] (each window predicts its tokens 1..S-1)."""
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for rows in _batches(windows, batch_size):
        rows = rows.to(device)
        logits = model(input_ids=rows[:, :-1]).logits.float()
        nll += F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum").item()
        count += rows[:, 1:].numel()
    return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count}


def evenly_spaced_anchors(seq_len: int, block: int, count: int) -> torch.Tensor:
    """`count` anchors spread over [1, seq_len - block] (fixed, for evaluation)."""
    return torch.linspace(1, seq_len - block, count).round().long().unique()


@torch.no_grad()
def dflash_block_nll(target, dflash, windows: torch.Tensor, anchors_per_window: int = 16,
                     batch_size: int = 16) -> dict:
    """DFlash's held-out loss: mean NLL of the true token at each block position j = 1..block-1, with
    evenly spaced anchors in every window; ppl_j = exp(nll_j). Position 1 is next-token prediction."""
    device = next(target.parameters()).device
    block = dflash.block_size
    seq_len = windows.shape[1] - 1
    anchors_1 = evenly_spaced_anchors(seq_len, block, anchors_per_window).to(device)
    nll = torch.zeros(block - 1, dtype=torch.float64, device=device)
    hits = torch.zeros(block - 1, dtype=torch.float64, device=device)
    count = 0
    for rows in _batches(windows, batch_size):
        rows = rows.to(device)
        anchors = anchors_1.expand(rows.shape[0], -1)
        logits = dflash_block_logits(target, dflash, rows[:, :-1], rows, anchors)
        _, labels = block_targets(rows, anchors, block)
        logp = F.log_softmax(logits.float(), dim=-1)
        nll += -logp.gather(-1, labels[..., None])[..., 0].sum((0, 1)).double()
        hits += (logits.argmax(-1) == labels).sum((0, 1)).double()
        count += labels.shape[0] * labels.shape[1]
    nll_j = (nll / count).tolist()
    return {"ppl_by_position": [math.exp(v) for v in nll_j], "accuracy_by_position": (hits / count).tolist(),
            "ppl_position_1": math.exp(nll_j[0]), "ppl_mean_nll": math.exp(sum(nll_j) / len(nll_j)),
            "blocks": count}


def dflash_block_logits(target, dflash, context_ids: torch.Tensor, token_ids: torch.Tensor,
                        anchors: torch.Tensor) -> torch.Tensor:
    """Drafts of one pass with a block at every anchor: logits [B, N, block-1, V] for positions
    anchor+1 .. anchor+block-1. Context features come from the target over `context_ids` [B, C];
    anchor tokens from `token_ids` (which may extend past the context)."""
    out = target(input_ids=context_ids, output_hidden_states=True)
    features = extract_context_feature(out.hidden_states, dflash.target_layer_ids)
    return draft_block_logits(dflash, target.get_input_embeddings(), target.get_output_embeddings(), features,
                              token_ids, anchors)


def draft_block_logits(dflash, embed, head, features: torch.Tensor, token_ids: torch.Tensor,
                       anchors: torch.Tensor) -> torch.Tensor:
    """`dflash_block_logits` from context features [B, C, n*H] the caller already has (training), with the
    target's embedding and LM head."""
    block, ctx_len = dflash.block_size, features.shape[1]
    noise = embed(block_input_ids(token_ids, anchors, block, dflash.mask_token_id))
    hidden = dflash(block_position_ids(anchors, ctx_len, block), noise, features,
                    attention_mask=block_attention_mask(anchors, ctx_len, block))
    return head(hidden.view(anchors.shape[0], anchors.shape[1], block, -1)[:, :, 1:])


@torch.no_grad()
def greedy_continuation(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Prompts [B, P] (no padding) -> [B, P + new_tokens] with the model's greedy tokens, KV-cached."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompts, past_key_values=cache, use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(new_tokens - 1):
        out = model(input_ids=tokens[-1][:, None], past_key_values=cache, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat([prompts, torch.stack(tokens, dim=1)], dim=1)


@torch.no_grad()
def ar_accept_runs(drafter, sequences: torch.Tensor) -> np.ndarray:
    """match[b, p] = drafter's argmax after sequences[b, :p+1] equals sequences[b, p+1] ([B, T-1] bool)."""
    device = next(drafter.parameters()).device
    seq = sequences.to(device)
    return (drafter(input_ids=seq[:, :-1]).logits.argmax(-1) == seq[:, 1:]).cpu().numpy()


@torch.no_grad()
def dflash_accept_lengths(target, dflash, sequences: torch.Tensor, first_anchor: int, k_max: int,
                          chunk: int = 32) -> np.ndarray:
    """accepted[b, c] for anchors c in [first_anchor, T - 1): leading drafts of the block at c (context =
    target features before c) that equal the sequence, at most k_max and never past its end ([B, T] int,
    -1 where not computed)."""
    device = next(target.parameters()).device
    seq = sequences.to(device)
    batch, length = seq.shape
    padded = torch.cat([seq, torch.full((batch, k_max), -1, dtype=seq.dtype, device=device)], dim=1)
    accepted = np.full((batch, length), -1, dtype=np.int64)
    all_anchors = torch.arange(first_anchor, length - 1, device=device)
    for lo in range(0, all_anchors.numel(), chunk):
        anchors = all_anchors[lo:lo + chunk]
        ctx_len = int(anchors.max())  # features of positions < the last anchor suffice
        logits = dflash_block_logits(target, dflash, seq[:, :ctx_len], seq, anchors.expand(batch, -1))
        drafts = logits[:, :, :k_max].argmax(-1)  # [B, N, k]
        truth = padded[:, (anchors[:, None] + torch.arange(1, k_max + 1, device=device)).flatten()]
        run = (drafts == truth.view(batch, -1, k_max)).long().cumprod(-1).sum(-1)
        accepted[:, anchors.cpu().numpy()] = run.cpu().numpy()
    return accepted


def acceptance_tau(accept_at, first_root: int, last_index: int, k: int) -> dict:
    """Walk greedy verifications from root `first_root`: accept_at(c) drafts accepted at root c (capped at
    k), commit accepted + 1, stop before a block would pass `last_index`. tau = committed / verifications."""
    root, verifications, committed, hist = first_root, 0, 0, np.zeros(k + 1, dtype=np.int64)
    while root + k <= last_index:
        accepted = min(int(accept_at(root)), k)
        if accepted < 0:
            raise ValueError(f"no acceptance length computed at position {root}")
        hist[accepted] += 1
        verifications += 1
        committed += accepted + 1
        root += accepted + 1
    return {"verifications": verifications, "committed": committed, "accepted_hist": hist}


def accept_at_function(match: np.ndarray | None, accepted: np.ndarray | None, row: int, k: int):
    """accept_at(c) of sequence `row`: the drafts accepted at root c, from AR match flags [B, T-1] (the run
    of matches from c, at most k) or DFlash accept lengths [B, T] (as computed: -1 where not)."""
    if match is not None:
        flags = match[row]

        def accept_at(c):
            run = 0
            while run < k and c + run < flags.shape[0] and flags[c + run]:
                run += 1
            return run
        return accept_at
    return lambda c: accepted[row][c]


def tau_from_runs(match: np.ndarray | None, accepted: np.ndarray | None, prompt_len: int, k: int) -> dict:
    """tau over a batch, from AR match flags [B, T-1] or DFlash accept lengths [B, T]."""
    total_v, total_c = 0, 0
    hist = np.zeros(k + 1, dtype=np.int64)
    rows = match.shape[0] if match is not None else accepted.shape[0]
    length = (match.shape[1] + 1) if match is not None else accepted.shape[1]
    for b in range(rows):
        accept_at = accept_at_function(match, accepted, b, k)
        # the first committed token after the prompt comes from the prefill: the first root is it
        walk = acceptance_tau(accept_at, prompt_len, length - 1, k)
        total_v += walk["verifications"]
        total_c += walk["committed"]
        hist += walk["accepted_hist"]
    return {"tau": tau(total_c, total_v), "verifications": int(total_v), "committed": int(total_c),
            "accepted_hist": hist.tolist()}


# -- routing locality --------------------------------------------------------------------------------

def routing_locality(trace, unions: tuple[int, ...] = (9, 17)) -> dict:
    """Locality of exact routing in a Trace, in metrics.json's layout, from `specmoe.routing.statistics`
    (`routing_stats`, the one implementation): per layer, the fraction of a token's top-K already in the
    previous token's top-K; the recall of the pre-gate's top-K for the layer's top-K (layers >= 1); the
    mean number of distinct experts over windows of w consecutive tokens (w = k + 1 of a verification
    block); selection load (max / mean over experts) and its normalised entropy."""
    from specmoe.routing.statistics import routing_stats

    stats = routing_stats(trace, capacities=(), windows=unions, bonuses=(), policy_capacities=())
    layer, chance = stats["per_layer"], stats["random_routing"]
    return {
        "tokens": stats["tokens"],
        "reuse_consecutive": {"per_layer": layer["reuse_consecutive"], "mean": stats["mean"]["reuse_consecutive"],
                              "random_routing": chance["reuse_consecutive"]},
        "pregate_recall": {"per_layer": layer["pregate_recall"], "mean": stats["mean"]["pregate_recall"],
                           "random_routing": chance["pregate_recall"]},
        "union_experts": {f"w{w}_mean": stats["mean"][f"distinct_w{w}"] for w in unions} | {
            f"w{w}_per_layer": layer[f"distinct_w{w}"] for w in unions} | {
            f"w{w}_random_routing": chance[f"distinct_w{w}"] for w in unions},
        "load_max_over_mean": layer["load_max_over_mean"],
        "load_entropy_normalised": layer["load_entropy_normalised"],
    }
