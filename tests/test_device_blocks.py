"""Verification blocks on the device (`specmoe.engines.device_blocks`): a block's selection, expert pool, demand
copies and refill moves decided on the device make the host path's decisions bit for bit: the same tokens,
accepted lengths, selections, pool state (slot table, members, recency, counters), copies and moves, union slots
used, for exact, acceptmoe and confidence_top1, generating with the family's AR drafter and following synthetic
blocks. On the CPU the block's kernels run in Triton's interpreter (a subprocess); on a CUDA device (marked gpu)
as one captured graph per block, also under injected copy delays."""

import importlib.util

import numpy as np
import pytest
from _interpreter import run_in_interpreter

from specmoe.engines import EngineConfig, build_engine
from specmoe.offload import ExpertResidency
from specmoe.speculation import SpeculativeConfig
from specmoe.verifiers import selector_preset

SELECTORS = ("exact", "acceptmoe", "confidence_top1")

# shared by the interpreter script and the gpu tests: the device blocks against the host path on one model
COMPARE = r"""
import dataclasses
import numpy as np
from specmoe.engines import EngineConfig, build_engine
from specmoe.offload import CopyStats, ExpertResidency, ExpertStore
from specmoe.routing import Calibration
from specmoe.speculation import SpeculativeConfig
from specmoe.verifiers import selector_preset


def engines(model, adapter, selector, k, pool, new, seq, device="cpu", **spec):
    store = ExpertStore.from_model(model, adapter)
    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    config = SpeculativeConfig(selector_preset(selector), k=k, pool_size=pool, max_new_tokens=new, **spec)
    residency = ExpertResidency(store, adapter.num_experts, device)  # shared: runs alternate between the engines
    make = lambda mode: build_engine(model, None, cal, EngineConfig(max_seq_len=seq, block_device=mode),  # noqa
                                     speculative=config, residency=residency)
    return make("on"), make("off")


def state(engine):
    pool = engine.block_router.pool
    return (pool.slot.copy(), pool.pool_mask.copy(), pool.recency.copy(), pool.block, pool.totals(),
            pool.copies.copy(), pool.moves.copy(), engine.union_used)


def run(engine, go):
    before = dataclasses.replace(engine.copies.stats)
    out = go(engine)
    after = engine.copies.stats
    return out, state(engine), {f: getattr(after, f) - getattr(before, f) for f in after.FIELDS}


def counted(c):
    # copy counts that depend neither on the path nor on the copy timing: warm copies depend on which engine of the
    # shared unit ran last; a prefetch hit is in time or late by the host path's copy timing (a generation's
    # prefill runs there), always in time on the device path (joined before the layer)
    return {**c, "warm": 0, "prefetch_in_time": c["prefetch_in_time"] + c["prefetch_late"], "prefetch_late": 0}


def per_block(copies):
    # a block's copy counts as `counted` takes them: a prefetch hit is in time or late by the host path's copy timing
    fields = list(CopyStats.FIELDS)
    merged = np.array(copies, dtype=np.int64)
    merged[:, fields.index("prefetch_in_time")] += merged[:, fields.index("prefetch_late")]
    merged[:, fields.index("prefetch_late")] = 0
    return merged


def same(a, b):
    (ra, sa, ca), (rb, sb, cb) = a, b
    for x, y in zip(ra if isinstance(ra, list) else [ra], rb if isinstance(rb, list) else [rb], strict=True):
        assert x.info["verify"] == "device" and y.info["verify"] == "host", (x.info, y.info)
        assert x.info["host_blocks_why"] is None and y.info["host_blocks_why"] == "block_device='off'"
        assert x.tokens == y.tokens and list(x.accepted) == list(y.accepted)
        assert len(x.block_selected) == len(y.block_selected)
        for p, q in zip(x.block_selected, y.block_selected, strict=True):
            np.testing.assert_array_equal(p, q)
        np.testing.assert_array_equal(per_block(x.copies), per_block(y.copies))
        np.testing.assert_allclose(x.displaced, y.displaced, rtol=1e-9)
    for p, q in zip(sa, sb, strict=True):
        if isinstance(p, np.ndarray):
            np.testing.assert_array_equal(p, q)
        else:
            assert p == q, (p, q)
    assert counted(ca) == counted(cb), (ca, cb)
    assert ca["demand"] > 0 and ca["moved"] > 0, ca
    if x.info["prefetch"]:  # the blocks' prefetch hits count in time (joined before their layer); a late one can
        # come only from the prefill's host-path copies, by their timing (counted above), so none is asserted here
        assert ca["prefetch_in_time"] > 0 and ca["prefetch_unused"] > 0, ca
    return ca
"""

