"""The MoE kernels' launch parameters: tuned once per device and shape on CUDA, cached on disk, read back by
later builds (`specmoe.kernels.tuning`). The tuner is a stand-in here (no GPU); the GPU test builds an
engine twice."""

import json

import pytest
import torch

from specmoe.engines import EngineConfig
from specmoe.kernels import tuning
from specmoe.kernels.tuning import cache_key, cache_path, check_tune, launch_params, read_cache, write_entry

GPU = {"device": "NVIDIA H200", "capability": "9.0", "torch": "2.9.0", "triton": "3.5.0"}
SHAPE = {"hidden": 2048, "inter": 1024, "top_k": 8, "dtype": "bfloat16"}
CANDIDATES = ({"b": 16}, {"b": 8}, {"b": 4})
DEFAULTS = {"b": 16}


class Tuner:
    """A stand-in tuner: counts its calls, picks `pick`."""

    def __init__(self, pick=1):
        self.calls, self.pick = 0, pick

    def __call__(self):
        self.calls += 1
        return dict(CANDIDATES[self.pick]), {0: 0.3, 1: 0.1, 2: 0.2}


def choose(tune, path, tuner, identity=GPU, shape=SHAPE):
    return launch_params(tune, "slot_moe", shape, identity, CANDIDATES, DEFAULTS, tuner, path)


def test_key_names_device_versions_kernel_and_shape():
    key = cache_key(GPU, "slot_moe", SHAPE)
    assert key == cache_key(dict(reversed(GPU.items())), "slot_moe", dict(reversed(SHAPE.items())))
    assert json.loads(key) == {**GPU, "kernel": "slot_moe", "shape": SHAPE}
    others = [cache_key({**GPU, field: "other"}, "slot_moe", SHAPE) for field in GPU]
    others += [cache_key(GPU, "grouped_slot_moe", SHAPE), cache_key(GPU, "slot_moe", {**SHAPE, "dtype": "float16"}),
               cache_key(GPU, "slot_moe", {**SHAPE, "hidden": 4096})]
    assert len({key, *others}) == len(others) + 1


def test_cache_path_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(tuning.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == tmp_path / "xdg" / "specmoe" / "kernel_tuning.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_path() == tmp_path / "home" / ".cache" / "specmoe" / "kernel_tuning.json"
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "mine.json"))
    assert cache_path() == tmp_path / "mine.json"


def test_write_and_read_keep_other_entries_and_leave_no_temporary_file(tmp_path):
    path = tmp_path / "sub" / "tuning.json"
    assert read_cache(path) == ({}, None)
    write_entry(path, "a", {"params": {"b": 8}})
    write_entry(path, "b", {"params": {"b": 4}})
    write_entry(path, "a", {"params": {"b": 16}})
    entries, note = read_cache(path)
    assert note is None and entries == {"a": {"params": {"b": 16}}, "b": {"params": {"b": 4}}}
    assert [p.name for p in path.parent.iterdir()] == ["tuning.json"]


def test_auto_tunes_once_then_reads_the_cache(tmp_path):
    path, tuner = tmp_path / "tuning.json", Tuner()
    first = choose("auto", path, tuner)
    assert (first.params, first.source, tuner.calls) == ({"b": 8}, "tuned", 1)
    assert any("tuned" in n and str(path) in n for n in first.notes), first.notes
    second = choose("auto", path, tuner)
    assert (second.params, second.source, tuner.calls) == ({"b": 8}, "cache", 1)
    assert any("read from the tuning cache" in n for n in second.notes), second.notes
    # another shape or device is another entry: tuned once more
    assert choose("auto", path, tuner, shape={**SHAPE, "top_k": 4}).source == "tuned" and tuner.calls == 2
    assert choose("auto", path, tuner, identity={**GPU, "device": "NVIDIA A100"}).source == "tuned"
    assert tuner.calls == 3 and len(read_cache(path)[0]) == 3


def test_true_tunes_again_and_overwrites_false_and_cpu_use_the_defaults(tmp_path):
    path = tmp_path / "tuning.json"
    choose("auto", path, Tuner(pick=1))
    again = Tuner(pick=2)
    assert choose(True, path, again).params == {"b": 4} and again.calls == 1
    assert choose("auto", path, again).params == {"b": 4} and again.calls == 1  # the overwritten entry
    never = Tuner()
    fixed = choose(False, path, never)
    assert (fixed.params, fixed.source, fixed.notes) == (DEFAULTS, "defaults", ())
    cpu = choose("auto", path, never, identity=None)
    assert (cpu.params, cpu.source, cpu.notes) == (DEFAULTS, "defaults", ())
    assert "tuning needs CUDA" in choose(True, path, never, identity=None).notes[0]
    assert never.calls == 0


