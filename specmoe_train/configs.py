"""Sizes and training settings of the small model family, and the transformers configs built from them.

`FAMILY_PRESETS["h200"]` is the shipped family (one H200, about 8 minutes of training, under 40 MB of
bf16 weights); `FAMILY_PRESETS["tiny"]` runs a few steps on a CPU in seconds (tests).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from transformers import OlmoConfig, OlmoeConfig

from specmoe.drafters.dflash_model import dflash_config


@dataclass(frozen=True)
class StageConfig:
    """One training stage. `steps` None: run `probe_steps`, time them, and set the total to what fits in
    `time_budget_s` (at most `max_steps`); the probe lies inside the linear warm-up, so the run equals one
    started with the chosen `steps` given explicitly (the number is recorded in the metrics)."""

    steps: int | None = None
    time_budget_s: float = 60.0
    max_steps: int = 100_000
    probe_steps: int = 30
    lr: float = 3e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    log_every: int = 25

    def __post_init__(self) -> None:
        if self.steps is None and self.probe_steps > self.warmup:
            raise ValueError("the timing probe must lie inside the warm-up (probe_steps <= warmup)")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be positive, got {self.steps}")


@dataclass(frozen=True)
class FamilyConfig:
    """Target (OLMoE routing geometry), AR drafter (OLMo) and DFlash drafter sizes, and training."""

    # target: OlmoeForCausalLM
    hidden_size: int = 128
    num_layers: int = 16
    num_heads: int = 4
    expert_size: int = 32  # intermediate size of one expert
    num_experts: int = 64
    top_k: int = 8
    router_aux_loss_coef: float = 0.01
    max_positions: int = 4096
    # AR drafter: OlmoForCausalLM, tied embeddings
    ar_hidden_size: int = 128
    ar_layers: int = 4
    ar_heads: int = 4
    ar_intermediate: int = 512
    # DFlash drafter (hidden size = the target's)
    df_layers: int = 3
    df_heads: int = 4
    df_intermediate: int = 512
    block_size: int = 17  # anchor + 16 mask tokens: up to k = 16 drafts per pass
    anchors_per_sequence: int = 32
    block_loss_decay: float = 7.0  # weight of block position j: exp(-(j - 1) / decay)
    distill_weight: float = 0.5  # drafters: (1 - w) * CE(text) + w * KL(target || drafter)
    # data and training
    seq_len: int = 512
    batch_size: int = 64
    seed: int = 0
    eval_every: int = 250  # held-out loss on `eval_windows` windows of the evaluation part (monitoring only)
    eval_windows: int = 16
    target: StageConfig = field(default_factory=lambda: StageConfig(time_budget_s=250.0, max_steps=2500, lr=3e-3))
    drafters: StageConfig = field(default_factory=lambda: StageConfig(time_budget_s=130.0, max_steps=1250, lr=2e-3))

    def to_dict(self) -> dict:
        return asdict(self)

    def with_steps(self, target_steps: int | None, drafter_steps: int | None) -> "FamilyConfig":
        """This config with explicit step counts (None keeps the preset's)."""
        target = self.target if target_steps is None else replace(self.target, steps=target_steps)
        drafters = self.drafters if drafter_steps is None else replace(self.drafters, steps=drafter_steps)
        return replace(self, target=target, drafters=drafters)


FAMILY_PRESETS: dict[str, FamilyConfig] = {
    "h200": FamilyConfig(),
    "tiny": FamilyConfig(
        hidden_size=32, num_layers=2, num_heads=2, expert_size=16, num_experts=8, top_k=2, max_positions=256,
        ar_hidden_size=32, ar_layers=1, ar_heads=2, ar_intermediate=64, df_layers=1, df_heads=2,
        df_intermediate=64, block_size=5, anchors_per_sequence=4, seq_len=32, batch_size=4, eval_every=6,
        eval_windows=2,
        target=StageConfig(steps=12, lr=1e-2, warmup=2, log_every=1),
        drafters=StageConfig(steps=12, lr=1e-2, warmup=2, log_every=1),
    ),
}


def target_config(fc: FamilyConfig, vocab_size: int, eos_id: int, pad_id: int) -> OlmoeConfig:
    config = OlmoeConfig(
        vocab_size=vocab_size, hidden_size=fc.hidden_size, intermediate_size=fc.expert_size,
        num_hidden_layers=fc.num_layers, num_attention_heads=fc.num_heads, num_key_value_heads=fc.num_heads,
        num_experts=fc.num_experts, num_experts_per_tok=fc.top_k, norm_topk_prob=False,
        router_aux_loss_coef=fc.router_aux_loss_coef, max_position_embeddings=fc.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
    )
    config.architectures = ["OlmoeForCausalLM"]
    return config


def ar_drafter_config(fc: FamilyConfig, vocab_size: int, eos_id: int, pad_id: int) -> OlmoConfig:
    config = OlmoConfig(
        vocab_size=vocab_size, hidden_size=fc.ar_hidden_size, intermediate_size=fc.ar_intermediate,
        num_hidden_layers=fc.ar_layers, num_attention_heads=fc.ar_heads, num_key_value_heads=fc.ar_heads,
        max_position_embeddings=fc.max_positions, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
    )
    config.architectures = ["OlmoForCausalLM"]
    return config


def dflash_drafter_config(fc: FamilyConfig, target: OlmoeConfig, mask_id: int):
    return dflash_config(target, num_layers=fc.df_layers, block_size=fc.block_size, mask_token_id=mask_id,
                         intermediate_size=fc.df_intermediate, num_attention_heads=fc.df_heads)