_CHECK = COMPARE + r"""
import sys
from specmoe.assets import family_path
from specmoe.drafters import DrafterConfig, build_drafter
from specmoe.models import load_model
from specmoe.records import AcceptanceProfile, synthetic_blocks
from specmoe.records.synthetic import synthetic_trace
import json

model, adapter = load_model(str(family_path("target")))
drafter = build_drafter(DrafterConfig("ar"), model)
text = json.loads((family_path().parent / "metrics.json").read_text())["slice"]["slice"]["token_ids"][1]
trace = synthetic_trace("olmoe-like", tokens=24, seed=1)
blocks = synthetic_blocks(trace, 4, AcceptanceProfile.geometric(0.6), seed=3, max_blocks=3)
for selector in sys.argv[1:] or ("exact", "acceptmoe", "confidence_top1"):
    dev, host = engines(model, adapter, selector, 4, 32, 8, 64)
    gen = lambda e: e.generate(text[:12], 8, drafter=drafter, record=True)  # noqa
    counts = same(run(dev, gen), run(host, gen))
    print("ok generate", selector, counts, flush=True)
    if selector not in globals().get("FOLLOW", (selector,)):  # the selectors that also follow blocks
        continue
    fol = lambda e: e.follow(blocks, first_position=12, record=True)  # noqa
    counts = same(run(dev, fol), run(host, fol))
    print("ok follow", selector, counts, flush=True)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_device_blocks_verify_as_the_host_path_in_the_interpreter():
    from _device_cases import FAST_CALLS

    # every selector generates; one follows blocks (the fed path: the prefetch test below follows with acceptmoe,
    # and on the GPU every selector follows)
    script = _CHECK.replace("import numpy as np\n", "import numpy as np\n" + FAST_CALLS + "FOLLOW = ('exact',)\n", 1)
    done = run_in_interpreter(script, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for name in SELECTORS:
        assert f"ok generate {name} " in done.stdout, done.stdout
    assert "ok follow exact " in done.stdout and done.stdout.count("ok follow") == 1, done.stdout


# the block prefetch on the device: the prediction from each position's pre-gate logits, its copies and the
# placement of the block's missing experts (hits stay where they were copied) as the host path's
# (confidence_top1 and a budget that spills are covered by the kernel check, tests/test_device_select.py, and on the
# GPU by test_gpu_device_blocks_verify_as_the_host_path)
_PREFETCH = _CHECK.replace('for selector in sys.argv[1:] or ("exact", "acceptmoe", "confidence_top1"):',
                           'for selector, budget in (("acceptmoe", 4),):').replace(
    "engines(model, adapter, selector, 4, 32, 8, 64)",
    "engines(model, adapter, selector, 4, 32, 8, 64, prefetch=budget)")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_device_blocks_prefetch_as_the_host_path_in_the_interpreter():
    from _device_cases import FAST_CALLS

    assert _PREFETCH != _CHECK
    script = _PREFETCH.replace("import numpy as np\n",
                               "import numpy as np\n" + FAST_CALLS + "FOLLOW = ('acceptmoe',)\n", 1)
    done = run_in_interpreter(script, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "ok generate acceptmoe " in done.stdout and "ok follow acceptmoe " in done.stdout, done.stdout


# union slots sized by measurement (U below a block's worst case): the same run where they suffice, the host path's
# error where a block's layer misses more
_UNION = COMPARE + r"""
from specmoe.drafters import DrafterConfig, build_drafter
from specmoe.models import load_model

model, adapter = load_model("olmoe-tiny", seed=0)
model.set_experts_implementation("eager")
drafter = build_drafter(DrafterConfig("synthetic", acceptance=0.6), model)
prompt = np.random.default_rng(7).integers(4, adapter.vocab_size, 12).tolist()
gen = lambda e: e.generate(prompt, 5, drafter=drafter, record=True)  # noqa
dev, host = engines(model, adapter, "acceptmoe", 4, 32, 8, 64, union_slots=10)  # the worst case: min(32, 5 x 8)
assert dev.device_blocks() is None
print("ok fits", same(run(dev, gen), run(host, gen)), dev.union_used, flush=True)
errors = []
for engine in engines(model, adapter, "exact", 4, 32, 8, 64, union_slots=16):
    try:
        engine.generate(prompt, 8, drafter=drafter)
    except ValueError as exc:
        errors.append(str(exc))
