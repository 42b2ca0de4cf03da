"""Block selection and the expert pool on the device (`specmoe.kernels.device_select`) against the host
(`select_block_into`, `ExpertPool.use` / `end_block`), block by block and layer by layer
(`policy_checks.check_device_select`: counts, sets, selections, route rows, the weights' and displaced mass's bits, the
pool's state and refill moves): every selector in Triton's interpreter on the CPU (a few blocks), and more blocks
on a CUDA device (marked gpu)."""

import importlib.util

import numpy as np
import pytest
from _device_cases import case_scoring
from _interpreter import run_in_interpreter

from specmoe.verifiers import ExpertPool, selector_preset

# (name, selector, overrides, E, P, scoring, D, blocks)
CASES = [
    ("exact", "exact", {}, 64, 16, "softmax", 9, 2),
    ("acceptmoe", "acceptmoe", {}, 64, 16, "softmax", 9, 3),
    ("acceptmoe_pruned", "acceptmoe", {"gamma": 2.0, "prune_budget": 0.5}, 64, 24, "softmax_renorm", 16, 2),
    ("confidence_top1", "confidence_top1", {}, 64, 16, "softmax", 16, 2),
    ("confidence_sigmoid_groups", "confidence_top1", {}, 64, 32, "sigmoid_groups", 9, 2),
    ("acceptmoe_sigmoid", "acceptmoe", {"gamma": 1.5}, 64, 16, "sigmoid", 9, 2),
    ("acceptmoe_e256", "acceptmoe", {}, 256, 64, "softmax", 16, 2),
    ("confidence_e256_groups", "confidence_top1", {"gamma": 1.2}, 256, 64, "sigmoid_groups", 9, 1),
    ("exact_e256", "exact", {}, 256, 32, "sigmoid", 9, 1),
]


def scoring_of(name: str, num_layers: int, num_experts: int, seed: int = 0):
    if name == "softmax":
        return False  # the pool's own softmax selection scores
    return case_scoring(name, num_layers, num_experts, seed, scale=2.5, groups=(8, 4 if num_experts == 256 else 3))


def run_case(case, device, num_blocks=None, num_layers=2, seed=0, max_positions=None):
    from specmoe.kernels.policy_checks import check_device_select, device_select_case

    name, kind, overrides, E, P, scoring, D, blocks = case
    blocks = num_blocks or blocks
    z, alpha = device_select_case(blocks, num_layers, D, E, seed=seed)
    warm = np.stack([np.random.default_rng(seed + layer).permutation(E) for layer in range(num_layers)])
    pool = ExpertPool(num_layers, E, 8, P, warm)
    return check_device_select(selector_preset(kind, **overrides), scoring_of(scoring, num_layers, E, seed), pool, z,
                               alpha, device, max_positions)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_block_selection_compiles_for_the_gpu_for_every_case():
    """Triton's interpreter skips the compiler's type rules: every case's launches (select, and with a budget
    predict, then end_block) go through Triton's front end for an H200 here, without one (`compile_launches`)."""

    from specmoe.kernels.compiled import compile_launches, launch_block_selection

    with compile_launches() as compiled:
        for name, kind, overrides, E, P, scoring, D, _ in CASES + [c[:8] for c in PREFETCH_CASES]:
            budget = next((c[8] for c in PREFETCH_CASES if c[0] == name), 0)
            pool = ExpertPool(2, E, 8, P, np.tile(np.arange(E), (2, 1)))
            launch_block_selection(pool, selector_preset(kind, **overrides), scoring_of(scoring, 2, E), D, budget)
    names = {name for name, _ in compiled}
    assert names >= {"_own_kernel", "_demand_kernel", "_execute_kernel", "_use_kernel", "_prefetch_kernel",
                     "_refill_kernel"}, names


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_block_selection_fits_its_registers_at_e64_and_e256():
    """The whole compile for an H200 here, without one (`compile_launches(full=True)`: PTX, then ptxas's register
    report), of a block selector's and the block prefetch's launches at E = 64 and 256, D = 17, on their default
    warps (`select_warps`): the rankings' comparison tiles and the [D, E] tiles fit the registers. `_order` with
    [256, 64] tiles compiled, then ran 3-6x slower on the H200 from 5.9 KB of spill stores (BENCHMARKS.md);
    `_use_kernel`'s [D, E] tiles spilled 20-96 bytes on the warps before (one at E = 64, four at 256)."""
    from specmoe.kernels.compiled import compile_launches, launch_block_selection

    chosen = [c for c in CASES if c[0] in ("acceptmoe", "acceptmoe_e256", "confidence_e256_groups")]
    chosen += [c[:8] + (c[8],) for c in PREFETCH_CASES if c[0] == "exact_prefetch_e256"]
    with compile_launches(full=True) as compiled:
        for name, kind, overrides, E, P, scoring, _, _, *budget in chosen:
            pool = ExpertPool(2, E, 8, P, np.tile(np.arange(E), (2, 1)))
            launch_block_selection(pool, selector_preset(kind, **overrides), scoring_of(scoring, 2, E), 17,
                                   budget[0] if budget else 0)
    assert {(name, c["E"]) for name, c, _ in compiled} >= {
        (k, e) for k in ("_own_kernel", "_demand_kernel", "_execute_kernel", "_use_kernel", "_refill_kernel")
        for e in (64, 256)} | {("_prefetch_kernel", 256)}
    for name, constants, usage in compiled:
        assert usage["spill_stores"] == 0 and usage["registers"] <= 255, (name, constants["E"], usage)