@pytest.mark.parametrize("content,what", [("{not json", "is not valid JSON"),
                                          ('{"some": "other tool"}', "is not a 'specmoe kernel tuning' file"),
                                          (json.dumps({"format": "specmoe kernel tuning", "version": 1,
                                                       "entries": {}}), "of version 2"),  # timed eagerly
                                          (b"\xff\xfe\x00", "unreadable")])
def test_corrupt_or_foreign_cache_is_ignored_with_a_note_and_replaced(tmp_path, content, what):
    path = tmp_path / "tuning.json"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    tuner = Tuner()
    choice = choose("auto", path, tuner)
    assert choice.source == "tuned" and tuner.calls == 1
    assert any(what in n and "ignored" in n for n in choice.notes), choice.notes
    assert choose("auto", path, tuner).source == "cache" and tuner.calls == 1  # the file was replaced


def test_stale_entry_not_among_the_candidates_is_tuned_again(tmp_path):
    path, tuner = tmp_path / "tuning.json", Tuner()
    write_entry(path, cache_key(GPU, "slot_moe", SHAPE), {"params": {"b": 3}})
    choice = choose("auto", path, tuner)
    assert choice.source == "tuned" and tuner.calls == 1
    assert any("not one of the current candidates" in n for n in choice.notes), choice.notes


def test_unwritable_cache_is_a_note_not_a_crash(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    choice = choose("auto", blocker / "tuning.json", Tuner())  # a directory that cannot be made
    assert choice.source == "tuned" and choice.params == {"b": 8}
    assert any("could not be written" in n for n in choice.notes), choice.notes


@pytest.mark.parametrize("bad", ["yes", "on", 1, 0, None, "Auto"])
def test_tune_validation_names_the_values(bad):
    with pytest.raises(ValueError, match=r"tune must be 'auto' .*True .*False .*got"):
        check_tune(bad)
    with pytest.raises(ValueError, match="tune must be"):
        EngineConfig(tune=bad)
    assert EngineConfig().tune == "auto" and EngineConfig(tune=False).tune is False


def test_kernel_wrappers_key_by_shape_and_call_their_tuner_once(monkeypatch, tmp_path):
    """`moe_launch_params` / `grouped_launch_params`: on a (stand-in) CUDA device the first call runs the
    kernel's tuner, the second reads the cache; the grouped kernel's entries are per D."""
    from specmoe.kernels import grouped_moe, moe

    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "tuning.json"))
    calls = []
    for module in (moe, grouped_moe):
        monkeypatch.setattr(module, "device_identity", lambda device: GPU)
    monkeypatch.setattr(moe, "tune_moe", lambda *a: calls.append("moe") or (dict(moe.MOE_CANDIDATES[2]), {2: 0.1}))
    monkeypatch.setattr(grouped_moe, "tune_grouped_moe", lambda buf, d, *a: calls.append(d) or (
        dict(grouped_moe.GROUPED_CANDIDATES[1]), {1: 0.1}))
    buf = torch.zeros(16, 3 * 8 * 4, dtype=torch.bfloat16)
    for _ in range(2):
        assert moe.moe_launch_params("auto", buf, 2, 8, 4).params == moe.MOE_CANDIDATES[2]
        for d in (5, 9):
            choice = grouped_moe.grouped_launch_params("auto", buf, d, 2, 8, 4)
            assert choice.params == grouped_moe.GROUPED_CANDIDATES[1]
    assert calls == ["moe", 5, 9]
    assert moe.moe_launch_params(False, buf, 2, 8, 4).params == moe.MOE_DEFAULTS


def test_decoder_records_the_launch_parameters_that_run(monkeypatch, tmp_path):
    """OLMoE's decoder: `use_kernels` returns `launch` (kernel -> params and source); on the CPU the torch
    path runs, so nothing is launched with Triton parameters."""
    from specmoe.engines.helpers import random_model_on_device
    from specmoe.models.olmoe_decode import OlmoeDecoder
    from specmoe.offload import ExpertStore

    model, adapter = random_model_on_device("olmoe-micro", 0, torch.float32, "cpu")
    store = ExpertStore.from_model(model, adapter)
    decoder = OlmoeDecoder.from_model(model, 16)
    kernels = decoder.use_kernels("auto", "auto", "slot", store.layers[0][:16], tune="auto")
    assert kernels["backend"] == "torch" and kernels["launch"] == {} and kernels["launch"] is decoder.launch
    with pytest.raises(ValueError, match="tune must be"):
        decoder.use_kernels("auto", "auto", "slot", store.layers[0][:16], tune="always")


