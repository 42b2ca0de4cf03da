"""The device policy (`specmoe.engines.device_policy`): with C < E an autoregressive token runs the logical cache
(`DeviceCache`) and its demand and prefetch copies (`expert_copy`) on the device, and decodes exactly as the host
policy: the same tokens, selections, router and pre-gate logits, logits bit for bit, and copies by class, for every
policy kind, routing from the model's own logits or following a logit feed (trace-following). On the CPU the device-policy token runs its Triton kernels in Triton's interpreter (a subprocess);
on a CUDA device (marked gpu) as one captured graph per token, also under injected copy delays."""

import importlib.util

import numpy as np
import pytest
from _interpreter import run_in_interpreter

from specmoe.engines import EngineConfig, build_engine
from specmoe.engines.results import COPY_FIELDS
from specmoe.routing import preset

POLICIES = ("exact_lru", "cache_prior", "psr", "spec_exec")
# copy classes that do not depend on when copies are issued (the host path queues prefetches behind max_in_flight
# and drops those reassigned before issue; the device path copies each at once, and joins it before its layer)
SAME_CLASSES = [COPY_FIELDS.index(name) for name in ("demand", "prefetch", "prefetch_unused", "warm")]
IN_TIME, LATE = COPY_FIELDS.index("prefetch_in_time"), COPY_FIELDS.index("prefetch_late")

# shared by the interpreter script and the gpu tests: device policy against host policy on one model
COMPARE = r"""
import numpy as np
from specmoe.engines import EngineConfig, build_engine
from specmoe.models import load_model
from specmoe.offload import ExpertStore
from specmoe.routing import Calibration, preset


def engines(name, policy_name, capacity, seq, device="cpu", layers=None, experts=None, device_mode="on", **config):
    if layers is None and experts is None:
        model, adapter = load_model(name, seed=0, device=device)
    else:  # the named config cut to its first layers (the interpreter's time is per layer step), or widened
        import torch
        from specmoe.models import adapter_for, named_config
        from specmoe.models.registry import ARCHITECTURES
        hf = named_config(name)
        hf.num_hidden_layers = layers or hf.num_hidden_layers
        hf.num_experts = experts or hf.num_experts
        model = ARCHITECTURES[hf.model_type].build_random(hf, 0, torch.float32, device).eval()
        adapter = adapter_for(hf)
    store = ExpertStore.from_model(model, adapter)
    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    policy = preset(policy_name, capacity, adapter.top_k)
    make = lambda mode: build_engine(model, policy, cal, EngineConfig(max_seq_len=seq, policy_device=mode,  # noqa
                                                                        **config), store=store)
    return make(device_mode), make("off"), adapter


def compare(a, b, same_classes, in_time, late, exact_logits=True):
    assert a.info["routing"] == "device_policy" and b.info["routing"] == "host", (a.info, b.info)
    np.testing.assert_array_equal(a.output_tokens, b.output_tokens)
    np.testing.assert_array_equal(a.selected, b.selected)
    np.testing.assert_array_equal(a.router_logits, b.router_logits)
    np.testing.assert_array_equal(a.pregate_logits, b.pregate_logits)
    if a.logits is not None:
        if exact_logits:
            np.testing.assert_array_equal(a.logits, b.logits)
        else:
            np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-3 * np.abs(b.logits).max())
    np.testing.assert_array_equal(a.copies[:, same_classes], b.copies[:, same_classes])
    # every executed prefetch is in time on the device path; in time + late is the host's
    np.testing.assert_array_equal(a.copies[:, in_time], b.copies[:, in_time] + b.copies[:, late])
    assert not a.copies[:, late].any()
    assert a.unused_at_end == b.unused_at_end
"""

