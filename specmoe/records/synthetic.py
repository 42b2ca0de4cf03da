"""Synthetic routing sources: router and pre-gate logits drawn from a few parameters, as a `Trace`.

A routing source stands in for a model's routing where only its statistics matter (the CPU replay, the engine's
trace-following, the synthetic block sources, `specmoe stats`). Its generative model, per MoE layer l, expert e
and position t of a sequence (docs/routing-source.md):

    a[t, l, e] = skew * b[l, e] + sqrt(token_share) * u[x_t, l, e] + sqrt(latent_share) * h[t, l, e]
                 + sqrt(1 - token_share - latent_share) * eps[t, l, e]
    z[t, l, e] = scale * (a[t, l, e] + margin * m[t, l] * [e in top-K of a[t, l]]),  m[t, l] ~ Exponential(1)
    g[t, l, e] = z[t, l, e] + scale * pregate_noise * std(a) * eta[t, l, e]

- b: expert popularity, -log(rank) over a random ranking of each layer's experts (Zipf-like load skew), centred;
- u: a fixed Gaussian affinity of each (token, layer) to the experts (what the calibration's token prior finds),
  with the input tokens x_t drawn from a Zipf law over the vocabulary (exponent `token_zipf`);
- h: a persistent latent affinity, an AR(1) process over the positions of a sequence with coefficient
  `persistence` (consecutive-token reuse), stationary with unit variance;
- eps, eta: fresh Gaussian noise; `margin` is the mean lift of the own top-K above the rest (exponentially
  distributed over (t, l), so that a share of the margins lies below any bonus): the top-K margin over Delta;
- g: the pre-gate of layer l (the router of layer l on layer l-1's MoE input) is layer l's logits plus noise whose
  size `pregate_noise` sets the pre-gate top-K recall; row 0 is drawn the same way (what a tiled trace uses).
`scale` sets the router entropy only: policy decisions, and so copy counts, are invariant to it (ranks, and a
bonus in units of Delta).

b and u are the source's "model", fixed by `structure_seed`; a draw (`synthetic_trace(..., seed)`) draws tokens,
h, eps and eta. Each sequence has its own generator (spawned from the source, the split and the seed), so a
draw of more tokens extends a shorter one. The calibration (`synthetic_calibration`) comes from a separate,
held-out draw of the same source through `CalibrationBuilder`, as a real model's comes from held-out text.

Named sources (`SOURCES`): "olmoe-like", fitted by `scripts/fit_routing_source.py` so that the CPU replay of exact
LRU, Cache-Prior and PSR reproduces OLMoE-1B-7B's copy counts (the paper's Section 6.5). `read_trace` and
`read_calibration` are the one resolver where a trace or calibration file is accepted: a file, or a source spec
"NAME[:key=value,...]": the draw's tokens and seed, any float parameter overriding the named source's (a point
of the crossover map), and the geometry (num_experts, top_k, num_layers: the source's statistics at another model's
shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
from scipy.signal import lfilter

from ..routing.calibration import Calibration, CalibrationBuilder
from ..routing.validate import integer
from .traces import Trace, TraceError

_EVALUATION, _CALIBRATION = 0, 1  # the splits of a source's draws
CALIBRATION_TOKENS, CALIBRATION_SEED = 32768, 0  # the held-out draw of a named source's calibration


@dataclass(frozen=True)
class SourceParams:
    """The parameters of a synthetic routing source (see the module docstring for the model)."""

    num_layers: int = 16
    num_experts: int = 64
    top_k: int = 8
    vocab_size: int = 4096
    persistence: float = 0.9  # AR(1) coefficient of the latent affinity h: consecutive-token reuse
    latent_share: float = 0.4  # variance share of h in a
    token_share: float = 0.2  # variance share of the token affinity u in a
    skew: float = 0.5  # weight of the popularity -log(rank): load skew
    margin: float = 0.0  # lift of the own top-K, in units of a's noise scale: the top-K margin over Delta
    pregate_noise: float = 0.5  # std of the pre-gate's noise over std(a): lower means higher pre-gate recall
    scale: float = 1.0  # logit scale: router entropy (no effect on routing decisions)
    token_zipf: float = 1.1  # exponent of the input tokens' Zipf law
    sequence_length: int = 1024  # positions per sequence (the cache is reset at each)
    structure_seed: int = 0  # fixes the popularity ranking and the token affinities

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "vocab_size", "sequence_length"):
            integer(getattr(self, name), name, TraceError, minimum=1)
        if not self.top_k <= self.num_experts:
            raise TraceError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if not (0.0 <= self.persistence < 1.0 and self.latent_share >= 0 and self.token_share >= 0
                and self.latent_share + self.token_share <= 1.0):
            raise TraceError("need 0 <= persistence < 1 and latent_share, token_share >= 0 with sum <= 1, got "
                             f"{self.persistence}, {self.latent_share}, {self.token_share}")
        if min(self.skew, self.margin, self.pregate_noise, self.token_zipf) < 0 or self.scale <= 0:
            raise TraceError("skew, margin, pregate_noise and token_zipf must be >= 0 and scale > 0")

    def replace(self, **changes) -> "SourceParams":
        return dataclasses.replace(self, **changes)

    def digest(self) -> str:
        """sha256 of the parameters: the identity of the source (run directories record it for a named source)."""
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()


# Fitted by scripts/fit_routing_source.py (docs/routing-source.md): OLMoE-1B-7B's geometry and copy counts.
SOURCES: dict[str, SourceParams] = {
    "olmoe-like": SourceParams(persistence=0.6, latent_share=0.3, token_share=0.15, skew=0.6, margin=0.5,
                               pregate_noise=0.6),
}


@functools.lru_cache(maxsize=4)
def _structure(params: SourceParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(popularity b [L, E], token affinity u [V, L, E] float32, token probabilities [V]) of the source."""
    rng = np.random.default_rng(np.random.SeedSequence([params.structure_seed, 7]))
    L, E, V = params.num_layers, params.num_experts, params.vocab_size
    ranks = np.stack([rng.permutation(E) for _ in range(L)]) + 1
    b = -np.log(ranks)
    b -= b.mean(axis=1, keepdims=True)
    u = rng.standard_normal((V, L, E), dtype=np.float32)
    p = 1.0 / np.arange(1, V + 1) ** params.token_zipf
    return b, u, p / p.sum()


