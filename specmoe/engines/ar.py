"""The autoregressive offloading engine: batch-1 decoding with a logical expert cache (PSR and baselines).

One token: graph A_0 (embedding, attention, router, pre-gate) -> for each MoE layer l: the host waits for
A_l's logits, runs part 2 of layer l (`LogicalCache.route`), issues demand copies, makes the compute stream
wait on the copies of the executed slots only, launches graph B_l (MoE over the slot buffer) and graph
A_{l+1}, and then, while those run, part 1 of layer l+1 (`LogicalCache.insert_predicted` on the pre-gate)
and the prefetch pump -> head graph (final norm, LM head, greedy token).

With every expert resident (C = E) and a policy that then routes as the router's own top-K (exact,
Cache-Prior, PSR), routing runs on the device instead (`specmoe.kernels.device_routing`, `EngineConfig.device_routing`)
and the whole token is one CUDA graph: the same selections, no host round trip per layer.

Routing never reads timing in the default (logical) mode: copies only change latency. Modes:
- teacher-forced windows (`teacher_forced`) and greedy generation with stop tokens (`generate`); prompt
  positions are decoded through the same path but not timed, after the warm set has been copied;
- physical-cache mode (`cache_mode="physical"`): part 1 may insert only as many experts as there is room for
  copies in flight, and inserted experts are copied at once, so routing sees exactly the experts whose
  copies have been issued (the paper's Section 3 / Table 1 setting): timing-dependent on purpose;
- a logit feed (`feed=`): router and pre-gate logits from a recording instead of the model;
- copies-skipped (`skip_copies`): the same routing, no copy is made: the compute-only time.
On the CPU the same code runs eagerly with synchronous (or simulated, see `CopyStream`) copies.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from specmoe.kernels import check_kernel_choice
from specmoe.models.decoder import Decoder
from specmoe.offload import ExpertResidency, ExpertStore
from specmoe.routing import Calibration, EngineScoring, LogicalCache, PolicyConfig, PolicyError, router_fingerprint
from specmoe.routing import validate
from specmoe.kernels.device_routing import device_routing_applies

from .recorder import ATTENTION_DONE, COPY_CHECKS, COPY_ISSUE, MOE_START, ROUTING, WAIT_START, StepRecorder
from .results import DecodeResult, LogitFeed, ModelFeed
from .runner import StepRunner

CACHE_MODES = ("logical", "physical")
DEVICE_ROUTING = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built with (fixed for its lifetime). backend: our Triton kernels (RMSNorm, attention
    prologue, slot MoE) or their torch versions ("auto": Triton on CUDA where installed); attention: "split_kv"
    (our Triton kernel, reads only the written positions), "sdpa" (torch, the whole masked cache), "flash_attn"
    (flash-attn's flash_attn_with_kvcache), or "auto" (split_kv on CUDA with Triton, else sdpa); moe: "slot" (our slot-indexed kernel) or
    "vllm" (vLLM's fused_experts); tune: pick the MoE kernel's launch parameters on the device. Optional
    packages must be installed (else ImportError at build) and are checked against the torch path at build;
    one that disagrees is not used (see `ArEngine.notes`). device_routing: when every expert is resident and
    the policy reduces to the router's own top-K, route on the device and run each token as one launch
    ("auto": on CUDA; "on": on any device, the CPU included; "off": always the host's `LogicalCache.route`)."""

    max_seq_len: int = 1024
    cuda_graphs: bool = True
    backend: str = "auto"
    attention: str = "auto"
    moe: str = "slot"
    tune: bool = False
    device_routing: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_seq_len", validate.integer(self.max_seq_len, "max_seq_len", minimum=1))
        check_kernel_choice(self.backend, self.attention, self.moe)
        if self.device_routing not in DEVICE_ROUTING:
            raise ValueError(f"device_routing must be one of {DEVICE_ROUTING}, got {self.device_routing!r}")

    def check_decoder(self, decoder: Decoder) -> None:
        """ValueError unless the decoder's KV cache has this config's max_seq_len positions."""
        if self.max_seq_len != decoder.geometry.max_seq_len:
            raise ValueError(f"max_seq_len={self.max_seq_len} but the decoder's KV cache has "
                             f"{decoder.geometry.max_seq_len} positions")

    def prepare(self, decoder: Decoder, residency: ExpertResidency, stream) -> dict:
        """Choose and check the decoder's kernels (`Decoder.use_kernels`) on the compute stream `stream` (None
        on the CPU); the slots must hold real experts (the checks read them). Returns what is used."""
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            return decoder.use_kernels(self.backend, self.attention, self.moe, residency.slots.layer(0), self.tune)


