"""The device path's per-block timeline (`specmoe.engines.kernel_timeline`): kernels classed by name into selection,
copies and compute, copies exposed only where no other kernel runs, the rest of the wall time idle; on a CUDA
device (marked gpu) from the profiler's record of real device-path blocks."""

import inspect

import numpy as np
import pytest

from specmoe.engines import kernel_timeline
from specmoe.engines.kernel_timeline import KernelSpan, kernel_part, timeline


def test_timeline_splits_a_block_by_kernel_class():
    """Kernels in line (one after another): each class's time, the copies all exposed, the rest of the wall time
    idle; the parts add up to the block."""
    spans = [KernelSpan("void at::native::vectorized_elementwise_kernel", 0.0, 400.0),
             KernelSpan("_demand_kernel", 400.0, 460.0),
             KernelSpan("_use_kernel", 470.0, 490.0),
             KernelSpan("_expert_copy_kernel", 500.0, 800.0),
             KernelSpan("gemv_kernel", 800.0, 1000.0)]
    out = timeline(spans, blocks=2, step_ms=0.75, draft_ms=1.5)
    assert out["selection"] == pytest.approx(0.04)  # (60 + 20) µs over 2 blocks
    assert out["copy_wait"] == pytest.approx(0.15) and out["copies_hidden"] == 0.0
    assert out["compute"] == pytest.approx(0.3)
    assert out["idle_other"] == pytest.approx(0.75 - 0.49)
    assert out["copy_issue"] == out["copy_checks"] == 0.0 and out["draft"] == 1.5 and out["step"] == 0.75
    parts = ("selection", "copy_issue", "copy_checks", "copy_wait", "idle_other", "compute")
    assert sum(out[p] for p in parts) == pytest.approx(out["step"])


def test_copies_beside_other_kernels_count_where_nothing_else_runs():
    """A demand copy beside the MoE of the pool's experts, waited for at the join: only the part with no other
    kernel running is exposed, the rest hidden; two overlapping copies count once."""
    spans = [KernelSpan("_use_kernel", 0.0, 50.0),
             KernelSpan("_expert_copy_kernel", 50.0, 150.0),  # the demand copy, on its branch
             KernelSpan("_grouped_gate_up_kernel", 55.0, 100.0),  # the pool's experts, beside it
             KernelSpan("_expert_copy_kernel", 60.0, 140.0),  # e.g. a prefetch copy at the same time
             KernelSpan("_grouped_down_kernel", 150.0, 200.0),
             KernelSpan("_expert_copy_kernel", 200.0, 210.0)]  # a refill move, in line
    out = timeline(spans, blocks=1, step_ms=0.25)
    assert out["copy_wait"] == pytest.approx(0.065)  # 55 µs at the join + the 10 µs move
    assert out["copies_hidden"] == pytest.approx(0.045)  # beside the gate/up kernel
    assert out["selection"] == pytest.approx(0.05) and out["compute"] == pytest.approx(0.095)
    assert out["idle_other"] == pytest.approx(0.25 - 0.21)


def test_kernels_that_start_early_and_wait_count_from_when_they_can_run():
    """Under programmatic dependent launch each kernel starts while the one before it runs and waits for it (the
    profiler's span holds the wait): a kernel counts from the end of the last kernel that started before it and
    ended before it did, so nothing counts twice and an in-line copy that the next kernel waits for is exposed."""
    spans = [KernelSpan("gemv_kernel", 0.0, 100.0),
             KernelSpan("_use_kernel", 5.0, 130.0),  # runs 100-130
             KernelSpan("_expert_copy_kernel", 10.0, 330.0),  # runs 130-330
             KernelSpan("gemv_kernel", 20.0, 400.0)]  # runs 330-400
    out = timeline(spans, blocks=1, step_ms=0.45)
    assert out["compute"] == pytest.approx(0.17) and out["selection"] == pytest.approx(0.03)
    assert out["copy_wait"] == pytest.approx(0.2) and out["copies_hidden"] == 0.0
    assert out["idle_other"] == pytest.approx(0.05)
    assert [(s.start_us, s.end_us) for s in kernel_timeline.running(spans)] == \
        [(0.0, 100.0), (100.0, 130.0), (130.0, 330.0), (330.0, 400.0)]