def _sequence(params: SourceParams, split: int, seed: int, index: int, length: int):
    """Router and pre-gate logits [length, L, E] (float32) and tokens [length] of sequence `index` of a draw."""
    b, u, p = _structure(params)
    rng = np.random.default_rng(np.random.SeedSequence([params.structure_seed, split, seed, index]))
    L, E = params.num_layers, params.num_experts
    tokens = rng.choice(params.vocab_size, size=length, p=p)
    rho = params.persistence
    eps = rng.standard_normal((length, L, E))
    c = np.sqrt(1.0 - rho * rho)  # h_t = rho h_{t-1} + c eps_t, h_0 = eps_0: stationary AR(1), unit variance
    h = lfilter([c], [1.0, -rho], eps, axis=0, zi=(1.0 - c) * eps[:1])[0] if rho else eps
    h = h.astype(np.float32)
    noise_share = max(1.0 - params.token_share - params.latent_share, 0.0)
    a = (params.skew * b[None]).astype(np.float32) + np.sqrt(params.token_share) * u[tokens] \
        + np.sqrt(params.latent_share) * h + np.sqrt(noise_share) * rng.standard_normal((length, L, E), dtype=np.float32)
    if params.margin:
        top = np.argpartition(-a, params.top_k - 1, axis=-1)[..., :params.top_k]
        lift = (params.margin * rng.standard_exponential((length, L, 1))).astype(np.float32)
        np.put_along_axis(a, top, np.take_along_axis(a, top, -1) + lift, axis=-1)
    spread = np.sqrt(params.skew ** 2 * float(np.var(b)) + 1.0)  # std of a without the margin
    g = a + np.float32(params.pregate_noise * spread) * rng.standard_normal((length, L, E), dtype=np.float32)
    return (np.float32(params.scale) * a).astype(np.float32), (np.float32(params.scale) * g).astype(np.float32), tokens