@dataclass(frozen=True)
class RunSettings:
    """What may change between runs (`ArEngine.configure`). max_in_flight: prefetch copies in flight at once;
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


class ArEngine:
    """Batch-1 autoregressive decoding of an MoE model whose experts live in an `ExpertResidency` unit."""

    def __init__(self, decoder: Decoder, residency: ExpertResidency, policy: PolicyConfig, calibration: Calibration,
                 config: EngineConfig = EngineConfig(), settings: RunSettings = RunSettings(),
                 fingerprint: str | None = None):
        """fingerprint: the router fingerprint of the model (`router_fingerprint` of its routers). Calibrations
        are checked with `Calibration.check`: the geometry here and in `configure`, and at every run against
        the model whose logits routing reads (vocabulary and fingerprint of this model, or the fingerprint of
        a logit feed's source); None checks the geometry only."""
        g = self.geometry = decoder.geometry
        self.fingerprint = fingerprint
        calibration.check(g.num_layers, g.num_experts)
        config.check_decoder(decoder)
        self.num_layers, self.num_experts, self.top_k = g.num_layers, g.num_experts, g.top_k
        self._check_policy(policy)
        residency.check_fits(g.num_layers, g.num_experts, g.expert_width, decoder.dtype, policy.capacity)
        self.decoder, self.residency, self.config = decoder, residency, config
        self.store, self.slots, self.copies = residency.store, residency.slots, residency.copies
        self.policy, self.calibration = policy, calibration
        self.cache = LogicalCache(policy, calibration, g.num_layers, g.num_experts)
        self.scoring = EngineScoring.of(decoder.scoring, g.num_layers, g.num_experts)
        self.settings = settings
        self.device = residency.device
        self.cuda = self.device.type == "cuda"
        self.compute = torch.cuda.Stream(device=self.device) if self.cuda else None
        with torch.no_grad():
            self._load_warm()  # the kernel checks read real expert bytes from the slots
        self.kernels = config.prepare(decoder, residency, self.compute)
        # the whole-token launch, where a policy at C = E could use it
        whole = (config.device_routing == "on" or (config.device_routing == "auto" and self.cuda)) \
            and residency.num_slots == g.num_experts and decoder.scoring.kind == "softmax"
        self.runner = StepRunner(decoder, 1, residency, self.compute, config.cuda_graphs,
                                 resident_scoring=decoder.scoring if whole else None)
        self.step = self.runner.step
        self.feed = ModelFeed(self.step)
        self._slots = [self.step.slots_np[l, 0] for l in range(g.num_layers)]
        self._weights = [self.step.weights_np[l, 0] for l in range(g.num_layers)]
        self.notes = decoder.notes + self.runner.notes

    @property
    def graphs(self):
        return self.runner.graphs

    # -- configuration -------------------------------------------------------------------------------
    def _check_policy(self, policy: PolicyConfig) -> None:
        policy.check_experts(self.num_experts)  # C > E: PolicyError with the numbers
        if policy.top_k != self.top_k:
            raise PolicyError(f"policy top_k K={policy.top_k} but the model routes to {self.top_k} experts")

    def configure(self, policy: PolicyConfig | None = None, calibration: Calibration | None = None,
                  **settings) -> None:
        """Switch policy (at most the unit's slots per layer) and/or calibration, and/or RunSettings fields."""
        if policy is not None or calibration is not None:
            policy = policy or self.policy
            self._check_policy(policy)
            if calibration is not None:
                calibration.check(self.num_layers, self.num_experts)
            if policy.capacity > self.residency.num_slots:
                raise ValueError(f"capacity C={policy.capacity} exceeds the {self.residency.num_slots} slots per "
                                 "layer of the engine's expert residency: build another engine")
            self.policy, self.calibration = policy, calibration or self.calibration
            self.cache = LogicalCache(policy, self.calibration, self.num_layers, self.num_experts)
        if settings:
            self.settings = self.settings.updated(**settings)

    # -- runs ----------------------------------------------------------------------------------------
    def _load_warm(self) -> int:
        self.settings.apply(self.residency)
        self.cache.reset()
        return self.residency.load_warm(np.stack([self.cache.resident(l) for l in range(self.num_layers)]))

    def reset(self) -> int:
        """A new sequence: logical cache to the warm set, warm experts copied (waited for), positions from 0.
        Returns the number of warm copies (part of prompt processing, never timed)."""
        with torch.no_grad():
            copies = self._load_warm()
            self.decoder.reset()
            if self.cuda:
                torch.cuda.synchronize()
        return copies

    def _step(self, t: int, token: int, feed, rec: StepRecorder, position: int) -> None:
        """Step t of the run, one token at `position`: the data flow of the module docstring."""
        cache, copies, run = self.cache, self.copies, self.runner
        inserts = self.policy.insert_budget > 0
        self.step.set_input((token,), position, self.geometry.max_seq_len)
        rec.begin(t, token)
        run.attention(0)
        rec.gpu_mark(t, 0, ATTENTION_DONE)
        for l in range(self.num_layers):
            run.wait_logits(l)
            rec.tick()
            slots = self._slots[l]
            d = cache.route(l, feed.router(t, l), token, self.scoring, rec.router_logits[t, l], rec.selected[t, l],
                            slots, self._weights[l])
            rec.tick(ROUTING)
            if d:
                copies.assign(l, cache.demand_slots[:d], cache.demand[:d], prefetch=False)
            rec.tick(COPY_ISSUE)
            rec.gpu_mark(t, l, WAIT_START)
            copies.wait(l, copies.need(l, slots), self.compute)
            rec.gpu_mark(t, l, MOE_START)
            rec.tick(COPY_CHECKS)
            run.moe(l)
            if l + 1 < self.num_layers:
                run.attention(l + 1)
                rec.gpu_mark(t, l + 1, ATTENTION_DONE)
                g = rec.pregate_logits[t, l + 1] = feed.pregate(t, l + 1)
                if inserts:
                    self._part1(l + 1, g, token)
            else:
                run.head()
            copies.pump()
        run.wait_head()
        rec.end(t, int(self.step.next_np[0]))

    def device_routing(self, feed: LogitFeed | None = None) -> str | None:
        """None if the next run routes on the device (one launch per token), else why it routes on the host."""
        if self.runner.resident_scoring is None:
            return f"device_routing={self.config.device_routing!r} on {self.device.type} with these slots and router"
        if feed is not None:
            return "routing reads a logit feed"
        if self.settings.instrument:
            return "instrumented runs time each layer's host gap"
        return device_routing_applies(self.policy, self.num_experts, self.decoder.scoring)

    def _whole_step(self, t: int, token: int, rec: StepRecorder, position: int) -> None:
        """Step t with routing on the device: one launch, then the records (routing as the host would see it)."""
        step, e = self.step, self.num_experts
        step.set_input((token,), position, self.geometry.max_seq_len)
        rec.begin(t, token)
        self.runner.whole_step()
        self.runner.wait_head()
        rec.end(t, int(step.next_np[0]))
        rec.router_logits[t] = step.logits_np[:, 0, :e]
        rec.pregate_logits[t, 1:] = step.logits_np[:-1, 0, e:]
        rec.selected[t] = self.runner.experts_np[:, 0]

    def _part1(self, layer: int, pregate: np.ndarray, token: int) -> None:
        # physical-cache mode: insert only what can be copied at once, so that routing sees issued copies
        physical = self.settings.cache_mode == "physical"
        budget = max(self.settings.max_in_flight - self.copies.in_flight(), 0) if physical else None
        # float32 as recorded: part 1 only ranks g, and float32 -> float64 keeps every order and tie
        inserted = self.cache.insert_predicted(layer, pregate, token, budget=budget)
        if inserted.size:
            self.copies.assign(layer, self.cache.slot_of(layer, inserted), inserted, prefetch=True,
                               issue_now=physical)

    def _run(self, tokens_in, num_steps: int, timed_from: int, feed: LogitFeed | None, return_logits: bool,
             stop_tokens=(), feed_outputs_from: int | None = None, first_position: int = 0) -> DecodeResult:
        g = self.geometry
        first_position = validate.integer(first_position, "first_position", minimum=0)
        if first_position + num_steps > g.max_seq_len:
            raise ValueError(f"{num_steps} positions from position {first_position} do not fit the static KV cache "
                             f"of {g.max_seq_len} (EngineConfig.max_seq_len)")
        stops = set(validate.token_ids(list(stop_tokens), None, g.vocab_size, "stop_tokens", ValueError).tolist())
        if feed is None:  # routing reads this model's logits and tokens: the calibration must be this model's
            self.calibration.check(g.num_layers, g.num_experts, g.vocab_size, self.fingerprint)
        else:  # the feed's source model's
            self.calibration.check(g.num_layers, g.num_experts, fingerprint=feed.fingerprint)
        if feed is not None:
            if feed.tokens is not None:  # the recorded run's tokens and length
                num_steps, stops = min(num_steps, len(feed.tokens)), set()
            feed.check(num_steps, g.num_layers, g.num_experts)
        rec = StepRecorder(num_steps, g.num_layers, g.num_experts, g.top_k, self.copies,
                           self.settings.instrument, self.compute)
        logits = np.zeros((num_steps, g.vocab_size), np.float32) if return_logits else None
        warm = self.reset()
        source = self.feed if feed is None else feed
        host_routing = self.device_routing(feed)
        if host_routing is None:
            self.runner.set_slot_map(np.stack([self.cache.slot_of(l, np.arange(self.num_experts))
                                               for l in range(self.num_layers)]))
        with torch.no_grad(), (torch.cuda.stream(self.compute) if self.cuda else contextlib.nullcontext()):
            for t in range(num_steps):
                if feed is not None and feed.tokens is not None:
                    token = int(feed.tokens[t])
                elif feed_outputs_from is None or t < feed_outputs_from:
                    token = int(tokens_in[t])
                else:
                    token = int(rec.outputs[t - 1])
                if host_routing is None:
                    self._whole_step(t, token, rec, first_position + t)
                else:
                    self._step(t, token, source, rec, first_position + t)
                if logits is not None:
                    logits[t] = self.step.out_logits[0].float().cpu().numpy()
                if feed_outputs_from is not None and t + 1 >= feed_outputs_from and int(rec.outputs[t]) in stops:
                    break
        s = self.settings
        # fingerprint: the routers whose logits routing read (LogitFeed.of carries it on)
        info = {"policy": self.policy.name, "warm_copies": warm, **self.kernels,
                "routing": "device" if host_routing is None else "host", "host_routing_why": host_routing,
                "fingerprint": self.fingerprint if feed is None else feed.fingerprint,
                "cuda_graphs": self.graphs is not None, "cache_mode": s.cache_mode, "max_in_flight": s.max_in_flight,
                "skip_copies": s.skip_copies, "feed": feed is not None, "notes": list(self.notes)}
        return rec.result(timed_from, logits, info)

    def teacher_forced(self, tokens, prompt_len: int = 0, feed: LogitFeed | None = None,
                       return_logits: bool = False, first_position: int = 0) -> DecodeResult:
        """Decode `tokens` [T] token by token, feeding the given tokens; steps before `prompt_len` are prompt
        processing (not timed). output_tokens[t] is the greedy prediction after tokens[:t+1].

        first_position > 0 (for timing at long contexts without decoding a prefix): the tokens sit at positions
        first_position .. first_position + T - 1 and attend to whatever the KV cache holds below them, so the
        outputs are not the model's on any real text; routing still starts from the warm set."""
        tokens = validate.token_ids(tokens, None, self.geometry.vocab_size, "tokens", ValueError)
        prompt_len = validate.integer(prompt_len, "prompt_len", minimum=0, maximum=len(tokens))
        return self._run(tokens, len(tokens), prompt_len, feed, return_logits, first_position=first_position)

    def generate(self, prompt, max_new_tokens: int, stop_tokens=(), feed: LogitFeed | None = None,
                 return_logits: bool = False) -> DecodeResult:
        """Greedy generation: the prompt is decoded token by token (not timed), then each step feeds the
        previous greedy token. Stops after max_new_tokens generated tokens or at a stop token (kept). The
        timed steps are those that consume a generated token; `generated` lists the new tokens."""
        prompt = validate.token_ids(prompt, None, self.geometry.vocab_size, "prompt", ValueError)
        max_new_tokens = validate.integer(max_new_tokens, "max_new_tokens", minimum=1)
        if prompt.size == 0:
            raise ValueError("generate needs a non-empty prompt")
        num_steps = prompt.size + max_new_tokens - 1
        result = self._run(prompt, num_steps, prompt.size, feed, return_logits, stop_tokens,
                           feed_outputs_from=prompt.size)
        result.generated = result.output_tokens[prompt.size - 1:].tolist()
        return result


def build_engine(model, policy: PolicyConfig, calibration: Calibration, config: EngineConfig = EngineConfig(),
                 settings: RunSettings = RunSettings(), *, residency: ExpertResidency | None = None,
                 store: ExpertStore | None = None, host_memory_limit: int | None = None,
                 device_memory_limit: int | None = None) -> ArEngine:
    """An ArEngine for a transformers MoE model: the decoder's weights taken from the model (on its device
    and dtype). Experts: the given `residency` unit (share one between engines), else a new unit of C slots
    over `store`, else over a new pinned ExpertStore copied from the model."""
    from specmoe.models import adapter_for, decoder_for

    if residency is None:
        store = store or ExpertStore.from_model(model, host_memory_limit=host_memory_limit)
        policy.check_experts(store.num_experts)  # C > E: the policy's error before any allocation
        residency = ExpertResidency(store, policy.capacity, next(model.parameters()).device,
                                    memory_limit=device_memory_limit)
    decoder = decoder_for(model.config).from_model(model, config.max_seq_len)
    fingerprint = adapter_for(model.config).fingerprint(model)
    return ArEngine(decoder, residency, policy, calibration, config, settings, fingerprint)


def build_engine_from_checkpoint(path, policy: PolicyConfig, calibration: Calibration,
                                 config: EngineConfig = EngineConfig(), settings: RunSettings = RunSettings(), *,
                                 device="cpu", dtype: torch.dtype = torch.bfloat16,
                                 host_memory_limit: int | None = None,
                                 device_memory_limit: int | None = None) -> ArEngine:
    """An ArEngine read from a local checkpoint directory without instantiating the transformers model: the
    experts go straight into the pinned store, the other weights to the device."""
    from transformers import AutoConfig

    from specmoe.models import adapter_for, decoder_for
    from specmoe.offload import CheckpointReader, ExpertGeometry

    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    adapter = adapter_for(hf_config)
    geometry = ExpertGeometry.of(adapter)
    policy.check_experts(geometry.num_experts)
    store = ExpertStore.from_checkpoint(path, geometry, dtype=dtype, host_memory_limit=host_memory_limit)
    residency = ExpertResidency(store, policy.capacity, device, memory_limit=device_memory_limit)
    decoder = decoder_for(hf_config).from_checkpoint(path, config.max_seq_len, device, dtype)
    reader = CheckpointReader(path)
    fingerprint = router_fingerprint([reader.get(adapter.router_weight_name(layer)).float().numpy()
                                      for layer in range(adapter.num_moe_layers)])
    return ArEngine(decoder, residency, policy, calibration, config, settings, fingerprint)