_CHECK = COMPARE + r"""
import sys
from specmoe.engines.results import COPY_FIELDS
sys.path.insert(0, "tests")
from test_device_policy import IN_TIME, LATE, POLICIES, SAME_CLASSES
for policy_name in POLICIES:
    dev, host, adapter = engines("olmoe-tiny", policy_name, 16, 24, layers=4)
    tokens = np.random.default_rng(len(policy_name)).integers(0, adapter.vocab_size, 5)
    a = dev.teacher_forced(tokens, prompt_len=2, return_logits=True)
    b = host.teacher_forced(tokens, prompt_len=2, return_logits=True)
    compare(a, b, SAME_CLASSES, IN_TIME, LATE)
    totals = a.copy_totals(timed_only=False)
    if policy_name == "psr":  # a second run on the same engines: the device state and the copy stream reset
        ga, gb = dev.generate(tokens[:2], 3, return_logits=True), host.generate(tokens[:2], 3, return_logits=True)
        compare(ga, gb, SAME_CLASSES, IN_TIME, LATE)
        assert ga.generated == gb.generated
    print("ok", policy_name, totals, flush=True)
"""


# trace-following: router and pre-gate logits (and tokens) from a synthetic source with the tiny model's L, E, K
FEEDS = r"""
from specmoe.engines.results import LogitFeed
from specmoe.records.synthetic import SOURCES, synthetic_trace
from specmoe.routing import RouterScoring


def feeds(adapter, tokens, seed=0):
    source = SOURCES["olmoe-like"].replace(num_layers=adapter.num_moe_layers)  # the model's depth
    trace = synthetic_trace(source, tokens=tokens, seed=seed)
    assert trace.router_logits.shape[1:] == (adapter.num_moe_layers, adapter.num_experts)
    assert np.abs(trace.pregate_logits[:, 0]).max() > 0  # a pre-gate row of layer 0 that routing must not read
    z, g, ids = trace.router_logits, trace.pregate_logits, trace.token_ids % adapter.vocab_size
    own = LogitFeed(z, g, ids, trace.fingerprint, trace.scoring)  # softmax: routed by the model's rule
    bias = np.random.default_rng(seed).normal(0.0, 0.2, z.shape[1:])
    rule = RouterScoring("sigmoid", renormalise=True, scale=2.5, bias=bias)
    return own, LogitFeed(z, g, ids, trace.fingerprint, rule)  # a sigmoid source: its bias, weights and scale


def check_fed(a, b, feed):
    assert a.info["feed"] and b.info["feed"]
    n = len(a.output_tokens)
    np.testing.assert_array_equal(a.router_logits, feed.router_logits[:n])  # routed from the feed, not the model
    np.testing.assert_array_equal(a.pregate_logits[:, 1:], feed.pregate_logits[:n, 1:])
    assert not a.pregate_logits[:, 0].any()
"""

