"""The harness's speculative loop against the public DFlash decoding loop (`dflash.model.dflash_generate`, the
`dflash` package on PyPI): on the shipped family target with the shipped DFlash drafter, greedy, exact
selection with every expert in the pool (P = E) and k = block_size - 1, both commit the same tokens in the
same blocks: the first new token from the prefill, then blocks of the same acceptance lengths (tau is
`dflash_generate`'s acceptance length)."""

import time

import pytest
import torch

from specmoe.assets import family_path
from specmoe.drafters import DrafterConfig, build_drafter
from specmoe.harness import speculative_generate
from specmoe.speculation import SpeculativeConfig
from specmoe.verifiers import selector_preset

public = pytest.importorskip("dflash.model", reason="the dflash package (the `dflash` extra) is not installed")

NEW = 40
PROMPT_LENGTHS = (40, 80, 120)


@pytest.fixture(scope="module")
def public_drafter(family):
    """The shipped DFlash drafter loaded with the public package's model class, as `build_drafter` loads it."""
    param = next(family[0].parameters())
    model = public.DFlashDraftModel.from_pretrained(str(family_path("dflash_drafter")), dtype=param.dtype,
                                                    local_files_only=True)
    return model.to(param.device).eval()


def public_generate(drafter, target, prompt: list[int], max_new_tokens: int):
    """`dflash_generate`, greedy, with its statistics (new tokens, acceptance length of every block). Its
    statistics time the loop with `torch.cuda.synchronize`, which a CPU-only torch refuses: plain wall time
    here."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(public, "_cuda_time", time.perf_counter)
        out = public.dflash_generate(drafter, target, torch.tensor([prompt]), max_new_tokens, None,
                                     temperature=0.0, return_stats=True)
    return out.output_ids[0, len(prompt):].tolist(), list(out.acceptance_lengths)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_blocks_and_tokens_match_the_public_dflash_loop(family, family_text, public_drafter, length):
    model, adapter = family
    prompt = family_text[:length]
    k = public_drafter.block_size - 1
    # The public loop shrinks its last blocks to fit max_new_tokens (fewer mask tokens change a DFlash pass's
    # drafts); asked for one block more, every block that covers our NEW tokens is a full one.
    tokens, lengths = public_generate(public_drafter, model, prompt, NEW + public_drafter.block_size)
    drafter = build_drafter(DrafterConfig("dflash"), model)
    config = SpeculativeConfig(selector_preset("exact"), k=k, pool_size=adapter.num_experts, max_new_tokens=NEW)
    result = speculative_generate(model, adapter, drafter, prompt, config, divergence=False)

    assert result.tokens.tolist() == tokens[:NEW]
    ours = [a + 1 for a in result.accepted]
    assert ours == lengths[:len(ours)]
    # the first new token is in no block: the blocks commit the other NEW - 1 (the last one cut)
    assert sum(ours[:-1]) < NEW - 1 <= sum(ours)
    roots = [length + sum(ours[:i]) for i in range(len(ours))]  # the first root is the first new token
    assert result.roots == roots
