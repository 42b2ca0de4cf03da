"""Time of the Gated DeltaNet's Triton kernels (`specmoe.kernels.gdn`) on one CUDA GPU: the prologue
(`gdn_prologue_triton`: convolution, silu, q/k norms, decay and beta) and the recurrence (`gdn_recurrence_triton`)
storing every position's state, as a verification block runs it with the "history" rollback, and without it.

A named config's Gated DeltaNet shapes (--model; default qwen3.6-35b-a3b: 30 layers of 16 key and 32 value heads,
d_k = d_v = 128, convolution width 4), bfloat16 as the decoder runs it, for each block size D (--positions). Each
layer has its own inputs, convolution and recurrent states and history (D x 2 MiB a layer at the default shapes),
so that, as in the model, a launch's states come from device memory rather than the L2. For each kernel and D, one
CUDA graph holds --repeats passes over the layers (a launch per layer, with programmatic dependent launch where the
decoder uses it); a round replays every graph twice, the second time timed with CUDA events (the first leaves the
L2 as the graph itself leaves it, not full of the graph before's writes); reported: µs per launch, the median over
--rounds rounds.

`--module LABEL=FILE` also times another version of gdn.py (e.g. the file before a change) in the same rounds, on
the same inputs, each under its label; its time over the current module's ("LABEL/current") is printed and kept.
`--compare` first runs each other version and the current one on the same inputs and says, per output, whether
they agree bit for bit (and else how many elements differ, and the largest relative difference).

    PYTHONPATH=. python3 scripts/bench_gdn_kernels.py --out runs/gdn_kernels.json [--module old=old_gdn.py] \
        [--compare] [--positions 1 9 17]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_device_cache import graph_of, load_file, time_graph  # noqa: E402

from specmoe.files import write_text_atomic  # noqa: E402
from specmoe.models import named_config  # noqa: E402

KERNELS = ("prologue", "recurrence_history", "recurrence")
PROLOGUE_OUTPUTS = ("state", "conv_in", "q", "k", "v", "decay", "beta")
RECURRENCE_OUTPUTS = ("out", "state", "history")


def gdn_shapes(model: str) -> dict:
    """The Gated DeltaNet shapes of a named config: heads (NK, NV, dk, dv), convolution width and number of
    Gated DeltaNet layers; ValueError for an unknown config or one without such layers."""
    try:
        config = named_config(model).get_text_config()
    except Exception as exc:  # the registry's own message names the known configs
        raise ValueError(str(exc)) from None
    layers = sum(t == "linear_attention" for t in getattr(config, "layer_types", [])[:config.num_hidden_layers])
    if not layers:
        raise ValueError(f"{model} has no Gated DeltaNet layers")
    heads = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
             config.linear_value_head_dim)
    return {"heads": heads, "width": config.linear_conv_kernel_dim, "layers": layers}


def load_module(path: str | None):
    """The kernel module: specmoe's gdn, or another version of gdn.py from the file at `path` (`load_file`)."""
    from specmoe.kernels import gdn
    if path is None:
        return gdn
    return load_file("specmoe.kernels._gdn_other", path)


def layer_inputs(shapes: dict, d: int, layers: int, dtype, device) -> list[dict]:
    """Each layer's prologue inputs and outputs and recurrence inputs, state and history at D = d (random, the
    contract's: `random_prologue_inputs`, `random_gdn_inputs`); one recurrence output shared by the layers, as
    the decoder's step has."""
    from specmoe.kernels.gdn import prologue_outputs, random_gdn_inputs, random_prologue_inputs

    heads, width = shapes["heads"], shapes["width"]
    nk, nv, dk, dv = heads
    out = torch.zeros(d, nv, dv, device=device)
    result = []
    for layer in range(layers):
        proj, weight, A, dt_bias, conv_state = random_prologue_inputs(d, heads, width, dtype, device, seed=layer)
        q, k, v, decay, beta, state = random_gdn_inputs(d, nk, nv, dk, dv, device, seed=layer)
        result.append({"prologue": (proj, weight, A, dt_bias, conv_state) + prologue_outputs(d, heads, width, dtype,
                                                                                             device),
                       "recurrence": (q, k, v, decay, beta, state), "history": torch.zeros(d, nv, dk, dv,
                                                                                           device=device),
                       "out": out})
    return result


def launch(module, kernel: str, inputs: dict) -> None:
    """One launch of `kernel` (KERNELS) of `module` on one layer's inputs."""
    if kernel == "prologue":
        module.gdn_prologue_triton(*inputs["prologue"])
    else:
        history = inputs["history"] if kernel == "recurrence_history" else None
        module.gdn_recurrence_triton(*inputs["recurrence"], history, inputs["out"])


