"""One cell of `specmoe run`: one configuration measured once (one round), over the whole workload.

`Session` holds what every cell of a run shares, built once per process: the model, the calibration, the
workload, the drafters and (engine runs) one expert residency unit with the engines on it. `Session.measure`
returns one table row: the configuration's columns (`Configuration.describe`) and the figures of `COLUMNS`,
per committed token (NaN where a configuration has no such figure). What each path measures:

- harness, teacher-forced (`excess_nll`, as `specmoe demo`): logical copies per token and the excess NLL over
  exact routing on the windows; one batched forward per window batch, so no latency (ms NaN).
- harness, generation: AR greedy decoding under the policy (`greedy_decode`, copies from the logical caches,
  each decode step's forward timed) or the speculative loop (`speculative_generate`); KL and excess NLL of the
  committed positions against exact routing on the same prefix (`divergence_from_exact`). Harness times are
  CPU wall times of transformers' eager expert loop, no latency measurement; the harness makes no copies
  (exposed wait 0).
- engine (`build_engine`; `Engine.teacher_forced`, `Engine.generate` without and with a drafter):
  per-token wall time, copies by class (demand, prefetch in time / late / unused), exposed copy wait; NLL
  from the engine's own logits (teacher-forced) against an exact-routing run of the same engine, KL of AR
  generation as in the harness; the speculative engine returns no distributions (KL NaN) and splits its time
  into drafting, verification and exposed copy wait per block.
- replay (`specmoe.replay`): copies per committed token and displaced router mass of the rollback cache, AR on
  the committed sequence and block selection over a synthetic drafter's blocks on a trace of the windows.

token_ms lists the latency of every committed token, the one definition the report's percentiles and CDF use:
an AR step's wall time for the token it produces; in speculative decoding (harness and engine alike,
`block_token_ms`) a block's drafting + verification time divided by the tokens it commits (accepted drafts +
the bonus token), given to each of them; the first new token, decoded by the prompt's forward, is in no block
and not listed (as the prompt is untimed in AR). request_ms is the ms per token of each request or window (the
unit the report's intervals resample, `specmoe.stats.unit_ratio`), request_tokens the tokens it counts over.

Rounds repeat deterministic work, and only the times differ between them, so a session computes no figure twice
from the same inputs (`specmoe run`'s later rounds re-time, they do not recompute):

- an untimed cell (harness teacher-forced, replay) is computed once per configuration; its later rounds repeat
  the figures (`seconds` is the cell's own, about 0);
- the divergence from exact routing (`divergence_from_exact`, one untimed forward per request) is memoised on
  its inputs: the prompt, the committed tokens and the exact bytes of the log-probabilities that produced them
  (`Session.divergence`). A later round that decodes the same tokens with the same distributions reuses it;
  one that does not (anything non-deterministic) computes it anew.

A resumed run starts a new session: its first cell of each configuration computes everything again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import numpy as np
import torch

from specmoe.speculation import prompt_tokens, tau
from .config import ConfigError, ExperimentConfig
from .grid import Configuration, GridModel

COLUMNS = ("round", "requests", "tokens", "verifications", "tau", "copies_per_token", "demand_per_token",
           "prefetch_per_token", "prefetch_in_time_per_token", "prefetch_late_per_token", "unused_per_token",
           "moves_per_token", "displaced_per_token_layer", "nll", "excess_nll", "kl", "ms_per_token", "ms_p50",
           "ms_p99", "draft_ms_per_token", "verify_ms_per_token", "wait_ms_per_token", "seconds")
NAN = float("nan")


class ForwardTimer:
    """Wall time of each forward of a module after `start()` (hooks; `stop()` removes them, returns ms)."""

    def __init__(self, module):
        self.module, self.times, self.handles, self._t = module, [], [], 0.0

    def start(self) -> None:
        def before(*_):
            self._t = time.perf_counter()

        def after(*_):
            self.times.append(1e3 * (time.perf_counter() - self._t))

        self.handles = [self.module.register_forward_pre_hook(before), self.module.register_forward_hook(after)]

    def stop(self) -> list[float]:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        return self.times


def check_device(config: ExperimentConfig) -> None:
    """ConfigError unless torch sees the config's device on this machine."""
    if config.device.startswith("cuda"):
        index = int(config.device.split(":")[1]) if ":" in config.device else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(f"{config.path}: device: {config.device!r} is not available on this machine (torch "
                              f"{torch.__version__} sees {torch.cuda.device_count()} CUDA devices): run this config "
                              "on a GPU machine, or set device = 'cpu' where the config allows it")


