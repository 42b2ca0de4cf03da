"""The device policy: an autoregressive token with the logical cache on the device and its copies issued by the
device, one CUDA graph per token, no host round trip per layer (`EngineConfig.policy_device`).

Per layer l the token runs, on the compute stream: attention, router and pre-gate (`Decoder.attention_router`);
the fork of layer l + 1's branch; the join of layer l's (below: the route may evict a prefetched slot and
demand-copy into it); `DeviceCache.step` routing l over the logical cache (the host `LogicalCache`'s decisions bit
for bit, `kernels.device_cache`), writing the selection and the route row straight into the step's rows; the
demand copy kernel (`kernels.expert_copy`: the demand list's experts from the pinned store into layer l's slots);
and the MoE over the route row. Layer l + 1's branch (`PrefetchBranch`), forked once the pre-gate logits exist
and joined at layer l + 1 (an event recorded right after its copies), runs part 1 of l + 1 (its insertions of
predicted experts, `DeviceCache.step` on the pre-gate, into layer l + 1's own list) and then the prefetch copy
kernel of l + 1 on a side stream, so both overlap the route, demand copy and MoE of l and the attention of
l + 1. Part 1 of l + 1 and the route of l touch disjoint state (each layer's rows, counters and lists), so running
them side by side makes the decisions of the host's order (route l, then part 1 of l + 1).
Then the head, and one device-to-host copy of the logits, selections, next token and the copy counters.

With a logit feed (trace-following, `LogitFeed`) the token's routing reads the feed, not the model's router: the
host writes the position's feed rows into a pinned staging buffer [L, 2E] laid out as the step's logits (row l:
the router logits z_l, then the pre-gate logits g_{l+1}; a feed's pre-gate row of layer 0 is never read, as on
the host path, which runs no part 1 for layer 0), and the token's first operation, on the compute stream and
captured in its graph, copies it to a static device buffer in one host-to-device copy; each layer's cache step
reads that buffer's row instead of the router GEMM's output (the model's router GEMM still runs, its output
unused). The device cache routes by the rule the host path applies to the feed (`CacheRouter.feed_rule`: a
trace's own rule, its selection bias and execution weights; the model's for a softmax trace with its groups),
so one `DevicePolicy` is kept per rule. The MoE reads the route row as always.

The host reads the records after the token (`DevicePolicy.token`), as the whole-step path does with every
expert resident. Copy accounting keeps the host path's classes (`CopyStats`), from the device cache's counters:
demand and prefetch insertions are the counters' own; a prefetch is "unused" when evicted (or left at the end)
without executing, as on the host; every other prefetch that executes is "in time", because its branch is
joined before its layer's cache step, so before its MoE; none is late, and none is dropped (every listed
prefetch is copied at once; the host path queues prefetches behind `max_in_flight` and drops those reassigned
before they were issued, so its `issued` and `dropped` can differ from this path's, never its decisions).

Not on this path (the engine keeps the host loop for them, `device_policy_reason`): the CPU (unless Triton's
interpreter runs the kernels: tests), the physical-cache mode (routing reads copy timing), instrumented runs,
and prompt chunks: this path steps the prompt one position at a time (the decisions are the same; only prompt
time differs).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

from specmoe.kernels.expert_copy import launch_copy, launch_shape, word_view
from specmoe.routing import LogicalCache
from specmoe.routing import kernels as K

POLICY_DEVICE = ("auto", "on", "off")
# "auto" runs the device policy where the H200 measured it faster than the host policy (BENCHMARKS.md): policies
# without prefetch insertions, at every E (Cache-Prior at C = 32 of OLMoE's 64 experts: host / device 1.06-1.08;
# at C = 64 of Qwen3.6's 256, 40 layers: 1.31). A prefetching policy's copies move at the copy kernel's rate on the
# device path and at the copy engine's on the host path, which made PSR slower on the device: host / device 0.89
# at OLMoE's size, 0.66 at Qwen3.6's.
SEPARATE_COPIER_ENV = "SPECMOE_PREFETCH_COPIER"  # "1": prefetch copies on a stream of their own (`PrefetchBranch`)
_STATE = ("istate", "iscalar", "fstate", "fscalar", "counters", "displaced_mass")


def kernels_reason(option: str, choice: str, cuda: bool) -> str | None:
    """None if a device path chosen by `choice` ("auto" / "on" / "off") of the EngineConfig field `option` can run
    its kernels here, else why the host path runs: "off"; "auto" on the CPU; the CPU without Triton's interpreter
    (TRITON_INTERPRET=1, for tests); no Triton."""
    if choice == "off":
        return f"{option}='off'"
    if not cuda and choice == "auto":
        return f"{option}='auto' on the CPU: the host path"
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return f"{option}: the device path's kernels need CUDA, or Triton's interpreter (TRITON_INTERPRET=1) on the CPU"
    try:
        import triton  # noqa: F401
    except ImportError:
        return f"{option}: the device path needs Triton"
    return None


def device_policy_reason(choice: str, cuda: bool, router, settings, feed, num_slots: int,
                         chunked_prompt: bool = False) -> str | None:
    """None if an autoregressive run with this `router` (a `CacheRouter`) on a unit of `num_slots` slots, routing
    from `feed` (a `LogitFeed`, or None: the model's own logits), runs the device policy, else why the host policy
    runs. choice: `EngineConfig.policy_device`; "auto" leaves a run that device routing takes (every expert
    resident, a policy that then reduces to the router's own top-K, no feed) to `EngineConfig.device_routing`,
    and keeps the host policy for prefetching policies and for a run with a prompt that the host path prefills in
    chunks (`chunked_prompt`: this path steps a prompt one position at a time, which costs more than its faster
    decoding saves unless the generation is long)."""
    if router is None:
        return "no autoregressive policy"
    if choice == "auto" and feed is None and router.device_reason(num_slots) is None:
        return "every expert resident and the router's own top-K: device_routing decides"
    why = kernels_reason("policy_device", choice, cuda)
    if why is not None:
        return why
    if choice == "auto":
        if router.inserts:
            return ("policy_device='auto' and a policy with prefetch insertions: their copies are faster on the host "
                    "path's copy engine than on the device path's copy kernel (policy_device='on' runs it there)")
        if chunked_prompt:
            return ("policy_device='auto' and a prompt that the host path prefills in chunks (the device policy "
                    "steps it one position at a time; policy_device='on' runs it there)")
    if settings.cache_mode == "physical":
        return "physical-cache mode reads copy timing on the host"
    if settings.instrument:
        return "instrumented runs time each layer's host gap"
    return None


def copy_views(residency, num_layers: int) -> tuple[list, list]:
    """The copy kernel's word views (`expert_copy.word_view`) of each layer's store rows and slot rows; the bytes
    of both where the two views' words differ (different alignments)."""
    store, slots = residency.store, residency.slots
    src = [word_view(store.layers[layer]) for layer in range(num_layers)]
    dst = [word_view(slots.data[layer]) for layer in range(num_layers)]
    if any(s.dtype != d.dtype for s, d in zip(src, dst)):
        src, dst = [s.view(torch.uint8) for s in src], [d.view(torch.uint8) for d in dst]
    return src, dst


def copy_delays(settings, launches: int, cuda: bool) -> np.ndarray | None:
    """A fixed delay in GPU cycles before each of a step's `launches` copy launches, drawn from
    `RunSettings.delay_seed` when `copy_delay` is set (timing-independence tests; CUDA only), else None."""
    from specmoe.offload.copies import CYCLES_PER_SECOND

    if settings.copy_delay is None or not cuda:
        return None
    rng = np.random.default_rng(settings.delay_seed)
    return (rng.uniform(*settings.copy_delay, launches) * CYCLES_PER_SECOND).astype(np.int64)


def delayed_copy(src: torch.Tensor, dst: torch.Tensor, listing: torch.Tensor, delays, which: int, cuda: bool,
                 blocks: int, block: int) -> None:
    """The copy kernel on `listing` (`launch_copy`), after launch `which`'s delay where delays are set."""
    if delays is not None and cuda:
        torch.cuda._sleep(int(delays[which]))
    launch_copy(src, dst, listing, blocks, block)


class PrefetchBranch:
    """Layer l + 1's prefetch beside layer l on the side of a device path (`DevicePolicy`, `DeviceBlocks`): its
    decision (part 1, the block prediction) forked once layer l's attention has written the pre-gate logits, then
    its copies; layer l + 1 joins `landed[l + 1]`, recorded right after its copies (so it waits for its own
    copies, not for the next layer's decision or copies queued behind them), before its route or selection.

    separate_copier: the copies run on a stream of their own (`copier`), after their decision and the previous
    layer's copies, so the decision of l + 1 runs while layer l's copies move; else (the default) decision and
    copies share one side stream, so each decision waits for the copies before it. Measured on the H200
    (BENCHMARKS.md, 2026-12-03): with the separate copy stream the AR device PSR token was 4% slower (4.45 against
    4.27 ms) and a verification block with the block prefetch 7% (1.302 against 1.219 ms per committed token), so
    it is an option for A/B runs on other machines (`SEPARATE_COPIER_ENV`=1). Each layer's list must be its own
    with it (the next decision may run before this layer's copy kernel has read its list)."""

    def __init__(self, device, num_layers: int, separate_copier: bool | None = None):
        if separate_copier is None:
            separate_copier = os.environ.get(SEPARATE_COPIER_ENV, "0") not in ("", "0")
        self.separate_copier = separate_copier
        self.decide = torch.cuda.Stream(device=device)
        self.copier = torch.cuda.Stream(device=device) if separate_copier else self.decide
        self.landed = [torch.cuda.Event() for _ in range(num_layers)]

    @contextlib.contextmanager
    def deciding(self, compute):
        """Run the next layer's decision on `decide`, after what `compute` has queued (the layer's attention)."""
        self.decide.wait_stream(compute)
        with torch.cuda.stream(self.decide):
            yield

    @contextlib.contextmanager
    def copying(self, layer: int):
        """Run `layer`'s prefetch copies on `copier`, after its decision; `landed[layer]` marks their end (and the
        decision's, with copies skipped)."""
        if self.separate_copier:
            self.copier.wait_stream(self.decide)
        with torch.cuda.stream(self.copier):
            yield
        self.landed[layer].record(self.copier)

    def join(self, compute, layer: int) -> None:
        """`compute` waits for `layer`'s decision and copies (before the layer's route)."""
        compute.wait_event(self.landed[layer])

    def close(self, compute) -> None:
        """`compute` joins the side streams (the end of a captured graph)."""
        compute.wait_stream(self.decide)
        if self.separate_copier:
            compute.wait_stream(self.copier)


def staged(shape, dtype, device, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A host buffer (pinned on CUDA) that the host writes before a launch, and its device copy, which the
    step's graph fills first (one host-to-device copy on the compute stream)."""
    return torch.zeros(shape, dtype=dtype, pin_memory=pin), torch.zeros(shape, dtype=dtype, device=device)


def path_state(path, decoder, step, residency, router, stream, cuda_graphs: bool, copy_in_graph: bool,
               blocks: int | None, block: int | None) -> None:
    """The state a device path (`DevicePolicy`, `DeviceBlocks`) keeps whatever it decides: its model and unit, its
    stream (None off CUDA), the copy launches' word views and shape (`blocks` x `block` words, default the
    device's `launch_shape`), and what `captured` and `launch` read: its graphs by copy setting and input, whether
    it uses them, and the run's settings (copies skipped, delays, a feed), which `start` sets."""
    g = decoder.geometry
    path.decoder, path.step, path.residency, path.router = decoder, step, residency, router
    path.stream, path.cuda = stream, stream is not None
    path.num_layers, path.num_experts, path.top_k = g.num_layers, g.num_experts, g.top_k
    path.src, path.dst = copy_views(residency, g.num_layers)
    shape = launch_shape(residency.device, path.src[0].shape[1])  # the copy launches' (`kernels.expert_copy`)
    path.blocks, path.block = blocks or shape[0], block or shape[1]
    path.copy_in_graph = copy_in_graph
    path.graphs = {}
    path.use_graphs = path.cuda and cuda_graphs
    path.skip, path.delays, path.fed = False, None, False


def captured(path):
    """The CUDA graph of a device path (`DevicePolicy`, `DeviceBlocks`) for its run's copy settings and input
    (skip, delays, fed): its `_body`, captured on its stream at their first use and kept in its `graphs`."""
    key = (path.skip, None if path.delays is None else tuple(path.delays), path.fed)
    if key not in path.graphs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=path.stream):
            path._body(path.skip, path.delays, path.copy_in_graph, path.fed)
        path.graphs[key] = graph
    return path.graphs[key]


def launch(path) -> None:
    """One step of a device path (`DevicePolicy`, `DeviceBlocks`) for its run's settings: its captured graph (and
    the copy-out where the graph does not hold it) or, without graphs, its body run eagerly; then the host waits
    for it."""
    if path.use_graphs:
        captured(path).replay()
        if not path.copy_in_graph:
            path._copy_out()
    else:
        path._body(path.skip, path.delays, copy_out=True, fed=path.fed)
    if path.cuda:
        path.ev_done.record(path.stream)
        path.ev_done.synchronize()


class DevicePolicy:
    """The device policy of one `CacheRouter` over one decoder step of D = 1 (module docstring): the device cache,
    the word views of the store and the slots, the feed's staging and device buffers, and one captured graph per
    copy setting (copies skipped or not, delays) and input (the model's router or a feed), kept in a dict. scoring:
    the rule routing applies (`CacheRouter.feed_rule`; default the model's). Build it before a request (its
    warm-up writes the KV rows of position 0)."""

    branch = True  # layer l + 1's part 1 and prefetch copies on the side (False: in line, on the compute stream)

    def __init__(self, decoder, step, residency, router, stream, cuda_graphs: bool = True,
                 copy_in_graph: bool = True, blocks: int | None = None, block: int | None = None, scoring=None):
        from specmoe.kernels.device_cache import DeviceCache

        g = decoder.geometry
        path_state(self, decoder, step, residency, router, stream, cuda_graphs, copy_in_graph, blocks, block)
        self.capacity = router.policy.capacity
        self.scoring = decoder.scoring if scoring is None else scoring
        host = LogicalCache(router.policy, router.calibration, g.num_layers, g.num_experts,
                            groups=self.scoring.groups)
        host.reset()  # the state a run starts from (`reset` on the device gives it again)
        self.cache = DeviceCache(host, self.scoring, residency.device)
        self.inserts = router.policy.insert_budget > 0
        device, pin = residency.device, self.cuda
        # a feed's rows of the position, laid out as the step's logits [L, 2E] (module docstring)
        self.feed_host, self.feed_dev = staged((g.num_layers, 2 * g.num_experts), torch.float32, device, pin)
        self.feed_np = self.feed_host.numpy()
        self.experts_dev = torch.zeros(g.num_layers, g.top_k, dtype=torch.int64, device=device)
        # each layer's part-1 list (count, experts, slots), its own: the next layer's part 1 may run before this
        # layer's copy kernel has read it (`PrefetchBranch`)
        self.prefetches = torch.zeros(g.num_layers, *self.cache.prefetch.shape, dtype=torch.int64, device=device)
        self.experts_host = torch.zeros(self.experts_dev.shape, dtype=torch.int64, pin_memory=pin)
        n = g.num_layers * K.N_COUNTERS
        self.records_dev = torch.zeros(n + 1, dtype=torch.int64, device=device)  # counters, then prefetches pending
        self.records_host = torch.zeros(n + 1, dtype=torch.int64, pin_memory=pin)
        self._last = np.zeros(K.N_COUNTERS + 1, np.int64)
        if self.cuda:
            self.branches = PrefetchBranch(device, g.num_layers)
            self.ev_done = torch.cuda.Event()
            with torch.no_grad(), torch.cuda.stream(stream):
                self._warm_up()

    # -- the token ---------------------------------------------------------------------------------------
    def _body(self, skip: bool, delays, copy_out: bool, fed: bool = False) -> None:
        """Every layer (module docstring), the head, the records; copied to the host at the end (copy_out). fed:
        routing reads the feed's rows (staged in `feed_host` before the launch), not the router's output."""
        dec, step, cache, e, last = self.decoder, self.step, self.cache, self.num_experts, self.num_layers - 1
        token = step.input_dev[:1]
        if fed:
            self.feed_dev.copy_(self.feed_host, non_blocking=True)
        branch = self.branches if self.cuda and self.branch else None
        for layer in range(self.num_layers):
            dec.attention_router(step, layer, copy_out=False)
            logits = self.feed_dev[layer] if fed else step.logits_dev[layer, 0]
            if self.inserts and layer < last:  # the next layer's branch, beside this layer's route and MoE
                with branch.deciding(self.stream) if branch else contextlib.nullcontext():
                    cache.step(token, layer + 1, pregate_logits=logits[e:], prefetch_out=self.prefetches[layer + 1])
                with branch.copying(layer + 1) if branch else contextlib.nullcontext():
                    if not skip:
                        self._copy(layer + 1, self.prefetches[layer + 1], delays, 2 * layer + 1)
            if branch and self.inserts and layer > 0:
                branch.join(self.stream, layer)  # part 1 and prefetch copies of this layer, forked at the last
            cache.step(token, layer, logits[:e], None, self.experts_dev[layer], step.route_dev[layer, 0])
            if not skip:
                self._copy(layer, cache.demand, delays, 2 * layer)
            dec.moe(step, layer, self.residency.slots.layer(layer), copy_in=False)
        if branch and self.inserts:
            branch.close(self.stream)
        dec.head(step, copy_out=False)
        n = self.num_layers * K.N_COUNTERS
        self.records_dev[:n].copy_(cache.counters.view(-1))
        self.records_dev[n:].copy_((cache.istate[:, K.PREFETCHED] >= 0).sum().view(1))
        if copy_out:
            self._copy_out()

    def _copy(self, layer: int, listing: torch.Tensor, delays, which: int) -> None:
        delayed_copy(self.src[layer], self.dst[layer], listing, delays, which, self.cuda, self.blocks, self.block)

    def _copy_out(self) -> None:
        step = self.step
        step.logits_host.copy_(step.logits_dev, non_blocking=True)
        self.experts_host.copy_(self.experts_dev, non_blocking=True)
        self.records_host.copy_(self.records_dev, non_blocking=True)
        step.copy_out_next()

    def _warm_up(self) -> None:
        """Compile every kernel (two eager passes of the token without copies, the second reading the feed buffer,
        and each copy kernel on an empty list) on a neutral input, then put the device cache's state back."""
        saved = {name: getattr(self.cache, name).clone() for name in _STATE}
        self.step.set_input([0], 0, self.decoder.geometry.max_seq_len)
        for fed in (False, True):
            self._body(skip=True, delays=None, copy_out=True, fed=fed)
        for listing in (self.cache.demand, self.cache.prefetch):
            empty = torch.zeros_like(listing)
            launch_copy(self.src[0], self.dst[0], empty, self.blocks, self.block)
        for name, value in saved.items():
            getattr(self.cache, name).copy_(value)
        torch.cuda.synchronize()

    # -- a run ---------------------------------------------------------------------------------------------
    def start(self, settings, fed: bool = False) -> None:
        """A new request (after the engine's `_start`: the slots hold the warm set): the device cache at the warm
        set; the run's copy settings (skip_copies; copy_delay draws a fixed delay per copy launch from
        delay_seed, on CUDA only); fed: routing reads a logit feed (`token`'s feed)."""
        self.cache.reset()
        self.skip, self.fed = settings.skip_copies, fed
        self.delays = copy_delays(settings, 2 * self.num_layers, self.cuda)
        self._last = self._totals(self.cache.counters.cpu().numpy().reshape(-1),
                                  int((self.cache.istate[:, K.PREFETCHED] >= 0).sum()))
        if self.use_graphs:  # captured here, not in the run's first step
            with torch.no_grad():
                captured(self)

    def _totals(self, counters: np.ndarray, pending: int) -> np.ndarray:
        return np.append(counters.reshape(self.num_layers, K.N_COUNTERS).sum(axis=0), pending)

    def token(self, t: int, token: int, position: int, rec, feed=None) -> None:
        """Step t: one token at `position` in one launch, routed from row t of `feed` (a `LogitFeed`; the run
        must have started with fed=True) or the model's router; then its records (`rec.begin` / `end`, the routing
        it saw) and its copies added to the copy stream's counters by class (module docstring)."""
        step, e = self.step, self.num_experts
        if (feed is not None) != self.fed:
            raise ValueError("a run's tokens are all fed or none (DevicePolicy.start's fed)")
        step.set_input((token,), position, self.decoder.geometry.max_seq_len)
        if feed is not None:  # the previous token has ended (waited for below): its graph no longer reads these
            self.feed_np[:, :e] = feed.router_logits[t]
            self.feed_np[:-1, e:] = feed.pregate_logits[t, 1:]
        rec.begin(t, token, position)
        launch(self)
        self._count(self.residency.copies.stats)
        rec.end(t, int(step.next_np[0]))
        routed = self.feed_np if self.fed else step.logits_np[:, 0]
        rec.position_routing(t, routed[:, None], self.experts_host.numpy()[:, None])

    def _count(self, stats) -> None:
        n = self.num_layers * K.N_COUNTERS
        now = self._totals(self.records_host.numpy()[:n], int(self.records_host[n]))
        d = now - self._last
        self._last = now
        demand, prefetch, unused, pending = (int(d[K.C_DEMAND]), int(d[K.C_PREFETCH]), int(d[K.C_UNUSED]),
                                             int(d[-1]))
        stats.demand += demand
        stats.prefetch += prefetch
        stats.prefetch_unused += unused
        stats.prefetch_in_time += prefetch - unused - pending  # executed for the first time this token
        if self.skip:
            stats.skipped += demand + prefetch
        else:
            stats.issued += demand + prefetch

    def finish(self) -> None:
        """After the run: the host's view made the device's again: the router's `LogicalCache` takes the device
        cache's state, and the copy stream's slot bookkeeping (what each slot holds, which slots hold unexecuted
        prefetches) follows the slots the device wrote, so that the next run's warm set and unused count are
        right on either path."""
        state = self.cache.state()
        host = self.router.cache
        for name in _STATE:
            getattr(host, name)[...] = state[name]
        copies, c = self.residency.copies, self.capacity
        held = state["istate"][:, K.SLOT_EXPERT, :c]
        prefetched = np.take_along_axis(state["istate"][:, K.PREFETCHED], np.maximum(held, 0), axis=1)
        copies.synchronize()
        copies.owner[:, :c] = held
        copies.content[:, :c] = held
        copies.fresh[:, :c] = (held >= 0) & (prefetched >= 0)
        copies.queued[:] = False
        copies.batch[:] = 0
        copies.pending[:] = copies.fresh.any(axis=1)
