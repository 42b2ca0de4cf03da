"""The autoregressive offloading engine: batch-1 decoding with a logical expert cache (PSR and baselines).

One token (DESIGN.md, "Data flow of one AR token"): graph A_0 (embedding, attention, router, pre-gate) ->
for each MoE layer l: the host waits for A_l's logits, runs part 2 of layer l (`LogicalCache.route`),
issues demand copies, writes the route row (slot ids + execution weights), makes the compute stream wait on
the events of the executed slots only, launches graph B_l (MoE over the slot buffer) and graph A_{l+1}, and
then, while those run, part 1 of layer l+1 (`LogicalCache.insert_predicted` on the pre-gate) and the
prefetch pump -> head graph (final norm, LM head, greedy token).

Routing never reads timing in the default (logical) mode: copies only change latency. Modes:
- teacher-forced windows (`teacher_forced`) and greedy generation with stop tokens (`generate`); prompt
  positions are decoded through the same path but not timed, after the warm set has been copied;
- physical-cache mode (`cache_mode="physical"`): part 1 may insert only as many experts as there is room for
  copies in flight, and inserted experts are copied at once, so routing sees exactly the experts whose
  copies have been issued (the paper's Section 3 / Table 1 setting): timing-dependent on purpose;
- trace-following (`trace=`): router and pre-gate logits come from a recorded trace instead of the model;
- copies-skipped (`skip_copies`): the same routing, no copy is made: the compute-only time.
On the CPU the same code runs eagerly with synchronous (or simulated, see `CopyStream`) copies.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from specmoe.kernels import load_flash_attn, load_fused_experts, triton_available, tune_moe
from specmoe.offload import CopyStream, ExpertStore, SlotBuffers
from specmoe.routing import Calibration, EngineScoring, LogicalCache, PolicyConfig, PolicyError, RouterScoring

from .results import COPY_FIELDS, DecodeResult, Trace

CACHE_MODES = ("logical", "physical")
BACKENDS = ("auto", "triton", "torch")
ATTENTIONS = ("sdpa", "flash_attn")
MOE_KERNELS = ("slot", "vllm")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. max_in_flight: prefetch copies in flight at once; copy_delay: (lo, hi) seconds of
    random delay before each copy (tests of timing independence); instrument: GPU events that time the host
    gap and the copy waits of every layer (costs a few µs per layer: keep it off for latency numbers).
    backend: our Triton kernels (RMSNorm, attention prologue, slot MoE) or their torch versions ("auto":
    Triton on CUDA where installed). attention: "sdpa" (torch) or "flash_attn" (flash-attn's
    flash_attn_with_kvcache); moe: "slot" (our slot-indexed kernel, per `backend`) or "vllm" (vLLM's
    fused_experts). The optional packages must be installed (else ImportError at build) and are checked
    against the torch path at build; one that disagrees is not used (see `ArEngine.notes`)."""

    max_seq_len: int = 1024
    max_in_flight: int = 2
    cache_mode: str = "logical"
    skip_copies: bool = False
    cuda_graphs: bool = True
    backend: str = "auto"
    attention: str = "sdpa"
    moe: str = "slot"
    tune: bool = False
    copy_delay: tuple[float, float] | None = None
    delay_seed: int = 0
    instrument: bool = False
    device_memory_limit: int | None = None

    def __post_init__(self) -> None:
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {self.cache_mode!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.moe not in MOE_KERNELS:
            raise ValueError(f"moe must be one of {MOE_KERNELS}, got {self.moe!r}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be positive, got {self.max_seq_len}")
        if self.copy_delay is not None and not 0 <= self.copy_delay[0] <= self.copy_delay[1]:
            raise ValueError(f"copy_delay must be (lo, hi) with 0 <= lo <= hi, got {self.copy_delay}")


def _relative_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    """|out - ref| / |ref| (L2, float32): how the engine compares a kernel with its torch reference."""
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-12))


