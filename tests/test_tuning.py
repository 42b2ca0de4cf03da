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
                                          (json.dumps({"format": "specmoe kernel tuning", "version": 99,
                                                       "entries": {}}), "of version 1"),
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
