"""Memory release and re-wake on CUDA tensors: the production path, run wherever a GPU is.

The same registry code as on the CPU (``test_memory.py``); what differs on a GPU is checked
here: level 1 offloads weights to pinned host memory and really frees device memory (torch's
allocator and the driver's ``mem_get_info`` both see it go), level 2 reloads weights from their
safetensors file into device tensors, and every re-wake is verified bit-exact. Skipped, saying
so, where torch sees no CUDA device (CPU-only machines and CI).
"""

from __future__ import annotations

import pytest
import torch

from ckpt_controller.errors import ResidualOverBudgetError, VerificationError
from ckpt_controller.memory import MemoryRegistry, save_file, tensor_checksum
from ckpt_controller.memory import measure

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch sees none)")

MIB = 1 << 20


def _model(n: int = 4, dim: int = 4096) -> torch.nn.Module:
    """``n`` float32 linear layers on the GPU: 64 MiB each at dim 4096."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(n))).cuda()


def _sums(module: torch.nn.Module) -> dict[str, str]:
    return {name: tensor_checksum(t) for name, t in module.state_dict().items()}


def _registered(tmp_path=None):
    model = _model()
    kv = torch.ones(64 * MIB // 4, dtype=torch.float32, device="cuda")
    reg = MemoryRegistry()
    source = None
    if tmp_path is not None:
        source = tmp_path / "weights.safetensors"
        save_file(model.state_dict(), source)
    reg.register("weights", model, source=source)
    reg.register("kv_cache", {"kv": kv})
    torch.cuda.synchronize()
    return model, kv, reg


def test_level1_offloads_to_pinned_memory_and_frees_the_device():
    model, kv, reg = _registered()
    params = list(model.parameters())
    want = _sums(model)
    host_copy = {n: t.detach().cpu().clone() for n, t in model.state_dict().items()}
    weights, total = reg.registered_bytes()["weights"], sum(reg.registered_bytes().values())
    before = measure.cuda_used("cuda")

    report = reg.release(level=1)
    after = measure.cuda_used("cuda")
    assert report.offloaded_bytes == weights and report.discarded_bytes == total - weights
    (dev,) = [d for d in report.devices if d.device.startswith("cuda")]
    assert dev.freed_bytes >= 0.9 * total
    assert f"{weights} bytes offloaded to pinned host memory" in dev.note
    assert before.reserved - after.reserved >= 0.9 * total  # the allocator gave it back
    assert before.device_used - after.device_used >= 0.9 * total  # and the driver saw it
    assert all(p.untyped_storage().nbytes() == 0 for p in params)

    back = reg.rewake()
    assert back.verified_tensors == len(want)
    assert all(a is b for a, b in zip(params, model.parameters()))  # the same objects
    assert all(p.is_cuda for p in model.parameters())
    assert _sums(model) == want
    for name, t in model.state_dict().items():
        assert torch.equal(t.cpu().view(torch.uint8), host_copy[name].view(torch.uint8)), name
    assert kv.is_cuda and torch.count_nonzero(kv) == 0  # scratch comes back zero-filled


def test_level2_reloads_device_tensors_from_their_file(tmp_path):
    model, kv, reg = _registered(tmp_path)
    want = _sums(model)
    total = sum(reg.registered_bytes().values())
    report = reg.release(level=2)
    assert report.offloaded_bytes == 0 and report.discarded_bytes == total
    assert report.freed_bytes >= 0.9 * total
    back = reg.rewake()
    assert back.verified_tensors == len(want) and _sums(model) == want
    assert all(p.is_cuda for p in model.parameters())


def test_a_flipped_bit_on_the_device_fails_the_rewake():
    model, kv, reg = _registered()
    reg.release(level=1)
    reg.after_refill = lambda: reg.flip_bit("weights")  # between the refill and the check
    with pytest.raises(VerificationError) as info:
        reg.rewake()
    assert info.value.details["tag"] == "weights"


def test_a_residual_over_budget_on_the_device_raises_and_rewake_rolls_back():
    model, kv, reg = _registered()
    want = _sums(model)
    ballast = torch.ones(256 * MIB, dtype=torch.uint8, device="cuda")  # not registered
    with pytest.raises(ResidualOverBudgetError) as info:
        reg.release(level=1, residual_budget_bytes=64 * MIB)
    assert info.value.details["residual_bytes"] > 64 * MIB
    reg.rewake()
    assert _sums(model) == want
    del ballast
