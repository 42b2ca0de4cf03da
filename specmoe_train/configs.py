"""Sizes and training settings of the small model family, and the transformers configs built from them.

`FAMILY_PRESETS["h200"]` is the shipped family (one H200, about 8 minutes of training, under 40 MB of
bf16 weights); `FAMILY_PRESETS["tiny"]` runs a few steps on a CPU in seconds (tests). `MEMBER_PRESETS` are the
family's members (DeepSeek-V3 and Qwen3.5-MoE targets on the same tokenizer and corpus), with the same two
presets.
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


# -- members: more trained targets of other architectures, same tokenizer and corpus --------------------------

@dataclass(frozen=True)
class MemberConfig:
    """A member of the family: a target of another architecture trained from scratch on the family's corpus
    with its tokenizer (the family's AR drafter drafts for it), and optionally its own DFlash drafter.

    model: the transformers config's keyword arguments (vocabulary and token ids come from the tokenizer);
    balance: "aux_loss" (the architecture's load-balancing loss, weighted by router_aux_loss_coef) or
    "bias_update" (DeepSeek-V3's auxiliary-loss-free balancing: after every optimizer step, per MoE layer,
    bias_i += bias_update_rate * sign(mean load - load_i), load_i = the tokens of the step's batch whose biased
    selection chose expert i; plus the sequence-wise balance loss weighted by `sequence_balance_coef`);
    train: the data, stage (target: the target; drafters: the DFlash drafter) and DFlash settings, as the
    family's (its OLMoE and AR sizes are unused); dflash_rope: the DFlash drafter's RoPE (None: the target's);
    dflash_target_layers: the target layers whose outputs condition it."""

    architecture: str  # model_type
    model: dict
    train: FamilyConfig
    balance: str = "aux_loss"
    bias_update_rate: float = 1e-3
    sequence_balance_coef: float = 0.0
    dflash: bool = False
    dflash_rope: dict | None = None
    dflash_target_layers: tuple[int, ...] | None = None  # None: DFlash's rule over the target's layers

    def to_dict(self) -> dict:
        return asdict(self)


# DeepSeek-V3 (Moonlight's shape, scaled down): 6 layers, the first dense, 64 routed experts of width 16, top-6,
# 2 ungated shared experts, one group, sigmoid router renormalised and scaled by Moonlight's 2.446, MLA without
# query compression (latent 64 + rope 16), tied embeddings. About 3.6M parameters, 7.4 MB in bf16.
_DEEPSEEK_V3 = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=16, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=4, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=2.446,
    kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=1,
    topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True, num_mtp_layers=0)

# Qwen3.5-MoE (Qwen3.6's shape, scaled down): 4 layers, three Gated DeltaNet then one gated full attention, 256
# experts of width 8, top-8 (softmax, renormalised), one shared expert of width 64 with its sigmoid gate, tied
# embeddings; load balancing by the architecture's auxiliary loss at the family's weight 0.01. About 4.7M
# parameters, 9.7 MB in bf16; its DFlash drafter (2 layers over the outputs of all four target layers) 0.8 MB.
_QWEN3_5_MOE = dict(
    hidden_size=128, num_hidden_layers=4, full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=8,
    shared_expert_intermediate_size=64, router_aux_loss_coef=0.01, max_position_embeddings=4096, rms_norm_eps=1e-6,
    tie_word_embeddings=True)

_H200_TRAIN = FAMILY_PRESETS["h200"]
_TINY_TRAIN = FAMILY_PRESETS["tiny"]

# preset -> member -> config. h200: about 135 s per target and 65 s for the DFlash drafter on one H200 (steps
# from the timing probe; with the measurements about 7 minutes in all), the two members 18 MB of bf16 weights.
MEMBER_PRESETS: dict[str, dict[str, MemberConfig]] = {
    "h200": {
        "deepseek_v3": MemberConfig(
            "deepseek_v3", _DEEPSEEK_V3, balance="bias_update", sequence_balance_coef=1e-4,
            train=replace(_H200_TRAIN, target=StageConfig(time_budget_s=135.0, max_steps=2500, lr=3e-3))),
        "qwen3_5_moe": MemberConfig(
            "qwen3_5_moe_text", _QWEN3_5_MOE, dflash=True, dflash_rope={"rope_type": "default", "rope_theta": 10000.0},
            dflash_target_layers=(0, 1, 2, 3),
            train=replace(_H200_TRAIN, df_layers=2, df_intermediate=256,
                          target=StageConfig(time_budget_s=135.0, max_steps=2500, lr=3e-3),
                          drafters=StageConfig(time_budget_s=65.0, max_steps=1250, lr=2e-3))),
    },
    "tiny": {
        "deepseek_v3": MemberConfig(
            "deepseek_v3", {**_DEEPSEEK_V3, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                            "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 8,
                            "num_experts_per_tok": 2, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "v_head_dim": 8,
                            "qk_nope_head_dim": 8, "max_position_embeddings": 256},
            balance="bias_update", sequence_balance_coef=1e-4, train=_TINY_TRAIN),
        "qwen3_5_moe": MemberConfig(
            "qwen3_5_moe_text", {**_QWEN3_5_MOE, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
                                 "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                 "num_experts": 16, "num_experts_per_tok": 4, "shared_expert_intermediate_size": 16,
                                 "max_position_embeddings": 256},
            dflash=True, dflash_rope={"rope_type": "default", "rope_theta": 10000.0}, dflash_target_layers=(0, 1, 2, 3),
            train=_TINY_TRAIN),
    },
}


def member_config(mc: MemberConfig, vocab_size: int, eos_id: int, pad_id: int):
    """The transformers config of a member's target."""
    from specmoe.models import ARCHITECTURES

    arch = ARCHITECTURES[mc.architecture]
    config = arch.config_class(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
                               **{k: (dict(v) if isinstance(v, dict) else v) for k, v in mc.model.items()})
    config.architectures = [arch.model_class.__name__]
    return config


def member_dflash_config(mc: MemberConfig, target, mask_id: int):
    fc = mc.train
    return dflash_config(target, num_layers=fc.df_layers, block_size=fc.block_size, mask_token_id=mask_id,
                         intermediate_size=fc.df_intermediate, num_attention_heads=fc.df_heads,
                         rope_parameters=mc.dflash_rope,
                         target_layer_ids=list(mc.dflash_target_layers) if mc.dflash_target_layers else None)
