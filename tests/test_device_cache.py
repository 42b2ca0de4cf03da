"""The logical cache on the device (`specmoe.kernels.device_cache`) against the host `LogicalCache`, step by step
(`policy_checks.check_device_cache`: selections, slots, execution weights, demand and prefetch lists and the whole
state, bit for bit): every policy kind in Triton's interpreter on the CPU (short sequences: the interpreter takes about
0.1-0.3 s per layer step), and long sequences on a CUDA device (marked gpu)."""

import ast
import importlib.util

import pytest
from _device_cases import FAST_CALLS, case_scoring
from _interpreter import run_in_interpreter

from specmoe.routing import Calibration, LogicalCache, RouterScoring, preset

# (name, policy preset, overrides, E, C, scoring, T, L)
CASES = [
    ("exact_lru", "exact_lru", {}, 64, 16, "softmax", 14, 2),
    ("exact_a", "exact_a", {}, 64, 16, "softmax", 10, 2),
    ("exact_with_prefetch", "exact_a", {"insert_budget": 2, "window": 4}, 64, 16, "softmax", 8, 2),
    ("cache_prior", "cache_prior", {}, 64, 16, "softmax", 12, 2),
    ("cache_prior_a", "cache_prior_a", {}, 64, 32, "softmax", 10, 2),
    ("cache_prior_published", "cache_prior_published", {}, 64, 16, "softmax", 12, 2),
    ("psr", "psr", {}, 64, 16, "softmax", 10, 2),
    ("psr_lru_running", "psr", {"insert_budget": 2, "window": 5, "priority": "lru", "protect_top": 1,
                                "delta": "running"}, 64, 16, "softmax", 8, 2),
    ("spec_exec", "spec_exec", {}, 64, 16, "softmax", 8, 2),
    ("psr_sigmoid_groups", "psr", {}, 64, 32, "sigmoid_groups", 6, 2),
    ("psr_e256", "psr", {}, 256, 64, "softmax_renorm", 3, 2),
]
# Edge cases of the cache step (the interpreter asserts that each happens): E not a power of two (masked lanes);
# C = K + 1, where the demand victims run out of unprotected residents and fall back to protected ones; LRU
# priorities with many ties (the warm experts all have priority 0, experts inserted at one token share theirs),
# decided by the index; windows larger than the budget, where an insertion's victim is a window expert not visited
# yet (evicted, then inserted again or left out); expert groups of a size that is not a power of two.
EDGE_CASES = [
    ("psr_e60", "psr", {"insert_budget": 2}, 60, 12, "softmax", 8, 2),
    ("exact_e60_sigmoid", "exact_a", {"insert_budget": 2, "window": 4}, 60, 16, "sigmoid", 6, 2),
    ("psr_c9", "psr", {"insert_budget": 2}, 64, 9, "softmax", 10, 2),
    ("psr_lru_ties", "psr", {"priority": "lru", "insert_budget": 3, "window": 12}, 48, 12, "softmax", 8, 2),
    ("psr_window", "psr", {"insert_budget": 4, "window": 16}, 64, 10, "softmax", 8, 3),
    ("psr_e48_groups", "psr", {}, 48, 16, "sigmoid_groups", 6, 2),  # groups of 6
    # a window past `ORDER_PICKS` at E = 256: part 1's pre-gate ranking by comparison tiles, not picks
    ("psr_e256_wide_window", "psr", {"insert_budget": 4, "window": 32}, 256, 64, "softmax_renorm", 3, 2),
]


def scoring_of(name: str, num_layers: int, num_experts: int, seed: int = 0) -> RouterScoring:
    return case_scoring(name, num_layers, num_experts, seed, scale=2.446, groups=(8, 3))