_CHECK_FED = COMPARE + FEEDS + r"""
import sys
sys.path.insert(0, "tests")
from test_device_policy import IN_TIME, LATE, POLICIES, SAME_CLASSES
for policy_name in POLICIES:
    dev, host, adapter = engines("olmoe-tiny", policy_name, 16, 24, layers=4)
    own, sigmoid = feeds(adapter, 5)
    tokens = np.zeros(5, dtype=np.int64)  # the feed's tokens are fed
    for feed in (own, sigmoid) if policy_name == "psr" else (own,):
        a = dev.teacher_forced(tokens, prompt_len=2, feed=feed, return_logits=True)
        b = host.teacher_forced(tokens, prompt_len=2, feed=feed, return_logits=True)
        compare(a, b, SAME_CLASSES, IN_TIME, LATE)
        check_fed(a, b, feed)
        print("ok", policy_name, feed.scoring.kind, a.copy_totals(timed_only=False), flush=True)
    if policy_name == "psr":  # one device policy per rule; the model's own logits again on the same engines
        assert len(dev._device_policies) == 2, dev._device_policies.keys()
        a = dev.teacher_forced(tokens + 3, prompt_len=2, return_logits=True)
        b = host.teacher_forced(tokens + 3, prompt_len=2, return_logits=True)
        compare(a, b, SAME_CLASSES, IN_TIME, LATE)
        assert not a.info["feed"]
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_device_policy_follows_a_feed_as_the_host_policy_in_the_interpreter():
    """Trace-following on the device policy (the feed's rows staged and copied to the device per token) against
    the host policy with the same feed: a softmax source for every policy kind, a sigmoid one for PSR."""
    done = run_in_interpreter(_CHECK_FED.replace("import numpy as np\n", "import numpy as np\n" + _fast_calls(), 1))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for name in POLICIES:
        assert f"ok {name} softmax " in done.stdout, done.stdout
    assert "ok psr sigmoid " in done.stdout, done.stdout
    psr = done.stdout.split("ok psr softmax ")[1].split("\n")[0]
    assert "'demand': 0," not in psr and "'prefetch': 0," not in psr  # both copy kinds ran


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_device_policy_decodes_as_the_host_policy_in_the_interpreter():
    done = run_in_interpreter(_CHECK.replace("import numpy as np\n", "import numpy as np\n" + _fast_calls(), 1))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for name in POLICIES:
        assert f"ok {name} " in done.stdout, done.stdout
    psr = done.stdout.split("ok psr ")[1].split("\n")[0]
    assert "'demand': 0," not in psr and "'prefetch': 0," not in psr  # both copy kinds ran


def _fast_calls() -> str:
    from _device_cases import FAST_CALLS

    return FAST_CALLS


def test_host_policy_where_the_device_policy_does_not_apply(olmoe_tiny, monkeypatch):
    model, adapter, store, cal = olmoe_tiny
    tokens = np.arange(4)
    psr = preset("psr", 16, adapter.top_k)
    off = build_engine(model, psr, cal, EngineConfig(max_seq_len=16, policy_device="off"), store=store)
    result = off.teacher_forced(tokens)
    assert result.info["routing"] == "host" and result.info["host_policy_why"] == "policy_device='off'"
    assert EngineConfig().policy_device == "auto"  # the default (docs/device-cache.md says why)
    default = build_engine(model, psr, cal, EngineConfig(max_seq_len=16, policy_device="auto"), store=store)
    result = default.teacher_forced(tokens)
    assert result.info["routing"] == "host" and "CPU" in result.info["host_policy_why"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    on = build_engine(model, psr, cal, EngineConfig(max_seq_len=16, policy_device="on"), store=store)
    assert "interpreter" in on.device_policy()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # only the reasons are asked: nothing runs in the interpreter
    assert on.device_policy() is None
    from specmoe.engines.results import LogitFeed

    assert on.device_policy(feed=LogitFeed.of(result)) is None  # trace-following runs on the device too
    on.configure(cache_mode="physical")
    assert "physical" in on.device_policy()
    on.configure(cache_mode="logical", instrument=True)
    assert "instrumented" in on.device_policy()
    resident = build_engine(model, preset("psr", adapter.num_experts, adapter.top_k), cal,
                            EngineConfig(max_seq_len=16, policy_device="auto"), store=store)
    assert "device_routing decides" in resident.device_policy()
    # device routing follows no feed: with one, "auto" leaves the all-resident run to the device policy
    assert "device_routing decides" not in resident.device_policy(feed=LogitFeed.of(result))
    with pytest.raises(ValueError, match="policy_device"):
        EngineConfig(policy_device="gpu")


def test_auto_runs_the_device_policy_where_it_was_measured_faster(olmoe_tiny):
    """On CUDA, "auto" runs the device policy for a policy without prefetch insertions, at any number of experts
    per layer, and keeps the host policy for a prefetching one; "on" runs it for all of them."""
    from specmoe.engines.device_policy import device_policy_reason
    from specmoe.engines.results import LogitFeed

    model, adapter, store, cal = olmoe_tiny
    k = adapter.top_k
    for name, runs in (("cache_prior", True), ("exact_lru", True), ("psr", False), ("spec_exec", False)):
        engine = build_engine(model, preset(name, 16, k), cal, EngineConfig(max_seq_len=16), store=store)
        why = device_policy_reason("auto", True, engine.router, engine.settings, None, 16)
        assert (why is None) == runs, (name, why)
        if not runs:
            assert "prefetch insertions" in why and "policy_device='on'" in why
        assert device_policy_reason("on", True, engine.router, engine.settings, None, 16) is None
    engine = build_engine(model, preset("cache_prior", 16, k), cal, EngineConfig(max_seq_len=16), store=store)
    why = device_policy_reason("auto", True, engine.router, engine.settings, None, 16, chunked_prompt=True)
    assert "prefills in chunks" in why
    assert device_policy_reason("on", True, engine.router, engine.settings, None, 16, chunked_prompt=True) is None
    feed = LogitFeed.of(engine.teacher_forced(np.arange(4)))
    engine.cuda = True  # as on a GPU: which runs chunk their prompt (only the reasons are asked)
    chunk = engine.config.prefill_chunk
    assert "prefills in chunks" in engine.device_policy(prompt=chunk)
    assert engine.device_policy(prompt=chunk - 1) is None  # no whole chunk: the host steps it one at a time too
    assert engine.device_policy(feed=feed, prompt=chunk) is None  # a fed prompt is stepped one at a time on both
    engine.router.num_experts = 256  # as Qwen3.6's router reports it: measured faster on the device there too
    assert device_policy_reason("auto", True, engine.router, engine.settings, None, 16) is None


# (model, policy, C): every policy kind at two capacities on OLMoE; PSR on Qwen3.5-MoE (Gated DeltaNet layers: the
# recurrent and convolution state advance inside the captured token; a renormalised softmax router and the gated
# shared expert)
DECODE_CASES = [("olmoe-tiny", p, c) for c in (32, 16) for p in POLICIES] + [("qwen3.5-moe-tiny", "psr", 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,policy_name,capacity", DECODE_CASES, ids=["-".join(map(str, c)) for c in DECODE_CASES])
def test_gpu_device_policy_decodes_as_the_host_policy(name, policy_name, capacity):
    """One captured graph per token: tokens, selections and copies by class as the host policy's; the logits equal
    to bf16 rounding (the device's float64 exp may move an execution weight by one float32 ulp)."""
    ns = {}
    exec(COMPARE, ns)
    dev, host, adapter = ns["engines"](name, policy_name, capacity, 64, device="cuda")
    tokens = np.random.default_rng(capacity).integers(0, adapter.vocab_size, 40)
    a = dev.teacher_forced(tokens, prompt_len=8, return_logits=True)
    b = host.teacher_forced(tokens, prompt_len=8, return_logits=True)
    assert dev._device_policy.use_graphs and dev._device_policy.graphs, dev.notes
    ns["compare"](a, b, SAME_CLASSES, IN_TIME, LATE, exact_logits=False)
    ga, gb = dev.generate(tokens[:6], 16), host.generate(tokens[:6], 16)
    assert ga.generated == gb.generated and ga.info["routing"] == "device_policy"
    held = dev._device_policy
    dev.configure(policy=dev.policy)  # a new router of the same policy: the device policy and its graph are kept
    again = dev.teacher_forced(tokens, prompt_len=8, return_logits=True)
    assert dev._device_policy is held and dev._device_policy.router is dev.router
    np.testing.assert_array_equal(again.selected, a.selected)
    np.testing.assert_array_equal(again.logits, a.logits)


@pytest.mark.gpu
def test_gpu_auto_takes_the_device_policy_at_256_experts():
    """The default policy_device="auto" at Qwen3.6's 256 experts per layer (where the H200 measured Cache-Prior
    1.31x faster on the device policy than on the host's): a Qwen3.5-MoE of 256 experts runs Cache-Prior on the
    device policy, with the tokens, selections and copies of the host policy."""
    ns = {}
    exec(COMPARE, ns)
    dev, host, adapter = ns["engines"]("qwen3.5-moe-tiny", "cache_prior", 64, 64, device="cuda", experts=256,
                                       device_mode="auto")
    assert adapter.num_experts == 256 and dev.config.policy_device == EngineConfig().policy_device == "auto"
    tokens = np.random.default_rng(11).integers(0, adapter.vocab_size, 40)
    a = dev.teacher_forced(tokens, prompt_len=8, return_logits=True)
    b = host.teacher_forced(tokens, prompt_len=8, return_logits=True)
    ns["compare"](a, b, SAME_CLASSES, IN_TIME, LATE, exact_logits=False)
    assert a.copies.sum() > 0  # C = 64 of 256: the comparison covers demand copies


@pytest.mark.gpu
@pytest.mark.parametrize("policy_name", POLICIES)
def test_gpu_device_policy_follows_a_feed_as_the_host_policy(policy_name):
    """Trace-following in the captured graph (the feed's rows copied in by the graph's first node): tokens,
    selections and copies by class as the host policy's with the same feed (a softmax source, and for PSR a
    sigmoid one); then the model's own logits on the same engine (its other graph)."""
    ns = {}
    exec(COMPARE + FEEDS, ns)
    dev, host, adapter = ns["engines"]("olmoe-tiny", policy_name, 16, 64, device="cuda")
    own, sigmoid = ns["feeds"](adapter, 40, seed=3)
    tokens = np.zeros(40, dtype=np.int64)
    for feed in (own, sigmoid) if policy_name == "psr" else (own,):
        a = dev.teacher_forced(tokens, prompt_len=8, feed=feed, return_logits=True)
        b = host.teacher_forced(tokens, prompt_len=8, feed=feed, return_logits=True)
        assert dev._device_policy.use_graphs and dev._device_policy.fed and dev._device_policy.graphs, dev.notes
        ns["compare"](a, b, SAME_CLASSES, IN_TIME, LATE, exact_logits=False)
        ns["check_fed"](a, b, feed)
    mine = np.random.default_rng(5).integers(0, adapter.vocab_size, 24)
    a = dev.teacher_forced(mine, prompt_len=4, return_logits=True)
    b = host.teacher_forced(mine, prompt_len=4, return_logits=True)
    ns["compare"](a, b, SAME_CLASSES, IN_TIME, LATE, exact_logits=False)


@pytest.mark.gpu
def test_gpu_device_policy_is_independent_of_copy_timing():
    """Delays before every demand and prefetch copy (the prefetch branch made slower than the layer it overlaps):
    the same tokens, selections, copies by class and logits bit for bit as without delays; a branch not joined
    before its layer would compute on stale slots and change the logits. Copies skipped: the same selections."""
    ns = {}
    exec(COMPARE, ns)
    dev, _, adapter = ns["engines"]("olmoe-tiny", "psr", 16, 64, device="cuda")
    tokens = np.random.default_rng(7).integers(0, adapter.vocab_size, 32)
    base = dev.teacher_forced(tokens, prompt_len=4, return_logits=True)
    for seed in (1, 2):
        dev.configure(copy_delay=(2e-4, 1e-3), delay_seed=seed)
        slow = dev.teacher_forced(tokens, prompt_len=4, return_logits=True)
        assert slow.info["routing"] == "device_policy"
        np.testing.assert_array_equal(slow.output_tokens, base.output_tokens)
        np.testing.assert_array_equal(slow.selected, base.selected)
        np.testing.assert_array_equal(slow.logits, base.logits)
        np.testing.assert_array_equal(slow.copies, base.copies)
    assert len(dev._device_policy.graphs) == 3  # one graph per copy setting
    dev.configure(copy_delay=None, skip_copies=True)
    skipped = dev.teacher_forced(tokens, prompt_len=4, return_logits=True)
    np.testing.assert_array_equal(skipped.selected[0, 0], base.selected[0, 0])  # later layers read stale slots
    assert skipped.copies[:, COPY_FIELDS.index("issued")].sum() == 0
    assert skipped.copies[:, COPY_FIELDS.index("skipped")].sum() > 0
