"""Where the device policy's token time goes: full-size OLMoE (seeded random weights on the
GPU), C = 32, routing following the olmoe-like source (4 windows of 96 tokens from position 2048 over a random KV
cache). Times, in 5 interleaved rounds (medians of the per-round means, ms per token), the token with every expert
resident (the reference of issue 21's targets), the device policy with Cache-Prior, with PSR (part 1 of the next
layer and its prefetch copies on a side stream, `DevicePolicy.branch`), and with PSR in line
(`DevicePolicy.branch = False`), each with copies skipped and with copies; then the kernels of 8 tokens of each
under torch's profiler (copies skipped; `kernel_timeline.kernel_table`, per token), and for Cache-Prior and PSR the
GPU operations (name, stream, start, duration) as $OUT/kernels_NAME.json.gz, from which the GPU's busy time and the
cache step's time per launch and stream are read, each operation from when it could run (`kernel_timeline.running`)
(`_cache_step_kernel`: on the compute stream the routes, on the side stream PSR's part 1).
`--module FILE` also runs Cache-Prior and PSR on another version of `specmoe/kernels/device_cache.py` (rows
"cp_other", "psr_other"; e.g. the file before a change) in the same rounds and profiles, so that the two compare
in one process on one machine.

    OUT=runs/profile PYTHONPATH=. python3 scripts/profile_device_policy.py [--module old_device_cache.py]
"""
import argparse
import gzip
import json
import os
import sys
import time

# the arguments first: a bad one is refused before torch and the package are imported
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--module", help="also run Cache-Prior and PSR on this version of device_cache.py")
parser.add_argument("--rounds", type=int, default=5)
args = parser.parse_args()
if args.rounds < 1:
    parser.error(f"--rounds must be at least 1, got {args.rounds}")
if args.module and not os.path.isfile(args.module):
    parser.error(f"--module {args.module}: no such file (another version of specmoe/kernels/device_cache.py)")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_engine, beside this script
from bench_device_cache import load_file  # noqa: E402
from bench_common import load_trace_windows, policies, randomize_caches, ratio_ci  # noqa: E402

from specmoe.engines import EngineConfig, build_engine  # noqa: E402
from specmoe.engines.device_policy import DevicePolicy  # noqa: E402
from specmoe.engines.helpers import random_model_on_device  # noqa: E402
from specmoe.engines.kernel_timeline import KernelSpan, busy_us, kernel_table, running  # noqa: E402
from specmoe.kernels import device_cache  # noqa: E402
from specmoe.offload import ExpertResidency, ExpertStore  # noqa: E402
from specmoe.routing import preset  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/prof")
if not torch.cuda.is_available():
    raise SystemExit("profile_device_policy.py profiles CUDA graphs: it needs a CUDA device")
os.makedirs(OUT, exist_ok=True)
t0 = time.time()
model, adapter = random_model_on_device("olmoe-1b-7b", 0, torch.bfloat16, "cuda")
store = ExpertStore.from_model(model, adapter)
L, E, K, V = adapter.num_moe_layers, adapter.num_experts, adapter.top_k, adapter.vocab_size
unit = ExpertResidency(store, E, "cuda")
traced = load_trace_windows("olmoe-like:tokens=8192", "olmoe-like", (L, E, K, V), 4, 96)
cal, wins, feeds = traced["calibration"], traced["windows"], traced["traces"]
engine = build_engine(model, preset("exact_lru", 32, K), cal, EngineConfig(max_seq_len=4096, policy_device="on"),
                      residency=unit)
randomize_caches({0: engine})
pols = policies(32, E, K)
print("setup", round(time.time() - t0), "s", flush=True)


CURRENT = device_cache.DeviceCache
OTHER = load_file("specmoe.kernels._device_cache_other", args.module).DeviceCache if args.module else None


def run(name, skip):
    pol = resident if name == "resident" else pols["psr" if name.startswith("psr") else "cache_prior"]
    branch, kind = name != "psr_inline", OTHER if name.endswith("_other") else CURRENT
    if DevicePolicy.branch != branch or device_cache.DeviceCache is not kind:
        DevicePolicy.branch = branch
        device_cache.DeviceCache = kind  # what DevicePolicy builds its cache from
        engine._device_policies.clear()
    engine.configure(policy=pol, calibration=cal, skip_copies=skip)
    ms = []
    for w, f in zip(wins, feeds):
        r = engine.teacher_forced(w, feed=f, first_position=2048)
        ms.append(r.ms[r.timed])
        copies[name] = r.summary()["copies_per_token"]["transferred"]
        assert r.info["routing"] == "device_policy", r.info  # with every expert resident too: it reads the feed
    return float(np.concatenate(ms).mean())


