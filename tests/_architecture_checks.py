"""What the harness tests of every architecture beyond OLMoE share (tests/test_deepseek_v3.py,
tests/test_qwen3_5_moe.py): seeded prompts, a tiny named config written by save_pretrained and loaded back, the
executed sets of transformers' own routers, and the check that exact routing changes nothing; and what several
test files build or check alike: left-padded batches, Qwen3.5-MoE's shipped image-text layout, and the family's
loop-against-walk tau cross-check."""

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


def image_text_qwen(model):
    """A Qwen3_5MoeForConditionalGeneration (the shipped layout: model_type qwen3_5_moe, tensors under
    model.language_model.) holding the text model `model`'s weights, with a one-layer vision tower."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    config = Qwen3_5MoeConfig(text_config=model.config.to_dict(),
                              vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                                 out_hidden_size=64))
    full = Qwen3_5MoeForConditionalGeneration(config).eval()
    full.model.language_model.load_state_dict(model.model.state_dict())
    full.lm_head.load_state_dict(model.lm_head.state_dict())
    return full


def assert_loop_agrees_with_the_walk(target, ar, dflash, prompt, new: int, k: int) -> None:
    """The family's tau cross-check (`tau_crosscheck`) on one prompt [S]: with each drafter the speculative loop
    commits the target's greedy text and every block agrees with the teacher-forced walk."""
    from specmoe_train.evaluate import ar_accept_runs, dflash_accept_lengths, greedy_continuation
    from specmoe_train.family import tau_crosscheck

    greedy = greedy_continuation(target, prompt[None], new)
    match = ar_accept_runs(ar, greedy)
    accepted = dflash_accept_lengths(target, dflash, greedy, prompt.numel() - 1, k)
    check = tau_crosscheck(target, ar, dflash, prompt[None], greedy, match, accepted, prompt.numel(), (k,),
                           log=lambda message: None)
    for name in ("ar_drafter", "dflash_drafter"):
        result = check[f"k{k}_{name}"]
        assert result["prompts_with_identical_tokens"] == 1, name  # committed text = the target's greedy text
        assert result["blocks"] > 0 and result["blocks_agreeing"] == result["blocks"], name