_CHECK = FAST_CALLS + r"""
import sys
sys.path.insert(0, "tests")
from test_device_cache import CASES, EDGE_CASES, scoring_of
from specmoe.kernels.policy_checks import check_device_cache, device_cache_case
from specmoe.routing import preset
for i, (name, base, overrides, E, C, scoring, T, L) in enumerate(CASES + EDGE_CASES):
    calibration, z, g, tokens = device_cache_case(L, E, T, seed=i + 9 * (i >= len(CASES)))
    totals = check_device_cache(preset(base, C, 8, **overrides), scoring_of(scoring, L, E, i), calibration, z, g,
                                tokens, "cpu", sequences=2)
    print("ok", name, totals, flush=True)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_device_cache_equals_host_cache_in_the_interpreter():
    done = run_in_interpreter(_CHECK)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    totals = {}
    for line in done.stdout.splitlines():
        if line.startswith("ok "):
            _, name, rest = line.split(" ", 2)
            totals[name] = ast.literal_eval(rest)
    assert sorted(totals) == sorted(c[0] for c in CASES + EDGE_CASES), done.stdout
    # every copy class occurs somewhere: the cases exercise demand and prefetch insertions and unused prefetches
    assert totals["psr"]["unused"] > 0
    for name in ("psr_e60", "exact_e60_sigmoid", "psr_c9", "psr_lru_ties", "psr_window", "psr_e256_wide_window"):
        assert totals[name]["demand"] > 0 and totals[name]["prefetch"] > 0, (name, totals[name])
    assert totals["psr_c9"]["protected_victims"] > 0  # the demand fallback to protected residents
    assert totals["psr_lru_ties"]["window_victims"] > 0 and totals["psr_window"]["window_victims"] > 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_cache_step_compiles_for_the_gpu_for_every_case():
    """The interpreter above does not apply the compiler's type rules (a loop-carried variable must keep its type);
    each case's two launches (the route alone, part 1 alone: as the engine launches them) compile for an H200 here,
    without one. A kernel that does not compile raises."""

    from specmoe.kernels.compiled import compile_launches, launch_cache_step
    from specmoe.kernels.policy_checks import device_cache_case

    with compile_launches() as compiled:
        for name, base, overrides, E, C, scoring, T, L in CASES + EDGE_CASES:
            policy = preset(base, C, 8, **overrides)
            calibration = device_cache_case(L, E, 2, seed=0)[0]
            cache = LogicalCache(policy, calibration, L, E, groups=scoring_of(scoring, L, E).groups)
            launch_cache_step(cache, scoring_of(scoring, L, E))
    assert {name for name, _ in compiled} == {"_cache_step_kernel"}
    routes = [c for _, c in compiled if c["DO_ROUTE"]]
    assert len(routes) >= len(CASES) and {c["KIND"] for c in routes} == {0, 1, 2, 3}  # every policy kind
    assert any(c["DO_PART1"] and not c["DO_ROUTE"] for _, c in compiled)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_cache_step_fits_its_registers_at_e64_and_e256():
    """The whole compile for an H200 here, without one (`compile_launches(full=True)`: PTX, then ptxas's register
    report), of Cache-Prior's and PSR's launches at E = 64 and 256, and of a PSR window of 32 at E = 256 (its
    pre-gate ranking past `ORDER_PICKS`, by comparison tiles): nothing spills."""

    from specmoe.kernels.compiled import compile_launches, launch_cache_step
    from specmoe.kernels.policy_checks import device_cache_case
    from specmoe.kernels.ranking import ORDER_PICKS

    cases = [(base, E, {}) for base in ("cache_prior", "psr") for E in (64, 256)]
    cases.append(("psr", 256, {"window": ORDER_PICKS + 8, "insert_budget": 4}))
    with compile_launches(full=True) as compiled:
        for base, E, overrides in cases:
            calibration = device_cache_case(2, E, 2, seed=0)[0]
            scoring = scoring_of("softmax_renorm", 2, E)
            cache = LogicalCache(preset(base, 32, 8, **overrides), calibration, 2, E, groups=scoring.groups)
            launch_cache_step(cache, scoring)
    assert any(c["M"] > ORDER_PICKS for _, c, _ in compiled)
    assert {c["E"] for _, c, _ in compiled} == {64, 256} and len(compiled) >= 6
    for name, constants, usage in compiled:
        assert usage["spill_stores"] == 0 and usage["registers"] <= 255, (constants["E"], constants["M"], usage)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_device_cache_refuses_other_groups_than_the_cache():
    from specmoe.kernels.device_cache import DeviceCache

    cache = LogicalCache(preset("psr", 16, 8), Calibration.uniform(2, 64, 10), 2, 64)
    with pytest.raises(ValueError, match="groups"):
        DeviceCache(cache, RouterScoring("sigmoid", n_group=8, topk_group=3), "cpu")


_PREFETCH_OUT = r"""
import numpy as np, torch
from specmoe.kernels.policy_checks import device_cache_case
from specmoe.kernels.device_cache import DeviceCache
from specmoe.routing import LogicalCache, RouterScoring, preset
calibration, z, g, tokens = device_cache_case(3, 64, 1, seed=4)
host = LogicalCache(preset("psr", 16, 8, insert_budget=2, window=4), calibration, 3, 64)
host.reset()
a, b = (DeviceCache(host, RouterScoring("softmax"), "cpu") for _ in range(2))
token = torch.tensor(tokens[:1], dtype=torch.int64)
a.step(token, 1, pregate_logits=torch.from_numpy(g[0, 1]))
mine = torch.full_like(b.prefetch, -7)
b.prefetch.fill_(-5)
b.step(token, 1, pregate_logits=torch.from_numpy(g[0, 1]), prefetch_out=mine)
assert a.prefetch[0] > 0, a.prefetch                              # part 1 inserted something
assert torch.equal(mine, a.prefetch), (mine, a.prefetch)          # the same list, in the buffer given
assert bool((b.prefetch == -5).all()), b.prefetch                 # the default list untouched
for name, x, y in zip(("istate", "fstate"), (a.istate, a.fstate), (b.istate, b.fstate)):
    assert torch.equal(x, y), name