copies: dict = {}  # transferred copies per token of each row's last window
resident = preset("exact_lru", E, K)  # every expert resident: routing on the device, one graph per token
names = ["resident", "cp", "psr", "psr_inline"] + (["cp_other", "psr_other"] if OTHER else [])
res = {f"{n}_{s}": [] for n in names for s in ("skip", "copies")}
for n in names:  # warm-up
    run(n, True)
    run(n, False)
for r in range(args.rounds):
    for n in names:
        for s in ("skip", "copies"):
            res[f"{n}_{s}"].append(run(n, s == "skip"))
    print("round", r, {k: round(v[-1], 3) for k, v in res.items()}, flush=True)
summary = {k: float(np.median(v)) for k, v in res.items()}
print("medians", summary, flush=True)
print("copies per token (last window)", {k: round(v, 2) for k, v in copies.items()}, flush=True)
pairs = [(f"{n}_{s}", "resident_skip") for n in ("cp", "psr") for s in ("skip", "copies")]
pairs += [(f"{n}_{s}", f"{n}_other_{s}") for n in ("cp", "psr") for s in ("skip", "copies") if OTHER]
ratios = {f"{a} / {b}": ratio_ci(res[a], res[b]) for a, b in pairs}
for label, r in ratios.items():
    print(f"{label}: {r['ratio']:.3f} ({r['lo']:.3f}-{r['hi']:.3f}) over {args.rounds} rounds", flush=True)

from torch.profiler import ProfilerActivity, profile  # noqa: E402

tables = {}
for n in names[1:]:
    for s in ("skip",):
        run(n, True)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            r = engine.teacher_forced(wins[0][:8], feed=feeds[0], first_position=2048)
        tables[n] = kernel_table(prof, len(r.ms), 25)[0]
        print(f"== {n} (ms per token under the profiler, not the rounds' time: {r.ms.mean():.3f})\n", tables[n],
              flush=True)
        if n in ("psr", "cp", "psr_other", "cp_other"):
            path = f"{OUT}/trace_{n}.json"
            prof.export_chrome_trace(path)
            # keep the GPU kernels only, compactly: name, stream, start, dur
            ev = json.load(open(path))
            ev = ev["traceEvents"] if isinstance(ev, dict) else ev
            ks = [(e.get("name"), e.get("tid"), e.get("ts"), e.get("dur")) for e in ev
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
            with gzip.open(f"{OUT}/kernels_{n}.json.gz", "wt") as fh:
                json.dump(ks, fh)
            os.remove(path)
            # each op from when it could run (`kernel_timeline.running`: PDL's early starts wait inside the span)
            ran = running([KernelSpan(name, ts, ts + dur) for name, _, ts, dur in ks])
            span = max(op.end_us for op in ran) - min(op.start_us for op in ran)
            print(f"{n}: {len(ks)} GPU ops, busy {busy_us(ran) / 1e3:.2f} ms over a span of {span / 1e3:.2f} ms",
                  flush=True)
            steps: dict = {}  # the cache step's launches per stream (compute: routes; side: PSR's part 1)
            for (name, stream, _, _), op in zip(ks, ran, strict=True):
                if name == "_cache_step_kernel":
                    steps.setdefault(stream, []).append(op.us)
            for stream, durs in steps.items():
                print(f"{n}: cache step on stream {stream}: {len(durs)} launches, median {np.median(durs):.1f} us, "
                      f"p10 {np.percentile(durs, 10):.1f}, p90 {np.percentile(durs, 90):.1f}", flush=True)
json.dump({"rounds": res, "medians": summary, "ratios": ratios, "copies_per_token": copies},
          open(f"{OUT}/profile_psr.json", "w"), indent=1)
open(f"{OUT}/tables.txt", "w").write("\n\n".join(f"== {k}\n{v}" for k, v in tables.items()))
print("done", round(time.time() - t0), "s")
