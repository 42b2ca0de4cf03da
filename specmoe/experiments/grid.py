"""A config's grid: the model it runs on with its geometry (read without loading weights) and the configurations that
`specmoe run` measures, in the order it runs them within a round.

A configuration is one thing to measure once per round: an AR policy at capacity C (kind "ar"), a drafter with
a selector, k and a pool P (kind "sd"), or, in replay mode, one replayed method over one source of blocks
("rollback", "ar_replay", "block"), each with the engine's run settings where the config varies them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from specmoe.geometry import Geometry
from specmoe.limits import MAX_CELLS

from .config import ConfigError, ExperimentConfig, policy_overrides


@dataclass(frozen=True)
class GridModel:
    """The target of a config's grid: what load_model takes, its geometry (L MoE layers, E experts, top-K,
    vocabulary V, from its config alone) and the positions its config allows (None where it names none)."""

    source: str
    geometry: Geometry
    max_positions: int | None

    def describe(self) -> dict:
        """manifest.json's "geometry" entry."""
        g = self.geometry
        return {"source": self.source, "num_layers": g.num_layers, "num_experts": g.num_experts, "top_k": g.top_k,
                "vocab_size": g.vocab_size, "max_positions": self.max_positions}


def model_source(source: str) -> str:
    """The `[model] source` as a checkpoint directory or named config ("family" and "family/<member>" are the
    shipped targets' directories: `resolve_source`)."""
    from specmoe.models import resolve_source

    return resolve_source(source)


def grid_model(config: ExperimentConfig) -> GridModel:
    """The model and its geometry from its config alone (no weights): ConfigError naming `model.source` if
    none."""
    from specmoe.models import ModelSourceError, adapter_for, named_config
    from specmoe.models.registry import NAMED_CONFIGS, _checkpoint_config

    try:
        source = model_source(config.model.source)
        hf = named_config(source) if source in NAMED_CONFIGS else _checkpoint_config(Path(source))
        adapter = adapter_for(hf)
    except (ModelSourceError, ValueError, OSError) as exc:
        raise ConfigError(f"{config.path}: model.source: {' '.join(str(exc).split())}") from None
    return GridModel(source, Geometry.of(adapter), getattr(hf, "max_position_embeddings", None))


@dataclass(frozen=True)
class Configuration:
    """One configuration of the grid (see the module docstring). settings: the engine's RunSettings fields the
    config sets, as (name, value) pairs."""

    index: int
    kind: str
    label: str
    policy: object = None  # PolicyConfig
    selector: object = None  # SelectorConfig
    drafter: str | None = None
    capacity: int | None = None
    pool: int | None = None
    k: int | None = None
    tau: float | None = None
    settings: tuple = ()

    def describe(self) -> dict:
        """The identifying columns of this configuration's rows."""
        settings = dict(self.settings)
        delay = settings.get("copy_delay")
        return {"config": self.index, "label": self.label, "kind": self.kind,
                "policy": self.policy.name if self.policy is not None else "",
                "C": self.capacity, "drafter": self.drafter or "", "selector": self.selector.name if self.selector else "",
                "k": self.k, "P": self.pool, "tau_target": self.tau,
                "cache_mode": settings.get("cache_mode", ""), "max_in_flight": settings.get("max_in_flight"),
                "copy_delay": "" if delay is None else f"{delay[0]:g}-{delay[1]:g}",
                "skip_copies": settings.get("skip_copies"), "acceptance": self.acceptance}

    @property
    def acceptance(self) -> str:
        """Whose accepted lengths the configuration commits: "closed-loop" where it runs its own selection
        against the drafts (a speculative run; exact over a synthetic profile, which stands in for exact's),
        "open-loop (exact's)" for a lossy selector replayed over the synthetic drafter's blocks, whose profile is
        exact verification's (optimistic for it); "" without verification blocks."""
        from specmoe.records import CLOSED_LOOP, open_loop

        if self.kind == "sd" or (self.kind == "block" and self.selector.kind == "exact"):
            return CLOSED_LOOP
        return open_loop("exact") if self.kind == "block" else ""


def _settings_suffix(settings: tuple) -> str:
    if not settings:
        return ""
    parts = []
    for key, value in settings:
        if key == "cache_mode":
            parts.append(value)
        elif key == "copy_delay":
            parts.append("no delay" if value is None else f"delay {value[0] * 1e3:g}-{value[1] * 1e3:g} ms")
        elif isinstance(value, bool):
            if value:
                parts.append(key)
        else:
            parts.append(f"{key}={value}")
    return f" [{', '.join(parts)}]" if parts else ""


def _settings_grid(config: ExperimentConfig, speculative: bool) -> list[tuple]:
    """The product of [run_settings]'s axes; the speculative engine routes logically, so its grid leaves out
    cache_mode (and the physical points)."""
    axes = [(k, v) for k, v in config.run_settings if not (speculative and k == "cache_mode")]
    if speculative and any(k == "cache_mode" and "logical" not in v for k, v in config.run_settings):
        return []
    return [tuple(zip([k for k, _ in axes], values)) for values in itertools.product(*[v for _, v in axes])]


