"""The decode path of one architecture, as the engines see it: the `Decoder` protocol.

A decoder is an MoE model without its routed experts, over a static KV cache, split into the three step
functions an engine interleaves with routing and expert copies (and captures as CUDA graphs, one set per
static number of positions D):

- `attention_router(step, layer)`: (layer 0: token embedding) attention of the step's D positions, the MoE
  input of the layer, and from it the router logits z of the layer and the pre-gate logits g of the next
  layer; both land in the step's pinned host buffer `logits` [L, D, 2E] = [z | g];
- `moe(step, layer, slot_buf)`: the routed experts of the D positions over the layer's slot buffer, at the
  slot ids and execution weights the host wrote into the step's `route` [L, D, 2K] (slots, then weights as
  float32 bit patterns), added to the residual stream, and nothing else: a prompt chunk may run it several
  times per layer, each time with the weights of other positions nonzero (resident parts such as shared
  experts belong in `attention_router`); with copy_in=False the device rows `route_dev` are
  used as they are (written on the device by `specmoe.kernels.device_routing` when every expert is resident);
- `head(step)`: final norm, LM head and the greedy token of each position into `next_tokens`.

D = 1 for autoregressive decoding and k + 1 for a verification block: the step buffers of each D are made
once (`decoder.step(D)`) and reused, so every launch has a static shape. The KV cache belongs to the
decoder; a step writes positions pos .. pos + D - 1 and query i attends positions 0 .. pos + i, so rolling
back rejected positions of a KV cache is only a matter of the next step's position; state that is not indexed
by position (a linear-attention layer's recurrent state) rolls back through `rollback(step, committed)`, which
the engine calls after every verification block.

Adding an architecture: implement this protocol (see `OlmoeDecoder` for the reference implementation) and
register its `from_model` / `from_checkpoint` constructors in `specmoe.models.registry.ARCHITECTURES`; the
engines never import a concrete decoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from specmoe.geometry import Geometry
from specmoe.kernels import slot_moe, slot_moe_grouped_triton, slot_moe_vllm
from specmoe.kernels.greedy import greedy_triton
from specmoe.routing import RouterScoring


@dataclass
class DecodeStep:
    """The buffers of one static number of positions D: the host writes `tokens`/`position` and the route rows,
    and reads the logits and the next tokens (numpy views of pinned memory); the device side mirrors them.
    `work` holds the architecture's own activations for these D positions."""

    num_positions: int
    input_host: torch.Tensor  # int64 [D + 1]: D token ids, then the first position
    input_dev: torch.Tensor
    logits_host: torch.Tensor  # float32 [L, D, 2E]: router logits z, then the next layer's pre-gate g
    logits_dev: torch.Tensor
    route_host: torch.Tensor  # int32 [L, D, 2K]: slot ids, then execution weights as float32 bit patterns
    route_dev: torch.Tensor
    next_host: torch.Tensor  # int64 [D]: greedy token after each position
    next_dev: torch.Tensor
    out_logits: torch.Tensor  # float32 [D, V] on the device
    work: dict = field(default_factory=dict)  # the decoder's activations and kernel workspaces for these D
    next_prob: torch.Tensor | None = None  # float32 [D] on the device: the greedy token's softmax probability

    def __post_init__(self) -> None:
        self.input_np = self.input_host.numpy()
        self.logits_np = self.logits_host.numpy()
        self.route_np = self.route_host.numpy()
        top_k = self.route_np.shape[-1] // 2
        self.slots_np = self.route_np[..., :top_k]
        self.weights_np = self.route_np.view(np.float32)[..., top_k:]
        self.next_np = self.next_host.numpy()

    @classmethod
    def allocate(cls, num_positions: int, geometry: Geometry, device: torch.device) -> "DecodeStep":
        g, d = geometry, num_positions
        pin = device.type == "cuda"

        def pair(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin), torch.zeros(shape, dtype=dtype, device=device)

        return cls(d, *pair(d + 1, torch.int64), *pair((g.num_layers, d, 2 * g.num_experts), torch.float32),
                   *pair((g.num_layers, d, 2 * g.top_k), torch.int32), *pair(d, torch.int64),
                   torch.zeros(d, g.vocab_size, dtype=torch.float32, device=device),
                   next_prob=torch.zeros(d, dtype=torch.float32, device=device))

    def set_input(self, tokens, position: int, max_seq_len: int) -> None:
        """The D input tokens and the first position of the next launch."""
        d = self.num_positions
        if not 0 <= position <= max_seq_len - d:
            raise ValueError(f"positions {position} .. {position + d - 1} are outside the static KV cache of "
                             f"{max_seq_len} positions")
        self.input_np[:d] = tokens
        self.input_np[d] = position

    def router_logits(self, layer: int) -> np.ndarray:
        """z of `layer` for the D positions, [D, E] (a view of the pinned buffer)."""
        return self.logits_np[layer, :, : self.logits_np.shape[-1] // 2]

    def pregate_logits(self, layer: int) -> np.ndarray:
        """g of `layer` (router `layer` on layer `layer - 1`'s MoE input), [D, E]; layer >= 1."""
        return self.logits_np[layer - 1, :, self.logits_np.shape[-1] // 2:]

    def copy_out_logits(self, layer: int) -> None:
        """The device-to-host copy of a layer's logits (inside the captured graph, or after it)."""
        self.logits_host[layer].copy_(self.logits_dev[layer], non_blocking=True)

    def copy_out_next(self) -> None:
        self.next_host.copy_(self.next_dev, non_blocking=True)


def model_source(model):
    """(config, weight, device, dtype) of a transformers model for a decoder's constructor: weight(name) reads a
    parameter or buffer by transformers' name (a tied LM head reads the embedding); the model's device and dtype."""
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    if "lm_head.weight" not in params:  # tied embeddings
        params["lm_head.weight"] = params["model.embed_tokens.weight"]
    first = params["model.embed_tokens.weight"]
    return model.config, lambda name: params[name].detach(), first.device, first.dtype


def torch_kernels(decoder, architecture: str, backend: str, attention: str, moe: str, tune) -> dict:
    """`Decoder.use_kernels` of a decoder that has only its torch path (torch SDPA, `slot_moe`'s torch version):
    the choices are checked, any other request is noted in `decoder.notes`, and torch is used."""
    from specmoe.kernels import check_kernel_choice, check_tune

    check_kernel_choice(backend, attention, moe)
    check_tune(tune)
    for what, asked, used in (("backend", backend, "torch"), ("attention", attention, "sdpa"), ("moe", moe, "slot")):
        if asked not in ("auto", used):
            decoder.notes.append(f"{what} {asked!r} is not implemented for the {architecture} decoder; {used} used")
    decoder.backend, decoder.attention = "torch", "sdpa"
    return {"backend": "torch", "attention": "sdpa", "moe": "slot", "launch": decoder.launch}


def verified(decoder, name: str, fallback: str, check) -> bool:
    """Run a kernel's self-check (`specmoe.kernels.checks`) for `decoder.use_kernels`; a failure of any kind
    (compile error, CUDA error, wrong result) must not cost the run: False, and `decoder.notes` says why and
    that `fallback` is used. True (noted) if the check passes."""
    device = decoder.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    try:
        check()
    except Exception as exc:
        if device.type == "cuda":
            torch.cuda.synchronize()
        decoder.notes.append(f"{name} unusable ({type(exc).__name__}: {exc}); {fallback} used")
        return False
    decoder.notes.append(f"{name} checked against torch on {where}; used")
    return True


def use_dense_kernels(decoder, on: bool, tune) -> None:
    """For `decoder.use_kernels`, where `on` (the Triton backend, its other kernels checked): the one-row linear
    layers of `decoder.dense_weights()` (each [N, K]; one launch per shape, the GEMV kernel or cuBLAS,
    `specmoe.kernels.gemv.Linears.choose`) and the greedy head kernel (checked at the decoder's vocabulary); else
    F.linear and torch's argmax. Sets decoder.linears' launches and decoder.greedy_fused."""
    from specmoe.kernels import checks

    decoder.linears.clear()
    decoder.greedy_fused = False
    if not on:
        return
    decoder.linears.choose(decoder.dense_weights(), tune, decoder.notes, decoder.launch, checks.check_gemv)
    vocab = decoder.lm_head.shape[0]
    g = torch.Generator(device=decoder.device).manual_seed(5)
    decoder.greedy_fused = verified(decoder, "greedy head kernel", "torch argmax", lambda: checks.check_greedy(
        (torch.randn(2, vocab, device=decoder.device, generator=g) * 4).to(decoder.dtype)))


def finish_head(decoder, step: "DecodeStep", layer: int, x: torch.Tensor, copy_out: bool = True) -> None:
    """The end of a step from the final norm's output x [D, H]: x as the features of decoder layer `layer` (the
    last), the LM head and greedy token (`greedy_head`), and (copy_out) the next token's copy to the host."""
    decoder._write_features(step, layer, x)
    greedy_head(decoder, step, x)
    if copy_out:
        step.copy_out_next()


def add_grouped_workspace(decoder, step: "DecodeStep", num_positions: int) -> None:
    """A step of D = num_positions > 1: the grouped MoE kernel's scratch (distinct slots, activations, expert
    outputs per pair) into step.work["grouped"], and its launch parameters at this D where the kernel is used."""
    from specmoe.kernels import make_grouped_workspace

    if num_positions > 1:
        c = decoder.geometry
        step.work["grouped"] = make_grouped_workspace(num_positions, c.top_k, c.hidden, c.inter, decoder.dtype,
                                                      decoder.device)
        if decoder.grouped_moe:
            choose_grouped_params(decoder, num_positions)


def greedy_head(decoder, step: "DecodeStep", x: torch.Tensor) -> None:
    """The LM head of x [D, H] (decoder.lm_head, on `decoder.linears`) into step.out_logits (float32 values of the
    model-dtype logits) and each row's greedy token (the first index of its largest logit) into step.next_dev: in
    one pass with its probability into step.next_prob (`greedy_triton`) where decoder.greedy_fused, else
    torch.argmax."""
    decoder.linears(x, decoder.lm_head, out32=step.out_logits)
    if decoder.greedy_fused:
        greedy_triton(step.out_logits, step.next_dev, step.next_prob)
    else:
        torch.argmax(step.out_logits, dim=-1, out=step.next_dev)


def use_slot_moe(decoder, slot_buf: torch.Tensor, tune) -> bool:
    """The Triton slot MoE kernels for `decoder.use_kernels`: launch parameters cached or tuned (`tune_slot_moe`),
    the per-token kernel checked on the device, then the grouped kernel for steps of D > 1 (`use_grouped_moe`).
    True and decoder.backend = "triton" where the check passes; else the torch version, the reason noted."""
    from specmoe.kernels import checks

    if not verified(decoder, "Triton slot MoE kernel", "torch fallback", lambda: (
            tune_slot_moe(decoder, slot_buf, tune),
            checks.check_slot_moe(decoder.geometry, slot_buf, decoder.moe_params, decoder.dtype, decoder.device))):
        decoder.moe_params = None
        decoder.launch.clear()
        return False
    decoder.backend = "triton"
    use_grouped_moe(decoder, slot_buf)
    return True


def use_grouped_moe(decoder, slot_buf: torch.Tensor) -> None:
    """Check the grouped slot MoE kernel for steps of D > 1 positions (`decoder.grouped_moe`) and choose its
    launch parameters for the steps made so far (later ones: `choose_grouped_params` when a step is made).
    The decoder holds geometry, dtype, device, notes, launch, grouped_params and _tuning = (tune, slot_buf)."""
    from specmoe.kernels import checks

    decoder.grouped_moe = verified(decoder, "grouped slot MoE kernel (steps of D > 1 positions)",
                                   "the slot MoE kernel once per position", lambda: (
                                       checks.check_grouped_moe(decoder.geometry, slot_buf, decoder.dtype,
                                                                decoder.device)))
    if decoder.grouped_moe:
        for d in [d for d in decoder._steps if d > 1]:
            choose_grouped_params(decoder, d)


def choose_grouped_params(decoder, num_positions: int) -> None:
    """The grouped kernel's launch parameters for steps of D = num_positions (cached, tuned now, or the
    defaults; tuned ones checked against torch at this D, the defaults used if they fail), into
    decoder.grouped_params[D] and decoder.launch."""
    from specmoe.kernels import GROUPED_DEFAULTS, LaunchChoice, checks, grouped_launch_params, grouped_params

    tune, slot_buf = decoder._tuning
    d, c, cuda = num_positions, decoder.geometry, decoder.device.type == "cuda"
    try:
        if cuda:  # the slot buffer's experts arrive on other streams
            torch.cuda.synchronize(decoder.device)
        choice = grouped_launch_params(tune, slot_buf, d, c.top_k, c.hidden, c.inter)
        if choice.source != "defaults":
            checks.check_grouped_moe(c, slot_buf, decoder.dtype, decoder.device, choice.params, num_positions=d)
    except Exception as exc:  # a failed tune or check must not cost the run
        if cuda:
            torch.cuda.synchronize(decoder.device)
        decoder.notes.append(f"grouped slot MoE kernel at D = {d}: tuned launch parameters unusable "
                             f"({type(exc).__name__}: {exc}); its defaults used")
        choice = LaunchChoice(dict(GROUPED_DEFAULTS), "defaults")
    decoder.notes.extend(choice.notes)
    decoder.grouped_params[d] = choice.params
    decoder.launch[f"grouped_slot_moe D={d}"] = {"params": grouped_params(d, choice.params), "source": choice.source}


def tune_slot_moe(decoder, slot_buf: torch.Tensor, tune, record: bool = True) -> None:
    """The per-token slot MoE kernel's launch parameters (`moe_launch_params`: cached, tuned now or the
    defaults) into decoder.moe_params, its notes into decoder.notes, and (record) into decoder.launch."""
    from specmoe.kernels import MOE_DEFAULTS, moe_launch_params

    g = decoder.geometry
    choice = moe_launch_params(tune, slot_buf, g.top_k, g.hidden, g.inter)
    decoder.notes.extend(choice.notes)
    decoder.moe_params = choice.params
    if record:
        decoder.launch["slot_moe"] = {"params": {**MOE_DEFAULTS, **choice.params}, "source": choice.source}
def split_kv_check(q, k_cache, v_cache, seq_len, scale):
    """The split-KV kernel in the form `specmoe.kernels.checks.check_attention` calls (its own workspace)."""
    from specmoe.kernels import make_split_kv_workspace, split_kv_attention

    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    ws = make_split_kv_workspace(q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], q.device,
                                 num_kv_heads=k_cache.shape[0])
    return split_kv_attention(q, k_cache, v_cache, seq_len, scale, out, ws)


def routed_moe(decoder, step: "DecodeStep", layer: int, slot_buf: torch.Tensor, copy_in: bool = True,
               fused_experts=None, late: tuple | None = None) -> None:
    """`Decoder.moe` for every decoder whose MoE input and residual are step.work["moe_in"] / ["h"]: the route rows
    to the device (unless the device wrote them, `specmoe.kernels.device_routing`), then the grouped kernel for
    D > 1 where chosen (each distinct slot's expert read once for the D positions), else one position at a time
    through `slot_moe` (decoder.backend, decoder.moe_params) or vLLM's `fused_experts` where given.
    late = (first, wait): slots first .. are still being written by copies on another stream; the grouped kernel
    computes the other slots' experts first and calls wait() before the late ones (`slot_moe_grouped_triton`),
    every other path calls it first."""
    c, w = decoder.geometry, step.work
    if copy_in:
        step.route_dev[layer].copy_(step.route_host[layer], non_blocking=True)
    if decoder.grouped_moe and step.num_positions > 1:
        slot_moe_grouped_triton(w["moe_in"], w["h"], slot_buf, step.route_dev[layer], w["h"], c.hidden, c.inter,
                                w["grouped"], decoder.grouped_params.get(step.num_positions), late)
        return
    if late is not None:
        late[1]()
    for i in range(step.num_positions):
        h, route = w["h"][i], step.route_dev[layer, i]
        if fused_experts is not None:
            slot_moe_vllm(w["moe_in"][i], h, slot_buf, route, h, c.hidden, c.inter, fused_experts)
        else:
            slot_moe(w["moe_in"][i], h, slot_buf, route, w["act"], h, c.hidden, c.inter, decoder.backend,
                     decoder.moe_params)


def residual_work(step: "DecodeStep", geometry: Geometry, dtype: torch.dtype, feature_layers) -> None:
    """The workspaces every decoder's step of D positions has: the residual stream h, the normed input xn, the
    MoE input moe_in, the per-token MoE kernel's activations act [K, I], the attention mask [D, S], and with
    captured features work["features"] [D, len(feature_layers) * H]."""
    g, d, dev = geometry, step.num_positions, step.input_dev.device
    zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
    step.work.update(h=zeros(d, g.hidden), xn=zeros(d, g.hidden), moe_in=zeros(d, g.hidden),
                     act=zeros(g.top_k, g.inter), mask=zeros(d, g.max_seq_len))
    if feature_layers:
        step.work["features"] = zeros(d, len(feature_layers) * g.hidden)


def checkpoint_source(path):
    """(config, weight) of a local checkpoint directory for a decoder's constructor: its transformers config and
    weight(name) -> tensor reading one tensor by transformers' name (a tied LM head reads the embedding), so that
    the routed experts are never read (the expert store reads them)."""
    from transformers import AutoConfig

    from .adapter import ModelSourceError
    from .checkpoint import CheckpointReader

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    reader = CheckpointReader(path, ModelSourceError)

    def weight(name):
        if name == "lm_head.weight" and name not in reader:
            name = "model.embed_tokens.weight"
        return reader.get(name)

    return config, weight


class Sourced:
    """The two ways to build a decoder whose constructor is `(config, weight, max_seq_len, device, dtype)`: from a
    transformers model (`model_source`) or a local checkpoint (`checkpoint_source`, routed experts never read); a
    decoder whose checkpoint names weights differently overrides `from_checkpoint`."""

    @classmethod
    def from_model(cls, model, max_seq_len: int):
        """From a transformers model of this architecture, on its device and in its dtype."""
        config, weight, device, dtype = model_source(model)
        return cls(config, weight, max_seq_len, device, dtype)

    @classmethod
    def from_checkpoint(cls, path, max_seq_len: int, device, dtype: torch.dtype):
        """Read config.json and the weights but the routed experts of a local checkpoint."""
        return cls(*checkpoint_source(path), max_seq_len, device, dtype)


class FeatureCapture:
    """The hidden states a drafter reads (DFlash), captured inside a decoder's steps: the shared part of
    `Decoder.capture_features` / `features`. A decoder sets `feature_layers = ()` and `_feature_slots = {}` at
    build, names its layer count (`_feature_layer_count`: transformers' hidden_states layers), allocates
    work["features"] [D, len(feature_layers) * H] in its steps and calls `_write_features` where each layer's
    state is final."""

    feature_layers: tuple[int, ...] = ()
    _feature_slots: dict[int, list[int]] = {}

    def capture_features(self, layer_ids) -> None:
        """Write the hidden state after each of `layer_ids` (transformers' hidden_states[l + 1]) into every
        step's work["features"] [D, len(layer_ids) * H]. A change of layers drops the steps made so far (graphs
        captured over them would not write the features): make the runners again."""
        ids = tuple(int(i) for i in layer_ids)
        num_layers = self._feature_layer_count
        if any(not 0 <= i < num_layers for i in ids):
            raise ValueError(f"feature layers {list(ids)} outside the target's layers 0..{num_layers - 1}")
        if ids != self.feature_layers:
            self._steps.clear()
        self.feature_layers = ids
        self._feature_slots = {}
        for slot, layer in enumerate(ids):
            self._feature_slots.setdefault(layer, []).append(slot)

    def features(self, step: "DecodeStep") -> torch.Tensor | None:
        """The captured features of the step's D positions [D, n * H] (None without `capture_features`)."""
        return step.work.get("features")

    def _write_features(self, step: "DecodeStep", layer: int, hidden: torch.Tensor) -> None:
        """Copy `hidden` [D, H], the state after `layer`, into its feature slots (if the layer is named)."""
        width = self.geometry.hidden
        for slot in self._feature_slots.get(layer, ()):
            step.work["features"][:, slot * width:(slot + 1) * width].copy_(hidden)


LAYER_KINDS = ("attention", "linear_attention", "dense_mlp", "moe")  # token mixers, then MLPs


class Decoder(Protocol):
    """One architecture's decode path (see the module docstring). `notes` say which kernels were chosen and
    why any was not. layer_kinds: per transformer layer, its token mixer ("attention" or "linear_attention",
    e.g. Gated DeltaNet) and its MLP ("moe", or "dense_mlp" for the dense layers some models put first); the
    engine routes the "moe" layers, numbered 0 .. L - 1 in order."""

    geometry: Geometry
    scoring: RouterScoring
    device: torch.device
    dtype: torch.dtype
    notes: list[str]
    layer_kinds: tuple[tuple[str, str], ...]

    @classmethod
    def from_model(cls, model, max_seq_len: int) -> "Decoder":
        """From a transformers model of this architecture, on its device and in its dtype."""

    @classmethod
    def from_checkpoint(cls, path, max_seq_len: int, device, dtype: torch.dtype) -> "Decoder":
        """From a local checkpoint directory, without reading the routed experts."""

    def use_kernels(self, backend: str, attention: str, moe: str, slot_buf: torch.Tensor, tune="auto") -> dict:
        """Choose the kernels ("auto" / "triton" / "torch" backend, attention and MoE implementations) and their
        launch parameters (tune: "auto", True or False, `specmoe.kernels.tuning`), check each against its
        torch reference on this device (`specmoe.kernels.checks`), fall back where one fails, and return what
        is used: {"backend", "attention", "moe", "launch"} (launch: kernel -> {"params", "source"}), and any
        kernel of the architecture's own (Qwen3.5-MoE: "gdn", its Gated DeltaNet recurrence; DeepSeek-V3: "dense", its
        fused norms, MLA prologue and SwiGLU or torch ops)."""

    def step(self, num_positions: int) -> DecodeStep:
        """The buffers of D = num_positions (made at the first call, then reused)."""

    def attention_router(self, step: DecodeStep, layer: int, copy_out: bool = True) -> None: ...

    def moe(self, step: DecodeStep, layer: int, slot_buf: torch.Tensor, copy_in: bool = True,
            late: tuple | None = None) -> None:
        """The layer's routed experts for the D positions, read from the slot buffer's rows that the route rows
        name (copied from the host first where copy_in). late = (first, wait): slots first .. are still being
        written by copies on another stream; wait() orders them before what the stream runs next, and must be
        called before any of those slots is read (the grouped kernel computes the other slots first)."""

    def head(self, step: DecodeStep, copy_out: bool = True) -> None: ...

    def reset(self) -> None:
        """A new sequence (positions count from 0 again)."""

    def rollback(self, step: DecodeStep, committed: int) -> None:
        """After a verification step of D positions of which the first `committed` are kept (the root and the
        accepted drafts): make the decoder's state that of the committed positions alone. KV caches need
        nothing (the next step's position overwrites the rejected rows); a recurrent state (linear attention)
        is restored to the one after position committed - 1 of the step, which the step keeps per position."""

    # how `rollback` restores a recurrent state ("history": the step keeps every position's state; "recompute":
    # the committed positions rerun from the step's start), None for a decoder whose state is all indexed by position
    state_rollback: str | None

    def set_state_rollback(self, mode: str) -> None:
        """Choose `state_rollback` (decoders with recurrent state); the steps made so far are dropped."""

    def randomize_cache(self, seed: int) -> None:
        """Fill the KV cache (and any recurrent state) with seeded random values: timing at long contexts
        without decoding a prefix (the outputs are then no model's on any text)."""

    feature_layers: tuple[int, ...]  # the layers whose hidden states the steps capture (`capture_features`)

    def capture_features(self, layer_ids) -> None:
        """Capture the hidden state after each of `layer_ids` (transformers' hidden_states[l + 1]) for every
        position of every step, for drafters that read the target's hidden states (DFlash). A change of layers
        drops the steps made so far: the engine makes its runners again."""

    def features(self, step: DecodeStep) -> torch.Tensor | None:
        """The captured features of the step's positions, [D, len(feature_layers) * H] (None if none)."""

    def bytes_per_token(self, position: int) -> int:
        """Bytes of weights and KV cache one decode step reads at `position`, routed experts excluded."""
