"""Quality and copy diagnostics of a routing policy in the harness.

- `token_nll` / `perplexity`: teacher-forced negative log-likelihood over token windows, each window one
  sequence (policy state reset per window).
- selfgen: `sample_selfgen` draws windows from the model under exact routing at temperature 1 (deterministic
  given the seed), and `excess_nll` scores a policy against exact routing on them. On text sampled from the
  exact model, the mean excess NLL per token estimates the KL divergence KL(exact || policy) of the
  next-token distributions; the excess perplexity is exp(excess) - 1.
- `copy_stats`: logical copies per routed token (demand, prefetch, unused prefetches) and router slots
  replaced per token, from the logical caches' counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .patch import RoutingContext, exact_routing


@dataclass
class Selfgen:
    """Windows sampled from the exact model: windows[i] = prompt_lengths[i] prompt tokens (or one start
    token), then sampled tokens; only the sampled tokens are scored."""

    windows: list[torch.Tensor]
    prompt_lengths: list[int]
    seed: int
    temperature: float = 1.0
    info: dict = field(default_factory=dict)


def _windows_and_starts(windows) -> tuple[list[torch.Tensor], list[int]]:
    if isinstance(windows, Selfgen):
        return windows.windows, list(windows.prompt_lengths)
    windows = [torch.as_tensor(w, dtype=torch.long).reshape(-1) for w in windows]
    return windows, [1] * len(windows)


def _check_context(model: nn.Module, ctx: RoutingContext | None) -> None:
    if ctx is not None and getattr(model, "specmoe_context", None) is not ctx:
        raise ValueError("this routing context is not the one patched into the model (patch_model returns it)")


@torch.no_grad()
def token_nll(model: nn.Module, ctx: RoutingContext | None, windows, *, batch_size: int = 8) -> list[np.ndarray]:
    """NLL (nats, float64) of each scored token of each window: tokens from position max(1, prompt length)
    on, each predicted from the window's earlier tokens in one teacher-forced forward. ctx None: exact
    routing (`exact_routing`, whatever the model is patched with); otherwise `ctx` must be the model's
    routing context. Windows of a batch are right-padded; padding never updates policy state."""
    _check_context(model, ctx)
    windows, starts = _windows_and_starts(windows)
    if ctx is None:
        with exact_routing(model):
            return _token_nll(model, windows, starts, batch_size)
    return _token_nll(model, windows, starts, batch_size)


def right_padded(windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token windows as one right-padded batch: (input ids [B, S], attention mask [B, S])."""
    length = max(len(w) for w in windows)
    ids = torch.zeros((len(windows), length), dtype=torch.long)
    mask = torch.zeros((len(windows), length), dtype=torch.long)
    for row, w in enumerate(windows):
        ids[row, :len(w)] = w
        mask[row, :len(w)] = 1
    return ids, mask


def _token_nll(model, windows, starts, batch_size) -> list[np.ndarray]:
    device = next(model.parameters()).device
    result: list[np.ndarray] = []
    for lo in range(0, len(windows), batch_size):
        batch = windows[lo:lo + batch_size]
        ids, mask = right_padded(batch)
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        for row, w in enumerate(batch):
            first = max(1, starts[lo + row])
            if len(w) <= first:
                result.append(np.zeros(0))
                continue
            logp = torch.log_softmax(logits[row, first - 1:len(w) - 1].float(), dim=-1)
            nll = -logp.gather(-1, w[first:].to(device)[:, None])[:, 0]
            result.append(nll.double().cpu().numpy())
    return result


def perplexity(model: nn.Module, ctx: RoutingContext | None, windows, *, batch_size: int = 8) -> float:
    """Perplexity exp(mean NLL per scored token) over `windows` (state reset per window; see token_nll)."""
    nll = np.concatenate(token_nll(model, ctx, windows, batch_size=batch_size))
    if nll.size == 0:
        raise ValueError("no token to score: windows need at least two tokens")
    return float(math.exp(nll.mean()))