assert len(errors) == 2 and errors[0] == errors[1] and "union slots' worth of experts" in errors[0], errors
print("ok over", errors[0], flush=True)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_device_blocks_with_union_slots_sized_by_measurement_in_the_interpreter():
    from _device_cases import FAST_CALLS

    done = run_in_interpreter(_UNION.replace("import numpy as np\n", "import numpy as np\n" + FAST_CALLS, 1))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "ok fits " in done.stdout and "ok over verification block at position 12: layer 2 misses" in done.stdout, \
        done.stdout


# other architectures: Qwen3.5-MoE (Gated DeltaNet layers, rolled back after each block) and DeepSeek-V3 (a
# sigmoid router with a selection bias and expert groups), with the synthetic drafter
_OTHER = COMPARE + r"""
import sys
from specmoe.drafters import DrafterConfig, build_drafter
from specmoe.models import load_model

name, selector = sys.argv[1:]
model, adapter = load_model(name, seed=0)
model.set_experts_implementation("eager")
drafter = build_drafter(DrafterConfig("synthetic", acceptance=0.6), model)
prompt = np.random.default_rng(7).integers(4, adapter.vocab_size, 12).tolist()
dev, host = engines(model, adapter, selector, 4, adapter.num_experts // 2, 8, 64)
gen = lambda e: e.generate(prompt, 8, drafter=drafter, record=True)  # noqa
print("ok", name, selector, same(run(dev, gen), run(host, gen)), flush=True)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("name, selector", [("qwen3.5-moe-tiny", "acceptmoe"),
                                            ("deepseek-v3-tiny-groups", "confidence_top1")])
def test_device_blocks_on_other_architectures_in_the_interpreter(name, selector):
    from _device_cases import FAST_CALLS

    script = f"import sys\nsys.argv = ['-', {name!r}, {selector!r}]\n" + _OTHER
    done = run_in_interpreter(script.replace("import numpy as np\n", "import numpy as np\n" + FAST_CALLS, 1))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert f"ok {name} {selector} " in done.stdout, done.stdout


def test_host_path_where_the_device_blocks_do_not_apply(olmoe_tiny, monkeypatch):
    model, adapter, store, cal = olmoe_tiny

    def engine(mode, **spec):
        config = SpeculativeConfig(selector_preset("acceptmoe"), k=4, pool_size=32, **spec)
        return build_engine(model, None, cal, EngineConfig(max_seq_len=32, block_device=mode), speculative=config,
                            residency=ExpertResidency(store, adapter.num_experts, "cpu"))

    assert engine("off").device_blocks() == "block_device='off'"
    assert "CPU" in engine("auto").device_blocks()
    assert EngineConfig().block_device == "auto"  # the default: the device path where it applies
    assert "CPU" in build_engine(model, None, cal, EngineConfig(max_seq_len=32), speculative=SpeculativeConfig(
        selector_preset("acceptmoe"), k=4, pool_size=32),
        residency=ExpertResidency(store, adapter.num_experts, "cpu")).device_blocks()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "interpreter" in engine("on").device_blocks()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # only the reasons are asked: nothing runs in the interpreter
    assert engine("on").device_blocks() is None
    assert engine("on", prefetch=4).device_blocks() is None  # the block prefetch runs on the device too
    assert engine("on", union_slots=16).device_blocks() is None  # U below the worst case: checked per block
    with pytest.raises(ValueError, match="block_device"):
        EngineConfig(block_device="gpu")


@pytest.fixture(scope="module")
def gpu_family():
    """The family's target on CUDA (float32) and its AR drafter, unpatched after the module."""
    from specmoe.assets import family_path
    from specmoe.drafters import DrafterConfig, build_drafter
    from specmoe.harness import unpatch
    from specmoe.models import load_model

    model, adapter = load_model(str(family_path("target")), device="cuda")
    yield model, adapter, build_drafter(DrafterConfig("ar"), model)
    unpatch(model)


@pytest.mark.gpu
@pytest.mark.parametrize("selector, prefetch", [(s, 0) for s in SELECTORS] + [("acceptmoe", 4),
                                                                               ("confidence_top1", 32)])