@pytest.mark.gpu
def test_second_build_reads_the_cache_and_picks_the_same_params(monkeypatch, tmp_path):
    """On CUDA: the first build tunes (source "tuned"), the second reads the cache file ("cache") and runs
    the same launch parameters, for the per-token kernel and the grouped kernel of a D = 5 step (chosen when
    the step is made), and the cache holds those and the one-row linears' entries; tune=False runs the
    defaults."""
    from specmoe.engines import build_engine
    from specmoe.engines.helpers import random_model_on_device
    from specmoe.kernels import MOE_DEFAULTS, grouped_params
    from specmoe.offload import ExpertStore
    from specmoe.routing import Calibration, preset

    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "tuning.json"))
    model, adapter = random_model_on_device("olmoe-1b-7b", seed=0, dtype=torch.bfloat16, device="cuda")
    store = ExpertStore.from_model(model, adapter)
    L, E, K, V = adapter.num_moe_layers, adapter.num_experts, adapter.top_k, adapter.vocab_size

    def build(tune):
        engine = build_engine(model, preset("exact_lru", E, K), Calibration.uniform(L, E, V),
                              EngineConfig(max_seq_len=64, tune=tune), store=store)
        assert engine.kernels["backend"] == "triton", engine.notes
        engine.decoder.step(5)  # a verification block's step: the grouped kernel's parameters for D = 5
        launch = engine.kernels["launch"]
        first_launch.update(launch)
        return launch["slot_moe"], launch["grouped_slot_moe D=5"]

    first_launch = {}
    first, second = build("auto"), build("auto")
    for a, b in zip(first, second):
        assert a["source"] == "tuned" and b["source"] == "cache"
        assert b["params"] == a["params"]
    # the per-token kernel, and the grouped kernel at D = 5 and at the prefill chunk's D (the engine's own runner)
    kernels = sorted(json.loads(key)["kernel"] + str(json.loads(key)["shape"].get("positions", ""))
                     for key in read_cache(tmp_path / "tuning.json")[0])
    moe = [name for name in kernels if name != "gemv"]
    assert moe == sorted(["slot_moe", "grouped_slot_moe5", f"grouped_slot_moe{EngineConfig().prefill_chunk}"])
    # and one entry per shape of the one-row linear layers (`gemv`), as the engine's launch table names them
    assert kernels.count("gemv") == sum(name.startswith("gemv ") for name in first_launch) > 0
    fixed = build(False)
    assert fixed[0] == {"params": MOE_DEFAULTS, "source": "defaults"}
    assert fixed[1] == {"params": grouped_params(5), "source": "defaults"}


def test_tuning_picks_the_fastest_candidate_that_compiles(monkeypatch):
    """`fastest` (every tuner's): the candidate with the lowest timing wins, one that raises is skipped, none
    compiling is an error naming the kernel. Timings come from a stand-in for triton.testing's
    do_bench_cudagraph (the default timer, `graph_ms`), a module put in sys.modules in place of triton.testing,
    so this runs without Triton too."""
    import sys
    import types

    from specmoe.kernels.tuning import fastest

    candidates = ({"n": 1}, {"n": 2}, {"n": 3})
    last, graphed = {}, []

    def run(params):
        if params["n"] == 2:
            raise RuntimeError("does not compile")
        last["n"] = params["n"]

    def cudagraph(fn, rep, return_mode):
        fn()
        graphed.append((rep, return_mode))
        return {1: 0.5, 3: 0.2}[last["n"]]

    testing = types.ModuleType("triton.testing")
    testing.do_bench_cudagraph = cudagraph
    monkeypatch.setitem(sys.modules, "triton.testing", testing)  # found there first: triton itself is not imported
    params, times = fastest(candidates, run, "test")
    assert params == {"n": 3} and times == {0: 0.5, 2: 0.2} and graphed == [(20, "median")] * 2
    timed = []  # a timer of the caller's in place of the graphs
    params, times = fastest(candidates, run, "test", bench=lambda fn: timed.append(fn()) or {1: 0.3, 3: 0.4}[last["n"]])
    assert params == {"n": 1} and times == {0: 0.3, 2: 0.4} and len(timed) == 2
    params, times = fastest(candidates, run, "test", bench=lambda fn: {1: 0.3, 3: 0.4}[last["n"]], launches=4)
    assert params == {"n": 1} and times == {0: 0.3 / 4, 2: 0.4 / 4}  # ms per launch of a batch of 4
    with pytest.raises(RuntimeError, match="no test configuration compiled"):
        fastest(candidates[1:2], run, "test")


