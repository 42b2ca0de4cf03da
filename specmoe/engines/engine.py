"""The offloading engine: batch-1 greedy decoding of an MoE model whose experts live in an `ExpertResidency` unit,
autoregressive or speculative, through one decode loop.

One decode step puts D tokens at a position through the decoder, layer by layer (`Engine._forward`): graph A_0
(embedding, attention, router, pre-gate) -> for each MoE layer l: the host waits for A_l's logits, the router
decides the layer's experts (`routers.Router.route`) and the engine issues its demand copies at once, makes the
compute stream wait on the copies of the executed slots only, launches graph B_l (MoE over the slot buffer) and
graph A_{l+1}, and while those run the router's `predict` on the pre-gate logits (PSR's part 1: prefetch
insertions) and the prefetch pump -> the head graph (final norm, LM head, greedy tokens).

- Autoregressive decoding (`generate(prompt, n)`, `teacher_forced`): D = 1, the `CacheRouter` of the policy
  (exact, Cache-Prior, PSR, speculative execution, logical or physical cache mode). With every expert resident
  and a policy that then routes as the router's own top-K, routing runs on the device instead
  (`specmoe.kernels.device_routing`, `EngineConfig.device_routing`) and a token is one CUDA graph; with
  `EngineConfig.policy_device`, any policy runs on the device with its copies, a token one CUDA graph, from the
  model's logits or a logit feed (`specmoe.engines.device_policy`).
- Speculative decoding (`generate(prompt, n, drafter=d)`): D = k + 1, the `BlockRouter` of the speculative
  config: block selection over the expert pool and union slots; greedy acceptance, the bonus token, rollback
  by position (the next block's root sits at the committed length; KV rows above it are overwritten), the
  drafter's commit, the pool refill (`specmoe.speculation` holds these semantics).
- Trace-following (`follow`): a recorded autoregressive run (`LogitFeed`) or recorded / synthetic verification
  blocks (`Blocks`), routed from their recorded logits on this engine's weights.
- Prefill: prompt processing, whose copies and time are not counted in the steps (`prefill_ms` is the time to
  the first new token). Autoregressive runs put the prompt through in steps of `EngineConfig.prefill_chunk`
  positions whose routing is position by position (`CacheRouter.begin_chunk`: the decisions of one position per
  step) and whose MoE runs in groups where a position reassigns a slot an earlier one executes. Speculative
  runs put the whole prompt through exact selection in blocks of k + 1 positions; the target's greedy token
  after it is the first new token (committed, in no block) and the root of the first verification block, as in
  the public DFlash loop, vLLM and SGLang, so tau is their acceptance length.

Routing never reads timing in the default (logical) mode: copies only change latency. `RunSettings` carries the
copy-timing settings (delay injection, prefetches in flight, copies-skipped mode, instrumentation). On the CPU
the same code runs eagerly with synchronous (or simulated, see `CopyStream`) copies.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from specmoe.models.decoder import Decoder
from specmoe.offload import ExpertResidency
from specmoe.routing import Calibration, PolicyConfig, PolicyError, validate
from specmoe.speculation import Drafter, SpeculativeConfig

from .config import EngineConfig, RunSettings
from .device_blocks import block_device_reason, held_blocks
from .device_policy import DevicePolicy, device_policy_reason
from .recorder import ATTENTION_DONE, COPY_CHECKS, COPY_ISSUE, MOE_START, ROUTING, WAIT_START, StepRecorder
from .results import DecodeResult, LogitFeed, ModelFeed
from .routers import BlockRouter, CacheRouter
from .runner import StepRunner
from .speculative import SpeculativeSteps


class Engine(SpeculativeSteps):
    """Batch-1 decoding of an MoE model whose experts live in an `ExpertResidency` unit (module docstring).

    policy: the autoregressive router's policy (`generate` without a drafter, `teacher_forced`); speculative: the
    speculative config (`generate` with a drafter, `follow` of blocks). Either may be None, not both; the unit
    needs C slots per layer for the policy and P + U for speculative decoding, and may be shared with other
    engines used alternately. fingerprint: the router fingerprint of the model (`router_fingerprint` of its
    routers): calibrations are checked against it at every run (or against a logit feed's source)."""

    def __init__(self, decoder: Decoder, residency: ExpertResidency, policy: PolicyConfig | None,
                 calibration: Calibration, config: EngineConfig = EngineConfig(), settings: RunSettings = RunSettings(),
                 fingerprint: str | None = None, speculative: SpeculativeConfig | None = None):
        if policy is None and speculative is None:
            raise ValueError("an engine needs a policy (autoregressive decoding) or a SpeculativeConfig (speculative "
                             "decoding), or both")
        g = self.geometry = decoder.geometry
        self.num_layers, self.num_experts, self.top_k = g.num_layers, g.num_experts, g.top_k
        self.fingerprint = fingerprint
        calibration.check(g.num_layers, g.num_experts)
        config.check_decoder(decoder)
        self.decoder, self.residency, self.config, self.settings = decoder, residency, config, settings
        self.store, self.slots, self.copies = residency.store, residency.slots, residency.copies
        self.calibration = calibration
        self.device = residency.device
        self.cuda = self.device.type == "cuda"
        self.compute = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.router = self.block_router = None
        if policy is not None:
            self._set_policy(policy, calibration)
        if speculative is not None:
            self._set_speculative(speculative)
        if policy is None:
            self._check_logical(settings)
        with torch.no_grad():
            self._load_warm(self.router or self.block_router)  # the kernel checks read real expert bytes
        self.kernels = config.prepare(decoder, residency, self.compute)
        self.notes = list(decoder.notes)
        self._runners: dict[int, StepRunner] = {}
        self._device_policy: DevicePolicy | None = None  # the last run's
        self._device_policies: dict = {}
        self._device_blocks: dict = {}  # the verification blocks' device paths, per speculative config
        self._make_runners()

    # -- configuration -------------------------------------------------------------------------------
    @property
    def policy(self) -> PolicyConfig | None:
        return None if self.router is None else self.router.policy

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return None if self.block_router is None else self.block_router.config

    @property
    def runner(self) -> StepRunner:
        """The runner of one-position steps."""
        return self._runners[1]

    @property
    def step(self):
        return self.runner.step

    @property
    def graphs(self):
        return self.runner.graphs

    @property
    def union_used(self) -> int:
        return 0 if self.block_router is None else self.block_router.union_used

    def _set_policy(self, policy: PolicyConfig, calibration: Calibration) -> None:
        policy.check_experts(self.num_experts)  # C > E: PolicyError with the numbers
        if policy.top_k != self.top_k:
            raise PolicyError(f"policy top_k K={policy.top_k} but the model routes to {self.top_k} experts")
        g = self.geometry
        self.residency.check_fits(g.num_layers, g.num_experts, g.expert_width, self.decoder.dtype, policy.capacity)
        self.router = CacheRouter(policy, calibration, g, self.decoder.scoring, self.copies)

    def _set_speculative(self, config: SpeculativeConfig) -> None:
        g = self.geometry
        config.check(g)
        router = BlockRouter(config, self.calibration, g, self.decoder.scoring, self.copies)
        self.residency.check_fits(g.num_layers, g.num_experts, g.expert_width, self.decoder.dtype, router.num_slots)
        self.block_router = router

    @staticmethod
    def _check_logical(settings: RunSettings) -> None:
        if settings.cache_mode != "logical":
            raise ValueError("speculative decoding routes logically (outputs never depend on copy timing); "
                             f"cache_mode={settings.cache_mode!r} is for autoregressive decoding")

    def _make_runners(self) -> None:
        """The runners of every static D this engine steps with (D = 1, and k + 1 for speculative decoding); made
        before any request, because their warm-up writes KV rows at position 0."""
        g, config = self.geometry, self.config
        # the whole-token graph with routing on the device, for the autoregressive router only (a speculative-only
        # engine that held it too verified 7% slower on the H200: BENCHMARKS.md, "One engine")
        whole = (config.device_routing == "on" or (config.device_routing == "auto" and self.cuda)) \
            and self.router is not None and self.residency.num_slots == g.num_experts
        sizes = {1} | ({self.block_router.config.k + 1} if self.block_router is not None else set()) \
            | ({config.prefill_chunk} if self.router is not None else set())
        for d in sorted(sizes - set(self._runners)):
            runner = StepRunner(self.decoder, d, self.residency, self.compute, config.cuda_graphs,
                                resident_scoring=self.decoder.scoring if whole and d == 1 else None)
            self._runners[d] = runner
            self.notes += runner.notes

    def configure(self, policy: PolicyConfig | None = None, calibration: Calibration | None = None,
                  speculative: SpeculativeConfig | None = None, **settings) -> None:
        """Switch the policy (at most the unit's slots per layer), the calibration and/or the speculative config,
        and/or RunSettings fields, for the next runs."""
        if calibration is not None:
            calibration.check(self.num_layers, self.num_experts)
            self.calibration = calibration
        if policy is not None or (calibration is not None and self.router is not None):
            self._set_policy(policy or self.router.policy, self.calibration)
        if speculative is not None or (calibration is not None and self.block_router is not None):
            self._set_speculative(speculative or self.block_router.config)
        self._make_runners()  # a router new to this engine may step with another D
        if settings:
            self.settings = self.settings.updated(**settings)

    # -- runs ----------------------------------------------------------------------------------------
    def _load_warm(self, router) -> int:
        self.settings.apply(self.residency)
        router.reset()
        return self.residency.load_warm(router.warm())

    def _start(self, router) -> int:
        """A new request on `router`: its state at the warm set, the warm experts copied (waited for), positions
        from 0. Returns the number of warm copies (prompt processing, never timed)."""
        with torch.no_grad():
            copies = self._load_warm(router)
            self.decoder.reset()
            if self.cuda:
                torch.cuda.synchronize()
        return copies

    def reset(self) -> int:
        """A new sequence on the autoregressive router (or the block router of a speculative-only engine)."""
        return self._start(self.router or self.block_router)

    def _stream(self):
        return torch.cuda.stream(self.compute) if self.cuda else contextlib.nullcontext()

    def _forward(self, run: StepRunner, ids, position: int, router, rec) -> None:
        """One decode step: the tokens `ids` at `position`.. through the target, `router` deciding every layer's
        experts (module docstring); the greedy tokens are in `run.step.next_np` after it."""
        copies, last = self.copies, self.num_layers - 1
        run.step.set_input(ids, position, self.geometry.max_seq_len)
        run.attention(0)
        rec.gpu_mark(0, ATTENTION_DONE)
        for layer in range(self.num_layers):
            run.wait_logits(layer)
            rec.tick()
            group = router.route(layer)
            while group is not None:  # one group, but for a prompt chunk whose positions reassign slots
                used, demand = group
                rec.tick(ROUTING)
                if demand is not None:
                    copies.assign(layer, demand[0], demand[1], prefetch=False)
                rec.tick(COPY_ISSUE)
                rec.gpu_mark(layer, WAIT_START)
                copies.wait(layer, copies.need(layer, used), self.compute)
                rec.gpu_mark(layer, MOE_START)
                rec.tick(COPY_CHECKS)
                run.moe(layer)
                group = None
                if router.grouped:
                    run.synchronize()
                    group = router.next_group(layer)
            if layer < last:
                run.attention(layer + 1)
                rec.gpu_mark(layer + 1, ATTENTION_DONE)
                router.predict(layer + 1)
            else:
                run.head()
            copies.pump()
        run.wait_head()

    def device_routing(self, feed: LogitFeed | None = None) -> str | None:
        """None if the next autoregressive run routes on the device (one launch per token), else why it routes
        on the host."""
        if self.runner.resident_scoring is None:
            return f"device_routing={self.config.device_routing!r} on {self.device.type} with these slots and router"
        if feed is not None:
            return "routing reads a logit feed"
        if self.settings.instrument:
            return "instrumented runs time each layer's host gap"
        return self.router.device_reason(self.residency.num_slots)

    def device_policy(self, feed: LogitFeed | None = None, prompt: int = 0) -> str | None:
        """None if the next autoregressive run (with C < E, where `device_routing` does not apply) runs the policy
        and its copies on the device (`specmoe.engines.device_policy`), else why it runs on the host. prompt: the
        run's untimed prompt positions (the host path prefills them in chunks)."""
        chunked = self._chunked_prompt(feed, prompt) >= self.config.prefill_chunk
        return device_policy_reason(self.config.policy_device, self.cuda, self.router, self.settings, feed,
                                    self.residency.num_slots, chunked_prompt=chunked)

    def _chunked_prompt(self, feed: LogitFeed | None, prompt: int) -> int:
        """Of a run's `prompt` positions, those the host path may prefill `prefill_chunk` at a time (it takes the
        whole chunks among them; 0: none): the model's own logits in logical mode only (a feed is stepped as
        recorded; physical mode reads the copies in flight per position)."""
        chunk = self.config.prefill_chunk
        return prompt if feed is None and self.settings.cache_mode == "logical" and chunk > 1 else 0

    def device_blocks(self) -> str | None:
        """None if the next speculative run verifies its blocks on the device (`specmoe.engines.device_blocks`),
        else why the host path does."""
        return block_device_reason(self.config.block_device, self.cuda, self.block_router, self.settings)

    def _blocks_step(self):
        """The device path of the block router's blocks, or None where the host path runs; (it, why not)."""
        why = self.device_blocks()
        run = self._runners[self.block_router.config.k + 1]
        device = None if why else held_blocks(self._device_blocks, self.decoder, run.step, self.residency,
                                              self.block_router, self.compute, self.config.cuda_graphs,
                                              run.copy_in_graph)
        return device, why

    def _policy_step(self, feed: LogitFeed | None = None) -> DevicePolicy:
        """The device policy of the current policy, calibration, routing rule (the model's, or that of `feed`:
        `CacheRouter.feed_rule`) and one-position step, kept per policy and rule (a `configure` back to a policy
        used before finds its graphs); all are dropped when the step changes."""
        step, router = self.runner.step, self.router
        held = self._device_policies
        if any(p.step is not step for p in held.values()):
            held.clear()
        rule = router.feed_rule(feed)
        key = (router.policy, id(router.calibration), rule, None if rule.bias is None else rule.bias.tobytes())
        if key not in held or held[key].router.calibration is not router.calibration:
            with torch.no_grad(), self._stream():
                held[key] = DevicePolicy(self.decoder, step, self.residency, router, self.compute,
                                         self.config.cuda_graphs, self.runner.copy_in_graph, scoring=rule)
        held[key].router = router  # the router whose host state `finish` updates
        self._device_policy = held[key]
        return held[key]

    def _whole_step(self, t: int, token: int, rec: StepRecorder, position: int) -> None:
        """Step t with routing on the device: one launch, then the records (routing as the host would see it)."""
        run = self.runner
        step = run.step
        step.set_input((token,), position, self.geometry.max_seq_len)
        rec.begin(t, token, position)
        run.whole_step()
        run.wait_head()
        rec.end(t, int(step.next_np[0]))
        rec.position_routing(t, step.logits_np, run.experts_np)

    @staticmethod
    def _need(router, what: str, setting: str):
        """`router`, or a ValueError saying that `what` needs `setting` (a policy, or a SpeculativeConfig)."""
        if router is None:
            raise ValueError(f"{what} needs {setting}: build the engine with one or set it with configure()")
        return router

    def _run(self, tokens_in, num_steps: int, timed_from: int, feed: LogitFeed | None, return_logits: bool,
             stop_tokens=(), feed_outputs_from: int | None = None, first_position: int = 0) -> DecodeResult:
        """An autoregressive run of `num_steps` one-position steps (the tokens fed, or from `feed_outputs_from`
        on the previous greedy token)."""
        router = self._need(self.router, "autoregressive decoding", "a policy")
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
        rec = StepRecorder(num_steps, g.num_layers, g.num_experts, g.top_k, self.copies, self.settings.instrument,
                           self.compute)
        logits = np.zeros((num_steps, g.vocab_size), np.float32) if return_logits else None
        host_routing = self.device_routing(feed)
        host_policy = "every expert resident: routing on the device" if host_routing is None else \
            self.device_policy(feed, timed_from)
        on_device = None if host_policy is not None else self._policy_step(feed)  # before _start: its warm-up
        warm = self._start(router)
        run = self.runner
        if host_routing is None:
            run.set_slot_map(router.slot_map())
        elif on_device is not None:
            on_device.start(self.settings, fed=feed is not None)
        s = self.settings
        router.bind(run.step, ModelFeed(run.step) if feed is None else feed, rec, s.cache_mode == "physical",
                    s.max_in_flight)
        chunk = self.config.prefill_chunk
        prompt = self._chunked_prompt(feed, timed_from) if on_device is None else 0
        with torch.no_grad(), self._stream():
            t = 0
            while t + chunk <= prompt:
                self._prefill_chunk(t, tokens_in[t:t + chunk], first_position + t, router, rec, logits)
                t += chunk
            for t in range(t, num_steps):
                if feed is not None and feed.tokens is not None:
                    token = int(feed.tokens[t])
                elif feed_outputs_from is None or t < feed_outputs_from:
                    token = int(tokens_in[t])
                else:
                    token = int(rec.outputs[t - 1])
                position = first_position + t
                if host_routing is None:
                    self._whole_step(t, token, rec, position)
                elif on_device is not None:
                    on_device.token(t, token, position, rec, feed)
                else:
                    rec.begin(t, token, position)
                    router.begin(t, token)
                    self._forward(run, (token,), position, router, rec)
                    rec.end(t, int(run.step.next_np[0]))
                if logits is not None:
                    logits[t] = run.step.out_logits[0].float().cpu().numpy()
                if feed_outputs_from is not None and t + 1 >= feed_outputs_from and int(rec.outputs[t]) in stops:
                    break
        if on_device is not None:
            on_device.finish()
        # fingerprint: the routers whose logits routing read (LogitFeed.of carries it on)
        info = {"policy": router.policy.name, "warm_copies": warm, **self.kernels,
                "routing": "device" if host_routing is None else "device_policy" if on_device else "host",
                "host_routing_why": host_routing, "host_policy_why": host_policy,
                "fingerprint": self.fingerprint if feed is None else feed.fingerprint,
                "cuda_graphs": self.graphs is not None, "cache_mode": s.cache_mode, "max_in_flight": s.max_in_flight,
                "skip_copies": s.skip_copies, "feed": feed is not None, "notes": list(self.notes)}
        return rec.result(timed_from, logits, info)

    def _prefill_chunk(self, t: int, tokens, position: int, router: CacheRouter, rec: StepRecorder,
                       logits: np.ndarray | None) -> None:
        """Record rows t .. t + D - 1: D prompt tokens at `position` in one step (the policy's decisions for each
        position as one position per step makes them, the MoE in groups: `CacheRouter.begin_chunk`)."""
        run = self._runners[len(tokens)]
        rec.begin_chunk(t, tokens, position)
        router.begin_chunk(run.step, t, tokens)
        self._forward(run, tokens, position, router, rec)
        rec.end_chunk(t, run.step.next_np)
        if logits is not None:
            logits[t:t + len(tokens)] = run.step.out_logits.float().cpu().numpy()

    def teacher_forced(self, tokens, prompt_len: int = 0, feed: LogitFeed | None = None,
                       return_logits: bool = False, first_position: int = 0) -> DecodeResult:
        """Decode `tokens` [T] token by token (autoregressive router), feeding the given tokens; steps before
        `prompt_len` are prompt processing (not timed). output_tokens[t] is the greedy prediction after
        tokens[:t+1].

        first_position > 0 (for timing at long contexts without decoding a prefix): the tokens sit at positions
        first_position .. first_position + T - 1 and attend to whatever the KV cache holds below them, so the
        outputs are not the model's on any real text; routing still starts from the warm set."""
        tokens = validate.token_ids(tokens, None, self.geometry.vocab_size, "tokens", ValueError)
        prompt_len = validate.integer(prompt_len, "prompt_len", minimum=0, maximum=len(tokens))
        return self._run(tokens, len(tokens), prompt_len, feed, return_logits, first_position=first_position)

    @torch.no_grad()
    def generate(self, prompt, max_new_tokens: int, stop_tokens=(), drafter: Drafter | None = None, *,
                 feed: LogitFeed | None = None, return_logits: bool = False, record: bool = False) -> DecodeResult:
        """Greedy generation of up to `max_new_tokens` new tokens after `prompt` (token ids); stops after a stop
        token (kept). Without a drafter: autoregressive decoding with the policy (the timed steps are those that
        consume a generated token; feed: route from a recorded run's logits). With a drafter: speculative
        decoding with the speculative config's selector, k and pool (record: keep each block's selections)."""
        g = self.geometry
        prompt = validate.token_ids(prompt, None, g.vocab_size, "prompt", ValueError)
        max_new_tokens = validate.integer(max_new_tokens, "max_new_tokens", minimum=1)
        if prompt.size == 0:
            raise ValueError("generate needs a non-empty prompt")
        if drafter is not None:
            if feed is not None or return_logits:
                raise ValueError("speculative generation takes no logit feed and returns no logits")
            return self._speculate(prompt.tolist(), max_new_tokens, stop_tokens, drafter, record)
        num_steps = prompt.size + max_new_tokens - 1
        result = self._run(prompt, num_steps, prompt.size, feed, return_logits, stop_tokens,
                           feed_outputs_from=prompt.size)
        result.generated = result.output_tokens[prompt.size - 1:].tolist()
        result.prefill_ms = float(result.ms[~result.timed].sum())  # the prompt's steps, the first token's included
        return result