def test_block_selection_warps_grow_with_the_expert_row():
    """One warp per 32 entries of the padded expert row, 1 to 8 (twice the cache step's); a DevicePool takes another
    count of 1, 2, 4 or 8 and refuses the rest in one line."""
    from specmoe.kernels.device_select import select_warps

    assert [select_warps(e) for e in (8, 32, 33, 48, 64, 65, 128, 256, 1024)] == [1, 1, 2, 2, 2, 4, 4, 8, 8]
    if importlib.util.find_spec("triton") is None:
        return
    from specmoe.kernels.device_select import DevicePool

    pool = ExpertPool(2, 64, 8, 16, np.tile(np.arange(64), (2, 1)))
    assert DevicePool(pool, selector_preset("acceptmoe"), False, 9, "cpu").warps == 2
    assert DevicePool(pool, selector_preset("acceptmoe"), False, 9, "cpu", warps=1).warps == 1
    with pytest.raises(ValueError, match="1, 2, 4 or 8 warps, got 16"):
        DevicePool(pool, selector_preset("acceptmoe"), False, 9, "cpu", warps=16)


# the block prefetch: (name, selector, overrides, E, P, scoring, D, blocks, budget, tight); tight: U set to the most
# experts one layer of one block misses, so that demand copies must take unused prefetches' slots
PREFETCH_CASES = [
    ("acceptmoe_prefetch", "acceptmoe", {}, 64, 16, "softmax", 9, 3, 4, False),
    ("confidence_prefetch_tight", "confidence_top1", {}, 64, 32, "sigmoid_groups", 9, 3, 64, True),
    ("exact_prefetch_e256", "exact", {}, 256, 64, "softmax_renorm", 9, 2, 12, True),
]


