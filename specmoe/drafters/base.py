"""The drafter protocol's rules, the drafters' errors and `check_drafter_fits` (the drafter configuration, the
table of drafters by name and `build_drafter` are in build.py).

A drafter proposes the k tokens that one verification block checks (paper, Section 7). The protocol itself,
`Drafter`, lives with the rest of the speculative semantics in `specmoe.speculation` (the harness and the
engines type against it); its rules are these. A drafter's state follows the committed sequence of one
request:

- `reset(prompt, features)`: start a request; `prompt` is the committed sequence so far, and its last
  token is the root of the first verification block. The speculative loops hand it the prompt followed by
  the first new token, the target's greedy token after the prompt, which the prefill decoded (as in the
  public DFlash loop, vLLM and SGLang).
- `propose(k) -> (tokens [k], confidences [k])`: the k drafts that continue the committed sequence, and
  c_i, the drafter's probability of its own token i (what confidence weighting reads). Proposing does not
  change what is committed.
- `commit(accepted, bonus_token, features)`: the verification accepted the first `accepted` drafts and the
  target's own token after them (the bonus token) follows; the drafter advances over them and rolls back
  whatever it computed for the rejected drafts. The bonus token is the next root.

Every drafter declares its sizes: `vocab_size` (must be the target's) and `hidden_size` (the hidden size of
the target features it reads, which must be the target's; None for a drafter that reads no target features);
`check_drafter_fits` refuses one that does not fit a target.

Drafters that read the target's hidden states (DFlash) name the target layers in `target_layer_ids`; the
harness then hands them the features of every committed position the target has processed: at `reset`
every position before the root (the prompt, which the prefill processed), at `commit` the root and the
accepted drafts of the block, each as the hidden states after those layers concatenated
([n, len(layer_ids) * H]). Other drafters get None. `fixed_cost_s`, where not None, is the drafting time
charged per block instead of the measured wall time (the synthetic drafter's optional cost); the harness
measures drafting apart from verification.

Drafters are chosen by name from one table, `DRAFTERS` in build.py (name -> builder(config, target) ->
Drafter; adding a drafter is a class that follows the protocol, a builder and an entry): ``ar`` (a
transformers causal LM with the target's vocabulary), ``dflash`` (a DFlash block drafter conditioned on the
target's features) and ``synthetic`` (exact routing's greedy continuation with a set acceptance profile).
``ar`` and ``dflash`` have two runtimes (`RUNTIMES`): ``hf``, the transformers modules with a DynamicCache
(`hf_autoregressive`, `dflash`), and ``static``, our own decode step over the same weights with a static KV
cache, one CUDA graph per drafted token (AR) or per block (DFlash) on a GPU and the same code eagerly on the
CPU (`static_ar`, `static_dflash`). ``auto`` picks ``static`` on a CUDA device where the architecture is
supported, else ``hf``.
"""

from __future__ import annotations

import torch

from specmoe.speculation import Drafter

RUNTIMES = ("auto", "hf", "static")
COST_MODES = ("charge", "spin")
ATTENTIONS = ("auto", "split_kv", "sdpa")  # the static drafters' ("auto": split_kv on CUDA with Triton, else sdpa)


class DrafterError(ValueError):
    """A drafter that cannot run with this target or configuration (unknown name, other vocabulary,
    hidden size or layers that do not fit the target, k beyond what it drafts, a bad acceptance profile)."""


def greedy_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens of logits [n, V] and the probability the distribution gives them (float64)."""
    probs = torch.softmax(logits.float(), dim=-1)
    tokens = probs.argmax(-1)
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].double()


def check_drafter_fits(drafter: Drafter, geometry, num_decoder_layers: int | None = None) -> None:
    """DrafterError unless the drafter's vocabulary is the target's and, for a drafter that reads the target's
    hidden states, every layer it names exists in the target and its hidden size is the target's (geometry:
    the target decoder's `Geometry`, or anything with num_layers, vocab_size and hidden).

    A drafter names decoder layers (transformers' hidden_states), dense ones included; num_decoder_layers: the
    target's decoder layers (e.g. `len(decoder.layer_kinds)`, DeepSeek-V3's dense first layers counted),
    default geometry.num_layers (every decoder layer has an MoE, as in OLMoE)."""
    g, problems = geometry, []
    num_layers = g.num_layers if num_decoder_layers is None else int(num_decoder_layers)
    if drafter.vocab_size != g.vocab_size:
        problems.append(f"vocabulary {drafter.vocab_size} (target {g.vocab_size})")
    layers = list(drafter.target_layer_ids)
    if layers:
        missing = [i for i in layers if not 0 <= i < num_layers]
        if missing:
            problems.append(f"needs the hidden states after target layers {missing}, the target has layers "
                            f"0..{num_layers - 1}")
        if drafter.hidden_size != g.hidden:
            problems.append(f"hidden size {drafter.hidden_size} (target {g.hidden})")
    if problems:
        raise DrafterError(f"the {drafter.name} drafter does not fit the target: " + "; ".join(problems))