def _draw(params: SourceParams, split: int, tokens: int, seed: int):
    """Yield (router logits, pre-gate logits, tokens) of each sequence of a draw of `tokens` positions."""
    tokens = integer(tokens, "tokens", TraceError, minimum=1)
    seed = integer(seed, "seed", TraceError, minimum=0)
    for index, lo in enumerate(range(0, tokens, params.sequence_length)):
        z, g, x = _sequence(params, split, seed, index, params.sequence_length)  # a whole one: a prefix of a
        n = min(params.sequence_length, tokens - lo)  # longer draw is this draw
        yield z[:n], g[:n], x[:n]


def source_params(source: "str | SourceParams") -> SourceParams:
    """The parameters of a named source (`SOURCES`), or `source` itself."""
    if isinstance(source, SourceParams):
        return source
    if source not in SOURCES:
        raise TraceError(f"unknown routing source {source!r}; named sources: {', '.join(SOURCES)}")
    return SOURCES[source]


def synthetic_trace(source: "str | SourceParams" = "olmoe-like", tokens: int = 8192, seed: int = 0,
                    name: str | None = None) -> Trace:
    """A draw of `tokens` positions (sequences of the source's `sequence_length`) from a routing source, as a
    `Trace` (softmax router). Deterministic in (source, tokens, seed). `name` labels it (default: the source's
    name, or "synthetic" for bare parameters)."""
    params = source_params(source)
    parts = list(_draw(params, _EVALUATION, tokens, seed))
    z, g, x = (np.concatenate(arrays) for arrays in zip(*parts))
    starts = np.arange(0, x.shape[0], params.sequence_length)
    name = name or (source if isinstance(source, str) else "synthetic")
    return Trace(z, g, x, starts, params.top_k, params.vocab_size, model=f"synthetic routing source {name}",
                 fingerprint=params.digest(),
                 info={"source": name, "params": dataclasses.asdict(params), "seed": int(seed), "tokens": int(tokens)})


def synthetic_calibration(source: "str | SourceParams" = "olmoe-like", tokens: int = CALIBRATION_TOKENS,
                          seed: int = CALIBRATION_SEED, name: str | None = None) -> Calibration:
    """The source's calibration from a held-out draw (its own split, never a `synthetic_trace` draw) of `tokens`
    positions, through `CalibrationBuilder` as `specmoe calibrate` builds a model's."""
    params = source_params(source)
    builder = CalibrationBuilder(params.num_layers, params.num_experts, params.vocab_size, params.top_k)
    for z, _, x in _draw(params, _CALIBRATION, tokens, seed):
        builder.add(z, x)
    name = name or (source if isinstance(source, str) else "synthetic")
    return builder.finish({"model": f"synthetic routing source {name}", "fingerprint": params.digest(),
                           "text": f"held-out draw of {tokens} tokens, seed {seed}"})


@functools.lru_cache(maxsize=8)
def _spec_calibration(params: SourceParams, name: str) -> Calibration:
    return synthetic_calibration(params, name=name)


# what a source spec may set: the draw, the source's parameters (a point of the crossover map) and its geometry
# (another model's expert count and top-K with the named source's statistics)
_DRAW_OPTIONS = ("tokens", "seed")
_PARAMETERS = ("persistence", "latent_share", "token_share", "skew", "margin", "pregate_noise", "scale", "token_zipf")
_GEOMETRY = ("num_experts", "top_k", "num_layers")


