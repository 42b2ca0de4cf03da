"""Training of the family: the OLMoE target from scratch, then both drafters against the frozen target (and
the members' targets, and a member's DFlash drafter alone, with the same loops).

- target: next-token cross-entropy plus the architecture's load-balancing loss (transformers' `aux_loss` with
  ``output_router_logits=True``, weighted by ``router_aux_loss_coef``: OLMoE, Qwen3.5-MoE), or DeepSeek-V3's
  auxiliary-loss-free balancing (`BiasBalance`: a selection-bias update after every step, plus its tiny
  sequence-wise balance loss);
- AR drafter (OLMo): (1 - w) * cross-entropy on the text + w * KL(target || drafter) on the target's
  teacher-forced next-token distribution;
- DFlash drafter: `anchors_per_sequence` random anchors per training window; each block (anchor + mask
  tokens) is drafted from the target's features at the positions before its anchor (many blocks in one pass
  through `block_attention_mask`); the same mixed loss at every block position j >= 1, weighted by
  exp(-(j - 1) / decay), since later positions only count once the earlier ones were accepted.

Weights are kept in the model's dtype (bf16 on the GPU: the experts' grouped_mm kernels run in bf16) with
fp32 master copies in AdamW; the learning rate warms up linearly and decays by a cosine to `min_lr_ratio`.
Batches come from a seeded sampler, anchors from a seeded generator, so a run is a function of the corpus,
the config and the seed (up to the nondeterminism CUDA kernels keep).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from specmoe.drafters.dflash_model import block_targets, extract_context_feature
from .configs import FamilyConfig, StageConfig
from .corpus import BatchSampler, spaced_windows
from .evaluate import draft_block_logits


def set_determinism(seed: int) -> None:
    """Seed everything and ask for deterministic kernels (warn where CUDA has none)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(seed)
    np.random.seed(seed)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def lr_at(step: int, total: int, stage: StageConfig) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to lr * min_lr_ratio at `total`."""
    if step < stage.warmup:
        return stage.lr * (step + 1) / stage.warmup
    progress = min(1.0, (step - stage.warmup) / max(1, total - stage.warmup))
    return stage.lr * (stage.min_lr_ratio + (1 - stage.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class MasterAdamW:
    """AdamW over fp32 master copies of a model's (bf16 or fp32) parameters; decay on matrices only."""

    def __init__(self, model: torch.nn.Module, stage: StageConfig):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        decay = [m for m in self.masters if m.ndim >= 2]
        no_decay = [m for m in self.masters if m.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": stage.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=stage.lr, betas=stage.betas, eps=1e-8, foreach=True)
        self.grad_clip = stage.grad_clip

    def step(self, lr: float) -> torch.Tensor:
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = torch.zeros_like(m) if p.grad is None else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self.masters, self.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.data.copy_(m.data)
                m.grad = None
            p.grad = None
        return norm


class _Clock:
    """Chooses a stage's step count from a timing probe when none is given."""

    def __init__(self, stage: StageConfig, device: torch.device):
        self.stage, self.device = stage, device
        self.total = stage.steps
        self.start = time.perf_counter()
        self.mark = None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self, step: int) -> None:
        if self.total is not None:
            return
        first = min(10, self.stage.probe_steps - 1)
        if step == first:
            self._sync()
            self.mark = time.perf_counter()
        elif step == self.stage.probe_steps:
            self._sync()
            per_step = (time.perf_counter() - self.mark) / (step - first)
            left = self.stage.time_budget_s - (time.perf_counter() - self.start)
            self.total = int(min(self.stage.max_steps, max(step, step + left // per_step)))

    @property
    def horizon(self) -> int:
        return self.total if self.total is not None else self.stage.max_steps

    def elapsed(self) -> float:
        self._sync()
        return time.perf_counter() - self.start


class _Curve:
    """The curve of a training loop: step values accumulate, and every `log_every` steps (and at the last)
    their mean becomes a row, with the held-out loss from `heldout()` every `eval_every` steps (and at the
    end)."""

    def __init__(self, model: str, names: tuple[str, ...], fc: FamilyConfig, stage: StageConfig, clock: _Clock,
                 heldout: Callable[[], float | None], device: torch.device):
        self.model, self.names, self.fc, self.stage, self.clock, self.heldout = model, names, fc, stage, clock, heldout
        self.acc, self.count, self.rows = torch.zeros(len(names), device=device), 0, []

    def add(self, step: int, lr: float, values: torch.Tensor) -> dict | None:
        """Accumulate the values of step `step` (counted from 1); returns the row if one is due."""
        self.acc += values
        self.count += 1
        if step % self.stage.log_every and step != self.clock.total:
            return None
        fc = self.fc
        row = {"model": self.model, "step": step, "tokens": step * fc.batch_size * fc.seq_len, "lr": lr,
               **dict(zip(self.names, (self.acc / self.count).tolist())), "seconds": round(self.clock.elapsed(), 2)}
        if step % fc.eval_every == 0 or step == self.clock.total:
            row["heldout_ce"] = self.heldout()
        self.rows.append(row)
        self.acc.zero_()
        self.count = 0
        return row

    def result(self, step: int, sampler: BatchSampler, **extra) -> dict:
        """What a training stage returns: steps, seconds, tokens, epochs, `extra`, the curve rows."""
        fc = self.fc
        return {"steps": step, "seconds": self.clock.elapsed(), "tokens": step * fc.batch_size * fc.seq_len,
                "epochs": step * fc.batch_size / max(1, sampler.starts.size), **extra, "rows": self.rows}


class BiasBalance:
    """DeepSeek-V3's auxiliary-loss-free load balancing of a model's sigmoid routers (every module with an
    `e_score_correction_bias`, kept in float32). Forward hooks on the routers count, while the model trains,
    how many tokens each expert's biased selection chose (the router's returned top-K indices) and add up the
    sequence-wise balance loss sum_i f_i P_i per sequence (f_i = E / (K T) x the sequence's tokens choosing i,
    P_i = the mean over its tokens of the scores normalised to sum to one); `update()` after the optimizer step
    moves every bias by rate * sign(mean load - load_i) and clears the counts."""

    def __init__(self, model, rate: float, coef: float):
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        if not self.routers:
            raise ValueError("bias balancing needs routers with an e_score_correction_bias")
        self.rate, self.coef = rate, coef
        for router in self.routers:
            router.e_score_correction_bias = router.e_score_correction_bias.float()
        first = self.routers[0].e_score_correction_bias
        self.loads = torch.zeros(len(self.routers), first.numel(), device=first.device)
        self.seq_loss = []
        self.last_imbalance = float("nan")
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, index: int):
        def hook(module, inputs, output):
            if not module.training:
                return
            logits, _, chosen = output
            experts, k = logits.shape[-1], chosen.shape[-1]
            counts = torch.zeros(chosen.shape[0], experts, device=chosen.device).scatter_(1, chosen, 1.0)
            self.loads[index] += counts.sum(0)
            if self.coef:
                batch, seq = inputs[0].shape[:2]
                scores = logits.float().sigmoid()
                p = (scores / scores.sum(-1, keepdim=True)).view(batch, seq, experts).mean(1)
                f = counts.view(batch, seq, experts).sum(1) * (experts / (k * seq))
                self.seq_loss.append((f * p).sum(-1).mean())
        return hook

    def take_loss(self) -> torch.Tensor:
        """The summed sequence-wise balance loss of the forward passes since the last call (zero without)."""
        loss = torch.stack(self.seq_loss).sum() if self.seq_loss else self.loads.new_zeros(())
        self.seq_loss = []
        return loss

    @torch.no_grad()
    def update(self) -> None:
        mean = self.loads.mean(-1, keepdim=True)
        self.last_imbalance = (self.loads.max(-1).values / mean[:, 0].clamp_min(1)).mean()
        step = self.rate * torch.sign(mean - self.loads)
        for router, delta in zip(self.routers, step):
            router.e_score_correction_bias += delta
        self.loads.zero_()

    def reset(self) -> None:
        self.loads.zero_()
        self.seq_loss = []

    def remove(self) -> dict:
        """Remove the hooks; the biases' spread per layer (for the record)."""
        for handle in self.handles:
            handle.remove()
        biases = torch.stack([r.e_score_correction_bias for r in self.routers])
        return {"bias_min": biases.min(-1).values.tolist(), "bias_max": biases.max(-1).values.tolist()}


@contextlib.contextmanager
def reference_delta_rule(model):
    """Within the context, the model's Gated DeltaNet layers run transformers' own torch implementation of the
    chunked gated delta rule instead of the optional kernel package's (`fla`) that transformers picks when it
    imports. Needed for training on Hopper: fla 0.6 refuses the backward of that kernel there under Triton
    3.4-3.7.0 (it gives wrong gradients, fla issue #640). transformers binds the chosen implementation at import
    as a module-level function wrapping its torch one (`__wrapped__`); the context swaps that name in the
    model's modeling module and restores it on exit. Yields whether there was one to swap (no GDN: False)."""
    module = sys.modules[type(model).__module__]
    name = "torch_chunk_gated_delta_rule"
    wrapped = getattr(module, name, None)
    reference = getattr(wrapped, "__wrapped__", None)
    if reference is None:
        yield False
        return
    setattr(module, name, reference)
    try:
        yield True
    finally:
        setattr(module, name, wrapped)


def choose_experts_implementation(model, batch: torch.Tensor, preferred: tuple[str, ...],
                                  router_logits: bool = True) -> str:
    """The first of `preferred` under which one forward and backward of `batch` runs (grads discarded);
    router_logits: ask for the architecture's aux_loss too."""
    for name in preferred:
        try:
            model.set_experts_implementation(name)
            out = model(input_ids=batch, output_router_logits=True) if router_logits else model(input_ids=batch)
            (out.logits.float().mean() + (out.aux_loss if router_logits else 0)).backward()
            model.zero_grad(set_to_none=True)
            return name
        except Exception as exc:  # an unsupported kernel on this device / version
            print(f"experts implementation {name!r} failed here: {type(exc).__name__}: {exc}"[:400], flush=True)
            model.zero_grad(set_to_none=True)
    raise RuntimeError(f"none of the experts implementations {preferred} runs on this machine")


@torch.no_grad()
def heldout_loss(model, rows: torch.Tensor | None) -> float | None:
    """Mean next-token cross-entropy on fixed held-out windows (monitoring only; no decision uses it)."""
    if rows is None:
        return None
    was_training = model.training
    model.eval()
    logits = model(input_ids=rows[:, :-1]).logits.float()
    model.train(was_training)
    return F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()


def monitor_rows(stream: np.ndarray | None, fc: FamilyConfig, device) -> torch.Tensor | None:
    """`eval_windows` windows of seq_len + 1 tokens spread over the evaluation stream."""
    if stream is None:
        return None
    return torch.from_numpy(spaced_windows(stream, fc.seq_len + 1, fc.eval_windows)[1]).to(device)


def train_target(model, stream: np.ndarray, fc: FamilyConfig, device: torch.device,
                 log: Callable[[str], None] = print, heldout: np.ndarray | None = None,
                 balance: BiasBalance | None = None) -> dict:
    """Train a target on the train stream; returns steps, seconds, tokens and the curve rows (with the held-out
    loss on `heldout` every `eval_every` steps, when given). Load balancing: the architecture's aux_loss, or
    `balance` (its sequence-wise loss weighted by balance.coef, its bias update after every step)."""
    stage = fc.target
    sampler = BatchSampler(stream, fc.batch_size, fc.seq_len, seed=fc.seed)
    preferred = ("grouped_mm", "eager") if device.type == "cuda" else ("eager",)
    probe = torch.from_numpy(stream[: 2 * (fc.seq_len + 1)].astype(np.int64)).view(2, -1)[:, :-1].to(device)
    model.train()
    with contextlib.ExitStack() as restore:
        try:
            impl = choose_experts_implementation(model, probe, preferred, router_logits=balance is None)
            delta_rule = None
        except RuntimeError:  # e.g. fla's refusal above: again with the reference delta rule, if the model has one
            if not restore.enter_context(reference_delta_rule(model)):
                raise
            delta_rule = "transformers' torch reference (the kernel package failed above)"
            log(f"target: Gated DeltaNet through {delta_rule}")
            impl = choose_experts_implementation(model, probe, preferred, router_logits=balance is None)
        return _train_target(model, sampler, stage, fc, device, log, heldout, balance, impl, delta_rule)


def _train_target(model, sampler: BatchSampler, stage: StageConfig, fc: FamilyConfig, device: torch.device,
                  log: Callable[[str], None], heldout: np.ndarray | None, balance: BiasBalance | None, impl: str,
                  delta_rule: str | None) -> dict:
    """`train_target`'s loop, under the experts implementation and delta rule chosen there."""
    if balance is not None:
        balance.reset()
    monitor = monitor_rows(heldout, fc, device)
    model.train()
    opt = MasterAdamW(model, stage)
    clock = _Clock(stage, device)
    curve = _Curve("target", ("loss", "ce", "aux_loss", "grad_norm"), fc, stage, clock,
                   lambda: heldout_loss(model, monitor), device)
    step = 0
    aux_coef = model.config.router_aux_loss_coef if balance is None else balance.coef
    while clock.total is None or step < clock.total:
        clock.before_step(step)
        batch = torch.from_numpy(sampler.next()).to(device)
        if balance is None:
            out = model(input_ids=batch[:, :-1], output_router_logits=True)
            aux = out.aux_loss
        else:
            out = model(input_ids=batch[:, :-1])
            aux = balance.take_loss()
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss = ce + aux_coef * aux
        loss.backward()
        lr = lr_at(step, clock.horizon, stage)
        norm = opt.step(lr)
        if balance is not None:
            balance.update()
        step += 1
        row = curve.add(step, lr, torch.stack([loss.detach(), ce.detach(), aux.detach().float(),
                                               norm.detach().float()]))
        if row:
            log(f"target step {step}/{clock.total} loss {row['loss']:.4f} ce {row['ce']:.4f} "
                f"aux {row['aux_loss']:.4f} lr {lr:.2e} {row['seconds']:.0f}s")
    extra = {"experts_implementation": impl}
    if delta_rule is not None:
        extra["gated_delta_rule"] = delta_rule
    if balance is not None:
        extra["bias_balance"] = {"rate": balance.rate, "sequence_balance_coef": balance.coef,
                                 "last_load_max_over_mean": float(balance.last_imbalance), **balance.remove()}
    return curve.result(step, sampler, **extra)


def _mixed_loss(student_logits: torch.Tensor, labels: torch.Tensor, teacher_logp: torch.Tensor,
                w: float) -> torch.Tensor:
    """Per-position (1 - w) * CE(labels) + w * KL(teacher || student), shapes [..., V] -> [...]."""
    logp = F.log_softmax(student_logits.float(), dim=-1)
    ce = -logp.gather(-1, labels[..., None])[..., 0]
    kl = (teacher_logp.exp() * (teacher_logp - logp)).sum(-1)
    return (1 - w) * ce + w * kl


def sample_anchors(rng: np.random.Generator, batch: int, count: int, seq_len: int, block: int) -> np.ndarray:
    """`count` distinct sorted anchors per row in [1, seq_len - block + 1]: every block position lies
    inside the window of seq_len + 1 tokens, and every anchor has at least one context position."""
    high = seq_len - block + 1
    return np.sort(np.stack([rng.choice(np.arange(1, high + 1), size=count, replace=False) for _ in range(batch)]),
                   axis=1)


def train_drafters(target, ar, dflash, stream: np.ndarray, fc: FamilyConfig, device: torch.device,
                   log: Callable[[str], None] = print, heldout: np.ndarray | None = None) -> dict:
    """Train the AR and DFlash drafters on the same batches, each against the frozen target (the AR
    drafter's held-out loss on `heldout` is logged every `eval_every` steps, when given). ar None: the DFlash
    drafter alone (a member's)."""
    stage = fc.drafters
    sampler = BatchSampler(stream, fc.batch_size, fc.seq_len, seed=fc.seed + 1)
    rng = np.random.Generator(np.random.PCG64([fc.seed, 2]))
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    dflash.train()
    opt_df = MasterAdamW(dflash, stage)
    if ar is not None:
        ar.train()
        opt_ar = MasterAdamW(ar, stage)
    block, n_anchor, w = fc.block_size, fc.anchors_per_sequence, fc.distill_weight
    pos_weight = torch.exp(-torch.arange(block - 1, device=device, dtype=torch.float32) / fc.block_loss_decay)
    clock = _Clock(stage, device)
    monitor = monitor_rows(heldout, fc, device)
    curve = _Curve("drafters", ("ar_loss", "dflash_loss", "dflash_acc1", "dflash_acc_mean"), fc, stage, clock,
                   lambda: heldout_loss(ar, monitor if ar is not None else None), device)
    rows_of_batch = torch.arange(fc.batch_size, device=device)[:, None, None]
    step = 0
    while clock.total is None or step < clock.total:
        clock.before_step(step)
        batch = torch.from_numpy(sampler.next()).to(device)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with torch.no_grad():
            out = target(input_ids=inputs, output_hidden_states=True)
            teacher = F.log_softmax(out.logits.float(), dim=-1)  # [B, S, V]: position p predicts p + 1
            features = extract_context_feature(out.hidden_states, dflash.target_layer_ids)
        ar_loss = _mixed_loss(ar(input_ids=inputs).logits, labels, teacher, w).mean() if ar is not None \
            else torch.zeros((), device=device)

        anchors = torch.from_numpy(sample_anchors(rng, batch.shape[0], n_anchor, fc.seq_len, block)).to(device)
        logits = draft_block_logits(dflash, embed, head, features, batch, anchors)  # [B, N, block-1, V]
        positions, df_labels = block_targets(batch, anchors, block)
        df_teacher = teacher[rows_of_batch, positions - 1]
        per_pos = _mixed_loss(logits, df_labels, df_teacher, w)  # [B, N, block-1]
        df_loss = (per_pos * pos_weight).sum(-1).mean() / pos_weight.sum()
        (ar_loss + df_loss).backward()
        lr = lr_at(step, clock.horizon, stage)
        if ar is not None:
            opt_ar.step(lr)
        opt_df.step(lr)
        with torch.no_grad():
            hit = (logits.argmax(-1) == df_labels).float()
            values = torch.stack([ar_loss.detach(), df_loss.detach(), hit[..., 0].mean(), hit.mean()])
        step += 1
        row = curve.add(step, lr, values)
        if row:
            log(f"drafters step {step}/{clock.total} ar {row['ar_loss']:.4f} dflash {row['dflash_loss']:.4f} "
                f"acc1 {row['dflash_acc1']:.3f} lr {lr:.2e} {row['seconds']:.0f}s")
    return curve.result(step, sampler)