try:
    b.step(token, 1, pregate_logits=torch.from_numpy(g[0, 1]), prefetch_out=mine[1:])
except ValueError as e:
    assert "prefetch_out must be int64" in str(e), e
else:
    raise AssertionError("a short prefetch_out was accepted")
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_part1_writes_its_list_where_asked():
    """`DeviceCache.step(prefetch_out=)`: part 1's list in the given buffer (each layer's own on the device
    policy's branch), the same list and state as into the default one, which is left alone; a buffer of the
    wrong shape is refused by name."""
    done = run_in_interpreter(_PREFETCH_OUT)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_cache_step_warps_grow_with_the_expert_row():
    """One warp per 64 entries of the padded expert row (two entries per thread), 1 to 8; a DeviceCache takes
    another count of 1, 2, 4 or 8 and refuses the rest in one line."""
    from specmoe.kernels.device_cache import default_warps

    assert [default_warps(e) for e in (8, 48, 60, 64, 65, 128, 256, 384, 1024)] == [1, 1, 1, 1, 2, 2, 4, 8, 8]
    if importlib.util.find_spec("triton") is None:
        return
    from specmoe.kernels.device_cache import DeviceCache

    cache = LogicalCache(preset("psr", 16, 8), Calibration.uniform(2, 64, 10), 2, 64)
    assert DeviceCache(cache, RouterScoring("softmax"), "cpu").warps == 1
    assert DeviceCache(cache, RouterScoring("softmax"), "cpu", warps=4).warps == 4
    with pytest.raises(ValueError, match="1, 2, 4 or 8 warps, got 3"):
        DeviceCache(cache, RouterScoring("softmax"), "cpu", warps=3)


