"""How much a graph launch costs on the host before and after a profiled pass: a device verification block's graph
and parts of its body captured alone (`DeviceBlocks._body`'s attention and router, selection, MoE of every layer,
the head, the pool's end of block, the copy-out), each replayed 30 times, the host's time in `replay()` and to the
GPU's end (medians); then one profiled replay of the head graph (torch's profiler, CUDA activity), and three of the
graphs and the engine's ms per block again. Once torch's profiler has recorded CUDA activity CUPTI stays attached to
the process and later launches cost more on the host, which is why the profile scripts time before they profile
(BENCHMARKS.md, "A block's idle time is the host's").

    PYTHONPATH=. python3 scripts/graph_launch_check.py [MODEL]    # a named config, default olmoe-tiny
"""
import argparse
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("model", nargs="?", default="olmoe-tiny", help="a named config of specmoe.models")
args = ap.parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_engine, bench_spec_engine beside it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from specmoe.models import ModelSourceError, named_config  # noqa: E402

try:
    named_config(args.model)
except ModelSourceError as exc:
    ap.error(str(exc))
if not torch.cuda.is_available():
    raise SystemExit("graph_launch_check.py times CUDA graph launches: it needs a CUDA device")
from bench_common import read_tiled  # noqa: E402
from profile_blocks import block_engine, tau_blocks  # noqa: E402

from specmoe.engines import EngineConfig  # noqa: E402
from specmoe.engines.helpers import resident_model_on_device  # noqa: E402
from specmoe.speculation import SpeculativeConfig  # noqa: E402
from specmoe.verifiers import selector_preset  # noqa: E402

name = args.model
model, adapter, store, unit = resident_model_on_device(name, 0, torch.bfloat16, "cuda")
L, E, K, V = adapter.num_moe_layers, adapter.num_experts, adapter.top_k, adapter.vocab_size
trace, calibration = read_tiled("olmoe-like:tokens=8192,skew=1", "olmoe-like:skew=1", L, E, K)
blocks = tau_blocks(trace, 16, 5.0, 8, V)
engine = block_engine(model, unit, calibration, EngineConfig(max_seq_len=4096),
                      SpeculativeConfig(selector_preset("acceptmoe"), k=16, pool_size=32), "device")
engine.follow(blocks, first_position=2048)
dev = next(iter(engine._device_blocks.values()))
dec, step, pool = dev.decoder, dev.step, dev.pool


def att():
    for layer in range(L):
        dec.attention_router(step, layer, copy_out=False)


def sel():
    for layer in range(L):
        pool.select(layer, dev.feed_dev[0, :, layer], dev.alpha_dev, step.route_dev[layer])


def moe():
    for layer in range(L):
        dec.moe(step, layer, dev.residency.slots.layer(layer), copy_in=False, late=None)


def copies_in():
    dev.alpha_dev.copy_(dev.alpha_host, non_blocking=True)
    dev.feed_dev.copy_(dev.feed_host, non_blocking=True)


parts = {
    "h2d alpha+feed": copies_in,
    "attention+router x16": att,
    "select x16": sel,
    "moe x16": moe,
    "head": lambda: dec.head(step, copy_out=False),
    "end_block": pool.end_block,
    "copy_out": dev._copy_out,
    "att+sel+moe": lambda: (att(), sel(), moe()),
    "body fed (as the block)": lambda: dev._body(skip=True, delays=None, copy_out=True, fed=True),
}
s = dev.stream


def follow_ms():
    res = engine.follow(blocks, first_position=2048)
    return float(np.concatenate([x.ms[x.timed] for x in res]).mean())


def timed(label, g):
    cpu, wall = [], []
    for _ in range(30):
        t0 = time.perf_counter()
        g.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        cpu.append(t1 - t0)
        wall.append(time.perf_counter() - t0)
    print(f"{label:26s} replay() {np.median(cpu) * 1e6:7.1f} us   replay+sync {np.median(wall) * 1e6:7.1f} us",
          flush=True)


print("engine block ms before any profiler", follow_ms(), flush=True)
graphs = {}
for label, body in parts.items():
    with torch.cuda.stream(s):
        body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        body()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    graphs[label] = g
    timed(label, g)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CUDA]):
    graphs["head"].replay()
    torch.cuda.synchronize()
print("-- after one profiled replay:", flush=True)
for label in ("head", "att+sel+moe", "body fed (as the block)"):
    timed(label, graphs[label])
print("engine block ms after the profiler", follow_ms(), flush=True)
