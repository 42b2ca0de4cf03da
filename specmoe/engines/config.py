"""How an engine is built (`EngineConfig`, fixed for its lifetime) and what may change between its runs
(`RunSettings`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from specmoe.kernels import check_kernel_choice, check_tune, pdl
from specmoe.models.decoder import Decoder
from specmoe.offload import ExpertResidency
from specmoe.routing import validate

CACHE_MODES = ("logical", "physical")
DEVICE_ROUTING = ("auto", "on", "off")
STATE_ROLLBACKS = ("auto", "history", "recompute")


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built with (fixed for its lifetime). backend: our Triton kernels (RMSNorm, attention
    prologue, slot MoE) or their torch versions ("auto": Triton on CUDA where installed); attention: "split_kv"
    (our Triton kernel, reads only the written positions), "sdpa" (torch, the whole masked cache), "flash_attn"
    (flash-attn's flash_attn_with_kvcache), or "auto" (split_kv on CUDA with Triton, else sdpa); moe: "slot" (our
    slot-indexed kernel) or "vllm" (vLLM's fused_experts); tune: the MoE kernels' launch parameters on CUDA
    ("auto": read from the tuning cache, else tuned once and cached; True: tuned again now, the cache entry
    overwritten; False: fixed defaults, for exact reproduction; `specmoe.kernels.tuning`; `kernels["launch"]`
    says which ran). Optional
    packages must be installed (else ImportError at build) and are checked against the torch path at build;
    one that disagrees is not used (see `Engine.notes`). device_routing: when every expert is resident and
    the policy reduces to the router's own top-K, route on the device and run each token as one launch
    ("auto": on CUDA; "on": on any device, the CPU included; "off": always the host's `LogicalCache.route`).
    policy_device: with C < E (or a policy that is not the router's own top-K), run the policy's logical cache
    and its copies on the device, a token as one CUDA graph, also when routing follows a logit feed
    (`specmoe.engines.device_policy`; "auto", the default: on CUDA for policies without prefetch insertions, at
    any number of experts per layer, the host policy otherwise; "on": wherever it applies, also on the CPU under
    Triton's interpreter, for tests; "off": the host's `LogicalCache` between per-layer launches). On an H200
    following the olmoe-like source the device policy is faster than the host policy for Cache-Prior (host /
    device 1.06 at full-size OLMoE, C = 32; 1.31 at Qwen3.6's size, C = 64), and PSR's prefetch copies, on the
    device path's copy kernel, make it slower than on the host policy's copy engine (0.89 and 0.66; BENCHMARKS.md);
    `result.info["routing"]` says which ran and `host_policy_why` why the host did.
    block_device: the speculative engine's verification blocks with their selection, expert pool, demand copies
    and refill on the device, a block as one CUDA graph, also following recorded blocks
    (`specmoe.engines.device_blocks`; "auto", the default: on CUDA where it applies, with the block prefetch
    too, the host path elsewhere; "on" / "off" as policy_device). On an H200 at full-size OLMoE (k = 16,
    acceptmoe, P = 24, 2k context) the device blocks took 0.63 of the host path's compute per committed token and
    0.88 of its time with copies, before the selection's sums were read in chunks (BENCHMARKS.md);
    `result.info["verify"]` says which path ran.
    prefill_chunk: prompt positions per step of the autoregressive prefill (1: one at a time; the policy's
    decisions are the same either way, `Engine` module docstring). state_rollback: how a verification block's
    recurrent state (Qwen3.5-MoE's Gated DeltaNet) is rolled back: "history" (the step keeps every position's
    state), "recompute" (the committed positions rerun from the block's start), "auto" (the decoder's default,
    history: the cheaper on an H200, BENCHMARKS.md); decoders without recurrent state take only "auto"."""

    max_seq_len: int = 1024
    cuda_graphs: bool = True
    backend: str = "auto"
    attention: str = "auto"
    moe: str = "slot"
    tune: str | bool = "auto"
    device_routing: str = "auto"
    policy_device: str = "auto"
    block_device: str = "auto"
    prefill_chunk: int = 16
    state_rollback: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_seq_len", validate.integer(self.max_seq_len, "max_seq_len", minimum=1))
        check_kernel_choice(self.backend, self.attention, self.moe)
        check_tune(self.tune)
        object.__setattr__(self, "prefill_chunk", validate.integer(self.prefill_chunk, "prefill_chunk", minimum=1))
        if self.device_routing not in DEVICE_ROUTING:
            raise ValueError(f"device_routing must be one of {DEVICE_ROUTING}, got {self.device_routing!r}")
        if self.policy_device not in DEVICE_ROUTING:
            raise ValueError(f"policy_device must be one of {DEVICE_ROUTING}, got {self.policy_device!r}")
        if self.block_device not in DEVICE_ROUTING:
            raise ValueError(f"block_device must be one of {DEVICE_ROUTING}, got {self.block_device!r}")
        if self.state_rollback not in STATE_ROLLBACKS:
            raise ValueError(f"state_rollback must be one of {STATE_ROLLBACKS}, got {self.state_rollback!r}")

    def check_decoder(self, decoder: Decoder) -> None:
        """ValueError unless the decoder's KV cache has this config's max_seq_len positions and a state_rollback
        other than "auto" has recurrent state to roll back."""
        if self.max_seq_len != decoder.geometry.max_seq_len:
            raise ValueError(f"max_seq_len={self.max_seq_len} but the decoder's KV cache has "
                             f"{decoder.geometry.max_seq_len} positions")
        if self.state_rollback != "auto" and decoder.state_rollback is None:
            raise ValueError(f"state_rollback={self.state_rollback!r}: the {type(decoder).__name__} has no recurrent "
                             "state to roll back (only \"auto\" applies)")

    def prepare(self, decoder: Decoder, residency: ExpertResidency, stream) -> dict:
        """Choose and check the decoder's kernels (`Decoder.use_kernels`) on the compute stream `stream` (None
        on the CPU); the slots must hold real experts (the checks read them). Returns what is used."""
        if self.state_rollback != "auto":
            decoder.set_state_rollback(self.state_rollback)
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            used = decoder.use_kernels(self.backend, self.attention, self.moe, residency.slots.layer(0), self.tune)
        if used.get("backend") == "triton":  # its kernels start while the one before finishes, where they can
            used["pdl"], why = pdl.status(residency.device)
            decoder.notes.append(why)
        if decoder.state_rollback is not None:
            used["state_rollback"] = decoder.state_rollback
        return used


