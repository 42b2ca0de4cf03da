"""What the harness tests of every architecture beyond OLMoE share (tests/test_deepseek_v3.py,
tests/test_qwen3_5_moe.py): seeded prompts, a tiny named config written by save_pretrained and loaded back, the
executed sets of transformers' own routers, and the check that exact routing changes nothing."""

import numpy as np
import torch

from specmoe.harness import collect_calibration
from specmoe.harness.patch import exact_routing
from specmoe.models import load_model

GEN = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=1, eos_token_id=None)


def random_tokens(vocab, n, seed):
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def left_padded(prompts, pad=1):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    return ids, mask


def tiny_checkpoint(name, tmp_path_factory):
    """(model loaded from its save_pretrained directory, adapter, directory, calibration, the built model) of the
    tiny named config `name`."""
    built, _ = load_model(name, seed=5)
    path = tmp_path_factory.mktemp("ckpt") / name
    built.save_pretrained(path)
    model, adapter = load_model(str(path))
    held_out = [random_tokens(adapter.vocab_size, 40, 200 + i) for i in range(4)]
    calibration = collect_calibration(model, adapter, held_out, {"text": "uniform random tokens, seeds 200-203"})
    return model, adapter, path, calibration, built


def own_selection(model, adapter, run):
    """The executed sets of transformers' own routers during `run()`: per MoE layer, [N, K] (sorted rows)."""
    seen = {layer: [] for layer in range(adapter.num_moe_layers)}
    hooks = [router.register_forward_hook(lambda m, a, out, layer=layer: seen[layer].append(out[2].sort(-1).values))
             for layer, router in enumerate(adapter.routers(model))]
    try:
        result = run()
    finally:
        for hook in hooks:
            hook.remove()
    return result, seen


def check_exact_routing_changes_nothing(model, adapter):
    """Exact routing through the harness: transformers' logits bitwise (forward over left-padded prompts and
    greedy generate), and the same executed sets as the model's own routers."""
    prompts = [random_tokens(adapter.vocab_size, n, 7 + i) for i, n in enumerate((6, 11, 8))]
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        reference, own = own_selection(model, adapter, lambda: model(input_ids=ids, attention_mask=mask).logits)
        with exact_routing(model, adapter, record=True) as context:
            routed = model(input_ids=ids, attention_mask=mask).logits
            selected = context._chunks[0].record["selected"]  # [B, S, L, K], best first
    assert torch.equal(routed, reference)
    for layer in range(adapter.num_moe_layers):  # the same sets as the model's own, not only the same logits
        ours = np.sort(selected[:, :, layer].reshape(-1, adapter.top_k), axis=-1)
        assert np.array_equal(ours, own[layer][0].numpy())
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=5, **GEN)
    with exact_routing(model, adapter):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, **GEN)
    assert torch.equal(out.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, reference.logits))