def test_rotation_reads_past_twice_the_l2(monkeypatch):
    """`rotation`: enough operands of a size that a batch reads at least twice the L2, at least one, at most
    `most`; none off CUDA (no L2 to defeat)."""
    from specmoe.kernels.tuning import l2_bytes, rotation

    assert l2_bytes("cpu") == 0 and rotation(1000, "cpu") == 1
    monkeypatch.setattr(tuning, "l2_bytes", lambda device: 50 * 2**20)
    mb = 2**20
    assert rotation(206 * mb, "cuda") == 1  # a head that alone is four L2s
    assert rotation(25 * mb, "cuda") == 4 and rotation(24 * mb, "cuda") == 5  # ceil(100 / size)
    assert rotation(mb // 4, "cuda") == 400 and rotation(mb // 8, "cuda") == 512  # capped at `most`
    assert rotation(mb // 8, "cuda", most=64) == 64 and rotation(0, "cuda", most=64) == 64


def test_per_token_and_gemv_tuners_time_batches_that_read_past_the_l2(monkeypatch):
    """`tune_moe` times each candidate over tokens whose routes hold K distinct slots and go through every slot
    before reading one again, as many as `rotation` asks for the K experts' bytes; `tune_gemv` over that many
    weights of the shape, the layer's own first (none other for a head larger than the L2). Both time with
    `fastest`'s own timer (CUDA graphs) and report ms per launch. Stand-ins for the launches and the timer."""
    from specmoe.kernels import gemv, moe

    monkeypatch.setattr(tuning, "l2_bytes", lambda device: 384 * 2**10)
    timed = []

    def fastest(candidates, run, what, bench=None, launches=1):  # ms per launch, as `fastest` reports them
        timed.append(bench)
        run(candidates[1])
        return dict(candidates[1]), {1: 6.0 / launches}

    routes, weights = [], []
    monkeypatch.setattr(moe, "fastest", fastest)
    monkeypatch.setattr(gemv, "fastest", fastest)
    monkeypatch.setattr(moe, "slot_moe_triton", lambda x, res, buf, route, *a: routes.append(route.clone()))
    monkeypatch.setattr(gemv, "linear", lambda x, w, params, out32: weights.append(w))
    H, I, K, C = 64, 32, 4, 10
    buf = torch.zeros(C, 3 * H * I, dtype=torch.bfloat16)  # 12 KiB per expert: 2 x 384 KiB is 16 tokens of 4
    params, times = moe.tune_moe(buf, K, H, I, torch.bfloat16)
    n = -(-2 * 384 * 2**10 // (K * 3 * H * I * 2))
    assert len(routes) == n == 16 and params == moe.MOE_CANDIDATES[1] and times == {1: 6.0 / n}
    slots = torch.stack(routes)[:, :K]
    assert all(len(set(r.tolist())) == K for r in slots)
    flat = slots.flatten().tolist()
    assert all(sorted(flat[i:i + C]) == list(range(C)) for i in range(0, len(flat) - C, C))  # every slot per cycle
    assert torch.equal(torch.stack(routes)[:, K:].view(torch.float32), torch.full((n, K), 1 / K))
    own = torch.randn(128, 512).to(torch.bfloat16)  # 128 KiB: 6 weights
    params, times = gemv.tune_gemv(128, 512, torch.bfloat16, "cpu", own)
    assert len(weights) == 6 and weights[0] is own and len({id(w) for w in weights}) == 6
    assert all(w.shape == (128, 512) and w.dtype == torch.bfloat16 for w in weights) and times == {1: 6.0 / 6}
    weights.clear()
    gemv.tune_gemv(512, 1024, torch.bfloat16, "cpu", None)  # 1 MiB, past 2 L2s alone: one random weight
    assert len(weights) == 1 and weights[0].shape == (512, 1024)
    assert timed == [None, None, None]