@dataclass(frozen=True)
class RunSettings:
    """What may change between runs (`Engine.configure`). max_in_flight: prefetch copies in flight at once;
    cache_mode: "logical" or "physical"; skip_copies: no copy is made (compute-only time); copy_delay: (lo, hi)
    seconds of random delay before each copy (tests of timing independence), seeded by delay_seed;
    instrument: GPU events that time the host gap and the copy waits of every layer (costs a few µs per
    layer: keep it off for latency numbers)."""

    max_in_flight: int = 2
    cache_mode: str = "logical"
    skip_copies: bool = False
    copy_delay: tuple[float, float] | None = None
    delay_seed: int = 0
    instrument: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_in_flight", validate.integer(self.max_in_flight, "max_in_flight"))
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {self.cache_mode!r}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        if self.copy_delay is not None and not 0 <= self.copy_delay[0] <= self.copy_delay[1]:
            raise ValueError(f"copy_delay must be (lo, hi) with 0 <= lo <= hi, got {self.copy_delay}")

    def updated(self, **changes) -> "RunSettings":
        """These settings with `changes`; a name that is not a run setting is a ValueError."""
        unknown = set(changes) - set(RunSettings.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{', '.join(sorted(unknown))}: not a run setting (EngineConfig fields are fixed "
                             f"when the engine is built); run settings: {', '.join(RunSettings.__dataclass_fields__)}")
        return replace(self, **changes)

    def apply(self, residency: ExpertResidency) -> None:
        """Hand the copy settings to the residency unit's copy stream (at the start of every run)."""
        residency.configure(self.max_in_flight, self.skip_copies, self.copy_delay, self.delay_seed)