def test_idle_before_finds_the_gaps_where_no_kernel_could_run():
    """The GPU's idle time before each kernel, from when the kernels could run: none under a PDL chain or beside a
    longer kernel, the launch gap after a kernel that takes no PDL, the host's time before the next step's first
    kernel; in the order given."""
    spans = [KernelSpan("gemv_kernel", 0.0, 100.0),
             KernelSpan("_use_kernel", 5.0, 130.0),  # PDL: starts early, runs 100-130, no gap
             KernelSpan("cublas_gemm", 138.0, 200.0),  # no PDL: launched 8 µs after the kernel before ended
             KernelSpan("_expert_copy_kernel", 150.0, 180.0),  # beside the GEMM
             KernelSpan("gemv_kernel", 600.0, 650.0)]  # the next step, after the host's 400 µs
    gaps = kernel_timeline.idle_before(kernel_timeline.running(spans))
    assert gaps == [0.0, 0.0, 8.0, 0.0, 400.0]
    assert kernel_timeline.idle_before(list(reversed(spans[2:]))) == [400.0, 0.0, 0.0]


def test_timeline_refuses_empty_input():
    with pytest.raises(ValueError, match="at least one block"):
        timeline([KernelSpan("gemm", 0.0, 1.0)], blocks=0, step_ms=1.0)
    with pytest.raises(ValueError, match="no kernels in the profile"):
        timeline([], blocks=3, step_ms=1.0)


def test_kernel_classes_name_the_kernels_the_device_path_launches():
    """Every name the timeline classes is a kernel of the device path's modules (a renamed kernel would silently
    count as compute)."""
    from specmoe.kernels import device_pool, device_select, expert_copy

    source = "".join(inspect.getsource(m) for m in (device_select, device_pool, expert_copy))
    for names in kernel_timeline.KERNEL_PARTS.values():
        for name in names:
            assert f"def {name}(" in source, name
    assert kernel_part("_refill_kernel") == "selection" and kernel_part("_expert_copy_kernel") == "copy_wait"
    assert kernel_part("ampere_bf16_s16816gemm") == "compute"


@pytest.mark.gpu
def test_gpu_timeline_of_device_blocks():
    """A profiled pass of device-path blocks (prefetch 4): the profiler sees every kernel of the replayed graphs
    (one `_use_kernel` per layer and block, one `_refill_kernel` per block), each part is positive, some copy
    time is hidden beside other kernels (the demand copies beside the MoE, the prefetch's), and the parts fit in
    the blocks' wall time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from specmoe.assets import family_path
    from specmoe.engines import EngineConfig, build_engine
    from specmoe.models import load_model
    from specmoe.offload import ExpertResidency, ExpertStore
    from specmoe.records import AcceptanceProfile, synthetic_blocks
    from specmoe.records.synthetic import synthetic_trace
    from specmoe.routing import Calibration
    from specmoe.speculation import SpeculativeConfig
    from specmoe.verifiers import selector_preset

    model, adapter = load_model(str(family_path("target")), device="cuda")
    L, E = adapter.num_moe_layers, adapter.num_experts
    store = ExpertStore.from_model(model, adapter)
    config = SpeculativeConfig(selector_preset("acceptmoe"), k=8, pool_size=E // 2, prefetch=4)
    engine = build_engine(model, None, Calibration.uniform(L, E, adapter.vocab_size), EngineConfig(max_seq_len=512),
                          speculative=config, residency=ExpertResidency(store, E, "cuda"))
    blocks = synthetic_blocks(synthetic_trace("olmoe-like", tokens=300, seed=3), 8, AcceptanceProfile.geometric(0.8))
    results = engine.follow(blocks, first_position=32)
    assert results[0].info["verify"] == "device"
    n = sum(int(r.timed.sum()) for r in results)
    step_ms = float(np.concatenate([r.ms[r.timed] for r in results]).mean())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.follow(blocks, first_position=32)
        torch.cuda.synchronize()
    spans = kernel_timeline.profiled_spans(prof)
    assert sum("_use_kernel" in s.name for s in spans) == n * L
    assert sum("_refill_kernel" in s.name for s in spans) == n
    out = timeline(spans, n, step_ms)
    assert min(out["selection"], out["copy_wait"], out["compute"], out["copies_hidden"]) > 0, out
    # the GPU's busy time (kernels at once counted once) within the plain pass's wall time
    busy_ms = kernel_timeline.busy_us(spans) / 1e3 / n
    assert busy_ms < 1.05 * step_ms, (busy_ms, out)
    assert out["idle_other"] > -0.05 * step_ms, out  # the parts count each instant once (PDL's waits included)
