"""Rollback of a transformers target's recurrent token mixers (linear attention) after a verification block.

A verification forward of D positions advances every linear-attention layer's convolution and recurrent state
over all D positions, and transformers' cache cannot put them back (its `crop` rolls back KV rows only; the
recurrent state holds no positions). When a block commits n < D positions, `MixerStates` restores the state
each such layer had before the block (a snapshot) and reruns the layer's token mixer alone over the n committed
positions' inputs, captured during the forward (the output is discarded: the rerun only advances the state).
This is the engine decoder's "recompute" rollback (`specmoe.models.qwen3_5_moe_decode`) on transformers' own
modules. The mixers hold no experts, so the rerun routes nothing: the block's routing context sees none of it.

What a model needs: decoder layers with a recurrent token mixer under one of `MIXER_ATTRIBUTES` (Qwen3.5-MoE's
and Qwen3-Next's Gated DeltaNet: `linear_attn`), called as mixer(hidden_states=..., cache_params=cache), whose
cache layer keeps its states in `conv_states` / `recurrent_states` (transformers' linear-attention cache layers).
For any other model `MixerStates` finds no mixers and does nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from specmoe.speculation import keeps_recurrent_state

MIXER_ATTRIBUTES = ("linear_attn",)  # decoder-layer attributes that hold a recurrent token mixer
STATE_FIELDS = ("conv_states", "recurrent_states")  # a linear-attention cache layer's states, {state_idx: tensor}


def recurrent_mixers(model: nn.Module) -> dict[int, nn.Module]:
    """The model's recurrent token mixers by decoder-layer index (empty for a model without)."""
    mixers = {}
    for module in model.modules():
        for name in MIXER_ATTRIBUTES:
            mixer = getattr(module, name, None)
            if isinstance(mixer, nn.Module) and isinstance(getattr(mixer, "layer_idx", None), int):
                mixers[mixer.layer_idx] = mixer
    return dict(sorted(mixers.items()))


class MixerStates:
    """The recurrent mixers of `model` decoding into `cache`: inside `with MixerStates(model, cache) as states:`
    (hooks that keep each mixer's input), `states.snapshot()` before a verification forward and
    `states.rollback(committed)` after it."""

    def __init__(self, model: nn.Module, cache):
        self.cache = cache
        self.mixers = recurrent_mixers(model)
        self.saved: dict[int, dict] = {}
        self.inputs: dict[int, torch.Tensor] = {}
        self.armed = False
        self.handles = []

    def __enter__(self) -> "MixerStates":
        """Hook every mixer so that its input hidden states [1, D, H] of a snapshotted forward are kept."""
        for index, mixer in self.mixers.items():
            self.handles.append(mixer.register_forward_pre_hook(self._keeper(index), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _keeper(self, index: int):
        def keep(module, args, kwargs):
            if self.armed:  # not during the rerun
                self.inputs[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return keep

    def snapshot(self) -> None:
        """Keep every mixer's cache states (a copy) and capture the next forward's inputs."""
        self.saved = {}
        for index in self.mixers:
            layer = self.cache.layers[index]
            if not keeps_recurrent_state(layer):
                raise RuntimeError(f"cache layer {index} of a recurrent mixer keeps no conv/recurrent states")
            self.saved[index] = {name: {i: None if t is None else t.clone() for i, t in getattr(layer, name).items()}
                                 for name in STATE_FIELDS}
        self.inputs = {}
        self.armed = True

    @torch.no_grad()
    def rollback(self, committed: int) -> None:
        """Put every mixer's state at the one after the first `committed` positions of the last snapshotted forward:
        restore the snapshot and rerun each mixer alone over those positions' inputs. Nothing to do when the forward
        committed every position."""
        self.armed = False
        if not self.mixers:
            return
        if not self.saved or len(self.inputs) != len(self.mixers):
            raise RuntimeError("rollback needs a snapshot and a captured forward of every recurrent mixer")
        span = next(iter(self.inputs.values())).shape[1]
        if not 1 <= committed <= span:
            raise ValueError(f"committed must be 1 .. {span}, got {committed}")
        if committed == span:
            return
        for index, mixer in self.mixers.items():
            layer = self.cache.layers[index]
            for name, states in self.saved[index].items():
                live = getattr(layer, name)
                for i, saved in states.items():
                    if saved is not None and live[i] is not None and live[i].shape == saved.shape:
                        live[i].copy_(saved)  # in place: the cache may hold its states at static addresses
                    else:
                        live[i] = saved
            mixer(hidden_states=self.inputs[index][:, :committed], cache_params=self.cache)
