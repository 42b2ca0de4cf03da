"""Registers and spills of the verification block's Triton kernels at a model's shapes, compiled for an H200 (sm_90)
on any machine, a GPU or not.

Each launch runs through Triton's whole compile for sm_90 and the ptxas Triton ships (`compiled.compile_launches`
with full=True; nothing runs): the grouped MoE's two weight kernels for every tuning candidate
(`grouped_moe.GATE_UP_CANDIDATES`, `DOWN_CANDIDATES`) at each block size D, the block selection's launches
(`DevicePool`: acceptmoe, with the block prefetch) and the AR cache step (`DeviceCache`: Cache-Prior and PSR) at
the model's E, K and router scoring. Reported per launch: its warps, ptxas's registers per thread, spill stores
and loads and stack frame (bytes), and the tensor-core product its PTX uses (`mma`: wgmma, mma.sync or none). A
kernel that spills, or one at 255 registers, is where a tile is too wide for the registers; only a GPU says what
that costs (`bench_device_select.py`, `sweep_grouped_moe.py`), and only the machine code says that it happens. A
named config needs no weights: the shapes come from its transformers config.

    PYTHONPATH=. python3 scripts/kernel_registers.py --model olmoe-1b-7b --positions 9 17 [--out regs.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from specmoe.files import write_text_atomic
from specmoe.geometry import Geometry
from specmoe.kernels import grouped_moe as gm
from specmoe.kernels.compiled import compile_launches, launch_block_selection, launch_cache_step
from specmoe.kernels.policy_checks import device_cache_case
from specmoe.models import NAMED_CONFIGS, adapter_for
from specmoe.models.registry import named_config
from specmoe.routing import LogicalCache, preset
from specmoe.verifiers import ExpertPool, selector_preset

COLUMNS = ("warps", "registers", "spill_stores", "spill_loads", "stack", "mma")


def model_shapes(name: str):
    """(Geometry of the named config's MoE layers, its router scoring for the two layers the launches are compiled
    for): from the config alone, no weights (a learned selection bias read as zeros)."""
    import dataclasses

    adapter = adapter_for(named_config(name))
    geometry = Geometry.of(adapter)
    scoring = adapter.router_scoring(lambda param: torch.zeros(geometry.num_experts))
    return geometry, scoring if scoring.bias is None else dataclasses.replace(scoring, bias=scoring.bias[:2])


def grouped_rows(geometry: Geometry, positions: int) -> list[dict]:
    """Every gate-up and down candidate of the grouped MoE at D = positions (bf16, two slots' buffers)."""
    h, inter, k = geometry.hidden, geometry.inter, geometry.top_k
    x = torch.zeros(positions, h, dtype=torch.bfloat16)
    route = torch.zeros(positions, 2 * k, dtype=torch.int32)
    buf = torch.zeros(2, geometry.expert_width, dtype=torch.bfloat16)
    ws = gm.make_grouped_workspace(positions, k, h, inter, torch.bfloat16, "cpu")
    with compile_launches(full=True) as compiled:
        for candidate in gm.GATE_UP_CANDIDATES:
            gm._launch_gate_up(x, buf, route, ws, 0, 2, gm.grouped_params(positions, candidate))
        for candidate in gm.DOWN_CANDIDATES:
            gm._launch_down(buf, route, ws, 0, 2, gm.grouped_params(positions, candidate))
    candidates = gm.GATE_UP_CANDIDATES + gm.DOWN_CANDIDATES
    if len(compiled) != len(candidates):  # a candidate compiled once for two: the rows would not line up
        raise RuntimeError(f"{len(compiled)} compiles for {len(candidates)} grouped MoE candidates")
    return [{"kernel": name, "D": positions, "params": dict(candidate, block_m=constants["BLOCK_M"]), **usage}
            for (name, constants, usage), candidate in zip(compiled, candidates)]


def selection_rows(geometry: Geometry, scoring, positions: int) -> list[dict]:
    """The block selection's launches (acceptmoe, a block prefetch of K experts) and the refill at D = positions
    (`compiled.launch_block_selection`: each launch form once)."""
    e, k = geometry.num_experts, geometry.top_k
    pool = ExpertPool(2, e, k, max(k + 1, e // 4), np.tile(np.arange(e), (2, 1)))
    with compile_launches(full=True) as compiled:
        launch_block_selection(pool, selector_preset("acceptmoe"), scoring, positions, prefetch=k)
    return [{"kernel": name, "D": positions, "params": {"E": e}, **usage} for name, _, usage in compiled]


def cache_step_rows(geometry: Geometry, scoring) -> list[dict]:
    """The AR cache step's route and part-1 launches (`compiled.launch_cache_step`), Cache-Prior and PSR at C = E / 4
    (at least K + 1)."""
    e, k = geometry.num_experts, geometry.top_k
    calibration = device_cache_case(2, e, 2, seed=0)[0]
    rows = []
    for base in ("cache_prior", "psr"):
        cache = LogicalCache(preset(base, max(k + 1, e // 4), k), calibration, 2, e, groups=scoring.groups)
        with compile_launches(full=True) as compiled:
            launch_cache_step(cache, scoring)
        rows += [{"kernel": f"{name} ({base}, {'route' if c['DO_ROUTE'] else 'part 1'})", "D": 1,
                  "params": {"E": e}, **usage} for name, c, usage in compiled]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| kernel | D | parameters | warps | registers | spill stores | spill loads | stack | mma |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['D']} | {', '.join(f'{k} {v}' for k, v in r['params'].items())} | "
              + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="olmoe-1b-7b", choices=sorted(NAMED_CONFIGS))
    ap.add_argument("--positions", type=int, nargs="+", default=[9, 17], help="block sizes D (k + 1)")
    ap.add_argument("--out", help="also write the rows as json")
    args = ap.parse_args(argv)
    if min(args.positions) < 1:
        ap.error("--positions must be at least 1")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("kernel_registers.py compiles Triton kernels: it needs triton installed") from None
    geometry, scoring = model_shapes(args.model)
    rows = [row for d in args.positions for row in grouped_rows(geometry, d) + selection_rows(geometry, scoring, d)]
    rows += cache_step_rows(geometry, scoring)
    print(f"{args.model}: H {geometry.hidden}, I {geometry.inter}, E {geometry.num_experts}, K {geometry.top_k}; "
          f"compiled for sm_90\n{table(rows)}")
    if args.out:
        write_text_atomic(args.out, json.dumps({"command": " ".join(["kernel_registers.py"] + (
            argv if argv is not None else sys.argv[1:])), "model": args.model, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