class ArEngine:
    """Batch-1 autoregressive decoding of an MoE model whose experts live in an ExpertStore."""

    def __init__(self, decoder, store: ExpertStore, policy: PolicyConfig, calibration: Calibration,
                 config: EngineConfig = EngineConfig()):
        c = decoder.cfg
        if (store.num_layers, store.num_experts) != (c.num_layers, c.num_experts) or \
                store.width != 3 * c.inter * c.hidden:
            raise ValueError(f"the expert store ({store.num_layers} layers x {store.num_experts} experts, row "
                             f"{store.width}) does not match the decoder ({c.num_layers} x {c.num_experts}, "
                             f"row {3 * c.inter * c.hidden})")
        if store.dtype != decoder.dtype:
            raise ValueError(f"the expert store holds {store.dtype}, the decoder computes in {decoder.dtype}")
        if config.max_seq_len != decoder.max_seq_len:
            raise ValueError(f"config.max_seq_len={config.max_seq_len} but the decoder's KV cache has "
                             f"{decoder.max_seq_len} positions")
        self.decoder, self.store, self.config = decoder, store, config
        # per-layer views of the decoder's pinned host buffers: the routing step reads and writes these
        e, k = c.num_experts, c.top_k
        self._router_rows = [decoder.logits_np[l, :e] for l in range(c.num_layers)]
        self._pregate_rows = [decoder.logits_np[l, e:] for l in range(c.num_layers)]  # g of layer l + 1
        self._route_slots = [decoder.route_np[l, :k] for l in range(c.num_layers)]
        self._route_weights = [decoder.weights_np[l] for l in range(c.num_layers)]
        self.num_layers, self.num_experts, self.top_k = c.num_layers, c.num_experts, c.top_k
        self._check_policy(policy)
        self.policy = policy
        self.cache = LogicalCache(policy, calibration, c.num_layers, c.num_experts)
        self.scoring = EngineScoring.of(RouterScoring(renormalise=c.norm_topk_prob), c.num_layers, c.num_experts)
        self.calibration = calibration
        self.device = decoder.device
        self.cuda = self.device.type == "cuda"
        backend = config.backend
        if backend == "auto":
            backend = "triton" if self.cuda and triton_available() else "torch"
        self.notes: list[str] = []
        decoder.backend = backend
        # a missing optional package is an ImportError here, before any buffer is allocated
        flash_attn = load_flash_attn() if config.attention == "flash_attn" else None
        fused_experts = load_fused_experts() if config.moe == "vllm" else None
        decoder.flash_attn = decoder.fused_experts = None  # set once checked
        self.slots = SlotBuffers(c.num_layers, policy.capacity, store.width, store.dtype, self.device,
                                 config.device_memory_limit)
        self.copies = CopyStream(store, self.slots, config.max_in_flight, config.skip_copies, config.copy_delay,
                                 config.delay_seed)
        self.graphs = None
        if self.cuda:
            self.compute = torch.cuda.Stream(device=self.device)
            self.ev_attn = [torch.cuda.Event() for _ in range(c.num_layers)]
            self.ev_head = torch.cuda.Event()
        with torch.no_grad():
            self._load_warm()
            with torch.cuda.stream(self.compute) if self.cuda else contextlib.nullcontext():
                self._use_optional_kernels(flash_attn, fused_experts)
                if self.cuda:
                    self._prepare_cuda()

    # -- configuration -------------------------------------------------------------------------------
    def _check_policy(self, policy: PolicyConfig) -> None:
        policy.check_experts(self.num_experts)  # C > E: PolicyError with the numbers
        if policy.top_k != self.top_k:
            raise PolicyError(f"policy top_k K={policy.top_k} but the model routes to {self.top_k} experts")

    def configure(self, policy: PolicyConfig | None = None, calibration: Calibration | None = None,
                  **changes) -> None:
        """Switch policy (same capacity: the slot buffers stay) and/or EngineConfig fields that do not change
        the buffers (max_in_flight, cache_mode, skip_copies, copy_delay, delay_seed, instrument)."""
        fixed = {"max_seq_len", "cuda_graphs", "backend", "attention", "moe", "tune",
                 "device_memory_limit"} & set(changes)
        if fixed:
            raise ValueError(f"{', '.join(sorted(fixed))} cannot change after the engine is built")
        if policy is not None or calibration is not None:
            policy = policy or self.policy
            self._check_policy(policy)
            if policy.capacity != self.policy.capacity:
                raise ValueError(f"capacity C={policy.capacity} differs from the engine's C={self.policy.capacity}: "
                                 "build another engine")
            self.policy, self.calibration = policy, calibration or self.calibration
            self.cache = LogicalCache(policy, self.calibration, self.num_layers, self.num_experts)
        if changes:
            self.config = replace(self.config, **changes)
            cp = self.copies
            cp.max_in_flight, cp.skip, cp.delay = self.config.max_in_flight, self.config.skip_copies, self.config.copy_delay
            cp.rng = np.random.default_rng(self.config.delay_seed)

    # -- set-up --------------------------------------------------------------------------------------
    def _load_warm(self) -> int:
        self.cache.reset()
        warm = np.stack([self.cache.resident(l) for l in range(self.num_layers)])
        return self.copies.reset_to(warm)

    def _prepare_cuda(self) -> None:
        """Tune and check the Triton kernels, warm up, capture the CUDA graphs and check them."""
        dec, c = self.decoder, self.decoder.cfg
        dec.route_np[:, : c.top_k] = np.arange(c.top_k)
        dec.weights_np[:] = 0.0
        dec.set_input(0, 0)
        if dec.backend == "triton":
            try:
                if self.config.tune and dec.fused_experts is None:  # vLLM's kernel runs the MoE otherwise
                    dec.moe_params, times = tune_moe(self.slots.layer(0), c.top_k, c.hidden, c.inter, dec.dtype)
                    self.notes.append(f"MoE kernel tuned: {dec.moe_params} (candidate ms: {times})")
                self._check_triton()
                self._warm_up()
            except Exception as exc:  # never let a kernel problem cost the run: fall back, and say so
                self.notes.append(f"Triton kernels unusable ({type(exc).__name__}: {exc}); torch fallback used")
                torch.cuda.synchronize()
                dec.backend, dec.moe_params = "torch", None
        if dec.backend != "triton":
            self._warm_up()
        if not self.config.cuda_graphs:
            dec.reset()
            return
        try:
            self.graphs = self._capture()
        except Exception as exc:  # e.g. a device-to-host copy this torch cannot capture: copy outside graphs
            self.notes.append(f"capture with in-graph device-to-host copies failed ({type(exc).__name__}: {exc}); "
                              "recaptured with the copies outside the graphs")
            torch.cuda.synchronize()
            dec.d2h_in_graph = False
            self.graphs = self._capture()
        graphs_a, _, graph_head = self.graphs
        # check that the captured device-to-host copies land (else copy outside the graphs)
        dec.logits_host.fill_(float("nan"))
        dec.next_token_host.fill_(-1)
        graphs_a[0].replay()
        graph_head.replay()
        torch.cuda.synchronize()
        ok = torch.equal(dec.logits_host[0], dec.logits_dev[0].cpu()) and \
            int(dec.next_token_host[0]) == int(dec.next_token[0])
        if not ok:
            dec.d2h_in_graph = False
            self.notes.append("device-to-host copies in captured graphs did not land; copied outside the graphs")
        dec.reset()

    def _capture(self):
        """CUDA graphs: A_l (attention, router, pre-gate) and B_l (MoE) per layer, and the head; one pool."""
        dec, num_layers = self.decoder, self.num_layers
        pool = torch.cuda.graph_pool_handle()

        def capture(fn):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.compute):
                fn()
            return graph

        graphs_a = [capture(lambda l=l: dec.attention_router(l, copy_out=dec.d2h_in_graph))
                    for l in range(num_layers)]
        graphs_b = [capture(lambda l=l: dec.moe(l, self.slots.layer(l))) for l in range(num_layers)]
        graph_head = capture(lambda: dec.head(copy_out=dec.d2h_in_graph))
        return graphs_a, graphs_b, graph_head

    def _check_triton(self) -> None:
        """Compare the Triton kernels with the torch path on this device (random inputs, layer 0's slots)."""
        from specmoe.kernels import moe as kmoe
        from specmoe.kernels import norm_rope as knr

        dec, c = self.decoder, self.decoder.cfg
        g = torch.Generator(device=self.device).manual_seed(0)
        x = torch.randn(c.hidden, device=self.device, generator=g).to(dec.dtype)
        res = torch.zeros(c.hidden, device=self.device, dtype=dec.dtype)  # compare the MoE output alone
        route = torch.zeros(2 * c.top_k, dtype=torch.int32, device=self.device)
        route[: c.top_k] = torch.arange(c.top_k, device=self.device, dtype=torch.int32)
        route[c.top_k:].view(torch.float32)[:] = torch.softmax(torch.randn(c.top_k, device=self.device,
                                                                           generator=g), 0)
        outs = []
        for fn in (kmoe.slot_moe_torch, lambda *a: kmoe.slot_moe_triton(*a, dec.moe_params)):
            out = torch.empty_like(res)
            fn(x, res, self.slots.layer(0), route, torch.empty_like(dec.act), out, c.hidden, c.inter)
            outs.append((out.float() - res.float()))
        torch.cuda.synchronize()
        err = _relative_error(outs[0], outs[1])
        if not err < 2e-2:
            raise RuntimeError(f"slot MoE kernel differs from the torch path: relative error {err:.3g}")
        w = dec.input_ln[0]
        a = knr.rmsnorm_torch(x, w, c.eps)
        b = knr.rmsnorm_triton(x, w, c.eps, torch.empty_like(x))
        err = _relative_error(a, b)
        if not err < 2e-2:
            raise RuntimeError(f"RMSNorm kernel differs from the torch path: relative error {err:.3g}")
        width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        qkv = torch.randn(width, device=self.device, generator=g).to(dec.dtype)
        pos = torch.tensor([3], device=self.device)
        outs = []
        for fn in (knr.qkv_prologue_torch, knr.qkv_prologue_triton):
            q = torch.zeros_like(dec.q)
            kc = torch.zeros(c.num_kv_heads, 8, c.head_dim, device=self.device, dtype=dec.dtype)
            vc = torch.zeros_like(kc)
            fn(qkv, dec.q_norm[0], dec.k_norm[0], dec.cos, dec.sin, pos, q, kc, vc, c.eps, c.clip_qkv)
            outs.append(torch.cat([q.flatten(), kc.flatten(), vc.flatten()]).float())
        err = _relative_error(outs[0], outs[1])
        if not err < 2e-2:
            raise RuntimeError(f"attention prologue kernel differs from the torch path: relative error {err:.3g}")
        self.notes.append(f"Triton kernels checked against torch on {torch.cuda.get_device_name(self.device)}")

    def _use_optional_kernels(self, flash_attn, fused_experts) -> None:
        """Check the optional kernels the config selects against the torch path on this device and hand those
        that agree to the decoder. Like the Triton kernels, one that fails or disagrees must not cost the run:
        the default path stays, and `notes` says why."""
        where = torch.cuda.get_device_name(self.device) if self.cuda else "the CPU"
        for fn, check, attr, name, default in (
                (flash_attn, self._check_flash_attn, "flash_attn", "flash-attn's flash_attn_with_kvcache", "SDPA"),
                (fused_experts, self._check_fused_experts, "fused_experts", "vLLM's fused_experts",
                 "the slot MoE kernel")):
            if fn is None:
                continue
            try:
                check(fn)
            except Exception as exc:  # an assertion, a CUDA error, a wrong result: all mean "do not use it"
                if self.cuda:
                    torch.cuda.synchronize()
                self.notes.append(f"{name} unusable ({type(exc).__name__}: {exc}); {default} used")
                continue
            setattr(self.decoder, attr, fn)
            self.notes.append(f"{name} checked against torch on {where}; used")

    def _check_flash_attn(self, flash_attn) -> None:
        """flash_attn_with_kvcache against SDPA: random query and caches of the decoder's shapes, the first
        two thirds of the positions attended."""
        from specmoe.kernels import decode_attention, decode_attention_flash

        dec, c = self.decoder, self.decoder.cfg
        g = torch.Generator(device=self.device).manual_seed(1)
        q = torch.randn(c.num_heads, c.head_dim, device=self.device, generator=g).to(dec.dtype)
        k_cache, v_cache = (torch.randn(c.num_kv_heads, dec.max_seq_len, c.head_dim, device=self.device,
                                        generator=g).to(dec.dtype) for _ in range(2))
        attended = 2 * dec.max_seq_len // 3 + 1
        mask = torch.full_like(dec.mask, torch.finfo(dec.dtype).min)
        mask[:attended] = 0.0
        seqlens = torch.full((1,), attended, dtype=torch.int32, device=self.device)
        ref = decode_attention(q, k_cache, v_cache, mask, dec.scale)
        out = decode_attention_flash(q, k_cache, v_cache, seqlens, dec.scale, flash_attn)
        err = _relative_error(ref, out)
        if not err < 2e-2:
            raise RuntimeError(f"flash_attn_with_kvcache differs from SDPA: relative error {err:.3g}")

    def _check_fused_experts(self, fused_experts) -> None:
        """vLLM's fused_experts against the torch slot MoE: random input, K random slots of layer 0."""
        from specmoe.kernels import slot_moe_torch, slot_moe_vllm

        dec, c = self.decoder, self.decoder.cfg
        g = torch.Generator(device=self.device).manual_seed(2)
        x = torch.randn(c.hidden, device=self.device, generator=g).to(dec.dtype)
        res = torch.zeros(c.hidden, device=self.device, dtype=dec.dtype)  # compare the MoE output alone
        route = torch.zeros(2 * c.top_k, dtype=torch.int32, device=self.device)
        route[: c.top_k] = torch.randperm(self.policy.capacity, device=self.device, generator=g)[: c.top_k]
        route[c.top_k:].view(torch.float32)[:] = torch.softmax(torch.randn(c.top_k, device=self.device,
                                                                           generator=g), 0)
        ref, out = torch.empty_like(res), torch.empty_like(res)
        slot_moe_torch(x, res, self.slots.layer(0), route, torch.empty_like(dec.act), ref, c.hidden, c.inter)
        slot_moe_vllm(x, res, self.slots.layer(0), route, out, c.hidden, c.inter, fused_experts)
        err = _relative_error(ref, out)
        if not err < 2e-2:
            raise RuntimeError(f"fused_experts differs from the torch slot MoE: relative error {err:.3g}")

    def _warm_up(self) -> None:
        """Two eager tokens (compiles kernels, creates cuBLAS handles) on the compute stream."""
        dec = self.decoder
        for _ in range(2):
            for l in range(self.num_layers):
                dec.attention_router(l)
                dec.moe(l, self.slots.layer(l))
            dec.head()
        torch.cuda.synchronize()

    # -- launches (graphs on CUDA, eager calls on the CPU) ---------------------------------------------
    def _attention(self, layer: int) -> None:
        dec = self.decoder
        if self.graphs is not None:
            self.graphs[0][layer].replay()
            if not dec.d2h_in_graph:
                dec.copy_out_attention(layer)
        else:
            dec.attention_router(layer)
        if self.cuda:
            self.ev_attn[layer].record(self.compute)

    def _moe(self, layer: int) -> None:
        if self.graphs is not None:
            self.graphs[1][layer].replay()
        else:
            self.decoder.moe(layer, self.slots.layer(layer))

    def _head(self) -> None:
        dec = self.decoder
        if self.graphs is not None:
            self.graphs[2].replay()
            if not dec.d2h_in_graph:
                dec.copy_out_head()
        else:
            dec.head()
        if self.cuda:
            self.ev_head.record(self.compute)

    # -- one token -----------------------------------------------------------------------------------
    def _step(self, t: int, token: int, rec: dict, trace: Trace | None) -> None:
        dec, cache, copies = self.decoder, self.cache, self.copies
        num_layers = self.num_layers
        physical = self.config.cache_mode == "physical"
        inserts = self.policy.insert_budget > 0
        inst = rec.get("events")
        stats_before = copies.stats.as_array()
        wait_before = copies.wait_s
        ns_route = ns_issue = ns_check = 0  # host ns: routing, demand-copy issue, copy checks and waits set up
        dec.set_input(token, t)
        start = time.perf_counter()
        self._attention(0)
        if inst is not None:
            inst[t][0][0].record(self.compute)
        z_rec, sel_rec = rec["z"][t], rec["sel"][t]
        for l in range(num_layers):
            if self.cuda:
                self.ev_attn[l].synchronize()
            t0 = time.perf_counter_ns()
            z = self._router_rows[l] if trace is None else trace.router_logits[t, l]
            slots = self._route_slots[l]
            d = cache.route(l, z, token, self.scoring, z_rec[l], sel_rec[l], slots, self._route_weights[l])
            t1 = time.perf_counter_ns()
            if d:
                copies.assign(l, cache.demand_slots[:d], cache.demand[:d], prefetch=False)
            t2 = time.perf_counter_ns()
            wait_for = copies.need(l, slots)
            if inst is not None:
                inst[t][l][1].record(self.compute)
            copies.wait(l, wait_for, self.compute if self.cuda else None)
            if inst is not None:
                inst[t][l][2].record(self.compute)
            t3 = time.perf_counter_ns()
            self._moe(l)
            ns_route, ns_issue, ns_check = ns_route + t1 - t0, ns_issue + t2 - t1, ns_check + t3 - t2
            if l + 1 < num_layers:
                self._attention(l + 1)
                if inst is not None:
                    inst[t][l + 1][0].record(self.compute)
                g = self._pregate_rows[l] if trace is None else trace.pregate_logits[t, l + 1]
                rec["g"][t, l + 1] = g
                if inserts:
                    self._part1(l + 1, g, token, physical)
            else:
                self._head()
            copies.pump()
        if self.cuda:
            self.ev_head.synchronize()
        rec["ms"][t] = (time.perf_counter() - start) * 1e3
        rec["host_us"][t] = (ns_route + ns_issue + ns_check) / 1e3
        rec["host_parts_us"][t] = (ns_route / 1e3, ns_issue / 1e3, ns_check / 1e3)
        rec["copies"][t] = copies.stats.as_array() - stats_before
        rec["wait_ms"][t] = (copies.wait_s - wait_before) * 1e3
        rec["out"][t] = int(dec.next_token_np[0])

    def _part1(self, layer: int, pregate: np.ndarray, token: int, physical: bool) -> None:
        # physical-cache mode: insert only what can be copied at once, so that routing sees issued copies
        budget = max(self.config.max_in_flight - self.copies.in_flight(), 0) if physical else None
        # float32 as recorded: part 1 only ranks g, and float32 -> float64 keeps every order and tie
        inserted = self.cache.insert_predicted(layer, pregate, token, budget=budget)
        if inserted.size:
            self.copies.assign(layer, self.cache.slot_of(layer, inserted), inserted, prefetch=True,
                               issue_now=physical)

    # -- runs ----------------------------------------------------------------------------------------
    def reset(self) -> int:
        """A new sequence: logical cache to the warm set, warm experts copied (waited for), empty KV cache.
        Returns the number of warm copies (part of prompt processing, never timed)."""
        with torch.no_grad():
            copies = self._load_warm()
            self.decoder.reset()
            if self.cuda:
                torch.cuda.synchronize()
        return copies

    def _run(self, tokens_in, num_steps: int, timed_from: int, trace: Trace | None, return_logits: bool,
             stop_tokens=(), feed_outputs_from: int | None = None) -> DecodeResult:
        c = self.decoder.cfg
        if num_steps > self.decoder.max_seq_len:
            raise ValueError(f"{num_steps} positions do not fit the static KV cache of {self.decoder.max_seq_len} "
                             "(EngineConfig.max_seq_len)")
        stops = set(int(s) for s in stop_tokens)
        if trace is not None:
            if trace.tokens is not None:  # the traced run's tokens and length
                num_steps, stops = min(num_steps, len(trace.tokens)), set()
            trace.check(num_steps, c.num_layers, c.num_experts)
        rec = {"z": np.zeros((num_steps, c.num_layers, c.num_experts), np.float32),
               "g": np.zeros((num_steps, c.num_layers, c.num_experts), np.float32),
               "sel": np.zeros((num_steps, c.num_layers, c.top_k), np.int64),
               "ms": np.zeros(num_steps), "host_us": np.zeros(num_steps),
               "host_parts_us": np.zeros((num_steps, 3)),
               "copies": np.zeros((num_steps, len(COPY_FIELDS)), np.int64), "wait_ms": np.zeros(num_steps),
               "out": np.zeros(num_steps, np.int64)}
        instrument = self.config.instrument and self.cuda
        if instrument:
            rec["events"] = [[[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(c.num_layers)]
                             for _ in range(num_steps)]
        logits = np.zeros((num_steps, c.vocab_size), np.float32) if return_logits else None
        inputs = np.zeros(num_steps, np.int64)
        warm = self.reset()
        steps = 0
        with torch.no_grad(), (torch.cuda.stream(self.compute) if self.cuda else contextlib.nullcontext()):
            for t in range(num_steps):
                if trace is not None and trace.tokens is not None:
                    token = int(trace.tokens[t])
                elif feed_outputs_from is None or t < feed_outputs_from:
                    token = int(tokens_in[t])
                else:
                    token = int(rec["out"][t - 1])
                inputs[t] = token
                self._step(t, token, rec, trace)
                steps = t + 1
                if logits is not None:
                    logits[t] = self.decoder.out_logits.float().cpu().numpy()
                if feed_outputs_from is not None and t + 1 >= feed_outputs_from and int(rec["out"][t]) in stops:
                    break
        n = steps
        timed = np.arange(n) >= timed_from
        result = DecodeResult(inputs[:n], rec["out"][:n].copy(), rec["sel"][:n], rec["z"][:n], rec["g"][:n], timed,
                              rec["ms"][:n], rec["host_us"][:n], rec["copies"][:n],
                              None if self.cuda else rec["wait_ms"][:n],  # GPU waits: instrumented runs only
                              logits=None if logits is None else logits[:n],
                              unused_at_end=int(self.copies.fresh.sum()), host_parts_us=rec["host_parts_us"][:n])
        if instrument:
            torch.cuda.synchronize()
            ev = rec["events"]
            gap = np.zeros((n, c.num_layers))
            wait = np.zeros((n, c.num_layers))
            for t in range(n):
                for l in range(c.num_layers):
                    gap[t, l] = ev[t][l][0].elapsed_time(ev[t][l][2]) * 1e3
                    wait[t, l] = ev[t][l][1].elapsed_time(ev[t][l][2]) * 1e3
            result.gap_us, result.wait_us = gap, wait
            result.wait_ms = None
        result.info = {"policy": self.policy.name, "warm_copies": warm, "backend": self.decoder.backend,
                       "attention": "sdpa" if self.decoder.flash_attn is None else "flash_attn",
                       "moe": "slot" if self.decoder.fused_experts is None else "vllm",
                       "cuda_graphs": self.graphs is not None, "cache_mode": self.config.cache_mode,
                       "max_in_flight": self.config.max_in_flight, "skip_copies": self.config.skip_copies,
                       "trace": trace is not None, "notes": list(self.notes)}
        return result

    def teacher_forced(self, tokens, prompt_len: int = 0, trace: Trace | None = None,
                       return_logits: bool = False) -> DecodeResult:
        """Decode `tokens` [T] token by token, feeding the given tokens; steps before `prompt_len` are prompt
        processing (not timed). output_tokens[t] is the greedy prediction after tokens[:t+1]."""
        tokens = np.asarray(tokens, dtype=np.int64)
        return self._run(tokens, len(tokens), prompt_len, trace, return_logits)

    def generate(self, prompt, max_new_tokens: int, stop_tokens=(), trace: Trace | None = None,
                 return_logits: bool = False) -> DecodeResult:
        """Greedy generation: the prompt is decoded token by token (not timed), then each step feeds the
        previous greedy token. Stops after max_new_tokens generated tokens or at a stop token (kept). The
        timed steps are those that consume a generated token; `generated` lists the new tokens."""
        prompt = np.asarray(prompt, dtype=np.int64)
        if prompt.size == 0 or max_new_tokens < 1:
            raise ValueError("generate needs a non-empty prompt and max_new_tokens >= 1")
        num_steps = prompt.size + max_new_tokens - 1
        result = self._run(prompt, num_steps, prompt.size, trace, return_logits, stop_tokens,
                           feed_outputs_from=prompt.size)
        result.generated = result.output_tokens[prompt.size - 1:].tolist()
        return result


def build_engine(model, policy: PolicyConfig, calibration: Calibration, config: EngineConfig = EngineConfig(), *,
                 adapter=None, store: ExpertStore | None = None, host_memory_limit: int | None = None) -> ArEngine:
    """An ArEngine for a transformers OLMoE model: decoder weights taken from the model (on its device and
    dtype), experts copied into a new pinned ExpertStore unless `store` is given (share one between engines)."""
    from specmoe.models.olmoe_decode import OlmoeDecoder

    if store is None:
        store = ExpertStore.from_model(model, adapter, host_memory_limit=host_memory_limit)
    decoder = OlmoeDecoder.from_hf(model, config.max_seq_len)
    return ArEngine(decoder, store, policy, calibration, config)


def build_engine_from_checkpoint(path, policy: PolicyConfig, calibration: Calibration,
                                 config: EngineConfig = EngineConfig(), *, device="cpu",
                                 dtype: torch.dtype = torch.bfloat16, host_memory_limit: int | None = None) -> ArEngine:
    """An ArEngine read from a local checkpoint directory without instantiating the transformers model: the
    experts go straight into the pinned store, the other weights to the device."""
    from transformers import AutoConfig

    from specmoe.models import adapter_for
    from specmoe.models.olmoe_decode import OlmoeDecoder
    from specmoe.offload import ExpertGeometry

    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    geometry = ExpertGeometry.of(adapter_for(hf_config))
    store = ExpertStore.from_checkpoint(path, geometry, dtype=dtype, host_memory_limit=host_memory_limit)
    decoder = OlmoeDecoder.from_checkpoint(path, config.max_seq_len, device, dtype)
    return ArEngine(decoder, store, policy, calibration, config)
