"""The device path's per-block timeline (`specmoe.engines.kernel_timeline`): kernels classed by name, the compute
stream's kernels split into selection, copies and compute, the rest of the wall time idle, other streams' kernels
reported beside the step; on a CUDA device (marked gpu) from the profiler's record of real device-path blocks."""

import inspect

import numpy as np
import pytest

from specmoe.engines import kernel_timeline
from specmoe.engines.kernel_timeline import KernelSpan, kernel_part, timeline


def test_timeline_splits_the_compute_stream_by_kernel_class():
    spans = [KernelSpan("void at::native::vectorized_elementwise_kernel", 7, 0.0, 400.0),  # compute, stream 7
             KernelSpan("_demand_kernel", 7, 400.0, 460.0),
             KernelSpan("_use_kernel", 7, 470.0, 490.0),
             KernelSpan("_expert_copy_kernel", 7, 500.0, 800.0),
             KernelSpan("gemv_kernel", 7, 800.0, 1000.0),
             KernelSpan("_prefetch_kernel", 9, 100.0, 150.0),  # the branch: beside the step, not in it
             KernelSpan("_expert_copy_kernel", 9, 150.0, 350.0)]
    out = timeline(spans, blocks=2, step_ms=0.75, draft_ms=1.5)
    assert out["selection"] == pytest.approx(0.04)  # (60 + 20) µs over 2 blocks
    assert out["copy_wait"] == pytest.approx(0.15)
    assert out["compute"] == pytest.approx(0.3)
    assert out["branch"] == pytest.approx(0.125)
    assert out["idle_other"] == pytest.approx(0.75 - 0.49)
    assert out["copy_issue"] == out["copy_checks"] == 0.0 and out["draft"] == 1.5 and out["step"] == 0.75
    parts = ("selection", "copy_issue", "copy_checks", "copy_wait", "idle_other", "compute")
    assert sum(out[p] for p in parts) == pytest.approx(out["step"])  # the parts add up to the block's wall time


def test_the_compute_stream_is_the_busiest():
    spans = [KernelSpan("_expert_copy_kernel", 3, 0.0, 50.0), KernelSpan("gemm", 5, 0.0, 80.0)]
    out = timeline(spans, blocks=1, step_ms=0.1)
    assert out["compute"] == pytest.approx(0.08) and out["copy_wait"] == 0.0
    assert out["branch"] == pytest.approx(0.05)


def test_timeline_refuses_empty_input():
    with pytest.raises(ValueError, match="at least one block"):
        timeline([KernelSpan("gemm", 0, 0.0, 1.0)], blocks=0, step_ms=1.0)
    with pytest.raises(ValueError, match="no kernels in the profile"):
        timeline([], blocks=3, step_ms=1.0)


def test_kernel_classes_name_the_kernels_the_device_path_launches():
    """Every name the timeline classes is a kernel of the device path's modules (a renamed kernel would silently
    count as compute)."""
    from specmoe.kernels import device_select, expert_copy

    source = inspect.getsource(device_select) + inspect.getsource(expert_copy)
    for names in kernel_timeline.KERNEL_PARTS.values():
        for name in names:
            assert f"def {name}(" in source, name
    assert kernel_part("_refill_kernel") == "selection" and kernel_part("_expert_copy_kernel") == "copy_wait"
    assert kernel_part("ampere_bf16_s16816gemm") == "compute"


@pytest.mark.gpu
def test_gpu_timeline_of_device_blocks():
    """A profiled pass of device-path blocks (prefetch 4): the profiler sees every kernel of the replayed graphs
    (one `_use_kernel` per layer and block, one `_refill_kernel` per block), each part is positive, the branch
    holds the prefetch, and the compute stream's kernels fit in the blocks' wall time."""
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
    assert min(out["selection"], out["copy_wait"], out["compute"], out["branch"]) > 0, out
    assert out["idle_other"] > -0.05 * step_ms, out  # kernels of the profiled pass within the plain pass's wall time