def run_prefetch_case(case, device, num_blocks=None, num_layers=3, seed=0):
    """A prefetch case (PREFETCH_CASES) with pre-gate logits that partly predict the router's: the router logits'
    blocks mixed with another draw, on the bfloat16 grid."""
    import torch

    from specmoe.kernels.policy_checks import check_device_select, device_select_case
    from specmoe.verifiers import SelectionBuffers, select_block_into

    name, kind, overrides, E, P, scoring, D, blocks, budget, tight = case
    blocks = num_blocks or blocks
    z, alpha = device_select_case(blocks, num_layers, D, E, seed=seed)
    other, _ = device_select_case(blocks, num_layers, D, E, seed=seed + 1000)
    g = torch.from_numpy(0.8 * z + 0.7 * other).to(torch.bfloat16).float().numpy()
    warm = np.stack([np.random.default_rng(seed + layer).permutation(E) for layer in range(num_layers)])
    selector, rule = selector_preset(kind, **overrides), scoring_of(scoring, num_layers, E, seed)
    union = None
    if tight:  # a dry run of the host pool for the most misses of one layer of one block
        pool, buffers, union = ExpertPool(num_layers, E, 8, P, warm), SelectionBuffers(D, E, 8), 1
        for b in range(blocks):
            for layer in range(num_layers):
                select_block_into(selector, z[b, layer], pool.resident(layer), alpha[b], 8, rule, buffers, layer=layer)
                union = max(union, pool.use(layer, buffers.selected[:D])[0].size)
            pool.end_block()
    pool = ExpertPool(num_layers, E, 8, P, warm, union_slots=union)
    return check_device_select(selector, rule, pool, z, alpha, device, pregate_logits=g, prefetch=budget)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_device_pool_refuses_bad_prefetch_input():
    """The block prefetch's entry points name what is wrong before any launch: the budget, a pool without one, the
    layer, the pre-gate logits' shape and dtype, alpha."""
    import torch

    from specmoe.kernels.device_select import DevicePool

    pool = ExpertPool(2, 64, 8, 16, np.stack([np.arange(64)] * 2))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch must be an integer >= 0"):
            DevicePool(pool, selector_preset("acceptmoe"), False, 9, "cpu", prefetch=bad)
    g, alpha = torch.zeros(9, 64), torch.ones(9, dtype=torch.float64)
    with pytest.raises(ValueError, match="no prefetch budget"):
        DevicePool(pool, selector_preset("acceptmoe"), False, 9, "cpu").predict(1, g, alpha)
    dev = DevicePool(pool, selector_preset("acceptmoe"), False, 9, "cpu", prefetch=4)
    with pytest.raises(ValueError, match=r"predicts layers 1 \.\. 1, got 0"):
        dev.predict(0, g, alpha)
    with pytest.raises(ValueError, match=r"pre-gate logits must be float32 \[D <= 9, 64\]"):
        dev.predict(1, torch.zeros(10, 64), torch.ones(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="pre-gate logits must be float32"):
        dev.predict(1, g.double(), alpha)
    with pytest.raises(ValueError, match=r"alpha must be float64 \[9\]"):
        dev.predict(1, g, alpha.float())


def check_over_union(device):
    """A block whose layer misses more than U experts: the count says so, no copy is listed, the layer's pool is
    unchanged, and every route entry points inside the slots (the engine raises the host's error after the block)."""
    import torch

    from specmoe.kernels.policy_checks import device_select_case
    from specmoe.kernels.device_select import DevicePool

    z, alpha = device_select_case(1, 1, 9, 64, seed=3)
    pool = ExpertPool(1, 64, 8, 16, np.random.default_rng(3).permutation(64)[None], union_slots=8)
    dev = DevicePool(pool, selector_preset("exact"), False, 9, device)
    before = {name: value.copy() for name, value in dev.state().items() if name != "block"}
    dev.select(0, torch.tensor(z[0, 0], device=device), torch.tensor(alpha[0], device=device))
    missing = int(dev.layer_counts[0, 0])
    assert missing > 8 and tuple(dev.counts.cpu().numpy())[2:] == (missing, 0) and int(dev.demand[0]) == 0
    route = dev.route[:9].cpu().numpy()
    assert route.min() >= 0 and route.max() < 16 + 8, route
    after = dev.state()
    for name, value in before.items():
        assert np.array_equal(after[name], value), name
    return missing


_CHECK = r"""
import sys
sys.path.insert(0, "tests")
from _device_cases import FAST_CALLS
exec(FAST_CALLS)
from test_device_select import CASES, run_case
for i, case in enumerate(CASES):
    print("ok", case[0], run_case(case, "cpu", seed=i), flush=True)

# blocks shorter than the pool's buffers, whose scratch rows past the block hold stale ranks: the launches read
# only the block's rows
import specmoe.kernels.device_select as ds
class Stale(ds.DevicePool):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scratch.own.fill_(0)
        self.scratch.executed.fill_(0)
ds.DevicePool = Stale
print("ok short", run_case(CASES[3], "cpu", seed=11, max_positions=32), flush=True)
from test_device_select import PREFETCH_CASES, run_prefetch_case
for i, case in enumerate(PREFETCH_CASES):
    print("ok", case[0], run_prefetch_case(case, "cpu", seed=i), flush=True)
from test_device_select import check_over_union
print("ok over_union", check_over_union("cpu"), flush=True)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_device_select_equals_host_in_the_interpreter():
    done = run_in_interpreter(_CHECK)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for name, *_ in CASES + [("short",), ("over_union",)] + PREFETCH_CASES:
        assert f"ok {name} " in done.stdout, done.stdout
    # every prefetch case predicts, hits and leaves prefetches unused; the tight ones spill demand copies into
    # unused prefetches' slots
    for name, *_, tight in PREFETCH_CASES:
        line = next(x for x in done.stdout.splitlines() if x.startswith(f"ok {name} "))
        counts = eval(line.split(" ", 2)[2])  # the totals dict printed by the script
        assert counts["prefetch"] > 0 and counts["prefetch_hit"] > 0 and counts["prefetch_unused"] > 0, line
        assert counts["demand"] > 0 and (counts["spilled"] > 0) == tight, line


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_gpu_device_select_equals_host(case):
    """40 blocks of 4 layers per case."""
    run_case(case, "cuda", num_blocks=40, num_layers=4, seed=7)


@pytest.mark.gpu
def test_gpu_device_select_over_union_slots():
    check_over_union("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", PREFETCH_CASES, ids=lambda c: c[0])
def test_gpu_device_select_prefetch_equals_host(case):
    """40 blocks of 4 layers per case, the block prefetch of layers 1-3."""
    counts = run_prefetch_case(case, "cuda", num_blocks=40, num_layers=4, seed=7)
    assert counts["prefetch_hit"] > 0 and counts["prefetch_unused"] > 0 and (counts["spilled"] > 0) == case[-1]


_PROBE_CHECK = r"""
import sys
import numpy as np
import torch
sys.path.insert(0, "tests")
from _select_probe import order_kernel, sum_kernel
from specmoe.verifiers.selection import _halving_sum

DEVICE = DEVICE_NAME
rng = np.random.default_rng(0)

# sums: the host's halving order, bit for bit, over magnitudes 1e-20..1e20 (where a one-after-another sum, or
# another tree, rounds differently), E below its padded row, and the entropy's negative terms
differs = 0
for E, block in ((256, 256), (200, 256), (64, 64), (37, 64)):
    for trial in range(20):
        x = np.zeros(block)
        x[:E] = rng.uniform(0.5, 1.0, E) * 10.0 ** rng.integers(-20, 21, E)
        if trial % 2:
            x[:E] *= -rng.uniform(0.0, 1e-3, E)
        out = torch.zeros(1, dtype=torch.float64, device=DEVICE)
        sum_kernel[(1,)](torch.tensor(x, device=DEVICE), out, BLOCK_E=block)
        want = _halving_sum(x[:E], np.empty(2 * E))
        assert out.item() == want, (E, trial, out.item(), want)
        differs += sum(x[:E].tolist()) != want
assert differs > 20, differs  # the order matters for these values

# the extra candidates: decreasing u, ties to the lower index, a limit; m <= 64 packed, m > 64 by picks or tiles,
# m = 0, and E = 64 (one comparison over the row)
checked = 0
for E, m, tied in ((256, 27, True), (256, 64, True), (256, 65, False), (256, 200, True), (256, 0, False),
                   (64, 40, True), (200, 50, True)):
    block = 1 << (E - 1).bit_length()
    u = np.zeros(E)
    experts = rng.choice(E, m, replace=False)
    u[experts] = rng.uniform(0.0, 1.0, m) * 10.0 ** rng.integers(-3, 1, m)
    if tied:  # five experts at the largest u, three at another value
        u[experts[:5]], u[experts[5:8]] = u[experts].max(), u[experts[8]]
    for limit in (0, 1, 8, 24, 33, m):
        order = sorted(np.flatnonzero(u > 0), key=lambda e: (-u[e], e))[:limit]
        want = np.full(block, -1)
        want[order] = np.arange(len(order))
        out = torch.empty(block, dtype=torch.int32, device=DEVICE)
        scratch_f = torch.zeros(block, dtype=torch.float64, device=DEVICE)
        scratch_r = torch.zeros(block, dtype=torch.int32, device=DEVICE)
        order_kernel[(1,)](torch.tensor(u, device=DEVICE), out, scratch_f, scratch_r, limit, E=E, BLOCK_E=block,
                           num_warps=8 if block == 256 else 2)
        assert np.array_equal(out.cpu().numpy(), want), (E, m, limit, np.flatnonzero(out.cpu().numpy() >= 0))
        checked += 1
print("probes ok", checked, differs)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_sum_and_candidate_order_probes_in_the_interpreter():
    """`_halving_sum` against the host's, bit for bit, on values whose sum depends on the order (1e-20 to 1e20, negative
    terms, E below its padded row); `_order_positive` against a sort by (-u, index): ties at the top, m <= 64
    packed into one comparison, m = 65 and 200 through `_order`'s picks and tiles, m = 0, E = 64 and 200."""
    done = run_in_interpreter('DEVICE_NAME = "cpu"\n' + _PROBE_CHECK)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "probes ok 42" in done.stdout, done.stdout


@pytest.mark.gpu
def test_gpu_sum_and_candidate_order_probes():
    """The probes compiled for the GPU: the halving sum's reductions of pairs as the hardware lays them out."""
    namespace = {}
    exec('DEVICE_NAME = "cuda"\n' + _PROBE_CHECK, namespace)
