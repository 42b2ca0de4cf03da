"""One round of the engine A/B: the rows an engine change must leave within noise, measured in one process on
the code found on PYTHONPATH (this checkout, or an older one: the script speaks both the one-engine API and
the earlier ArEngine / SpecEngine API), so that a driver can alternate processes of two commits.

Rows (full-size OLMoE-1B-7B config, bf16, seeded random weights on the device, a 4096-position KV cache, one
residency unit of E slots shared by every engine, teacher-forced windows of --prompt untimed and --tokens timed
random tokens):
- all_resident: exact routing with every expert resident, `EngineConfig(max_seq_len=4096)` as users build it;
- all_resident_tuned: the same with `EngineConfig(tune=True)` (the MoE kernel's launch parameters tuned at build);
- C32_psr: PSR at C = 32 (insert budget 1);
- sd_follow: trace-following of synthetic verification blocks (k = 8, tau about 5, acceptmoe, P = 24,
  U = 40) over the all-resident run's own router logits, rooted at position --prompt: ms per committed token;
- prompt_ms_<row>: the window's --prompt untimed positions, in ms (the prefill: time to the first token).
Prints one JSON line: {"rows": {name: ms}, "commit": ..., "api": "engine" | "ar/sd"}.

    PYTHONPATH=. python3 scripts/ab_engine.py [--tokens 64 --prompt 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np
import torch


def _api():
    try:
        from specmoe.engines import Engine  # noqa: F401  (the one-engine API)
        return "engine"
    except ImportError:
        return "ar/sd"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fixed-too", action="store_true", help="also sd_follow_fixed: the speculative engine with "
                    "EngineConfig(tune=False) (new API only)")
    ap.add_argument("--spec-device-routing", default="auto", help="the speculative engine's EngineConfig."
                    "device_routing (new API only)")
    args = ap.parse_args(argv)
    args.spec_config = {} if args.spec_device_routing == "auto" else {"device_routing": args.spec_device_routing}
    api = _api()
    from specmoe.engines.helpers import random_model_on_device
    from specmoe.models import adapter_for, decoder_for
    from specmoe.offload import ExpertResidency, ExpertStore
    from specmoe.routing import Calibration, preset
    from specmoe.verifiers import selector_preset
    if api == "engine":
        from specmoe.engines import Engine, EngineConfig, build_engine
        from specmoe.records import AcceptanceProfile, Trace, synthetic_blocks
        try:
            from specmoe.speculation import SpeculativeConfig
        except ImportError:  # before specmoe.speculation
            from specmoe.engines import SpecConfig as SpeculativeConfig
    else:
        from specmoe.engines.ar import EngineConfig, build_engine
        from specmoe.engines.sd import SpecConfig as SpeculativeConfig
        from specmoe.engines.sd import SpecEngine
        from specmoe.replay import AcceptanceProfile, synthetic_blocks
        from specmoe.traces import Trace

    started = time.time()
    model, adapter = random_model_on_device("olmoe-1b-7b", args.seed, torch.bfloat16, "cuda")
    L, E, K, V = adapter.num_moe_layers, adapter.num_experts, adapter.top_k, adapter.vocab_size
    store = ExpertStore.from_model(model, adapter)
    unit = ExpertResidency(store, E, "cuda")
    calibration = Calibration.uniform(L, E, V)
    seq = 4096
    engines = {
        "all_resident": build_engine(model, preset("exact_lru", E, K), calibration, EngineConfig(max_seq_len=seq),
                                     residency=unit),
        "all_resident_tuned": build_engine(model, preset("exact_lru", E, K), calibration,
                                           EngineConfig(max_seq_len=seq, tune=True), residency=unit),
        "C32_psr": build_engine(model, preset("psr", 32, K, insert_budget=1), calibration,
                                EngineConfig(max_seq_len=seq), residency=unit),
    }
    config = SpeculativeConfig(selector_preset("acceptmoe"), k=8, pool_size=24)
    decoder = decoder_for(model.config).from_model(model, seq)
    fingerprint = adapter_for(model.config).fingerprint(model)
    specs = {}
    if api == "engine":
        spec = Engine(decoder, unit, None, calibration, EngineConfig(max_seq_len=seq, **args.spec_config),
                      fingerprint=fingerprint, speculative=config)
        if args.fixed_too:  # the same with the kernels' fixed default launch parameters
            specs["sd_follow_fixed"] = Engine(decoder_for(model.config).from_model(model, seq), unit, None,
                                              calibration, EngineConfig(max_seq_len=seq, tune=False),
                                              fingerprint=fingerprint, speculative=config)
    else:
        from specmoe.drafters import DrafterConfig, build_drafter
        spec = SpecEngine(decoder, unit, build_drafter(DrafterConfig("synthetic"), model), calibration, config,
                          EngineConfig(max_seq_len=seq), fingerprint=fingerprint)
    setup_s = time.time() - started
    rng = np.random.default_rng(args.seed)
    windows = [rng.integers(0, V, args.prompt + args.tokens) for _ in range(args.windows)]
    rows: dict[str, list[float]] = {name: [] for name in [*engines, "sd_follow"]}
    rows.update({f"prompt_ms_{name}": [] for name in engines})
    recorded = None
    for w in windows:
        for name, engine in engines.items():
            r = engine.teacher_forced(w, prompt_len=args.prompt)
            rows[name].append(float(r.ms[r.timed].mean()))
            rows[f"prompt_ms_{name}"].append(float(r.ms[~r.timed].sum()))  # the prompt's steps: time to first token
            if name == "all_resident" and recorded is None:
                recorded = r
    trace = Trace(recorded.router_logits[args.prompt:], recorded.pregate_logits[args.prompt:],
                  recorded.input_tokens[args.prompt:], np.array([0]), K, V)
    blocks = synthetic_blocks(trace, 8, AcceptanceProfile.for_tau(5, 8), seed=args.seed)
    specs = {"sd_follow": spec, **specs}
    for _ in range(args.windows):
        for name, engine in specs.items():
            results = engine.follow(blocks, first_position=args.prompt)
            committed = sum(len(r.tokens) for r in results)
            if api == "engine":
                ms = sum(float(r.ms.sum()) for r in results)
            else:
                ms = 1e3 * sum(sum(r.verify_s) for r in results)
            rows.setdefault(name, []).append(ms / committed)
    if api == "engine":
        launch = {name: engine.kernels.get("launch") for name, engine in specs.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"api": api, "commit": commit, "setup_s": setup_s, "blocks": int(blocks.num_blocks),
                      "rows": {k: float(np.mean(v)) for k, v in rows.items()},
                      "windows": {k: v for k, v in rows.items() if k.startswith("sd_follow")},
                      "launch": launch if api == "engine" else None}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