def test_gpu_device_blocks_verify_as_the_host_path(selector, prefetch, gpu_family, family_text):
    """One captured graph per block (k = 8 and 16): tokens, accepted lengths, selections, the pool and the copies
    and moves as the host path's, generating with the family's AR drafter and following synthetic blocks; with a
    block prefetch budget, its prediction, copies and placement too."""
    from specmoe.records import AcceptanceProfile, synthetic_blocks
    from specmoe.records.synthetic import synthetic_trace

    ns = {}
    exec(COMPARE, ns)
    model, adapter, drafter = gpu_family
    trace = synthetic_trace("olmoe-like", tokens=400, seed=1)
    for k in (8, 16):
        dev, host = ns["engines"](model, adapter, selector, k, 32, 48, 512, device="cuda", prefetch=prefetch)
        blocks = synthetic_blocks(trace, k, AcceptanceProfile.geometric(0.8), seed=k)
        gen = lambda e: e.generate(family_text[:32], 48, drafter=drafter, record=True)  # noqa: E731
        ns["same"](ns["run"](dev, gen), ns["run"](host, gen))
        held = dev._device_blocks[dev.speculative]
        assert held.use_graphs and held.graphs, dev.notes
        fol = lambda e: e.follow(blocks, first_position=32, record=True)  # noqa: E731
        ns["same"](ns["run"](dev, fol), ns["run"](host, fol))
        again = ns["run"](dev, gen)  # a second run on the same engine: its graphs kept, the pool loaded again
        ns["same"](again, ns["run"](host, gen))
        assert dev._device_blocks[dev.speculative] is held


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [0, 4])
def test_gpu_device_blocks_are_independent_of_copy_timing(prefetch, gpu_family, family_text):
    """Delays before every demand copy, prefetch copy and refill move: the same tokens, selections, pool and copies
    as without (a copy or a move not ordered before the kernels that read its slots would change the tokens);
    copies skipped (following blocks, whose selection reads recorded logits): the same selections and pool,
    nothing issued."""
    ns = {}
    exec(COMPARE, ns)
    model, adapter, drafter = gpu_family
    dev, host = ns["engines"](model, adapter, "acceptmoe", 8, 32, 48, 512, device="cuda", prefetch=prefetch)
    gen = lambda e: e.generate(family_text[:32], 48, drafter=drafter, record=True)  # noqa: E731
    ns["run"](dev, gen)  # every run below starts from the slots this request leaves (its warm copies depend on them)
    base = ns["run"](dev, gen)
    for seed in (1, 2):
        dev.configure(copy_delay=(2e-4, 1e-3), delay_seed=seed)
        slow = ns["run"](dev, gen)
        assert slow[0].tokens == base[0].tokens and list(slow[0].accepted) == list(base[0].accepted)
        for p, q in zip(slow[0].block_selected, base[0].block_selected, strict=True):
            np.testing.assert_array_equal(p, q)
        assert ns["counted"](slow[2]) == ns["counted"](base[2])
    assert len(dev._device_blocks[dev.speculative].graphs) == 3  # one graph per copy setting
    from specmoe.records import AcceptanceProfile, synthetic_blocks
    from specmoe.records.synthetic import synthetic_trace

    blocks = synthetic_blocks(synthetic_trace("olmoe-like", tokens=200, seed=2), 8, AcceptanceProfile.geometric(0.8))
    fol = lambda e: e.follow(blocks, first_position=32, record=True)  # noqa: E731
    dev.configure(copy_delay=None)
    full = ns["run"](dev, fol)
    dev.configure(skip_copies=True)
    skipped = ns["run"](dev, fol)  # selection reads the blocks' recorded logits: every decision as with copies
    assert skipped[0][0].info["verify"] == "device"
    assert skipped[2]["issued"] == 0 and skipped[2]["skipped"] == full[2]["demand"] + full[2]["prefetch"] > 0
    assert (full[2]["prefetch"] > 0) == (prefetch > 0)
    for p, q in zip(skipped[0][0].block_selected, full[0][0].block_selected, strict=True):
        np.testing.assert_array_equal(p, q)
    np.testing.assert_array_equal(skipped[1][0], full[1][0])  # the pool's slot table


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3.5-moe-tiny", "deepseek-v3-tiny-groups"])
def test_gpu_device_blocks_on_other_architectures(name):
    """Qwen3.5-MoE (recurrent state rolled back after each captured block) and DeepSeek-V3 (sigmoid router, bias,
    groups) on CUDA: the same tokens, selections, pool and copies as the host path, every selector."""
    from specmoe.drafters import DrafterConfig, build_drafter
    from specmoe.models import load_model

    ns = {}
    exec(COMPARE, ns)
    model, adapter = load_model(name, seed=0, device="cuda")
    model.set_experts_implementation("eager")
    drafter = build_drafter(DrafterConfig("synthetic", acceptance=0.6), model)
    prompt = np.random.default_rng(7).integers(4, adapter.vocab_size, 24).tolist()
    for selector in SELECTORS:
        dev, host = ns["engines"](model, adapter, selector, 8, adapter.num_experts // 2, 32, 128, device="cuda")
        gen = lambda e: e.generate(prompt, 32, drafter=drafter, record=True)  # noqa: E731
        ns["same"](ns["run"](dev, gen), ns["run"](host, gen))