def parse_source(spec) -> tuple[SourceParams, dict] | None:
    """(parameters, {"tokens", "seed"}) of a source spec "NAME[:key=value,...]", or None if `spec` names no
    source. The keys are the draw's tokens and seed (integers), any of the source's float parameters
    (`_PARAMETERS`), which override the named source's: "olmoe-like:margin=0,skew=0.3" is a point of the
    crossover map (docs/crossover.md), and its geometry (`_GEOMETRY`, integers): "olmoe-like:num_experts=256" draws
    the source's statistics over 256 experts (e.g. for Qwen3.6's shapes; not a fit to that model's routing). A bad
    key or value is a TraceError naming the spec."""
    name, _, rest = str(spec).partition(":")
    if name not in SOURCES:
        return None
    options, overrides = {"tokens": 8192, "seed": 0}, {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        try:
            if not sep or key not in _DRAW_OPTIONS + _PARAMETERS + _GEOMETRY:
                raise ValueError(key)
            if key in _DRAW_OPTIONS + _GEOMETRY:
                if not value.isdigit():
                    raise ValueError(value)
                (options if key in _DRAW_OPTIONS else overrides)[key] = int(value)
            else:
                overrides[key] = float(value)
                if not np.isfinite(overrides[key]):
                    raise ValueError(value)
        except ValueError:
            raise TraceError(f"bad routing source spec {spec!r} at {item!r}: expected NAME[:key=value,...] with "
                             f"integer {', '.join(_DRAW_OPTIONS + _GEOMETRY)} and float {', '.join(_PARAMETERS)}") \
                from None
    try:
        return SOURCES[name].replace(**overrides), options
    except TraceError as exc:
        raise TraceError(f"routing source spec {spec!r}: {exc}") from None


def is_source(spec) -> bool:
    """Whether `spec` (a --trace or --calibration argument) names a synthetic source rather than a file: a source
    spec for which no file of that name exists."""
    return isinstance(spec, str) and not os.path.exists(spec) and spec.partition(":")[0] in SOURCES


def _label(spec: str) -> str:
    """The source's name in a spec, with its parameter overrides (the draw options do not change the source)."""
    name, _, rest = spec.partition(":")
    params = [item for item in filter(None, rest.split(",")) if item.partition("=")[0] in _PARAMETERS + _GEOMETRY]
    return name + (":" + ",".join(params) if params else "")


def read_trace(spec: "str | os.PathLike", **check) -> Trace:
    """The trace a --trace argument names: a trace file (`Trace.load`, with its geometry checks `check`), or a
    synthetic source spec "NAME[:key=value,...]" (`synthetic_trace`, checked the same way)."""
    if not is_source(spec):
        return Trace.load(spec, **check)
    params, options = parse_source(spec)
    trace = synthetic_trace(params, **options, name=_label(spec))
    trace.check(**check)
    return trace


def read_calibration(spec: "str | os.PathLike") -> Calibration:
    """The calibration a --calibration argument names: a calibration file, or a source spec (the held-out
    calibration of the source with the spec's parameters, `synthetic_calibration` at the defaults, whatever
    tokens and seed the spec gives)."""
    if not is_source(spec):
        return Calibration.load(spec)
    return _spec_calibration(parse_source(spec)[0], _label(spec))


def input_sha256(spec: "str | os.PathLike") -> str:
    """What a run directory records as an input's identity: the file's sha256, or for a source spec the
    sha256 of the spec and the source's parameters."""
    from ..files import file_sha256

    if not is_source(spec):
        return file_sha256(spec)
    return hashlib.sha256(f"{spec}\n{parse_source(spec)[0].digest()}".encode()).hexdigest()


# OLMoE-1B-7B's copies per token (paper, RTX 4090 engine, teacher-forced): C = 32 quoted from Section 6.5 (PSR at
# lambda 0.3, its demand copies as "psr_demand"); C = 16 derived, as the paper's text gives no copy counts there:
# (latency at 25% residency - the all-resident 6.8 ms) / the per-copy latency above that floor at C = 32 (exact LRU
# 0.59 ms, Cache-Prior 0.70 ms: 42.5 and 27.5 ms give 60.5 and 29.6); the same rule gives 30.3 and 10.7 at C = 32.
OLMOE_COPIES = {
    32: {"exact_lru": 30.5, "cache_prior": 10.5, "psr": 13.8, "psr_demand": 2.2, "spec_exec": 29.1},
    16: {"exact_lru": 60.5, "cache_prior": 29.6},
}
PAPER_POLICIES = ("exact_lru", "cache_prior", "psr", "spec_exec")


def paper_copies(trace: Trace, calibration: Calibration, capacities=(32, 16)) -> dict:
    """Copies per token of the paper's Section 6.5 policies replayed over `trace` (exact LRU, Cache-Prior lambda
    0.2, PSR n = 1 at `psr_bonus(C, E)`, speculative execution; `specmoe.routing.statistics.replay_policies`):
    {C: {name: copies, "psr_demand": demand}}, in the layout of `OLMOE_COPIES`."""
    from ..routing.statistics import replay_policies

    return {capacity: {**{name: summary["copies"] for name, summary in row.items()},
                       "psr_demand": row["psr"]["demand"]}
            for capacity, row in replay_policies(trace, calibration, capacities, PAPER_POLICIES).items()}
