"""Calibration from a model: router logits of exact routing on held-out text, fed to CalibrationBuilder."""

from __future__ import annotations

import datetime

import numpy as np
import torch
from torch import nn

from specmoe.models import MoEAdapter, adapter_for
from specmoe.routing import Calibration, CalibrationBuilder
from specmoe.records.traces import Trace, TraceError

from .diagnostics import right_padded
from .patch import exact_routing


@torch.no_grad()
def router_logits_of(model: nn.Module, adapter: MoEAdapter, windows, *, batch_size: int = 8):
    """Yield (selection scores [T, L, E] float64, token ids [T]) of each window under exact routing
    (`exact_routing`; the router's rule applied to its raw logits, `RouterScoring.selection_scores`: for
    softmax routers the router logits). The model's own
    routing context is restored when the generator ends: consume it fully."""
    device = next(model.parameters()).device
    windows = [torch.as_tensor(w, dtype=torch.long).reshape(-1) for w in windows]
    for w in windows:
        if w.numel() and not 0 <= int(w.min()) <= int(w.max()) < adapter.vocab_size:
            bad = int(w.min()) if int(w.min()) < 0 else int(w.max())
            raise ValueError(f"token id {bad} is outside the model's vocabulary (0 .. {adapter.vocab_size - 1})")
    with exact_routing(model, adapter, record=True) as context:
        for lo in range(0, len(windows), batch_size):
            batch = windows[lo:lo + batch_size]
            ids, mask = right_padded(batch)
            model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
            for row in range(len(batch)):
                z, _, tokens, _ = context.recorded(row)
                yield context.scoring.selection_scores(z), tokens


def collect_calibration(model: nn.Module, adapter: MoEAdapter, windows, provenance: dict | str, *,
                        batch_size: int = 8, progress: bool = False) -> Calibration:
    """Calibrate on held-out `windows` (token id sequences that no evaluation uses) under exact routing.

    provenance: a dict with at least "text" (what the windows are: corpus, split, how they were cut), or
    that description as a string. The model source ("model", default `model.specmoe_source`), the router
    fingerprint (checked by `Calibration.check` when the calibration is used) and the window count are added.
    progress: a bar over the windows (`specmoe.progress`)."""
    from specmoe.progress import bar

    info = {"text": provenance} if isinstance(provenance, str) else dict(provenance)
    if not info.get("text"):
        raise ValueError("the calibration provenance must describe the text it was computed on ('text')")
    fingerprint = adapter.fingerprint(model)
    if info.get("fingerprint", fingerprint) != fingerprint:
        raise ValueError("the provenance names a router fingerprint that is not this model's")
    info["fingerprint"] = fingerprint
    info.setdefault("model", getattr(model, "specmoe_source", None) or getattr(model, "name_or_path", "unknown"))
    info["model_type"] = adapter.model_type
    builder = CalibrationBuilder(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size, adapter.top_k,
                                 adapter.groups)
    count = 0
    with bar(len(windows) if hasattr(windows, "__len__") else None, "calibrating", progress, "window") as shown:
        for z, tokens in router_logits_of(model, adapter, windows, batch_size=batch_size):
            builder.add(z, tokens)
            count += 1
            shown.update(1)
    info["windows"] = count
    return builder.finish(info)


def record_trace(model, sequences, model_source: str = "", batch_size: int = 1) -> Trace:
    """Run `model` over each sequence (1-D LongTensors, no padding) under exact routing and record the raw router
    logits, the raw pre-gate logits, the token ids, the sequence boundaries and the router's rule (`scoring`). Sequences of equal length are
    batched `batch_size` at a time. The recording is the harness's (`exact_routing(record=True)`): the same
    code records calibrations, and the pre-gate is the adapter's router applied to the previous layer's MoE
    input."""
    import transformers

    adapter = adapter_for(model.config)
    device = next(model.parameters()).device
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    if not seqs or any(s.numel() == 0 for s in seqs):
        raise TraceError("record_trace needs at least one non-empty sequence")
    parts_z, parts_g = [], []
    with torch.no_grad(), exact_routing(model, adapter, record=True) as context:
        i = 0
        while i < len(seqs):
            j = i + 1
            while j < len(seqs) and j - i < batch_size and seqs[j].numel() == seqs[i].numel():
                j += 1
            model(input_ids=torch.stack(seqs[i:j]).to(device))
            for row in range(j - i):
                z, g, _, _ = context.recorded(row)
                parts_z.append(z)
                parts_g.append(g)
            i = j
    lengths = [s.numel() for s in seqs]
    info = {"dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "device": str(device),
            "transformers": transformers.__version__, "torch": torch.__version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "sequences": len(seqs)}
    return Trace(np.concatenate(parts_z), np.concatenate(parts_g), torch.cat(seqs).numpy(),
                 np.concatenate([[0], np.cumsum(lengths)[:-1]]), top_k=adapter.top_k,
                 vocab_size=adapter.vocab_size, model=model_source, fingerprint=adapter.fingerprint(model),
                 info=info, groups=adapter.groups, scoring=context.scoring)
