"""Shared pytest hooks: tests marked `gpu` run only where torch sees a CUDA device."""

import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_configure(config):
    # The test models are tiny: one torch thread is fastest, and on a 2-core CI machine several threads per
    # process oversubscribe the cores (measured here: a decode step of olmoe-tiny 0.04 s on one thread
    # against 0.78 s on two under load).
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


@pytest.fixture(scope="module")
def family():
    """The shipped family's target (float32, CPU) and its adapter, unpatched after the module."""
    from specmoe.harness import unpatch
    from specmoe.models import load_model
    from specmoe.assets import family_path

    model, adapter = load_model(str(family_path("target")))
    yield model, adapter
    unpatch(model)


@pytest.fixture(scope="module")
def olmoe_tiny():
    """olmoe-tiny with seeded weights (float32, CPU), its expert store and a uniform calibration."""
    from specmoe.models import load_model
    from specmoe.offload import ExpertStore
    from specmoe.routing import Calibration

    model, adapter = load_model("olmoe-tiny", seed=0)
    store = ExpertStore.from_model(model, adapter)
    return model, adapter, store, Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)


@pytest.fixture(scope="session")
def family_text():
    """Token ids of the second sequence of the family's evaluation slice (prompts are its prefixes)."""
    import json

    from specmoe.assets import family_path

    return json.loads((family_path().parent / "metrics.json").read_text())["slice"]["slice"]["token_ids"][1]