def _nll_of_logits(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """NLL (float64) of tokens[1:] under logits[:-1] (row t predicts token t + 1)."""
    logp = torch.log_softmax(torch.from_numpy(logits[:-1]).double(), dim=-1)
    return (-logp.gather(-1, torch.from_numpy(np.asarray(tokens[1:], dtype=np.int64))[:, None])[:, 0]).numpy()


def block_token_ms(accepted, block_ms) -> list[float]:
    """token_ms of speculative blocks (module docstring): each block's ms / (accepted + 1), once per committed
    token of the block."""
    out = []
    for a, ms in zip(accepted, block_ms, strict=True):
        out += [float(ms) / (int(a) + 1)] * (int(a) + 1)
    return out


def _ms_stats(token_ms: list[float]) -> dict:
    if not token_ms:
        return {"ms_p50": NAN, "ms_p99": NAN}
    return {"ms_p50": float(np.percentile(token_ms, 50)), "ms_p99": float(np.percentile(token_ms, 99))}


class Session:
    """What the cells of one run share (module docstring); `log(text)` reports set-up steps."""

    def __init__(self, config: ExperimentConfig, target: GridModel, configurations: list[Configuration],
                 run_dir: Path, log=print, progress: bool = False):
        from specmoe.models import load_model

        self.config, self.configurations, self.log, self.progress = config, configurations, log, progress
        self.run_dir = run_dir
        self.source, self.geo = target.source, target.geometry
        check_device(config)
        torch.set_num_threads(config.threads)
        started = time.time()
        self.model, self.adapter = load_model(target.source, seed=config.seed, dtype=config.model.dtype,
                                              device=config.device)
        self.model.requires_grad_(False)
        self.stop_tokens = tuple(t for t in [self.model.config.eos_token_id] if isinstance(t, int))
        self.sequences, self.workload_text = self._workload()
        self.drafters, self.engines, self.unit, self.reference = {}, {}, None, None
        if config.mode != "replay":
            for name in config.sd.drafters:  # a drafter that does not fit the target fails before any cell
                self.drafters[name] = self._drafter(name)
        self.calibration = self._calibration(run_dir / "calibration.safetensors")  # the slow step, after the checks
        if config.engine == "engine":
            self._build_engines()
        self.exact_nll = None
        if config.mode == "teacher_forced" and config.engine == "harness":
            from specmoe.harness import token_nll

            self.exact_nll = token_nll(self.model, None, self.sequences)
        self.trace, self.blocks = None, {}
        self.untimed: dict[int, dict] = {}  # configuration index -> its figures (module docstring)
        self.divergences: dict[str, dict] = {}  # digest of divergence_from_exact's inputs -> its result
        self.divergence_reused = 0
        self.setup_seconds = round(time.time() - started, 1)

    # -- set-up -------------------------------------------------------------------------------------------
    def _calibration(self, saved: Path):
        from specmoe.harness import collect_calibration, sample_selfgen
        from specmoe.routing import Calibration

        spec, geo = self.config.calibration, self.geo
        if spec.file or saved.is_file():
            calibration = Calibration.load(spec.file or saved)
            calibration.check(geo.num_layers, geo.num_experts, geo.vocab_size, self.adapter.fingerprint(self.model))
            return calibration
        self.log(f"calibrating on {spec.windows} windows of {spec.length} tokens sampled from the model")
        held_out = sample_selfgen(self.model, spec.windows, spec.length, seed=self.config.seed + 1,
                                  progress=self.progress)
        calibration = collect_calibration(self.model, self.adapter, held_out.windows, {
            "text": f"{spec.windows} windows of {spec.length} tokens sampled from the exact model, "
                    f"seed {self.config.seed + 1}"}, progress=self.progress)
        calibration.save(saved)  # a resumed run uses the same calibration
        return calibration

    def _workload(self):
        from .workload import load_sequences

        source = self.source
        tokenizer = source if Path(source).is_dir() else None
        prompts = self.config.mode == "generation"
        return load_sequences(self.config.workload, self.model, tokenizer, self.config.seed, prompts=prompts)

    def _drafter(self, name: str):
        from specmoe.drafters import build_drafter

        return build_drafter(self.config.drafter(name), self.model)

    def _max_seq_len(self) -> int:
        w, k = self.config.workload, max(self.config.sd.k or (0,))
        longest = max(len(s) for s in self.sequences)
        need = longest + (w.new_tokens + k + 1 if self.config.mode == "generation" else 0)
        return self.config.model.max_seq_len or -(-need // 64) * 64  # a multiple of 64, as the benchmarks use

    def _build_engines(self) -> None:
        """One expert residency unit with enough slots for every configuration, and the engines on it."""
        from specmoe.engines import EngineConfig
        from specmoe.offload import ExpertResidency, ExpertStore

        config, geo = self.config, self.geo
        union = config.sd.union_slots
        slots = max([*config.ar.capacity, *[p + (union if union is not None else geo.num_experts - p)
                                           for p in config.sd.pool]])
        store = ExpertStore.from_model(self.model, self.adapter)
        self.unit = ExpertResidency(store, slots, next(self.model.parameters()).device)
        self.engine_config = EngineConfig(max_seq_len=self._max_seq_len(), **dict(config.engine_config))
        self.log(f"engines: {slots} slots per layer, a KV cache of {self.engine_config.max_seq_len} positions")
        for c in self.configurations:  # every engine now: one that cannot run fails before any cell
            if c.kind == "sd":
                self._spec_engine(c.drafter, c.k, c.pool, c.selector)
            elif "ar" not in self.engines:
                self._ar_engine(c.policy)

    def _ar_engine(self, policy):
        from specmoe.engines import build_engine

        if "ar" not in self.engines:
            self.engines["ar"] = build_engine(self.model, policy, self.calibration, self.engine_config,
                                              residency=self.unit)
        return self.engines["ar"]

    def _spec_engine(self, drafter: str, k: int, pool: int, selector):
        from specmoe.engines import build_engine
        from specmoe.speculation import SpeculativeConfig

        key = ("sd", drafter, k, pool, selector)  # one engine per drafter: its decoder captures the drafter's features
        config = SpeculativeConfig(selector, k=k, pool_size=pool, max_new_tokens=self.config.workload.new_tokens,
                                   stop_tokens=self.stop_tokens, union_slots=self.config.sd.union_slots)
        if key not in self.engines:
            self.engines[key] = build_engine(self.model, None, self.calibration, self.engine_config,
                                             speculative=config, residency=self.unit)
        return self.engines[key]

    # -- cells --------------------------------------------------------------------------------------------
    def measure(self, c: Configuration, round_: int) -> dict:
        """Measure configuration `c` once; the row (module docstring)."""
        started = time.time()
        mode, engine = self.config.mode, self.config.engine
        if mode == "replay" or (mode == "teacher_forced" and engine == "harness"):  # untimed: once per configuration
            if c.index not in self.untimed:
                self.untimed[c.index] = self._replay(c) if mode == "replay" else self._harness_ar(c)
            figures = dict(self.untimed[c.index])
        elif c.kind == "sd":
            figures = self._engine_sd(c) if engine == "engine" else self._harness_sd(c)
        elif engine == "engine":
            figures = self._engine_ar(c)
        else:
            figures = self._harness_ar(c)
        row = {key: NAN for key in COLUMNS}
        row.update(c.describe())
        row.update(figures)
        row["round"], row["seconds"] = round_, round(time.time() - started, 3)
        row.setdefault("token_ms", [])
        row.setdefault("request_ms", [])
        row.setdefault("request_tokens", [])
        return row

    def divergence(self, prompt, tokens: torch.Tensor, logprobs: torch.Tensor) -> dict:
        """`divergence_from_exact(model, adapter, prompt, tokens, logprobs)`, memoised on the exact bytes of its
        inputs (module docstring): computed once per distinct prompt, committed tokens and log-probabilities."""
        from specmoe.harness import divergence_from_exact

        digest = hashlib.sha256()
        for part in (np.asarray(prompt_tokens(prompt), dtype=np.int64), tokens.cpu().numpy().astype(np.int64),
                     logprobs.detach().cpu().contiguous().numpy()):
            digest.update(str(part.dtype).encode() + str(part.shape).encode())
            digest.update(part.tobytes())
        key = digest.hexdigest()
        if key in self.divergences:
            self.divergence_reused += 1
        else:
            self.divergences[key] = divergence_from_exact(self.model, self.adapter, prompt, tokens, logprobs)
        return dict(self.divergences[key])

    def _harness_ar(self, c: Configuration) -> dict:
        from specmoe.harness import copy_stats, excess_nll, greedy_decode, patch_model, unpatch

        model, adapter = self.model, self.adapter
        if self.config.mode == "teacher_forced":
            context = patch_model(model, adapter, c.policy, self.calibration)
            try:
                r = excess_nll(model, context, self.sequences, exact_nll=self.exact_nll)
            finally:
                unpatch(model)
            return {"requests": len(self.sequences), "tokens": r["tokens"], "tau": 1.0, "copies_per_token": r["copies"],
                    "demand_per_token": r["demand"], "prefetch_per_token": r["prefetch"],
                    "unused_per_token": r["unused"], "displaced_per_token_layer": r["displaced_mass"] / adapter.num_moe_layers,
                    "nll": r["nll_policy"], "excess_nll": r["excess_nll"], "wait_ms_per_token": 0.0}
        sums = dict.fromkeys(("demand", "prefetch", "unused", "displaced_mass", "kl_sum", "excess_nll_sum"), 0.0)
        token_ms, request_ms, request_tokens, positions = [], [], [], 0
        for prompt in self._each(c):
            context = patch_model(model, adapter, c.policy, self.calibration)
            timer = ForwardTimer(model)
            try:
                tokens, logprobs = greedy_decode(model, prompt, self.config.workload.new_tokens, self.stop_tokens,
                                                 after_prefill=lambda: (context.clear_counters(), timer.start()))
                ms = timer.stop()
                stats = copy_stats(context)
            finally:
                timer.stop()
                unpatch(model)
            for key in ("demand", "prefetch", "unused", "displaced_mass"):
                sums[key] += stats[key] * stats["tokens"]
            divergence = self.divergence(prompt, tokens, logprobs)
            sums["kl_sum"] += divergence["kl_sum"]
            sums["excess_nll_sum"] += divergence["excess_nll_sum"]
            positions += divergence["positions"]
            token_ms += ms
            request_ms.append(float(np.mean(ms)))
            request_tokens.append(len(ms))
        n = max(positions, 1)
        return {"requests": len(self.sequences), "tokens": positions, "verifications": positions, "tau": 1.0,
                "copies_per_token": (sums["demand"] + sums["prefetch"]) / n, "demand_per_token": sums["demand"] / n,
                "prefetch_per_token": sums["prefetch"] / n, "unused_per_token": sums["unused"] / n,
                "displaced_per_token_layer": sums["displaced_mass"] / (n * adapter.num_moe_layers),
                "kl": sums["kl_sum"] / n, "excess_nll": sums["excess_nll_sum"] / n,
                "ms_per_token": float(np.mean(token_ms)), **_ms_stats(token_ms), "draft_ms_per_token": 0.0,
                "verify_ms_per_token": float(np.mean(token_ms)), "wait_ms_per_token": 0.0,
                "token_ms": token_ms, "request_ms": request_ms, "request_tokens": request_tokens}

    def _harness_sd(self, c: Configuration) -> dict:
        from specmoe.harness import speculative_generate
        from specmoe.speculation import SpeculativeConfig, summarize

        config = SpeculativeConfig(c.selector, k=c.k, pool_size=c.pool, max_new_tokens=self.config.workload.new_tokens,
                                   stop_tokens=self.stop_tokens)
        drafter = self.drafters[c.drafter]
        results, token_ms, request_ms, request_tokens = [], [], [], []
        for prompt in self._each(c):
            r = speculative_generate(self.model, self.adapter, drafter, prompt, config, calibration=self.calibration,
                                     record=self.config.sd.records, divergence=False)
            r.divergence = self.divergence(prompt, r.tokens, r.logprobs)
            results.append(r)
            request_ms.append(1e3 * (r.draft_s + r.verify_s) / max(int(r.tokens.numel()), 1))
            request_tokens.append(max(int(r.tokens.numel()), 1))
            token_ms += block_token_ms(r.accepted, 1e3 * np.asarray(r.block_s))
        if self.config.sd.records:
            self._save_records(c, results)
        s = summarize(results)
        # the block prefetch as the engine would make it: the link's copies are demand copies and prefetches
        ahead = {key: sum(r.prefetch[key] for r in results) / max(s["committed"], 1)
                 for key in ("demand", "prefetch", "prefetch_unused")}
        return {"requests": len(results), "tokens": s["committed"], "verifications": s["verifications"],
                "tau": s["tau"], "copies_per_token": ahead["demand"] + ahead["prefetch"],
                "demand_per_token": ahead["demand"], "prefetch_per_token": ahead["prefetch"],
                "unused_per_token": ahead["prefetch_unused"],
                "moves_per_token": s["moves_per_token"], "displaced_per_token_layer": s["displaced_per_token_layer"],
                "kl": s["kl"], "excess_nll": s["excess_nll"],
                "ms_per_token": s["draft_ms_per_token"] + s["verify_ms_per_token"], **_ms_stats(token_ms),
                "draft_ms_per_token": s["draft_ms_per_token"], "verify_ms_per_token": s["verify_ms_per_token"],
                "wait_ms_per_token": 0.0, "token_ms": token_ms, "request_ms": request_ms,
                "request_tokens": request_tokens}

    def _each(self, c: Configuration):
        """The workload's sequences, with a progress bar over them."""
        from specmoe.progress import each

        return each(self.sequences, c.label[:40], self.progress, "request")

    def _save_records(self, c: Configuration, results) -> None:
        """Every verification block of configuration `c` (`BlockRecords`), as
        RUN_DIR/blocks/blocks_cNNNN_DRAFTER_SELECTOR.safetensors (rewritten by each round; greedy decoding
        makes the same blocks)."""
        from specmoe.harness.patch import model_scoring
        from specmoe.records import BlockRecords

        adapter = self.adapter
        BlockRecords.from_requests(
            [r.blocks for r in results], top_k=adapter.top_k, vocab_size=adapter.vocab_size,
            model=self.model.specmoe_source, fingerprint=adapter.fingerprint(self.model),
            selector=c.selector.to_dict(), drafter=c.drafter, pool_size=c.pool, groups=adapter.groups,
            scoring=model_scoring(self.model, adapter),
            info={"prompts": self.workload_text, "calibration": self.calibration.provenance.get("text", "")},
        ).save(self.run_dir / "blocks" / f"blocks_c{c.index:04d}_{c.drafter}_{c.selector.kind}.safetensors")

    def _settings(self, c: Configuration) -> dict:
        from specmoe.engines import RunSettings

        defaults = {f.name: f.default for f in dataclasses.fields(RunSettings)}
        return {**defaults, **dict(c.settings)}

    def _engine_ar(self, c: Configuration) -> dict:
        engine = self._ar_engine(c.policy)
        tf = self.config.mode == "teacher_forced"
        if tf and self.reference is None:  # exact routing's NLL of every window (untimed, not a cell)
            from specmoe.routing import preset

            engine.configure(policy=preset("exact_lru", c.policy.capacity, self.geo.top_k), **self._settings(
                Configuration(-1, "ar", "")))
            self.reference = [_nll_of_logits(engine.teacher_forced(np.asarray(w), 1, return_logits=True).logits,
                                             np.asarray(w)) for w in self.sequences]
        engine.configure(policy=c.policy, **self._settings(c))
        totals = dict.fromkeys(("demand", "prefetch", "prefetch_in_time", "prefetch_late", "prefetch_unused"), 0.0)
        token_ms, request_ms, request_tokens, wait, nll, excess, kl, positions = [], [], [], 0.0, 0.0, 0.0, 0.0, 0
        for seq in self.sequences:
            if tf:
                r = engine.teacher_forced(np.asarray(seq), 1, return_logits=True)
                scored = _nll_of_logits(r.logits, np.asarray(seq))
                nll += float(scored.sum())
                excess += float((scored - self.reference[len(request_ms)]).sum())
                positions += scored.size
            else:
                r = engine.generate(np.asarray(seq), self.config.workload.new_tokens, self.stop_tokens,
                                    return_logits=True)
                generated = torch.tensor(r.generated)
                start = len(seq) - 1
                logprobs = torch.log_softmax(torch.from_numpy(r.logits[start:start + len(generated)]).float(), -1)
                d = self.divergence(seq, generated, logprobs)
                kl += d["kl_sum"]
                excess += d["excess_nll_sum"]
                positions += d["positions"]
            s = r.summary()
            n = s["tokens"]
            for key in totals:
                totals[key] += s["copies_per_token"][key] * n
            wait += s.get("exposed_wait_ms_per_token", NAN) * n
            ms = r.ms[r.timed].tolist()
            token_ms += ms
            request_ms.append(float(np.mean(ms)))
            request_tokens.append(len(ms))
        n = max(len(token_ms), 1)
        p = max(positions, 1)
        mean = float(np.mean(token_ms))
        tokens = len(token_ms) if tf else positions  # generation: the first new token's step is the prompt's
        return {"requests": len(self.sequences), "tokens": tokens, "verifications": tokens, "tau": 1.0,
                "copies_per_token": (totals["demand"] + totals["prefetch"]) / n,
                "demand_per_token": totals["demand"] / n, "prefetch_per_token": totals["prefetch"] / n,
                "prefetch_in_time_per_token": totals["prefetch_in_time"] / n,
                "prefetch_late_per_token": totals["prefetch_late"] / n, "unused_per_token": totals["prefetch_unused"] / n,
                "nll": nll / p if tf else NAN, "excess_nll": excess / p, "kl": NAN if tf else kl / p,
                "ms_per_token": mean, **_ms_stats(token_ms), "draft_ms_per_token": 0.0,
                "verify_ms_per_token": mean, "wait_ms_per_token": wait / n, "token_ms": token_ms,
                "request_ms": request_ms, "request_tokens": request_tokens}

    def _engine_sd(self, c: Configuration) -> dict:
        from specmoe.speculation import summarize

        engine = self._spec_engine(c.drafter, c.k, c.pool, c.selector)
        engine.configure(**{k: v for k, v in self._settings(c).items() if k != "cache_mode"})
        results, token_ms, request_ms, request_tokens = [], [], [], []
        for prompt in self.sequences:
            r = engine.generate(np.asarray(prompt), self.config.workload.new_tokens, self.stop_tokens,
                                drafter=self.drafters[c.drafter])
            results.append(r)
            token_ms += block_token_ms(r.accepted, r.draft_ms + r.ms)
            request_ms.append((r.draft_ms.sum() + r.ms.sum()) / max(len(r.tokens), 1))
            request_tokens.append(max(len(r.tokens), 1))
        s = summarize([r.counts() for r in results])
        committed = max(s["committed"], 1)
        # the GPU's copy wait is not seen by the host (NaN; compare with a copies-skipped run)
        wait = sum(NAN if r.wait_ms is None else r.wait_ms.sum() for r in results) / committed
        ahead = {key: sum(r.copy_totals()[key] for r in results) / committed  # the block prefetch's
                 for key in ("demand", "prefetch", "prefetch_unused")}
        return {"requests": len(results), "tokens": s["committed"], "verifications": s["verifications"],
                "tau": s["tau"], "copies_per_token": s["copies_per_token"], "demand_per_token": ahead["demand"],
                "prefetch_per_token": ahead["prefetch"], "unused_per_token": ahead["prefetch_unused"],
                "moves_per_token": s["moves_per_token"], "displaced_per_token_layer": s["displaced_per_token_layer"],
                "ms_per_token": s["draft_ms_per_token"] + s["verify_ms_per_token"], **_ms_stats(token_ms),
                "draft_ms_per_token": s["draft_ms_per_token"], "verify_ms_per_token": s["verify_ms_per_token"],
                "wait_ms_per_token": wait, "token_ms": token_ms, "request_ms": request_ms,
                "request_tokens": request_tokens}

    def _replay(self, c: Configuration) -> dict:
        from specmoe.harness import record_trace
        from specmoe.records import AcceptanceProfile, synthetic_blocks
        from specmoe.replay import replay_ar, replay_block_selection, replay_rollback

        if self.trace is None:
            self.trace = record_trace(self.model, self.sequences, self.source)
        key = (c.k, c.tau)
        if key not in self.blocks:
            self.blocks[key] = synthetic_blocks(self.trace, c.k, AcceptanceProfile.for_tau(c.tau, c.k),
                                                seed=self.config.seed, max_blocks=self.config.replay.max_blocks)
        blocks = self.blocks[key]
        if c.kind == "rollback":
            r = replay_rollback(c.policy, blocks, self.calibration)
        elif c.kind == "ar_replay":
            r = replay_ar(c.policy, blocks, self.calibration)
        else:
            r = replay_block_selection(c.selector, blocks, self.calibration, c.pool)
        committed = max(r.committed, 1)
        figures = {"requests": int(np.unique(blocks.request).size), "tokens": r.committed, "verifications": r.blocks,
                   "tau": tau(r.committed, r.blocks), "copies_per_token": r.copies_per_token,
                   "demand_per_token": r.copies_per_token, "displaced_per_token_layer": r.displaced_per_token_layer}
        if c.kind == "ar_replay":  # logical demand and prefetch copies over the committed sequence
            figures.update(tau=1.0, verifications=r.committed, demand_per_token=r.extra["demand"] / committed,
                           prefetch_per_token=r.extra["prefetch"] / committed)
        return figures