@torch.no_grad()
def sample_selfgen(model: nn.Module, n_windows: int, length: int, seed: int, prompts=None, *,
                   temperature: float = 1.0, batch_size: int = 8, start_token: int | None = None,
                   progress: bool = False) -> Selfgen:
    """`n_windows` windows of `length` tokens sampled from `model` under exact routing (`exact_routing`).

    Without prompts each window starts with one start token (default: the config's bos, else eos, else 0)
    and the rest is sampled; with prompts (token id sequences) window i continues prompts[i % len(prompts)]
    up to `length` tokens. Sampling is plain ancestral sampling at `temperature` (no top-k/top-p) from a CPU
    generator seeded with `seed`, so the windows are a function of the model's outputs, the seed and the
    batch size. progress: a bar over the sampled tokens (`specmoe.progress`)."""
    from specmoe.progress import bar

    if n_windows < 1 or length < 2:
        raise ValueError(f"need n_windows >= 1 and length >= 2, got {n_windows} and {length}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    config = model.config
    if start_token is None:
        start_token = next((t for t in (config.bos_token_id, config.eos_token_id) if isinstance(t, int)), 0)
    if prompts is None:
        start = torch.tensor([start_token])
        groups = [[start] * min(batch_size, n_windows - lo) for lo in range(0, n_windows, batch_size)]
    else:
        prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
        if not prompts or any(len(p) == 0 or len(p) >= length for p in prompts):
            raise ValueError(f"prompts must be non-empty and shorter than the window length {length}")
        groups = [[prompts[i % len(prompts)]] for i in range(n_windows)]  # one per forward: no padding
    generator = torch.Generator().manual_seed(int(seed))
    device = next(model.parameters()).device
    windows: list[torch.Tensor] = []
    sampled = sum(len(group) * (length - len(group[0])) for group in groups)
    with exact_routing(model), bar(sampled, "sampling windows", progress, "token") as shown:
        for group in groups:
            ids = torch.stack(group)
            out = model(input_ids=ids.to(device), use_cache=True)
            while ids.shape[1] < length:
                probs = torch.softmax(out.logits[:, -1].float().cpu() / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
                ids = torch.cat([ids, nxt], dim=1)
                shown.update(len(group))
                if ids.shape[1] < length:
                    out = model(input_ids=nxt.to(device), past_key_values=out.past_key_values, use_cache=True)
            windows.extend(ids.unbind(0))
    prompt_lengths = [len(g) for group in groups for g in group]
    return Selfgen(windows, prompt_lengths, int(seed), float(temperature),
                   {"model": getattr(model, "specmoe_source", None), "length": length})


def copy_stats(ctx: RoutingContext) -> dict:
    """Per routed token (sums over layers, averaged over tokens) since `ctx.clear_counters()`: copies,
    demand, prefetch, unused prefetches, router slots replaced, displaced router mass; and `tokens`.
    Finishes the sequences in progress so that their unused prefetches are counted."""
    ctx.finish()
    total = ctx.totals()
    tokens = max(total["tokens"], 1)
    stats = {key: total[key] / tokens for key in ("demand", "prefetch", "unused", "replaced", "displaced_mass")}
    stats["copies"] = stats["demand"] + stats["prefetch"]
    stats["tokens"] = total["tokens"]
    return stats


def excess_nll(model: nn.Module, ctx: RoutingContext, windows, *, batch_size: int = 8,
               exact_nll: list[np.ndarray] | None = None) -> dict:
    """Excess NLL of the policy of `ctx` over exact routing on `windows` (ideally a `Selfgen`), with the
    copy accounting of the same pass. exact_nll: `token_nll(model, None, windows)` if already computed.

    Returns excess_nll (mean per scored token: the KL estimate on selfgen windows), excess_ppl_pct
    (100 * (exp(excess) - 1)), nll/ppl of both, per_window_excess (mean per window, for paired statistics),
    tokens, and copy_stats' fields prefixed per token (copies, demand, prefetch, unused, replaced)."""
    _check_context(model, ctx)
    if exact_nll is None:
        exact_nll = token_nll(model, None, windows, batch_size=batch_size)
    ctx.finish()
    ctx.clear_counters()
    policy_nll = token_nll(model, ctx, windows, batch_size=batch_size)
    copies = copy_stats(ctx)
    if len(exact_nll) != len(policy_nll) or any(a.shape != b.shape for a, b in zip(exact_nll, policy_nll)):
        raise ValueError("exact_nll does not match these windows")
    exact_all, policy_all = np.concatenate(exact_nll), np.concatenate(policy_nll)
    if exact_all.size == 0:
        raise ValueError("no token to score")
    excess = float((policy_all - exact_all).mean())
    result = {
        "policy": ctx.policy.name, "tokens": int(exact_all.size), "excess_nll": excess,
        "excess_ppl_pct": 100.0 * math.expm1(excess),
        "nll_exact": float(exact_all.mean()), "nll_policy": float(policy_all.mean()),
        "ppl_exact": math.exp(exact_all.mean()), "ppl_policy": math.exp(policy_all.mean()),
        "per_window_excess": [float((p - e).mean()) if e.size else 0.0 for p, e in zip(policy_nll, exact_nll)],
    }
    result.update({key: value for key, value in copies.items() if key != "tokens"})
    return result