def expand(config: ExperimentConfig, geo: Geometry) -> list[Configuration]:
    """Every configuration of the config, in run order; ConfigError where the grid does not fit the model."""
    from specmoe.routing import PolicyError, preset
    from specmoe.verifiers import selector_preset

    def fail(key: str, message: str):
        raise ConfigError(f"{config.path}: {key}: {message}")

    for c in config.ar.capacity:
        if not geo.top_k <= c <= geo.num_experts:
            fail("ar.capacity", f"C={c} must lie in [K={geo.top_k}, E={geo.num_experts}] for {config.model.source} "
                                f"({'C > E' if c > geo.num_experts else 'C < K'})")
    for p in config.sd.pool:
        if not geo.top_k <= p <= geo.num_experts:
            fail("sd.pool", f"P={p} must lie in [K={geo.top_k}, E={geo.num_experts}] for {config.model.source}")
    policies = []
    for c in config.ar.capacity:
        for i, entry in enumerate(config.ar.policies):
            for overrides in entry.expand():
                try:
                    policies.append(preset(entry.preset, c, geo.top_k,
                                           **policy_overrides(overrides, c, geo.num_experts)))
                except PolicyError as exc:
                    fail(f"ar.policies[{i}]", str(exc))
    selectors = [selector_preset(e.preset, **o) for e in config.sd.selectors for o in e.expand()]
    out: list[Configuration] = []

    def add(kind, label, **fields):
        if len(out) == MAX_CELLS:  # stop a product of long axes before it is built
            fail("(grid)", f"more than {MAX_CELLS} configurations (the most a run takes); shorten the grid's lists")
        out.append(Configuration(len(out), kind, label, **fields))

    if config.mode == "replay":
        methods = config.replay.methods
        for k in config.sd.k:
            for tau in config.replay.tau:
                if not 1.0 <= tau < k + 1:
                    fail("replay.tau", f"tau={tau:g} must lie in [1, k + 1 = {k + 1}) for k={k}")
                at = f", k={k}, tau={tau:g}"
                for policy in policies:
                    if "rollback" in methods:
                        add("rollback", f"rollback {policy.name}{at}", policy=policy, capacity=policy.capacity, k=k,
                            tau=tau)
                    if "ar" in methods:
                        add("ar_replay", f"AR {policy.name}{at}", policy=policy, capacity=policy.capacity, k=k, tau=tau)
                if "block" in methods:
                    for selector in selectors:
                        for p in config.sd.pool:
                            add("block", f"block {selector.name}, P={p}{at}", selector=selector, pool=p, k=k, tau=tau)
        if not out:
            fail("replay.methods", f"the grid is empty: {', '.join(methods)} need [ar] policies (rollback, ar) or "
                                   "[sd] selectors and pool (block)")
        return out
    engine = config.engine == "engine"
    ar_settings = _settings_grid(config, False) if engine else [()]
    for policy in policies:
        for settings in ar_settings:
            add("ar", f"AR {policy.name}{_settings_suffix(settings)}", policy=policy, capacity=policy.capacity,
                settings=settings)
    sd_settings = _settings_grid(config, True) if engine else [()]
    for drafter in config.sd.drafters:
        for selector in selectors:
            for k in config.sd.k:
                for p in config.sd.pool:
                    for settings in sd_settings:
                        add("sd", f"SD {drafter} + {selector.name}, k={k}, P={p}{_settings_suffix(settings)}",
                            selector=selector, drafter=drafter, pool=p, k=k, settings=settings)
    if not out:  # the config's checks leave one way: an SD-only grid whose cache_mode axis has no 'logical'
        fail("run_settings.cache_mode", "the grid is empty: the speculative engine runs only with cache_mode "
                                        "'logical', and there is no [ar] grid")
    return out


def check_sizes(config: ExperimentConfig, target: GridModel, grid: list[Configuration]) -> None:
    """ConfigError unless the run is bounded: configurations x rounds within MAX_CELLS, and the positions a
    configuration reads (a window, or a prompt, its new tokens and the k positions of its last block) within
    the model's positions and `model.max_seq_len`; checked before any work."""
    def fail(key: str, message: str):
        raise ConfigError(f"{config.path}: {key}: {message}")

    if len(grid) * config.rounds > MAX_CELLS:
        fail("rounds", f"{len(grid)} configurations x {config.rounds} rounds = {len(grid) * config.rounds} cells, "
                       f"more than the {MAX_CELLS} a run takes")
    w = config.workload
    needed, what = w.length, "workload.length"
    if config.mode == "generation":
        k = max((c.k for c in grid if c.kind == "sd"), default=0)
        needed, what = w.length + w.new_tokens + k, "workload.length + workload.new_tokens" + " + sd.k" * (k > 0)
    for limit, name in ((target.max_positions, f"the {target.max_positions} positions of {config.model.source}"),
                        (config.model.max_seq_len, f"model.max_seq_len = {config.model.max_seq_len}")):
        if limit and needed > limit:
            fail(what.split(" + ")[-1], f"{what} = {needed} positions exceed {name}")
    if config.calibration.file is None and target.max_positions and config.calibration.length > target.max_positions:
        fail("calibration.length", f"{config.calibration.length} exceeds the {target.max_positions} positions of "
                                   f"{config.model.source}")