# (E, C) of the long CUDA runs, taken in turn by the cases: every policy kind at both E, every C at both E
_GPU_GEOMETRIES = [(64, 16), (256, 32), (64, 64), (256, 16), (64, 32), (256, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("case, num_experts, capacity",
                         [(c, *_GPU_GEOMETRIES[i % len(_GPU_GEOMETRIES)])
                          for i, c in enumerate(c for c in CASES if c[0] != "psr_e256")]
                         + [(c, c[3], c[4]) for c in EDGE_CASES] + [(c, 256, c[4]) for c in EDGE_CASES if c[3] != 256],
                         ids=lambda x: x[0] if isinstance(x, tuple) else str(x))
def test_gpu_device_cache_equals_host_cache(case, num_experts, capacity):
    """Long sequences (160 positions, 4 layers, a reset half-way) of every case, the cases spread over E = 64
    and 256 and C = 16, 32, 64, and the edge cases at their own E and C and at E = 256 (each step is a launch and a
    host comparison: the whole product took 25 s a case)."""
    from specmoe.kernels.policy_checks import check_device_cache, device_cache_case

    name, base, overrides, _, _, scoring, _, _ = case
    num_layers = 4
    calibration, z, g, tokens = device_cache_case(num_layers, num_experts, 160, seed=capacity + num_experts)
    check_device_cache(preset(base, capacity, 8, **overrides), scoring_of(scoring, num_layers, num_experts),
                       calibration, z, g, tokens, "cuda", sequences=2)


_ORDER_PROBE = '''
import triton
import triton.language as tl

from specmoe.kernels.ranking import _order


@triton.jit
def order_kernel(score_ptr, raw_ptr, avail_ptr, out_ptr, limit, BLOCK_E: tl.constexpr, TIES: tl.constexpr):
    idx = tl.arange(0, BLOCK_E)
    score, raw = tl.load(score_ptr + idx), tl.load(raw_ptr + idx)
    tl.store(out_ptr + idx, _order(score, raw, tl.load(avail_ptr + idx) != 0, idx, limit, BLOCK_E, TIES))
'''

_ORDER_CHECK = r"""
import sys
import numpy as np
import torch
sys.path.insert(0, PROBE_DIR)
from order_probe import order_kernel
from specmoe.kernels.ranking import TIES_F32, TIES_RAW, TIES_SCORE

E = 256
rng = np.random.default_rng(0)

def reference(score, raw, avail, limit):
    order = sorted(np.flatnonzero(avail), key=lambda e: (-score[e], -raw[e], e))[:limit]
    rank = np.full(E, -1)
    rank[order] = np.arange(len(order))
    return rank

def logits(kind):
    z = torch.from_numpy(rng.normal(0.0, 1.5, E)).to(torch.bfloat16).float().numpy().astype(np.float64)
    if kind == "tied_top":  # the largest value five times over, the next one twice
        top = np.argsort(-z)[:7]
        z[top[:5]], z[top[5:]] = z[top[0]], z[top[5]]
    elif kind == "zeros_top":  # +0 and -0 the largest, in mixed order
        z = -np.abs(z) - 0.5
        z[[9, 40, 41, 200, 255]] = [0.0, -0.0, 0.0, -0.0, -0.0]
    elif kind == "infinities":  # fewer finite experts than the limit: -inf ones follow by index
        z[:] = -np.inf
        z[[3, 100, 17]] = [1.0, 1.0, -2.0]
    return z

checked = 0
for kind in ("random", "tied_top", "zeros_top", "infinities"):
    z = logits(kind)
    avail = rng.uniform(size=E) < 0.8
    avail[[9, 40, 41, 200, 255, 3, 17, 100]] = True
    for limit in (1, 8, 24):
        want = reference(z, z, avail, limit)
        for ties in (TIES_RAW, TIES_SCORE, TIES_F32):
            out = torch.empty(E, dtype=torch.int32)
            order_kernel[(1,)](torch.tensor(z), torch.tensor(z), torch.tensor(avail.astype(np.int32)), out, limit,
                               BLOCK_E=E, TIES=ties)
            assert np.array_equal(out.numpy(), want), (kind, limit, ties, np.flatnonzero(out.numpy() >= 0))
            checked += 1
    raw = z + rng.normal(0.0, 1.0, E)  # the raw tie-break of TIES_RAW
    want = reference(np.where(z > 0.5, 1.0, z), raw, avail, 8)
    out = torch.empty(E, dtype=torch.int32)
    order_kernel[(1,)](torch.tensor(np.where(z > 0.5, 1.0, z)), torch.tensor(raw), torch.tensor(avail.astype(np.int32)),
                       out, 8, BLOCK_E=E, TIES=TIES_RAW)
    assert np.array_equal(out.numpy(), want), kind
print("order ok", checked)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_order_picks_rank_alike_for_every_tie_rule_in_the_interpreter(tmp_path):
    """`_order`'s picks past 64 experts (E = 256, limits 1, 8 and 24) under each TIES rule against a sort by
    (score, raw, lower index): random bfloat16-grid logits, the largest tied five times, +0 and -0 the largest
    (equal, so the lower index goes first: the float32 key must read -0 as +0), -inf experts past the finite ones,
    and experts left out of `avail`; TIES_RAW also with a raw tie-break that differs from the score."""
    (tmp_path / "order_probe.py").write_text(_ORDER_PROBE)
    done = run_in_interpreter(f"PROBE_DIR = {str(tmp_path)!r}\n" + _ORDER_CHECK)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "order ok 36" in done.stdout, done.stdout
