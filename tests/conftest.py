"""Shared pytest setup: the `gpu` marker skips cleanly when no CUDA device is present."""
from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture(scope="module")
def ap_path(tmp_path_factory):
    """A tiny Qwen2-MoE (2 MoE layers x 8 experts, hidden 128, intermediate 64, top-2; head_dim 32, which the
    decode attention kernel takes) as an AP checkpoint (tests of the device store and of the piecewise graphs)."""
    from model_fixtures import make_tiny_checkpoint
    from pwruntime.quant.build import QuantizeOptions, quantize_checkpoint

    root = tmp_path_factory.mktemp("devstore")
    src = make_tiny_checkpoint(root, "qwen2_moe", tokenizer=True, num_experts=8, hidden_size=128,
                               moe_intermediate_size=64)
    quantize_checkpoint(src, root / "ap", QuantizeOptions(weighting="none"), progress=False)
    return root / "ap"


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module: tiny models run fastest so (thread wake-ups dominate) and do not
    fight other test processes for cores. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
