"""Launching a decoder's step functions for one static number of positions D: CUDA graphs on a GPU (one
per layer for attention + router + pre-gate, one per layer for the MoE, one for the head, in one memory
pool), eager calls on the CPU. Engines drive it layer by layer and run routing between the launches.

With `resident_scoring` (every expert resident, routing reduced to the router's own top-K: see
`specmoe.kernels.device_routing`), the runner also holds the whole step as one launch (`whole_step`): every layer's
attention, on-device routing and MoE, then the head, in one CUDA graph with one device-to-host copy of the
logits, selections and tokens at its end."""

from __future__ import annotations

import numpy as np
import torch

from specmoe.kernels import checks, triton_available
from specmoe.models.decoder import Decoder
from specmoe.offload import ExpertResidency
from specmoe.routing import RouterScoring
from specmoe.kernels.device_routing import bias_rows_on, route_resident


class StepRunner:
    """The launches of `decoder`'s steps of D = num_positions over `residency`'s slot buffers, on the
    compute stream `stream` (None on the CPU)."""

    def __init__(self, decoder: Decoder, num_positions: int, residency: ExpertResidency, stream,
                 cuda_graphs: bool = True, resident_scoring: RouterScoring | None = None):
        self.decoder, self.residency, self.stream = decoder, residency, stream
        self.step = decoder.step(num_positions)
        g = decoder.geometry
        self.num_layers = g.num_layers
        self.cuda = stream is not None
        self.notes: list[str] = []
        self.graphs = self.graph_whole = None
        self.copy_in_graph = True  # device-to-host copies of logits and tokens inside the graphs
        self.resident_scoring = resident_scoring
        if resident_scoring is not None:  # the whole step's buffers: selections, and the slot of every expert
            pin = self.cuda
            self.experts_dev = torch.zeros(g.num_layers, num_positions, g.top_k, dtype=torch.int64,
                                           device=residency.device)
            self.experts_host = torch.zeros(self.experts_dev.shape, dtype=torch.int64, pin_memory=pin)
            self.experts_np = self.experts_host.numpy()
            self.slot_of = torch.arange(g.num_experts, dtype=torch.int32, device=residency.device)
            self.slot_of = self.slot_of.repeat(g.num_layers, 1).contiguous()
            self.bias = bias_rows_on(resident_scoring, g.num_layers, g.num_experts, residency.device)  # sigmoid
            self.routing_kernel = self._choose_routing_kernel()
        if self.cuda:
            self.ev_attention = [torch.cuda.Event() for _ in range(self.num_layers)]
            self.ev_head = torch.cuda.Event()
            with torch.no_grad(), torch.cuda.stream(stream):
                self._warm_up()
                if cuda_graphs:
                    self._capture_and_check()

    # -- set-up ------------------------------------------------------------------------------------------
    def _choose_routing_kernel(self) -> str:
        """The one-launch Triton kernel on CUDA where it agrees with the torch version, else torch ops."""
        if not (self.cuda and triton_available()):
            return "torch"
        g = self.decoder.geometry
        try:
            checks.check_resident_routing(self.step.num_positions, g.num_experts, g.top_k, self.resident_scoring,
                                          self.residency.device)
        except Exception as exc:  # a compile error, a CUDA error or a wrong result must not cost the run
            torch.cuda.synchronize()
            self.notes.append(f"resident routing kernel unusable ({type(exc).__name__}: {exc}); torch ops used")
            return "torch"
        self.notes.append("resident routing kernel checked against its torch version; used")
        return "triton"

    def _eager(self) -> None:
        dec, step = self.decoder, self.step
        for layer in range(self.num_layers):
            dec.attention_router(step, layer)
            dec.moe(step, layer, self.residency.slots.layer(layer))
        dec.head(step)
        if self.resident_scoring is not None:
            self._whole_step_body(copy_out=True)

    def _whole_step_body(self, copy_out: bool) -> None:
        """Every layer with routing on the device, then the head; the logits, selections and greedy tokens
        are copied to the host once, at the end."""
        dec, step, g = self.decoder, self.step, self.decoder.geometry
        for layer in range(self.num_layers):
            dec.attention_router(step, layer, copy_out=False)
            route_resident(step.logits_dev[layer, :, : g.num_experts], g.top_k, self.resident_scoring,
                           self.slot_of[layer], self.experts_dev[layer], step.route_dev[layer],
                           self.routing_kernel, None if self.bias is None else self.bias[layer])
            dec.moe(step, layer, self.residency.slots.layer(layer), copy_in=False)
        dec.head(step, copy_out=False)
        if copy_out:
            self._copy_out_whole_step()

    def _copy_out_whole_step(self) -> None:
        self.step.logits_host.copy_(self.step.logits_dev, non_blocking=True)
        self.experts_host.copy_(self.experts_dev, non_blocking=True)
        self.step.copy_out_next()

    def _neutral_input(self) -> None:
        """Token 0 at position 0 routed to slots 0..K-1 with zero weights: a harmless input for warm-up and
        capture (the KV cache rows it writes are overwritten by the first real step)."""
        step = self.step
        step.set_input([0] * step.num_positions, 0, self.decoder.geometry.max_seq_len)
        step.slots_np[:] = range(step.slots_np.shape[-1])
        step.weights_np[:] = 0.0

    def _warm_up(self) -> None:
        """Two eager passes (compiles kernels, creates cuBLAS handles) on the compute stream."""
        self._neutral_input()
        for _ in range(2):
            self._eager()
        torch.cuda.synchronize()

    def _capture(self) -> tuple:
        dec, step, pool = self.decoder, self.step, torch.cuda.graph_pool_handle()

        def capture(fn):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                fn()
            return graph

        copy_out = self.copy_in_graph
        graphs_a = [capture(lambda l=l: dec.attention_router(step, l, copy_out=copy_out))
                    for l in range(self.num_layers)]
        graphs_b = [capture(lambda l=l: dec.moe(step, l, self.residency.slots.layer(l)))
                    for l in range(self.num_layers)]
        if self.resident_scoring is not None:
            self.graph_whole = capture(lambda: self._whole_step_body(copy_out))
        return graphs_a, graphs_b, capture(lambda: dec.head(step, copy_out=copy_out))

    def _capture_and_check(self) -> None:
        self._neutral_input()
        try:
            self.graphs = self._capture()
        except Exception as exc:  # e.g. a device-to-host copy this torch cannot capture: copy outside graphs
            self.notes.append(f"capture with in-graph device-to-host copies failed ({type(exc).__name__}: {exc}); "
                              "recaptured with the copies outside the graphs")
            torch.cuda.synchronize()
            self.copy_in_graph = False
            self.graphs = self._capture()
        graphs_a, _, graph_head = self.graphs
        step = self.step
        step.logits_host.fill_(float("nan"))
        step.next_host.fill_(-1)
        graphs_a[0].replay()
        graph_head.replay()
        torch.cuda.synchronize()
        if not (torch.equal(step.logits_host[0], step.logits_dev[0].cpu())
                and torch.equal(step.next_host, step.next_dev.cpu())):
            self.copy_in_graph = False
            self.notes.append("device-to-host copies in captured graphs did not land; copied outside the graphs")

    # -- launches ----------------------------------------------------------------------------------------
    def attention(self, layer: int) -> None:
        """Attention, router and pre-gate of `layer`; its logits are on the host after `wait_logits`."""
        if self.graphs is not None:
            self.graphs[0][layer].replay()
            if not self.copy_in_graph:
                self.step.copy_out_logits(layer)
        else:
            self.decoder.attention_router(self.step, layer)
        if self.cuda:
            self.ev_attention[layer].record(self.stream)

    def wait_logits(self, layer: int) -> None:
        if self.cuda:
            self.ev_attention[layer].synchronize()

    def moe(self, layer: int) -> None:
        if self.graphs is not None:
            self.graphs[1][layer].replay()
        else:
            self.decoder.moe(self.step, layer, self.residency.slots.layer(layer))

    def head(self) -> None:
        """Final norm, LM head and greedy tokens; on the host after `wait_head`."""
        if self.graphs is not None:
            self.graphs[2].replay()
            if not self.copy_in_graph:
                self.step.copy_out_next()
        else:
            self.decoder.head(self.step)
        if self.cuda:
            self.ev_head.record(self.stream)

    def set_slot_map(self, slot_of: np.ndarray) -> None:
        """The slot of every expert [L, E] (every expert resident), read by the whole step's routing."""
        self.slot_of.copy_(torch.as_tensor(np.asarray(slot_of, dtype=np.int32)))

    def whole_step(self) -> None:
        """The whole step with routing on the device (needs `resident_scoring`); on the host after
        `wait_head`: logits, `experts_np` [L, D, K] and the greedy tokens."""
        if self.graph_whole is not None:
            self.graph_whole.replay()
            if not self.copy_in_graph:
                self._copy_out_whole_step()
        else:
            self._whole_step_body(copy_out=True)
        if self.cuda:
            self.ev_head.record(self.stream)

    def wait_head(self) -> None:
        if self.cuda:
            self.ev_head.synchronize()

    def synchronize(self) -> None:
        """Wait until everything launched so far has run (a prompt chunk's MoE group, before the host rewrites
        the route rows it read and copies into the slots it read)."""
        if self.cuda:
            self.stream.synchronize()