def compare(modules: dict, shapes: dict, d: int, dtype) -> list[dict]:
    """Each other module against "current" on the same fresh inputs (one layer), per kernel and output: equal bit
    for bit, else the number of differing elements and the largest relative difference."""
    rows = []
    for label, module in modules.items():
        if label == "current":
            continue
        for kernel in KERNELS:
            results = []
            for mod in (modules["current"], module):
                inputs = layer_inputs(shapes, d, 1, dtype, "cuda")[0]
                launch(mod, kernel, inputs)
                if kernel == "prologue":
                    results.append(dict(zip(PROLOGUE_OUTPUTS, inputs["prologue"][4:])))
                else:
                    results.append({"out": inputs["out"], "state": inputs["recurrence"][5],
                                    **({"history": inputs["history"]} if kernel == "recurrence_history" else {})})
            torch.cuda.synchronize()
            for name, ref in results[0].items():
                got = results[1][name]
                differ = int((ref != got).sum())
                scale = ref.float().abs().clamp_min(torch.finfo(torch.float32).tiny)
                rel = float(((got.float() - ref.float()).abs() / scale).max()) if differ else 0.0
                rows.append({"module": label, "kernel": kernel, "D": d, "output": name, "bitwise": differ == 0,
                             "differing": differ, "elements": ref.numel(), "max_relative": rel})
    return rows


def parse_modules(ap: argparse.ArgumentParser, specs: list[str]) -> dict[str, str]:
    """--module LABEL=FILE specs as {label: file}; refused in one line (exit 2) when malformed or missing."""
    others = {}
    for spec in specs:
        label, _, path = spec.partition("=")
        if not label or not path or label == "current" or label in others:
            ap.error(f"--module takes LABEL=FILE with distinct labels other than 'current', got {spec!r}")
        if not os.path.isfile(path):
            ap.error(f"--module {spec}: {path}: no such file")
        others[label] = path
    return others


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.6-35b-a3b")
    ap.add_argument("--positions", type=int, nargs="+", default=[1, 9, 17], help="block sizes D")
    ap.add_argument("--layers", type=int, default=None, help="layers' inputs (default: the config's Gated DeltaNet "
                                                             "layers)")
    ap.add_argument("--repeats", type=int, default=10, help="passes over the layers in one graph")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    ap.add_argument("--module", nargs="+", default=[], metavar="LABEL=FILE",
                    help="other versions of gdn.py timed alongside")
    ap.add_argument("--compare", action="store_true", help="first compare each other version's outputs with the "
                                                           "current one's")
    ap.add_argument("--out", default=None, help="also write the results as JSON")
    args = ap.parse_args(argv)
    if min(args.positions) < 1 or args.repeats < 1 or args.rounds < 1 or (args.layers is not None and
                                                                          args.layers < 1):
        ap.error("--positions, --layers, --repeats and --rounds must be at least 1")
    others = parse_modules(ap, args.module)
    try:
        shapes = gdn_shapes(args.model)
    except ValueError as exc:
        ap.error(str(exc))
    from specmoe.kernels.gdn import triton

    if not torch.cuda.is_available() or triton is None:
        raise SystemExit("bench_gdn_kernels.py times CUDA graphs of Triton kernels: it needs a CUDA device and Triton")
    layers = args.layers or shapes["layers"]
    modules = {"current": load_module(None)} | {label: load_module(path) for label, path in others.items()}
    dtype = torch.bfloat16
    report = {"command": " ".join(["bench_gdn_kernels.py"] + (argv if argv is not None else sys.argv[1:])),
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "host": platform.node(), "model": args.model,
              "heads": shapes["heads"], "width": shapes["width"], "layers": layers, "repeats": args.repeats,
              "rounds": args.rounds, "modules": others, "compare": [], "rows": []}
    print(f"{args.model}: {layers} layers' inputs, heads (NK, NV, dk, dv) = {shapes['heads']}, width "
          f"{shapes['width']}, {dtype}; {report['gpu']}; modules: current" + "".join(f", {k} = {v}"
                                                                                  for k, v in others.items()))
    if args.compare:
        for d in args.positions:
            for row in compare(modules, shapes, d, dtype):
                report["compare"].append(row)
                print(f"compare {row['module']} {row['kernel']} D={d} {row['output']}: " +
                      ("bitwise equal" if row["bitwise"] else f"{row['differing']} of {row['elements']} differ, "
                                                              f"max relative {row['max_relative']:.2e}"))
    graphs, times, kept = {}, {}, []
    for d in args.positions:
        inputs = layer_inputs(shapes, d, layers, dtype, "cuda")
        kept.append(inputs)  # the graphs hold the inputs' addresses: they must outlive the graphs
        for kernel in args.kernels:
            for label, module in modules.items():
                def launches(module=module, kernel=kernel, inputs=inputs):
                    for _ in range(args.repeats):
                        for one in inputs:
                            launch(module, kernel, one)
                graphs[kernel, d, label] = graph_of(launches)
                times[kernel, d, label] = []
        torch.cuda.synchronize()
    per_graph = args.repeats * layers
    for _ in range(args.rounds):  # every graph once per round: the versions meet the same clocks and neighbours
        for key, graph in graphs.items():
            graph.replay()  # untimed first: the L2 as this graph leaves it, not as the graph before (other writes)
            times[key].append(time_graph(graph) / per_graph)
    for d in args.positions:
        for kernel in args.kernels:
            row = {"kernel": kernel, "D": d}
            for label in modules:
                row[f"{label}_us"] = statistics.median(times[kernel, d, label])
            line = f"{kernel:18s} D={d:3d}: current {row['current_us']:7.2f} us"
            for label in others:
                row[f"{label}_over_current"] = row[f"{label}_us"] / row["current_us"]
                line += f" | {label} {row[f'{label}_us']:7.2f} us ({label}/current {row[f'{label}_over_current']:.2f})"
            print(line, flush=True)
            report["rows"].append(row)
    if args.out:
        write_text_atomic(args.out, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
