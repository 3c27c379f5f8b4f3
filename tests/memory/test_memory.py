"""Memory release and re-wake on real torch tensors, measured with psutil in the test itself.

CPU only here (the CUDA branches need a GPU). RSS figures are printed (``pytest -s``) so a run
shows what was measured; assertions use margins of at least 90% of the bytes involved.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import threading
import time

import msgspec
import psutil
import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_controller.clock import ManualClock
from ckpt_controller.errors import (
    MemoryError_,
    ResidualOverBudgetError,
    UsageError,
    VerificationError,
)
from ckpt_controller.memory import (
    MemoryRegistry,
    SafetensorsFile,
    save_file,
    tensor_checksum,
    trim_host_heap,
)
from ckpt_controller.memory import checksum as ck
from ckpt_controller.memory import measure
from ckpt_controller.protocol import MemoryReport
from support.timing import scaled

MIB = 1 << 20


def rss() -> int:
    trim_host_heap()
    return psutil.Process().memory_info().rss


class Stack(torch.nn.Module):
    """``n`` linear layers of ``dim`` x ``dim`` float32 (``4 * dim * dim`` bytes each)."""

    def __init__(self, n: int, dim: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(n))
        self.register_buffer("scale", torch.full((dim,), 0.5))


def filled(nbytes: int, value: float = 1.0) -> torch.Tensor:
    t = torch.empty(nbytes // 4, dtype=torch.float32)
    t.fill_(value)  # touched: its pages count in RSS like a live KV cache
    return t


def checksums(module: torch.nn.Module) -> dict[str, str]:
    named = list(module.named_parameters()) + list(module.named_buffers())
    return {name: tensor_checksum(t) for name, t in named}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


# ------------------------------------------------------------------- release levels


def test_level2_frees_rss_and_rewakes_into_the_same_objects(tmp_path):
    model = Stack(4, 4096)  # 4 x 64 MiB weights (+ biases and a buffer)
    kv = filled(64 * MIB)
    source = tmp_path / "weights.safetensors"
    save_file(model.state_dict(), source)
    reg = MemoryRegistry()
    reg.register("weights", model, source=source)
    reg.register("kv_cache", {"kv": kv})
    released = sum(reg.registered_bytes().values())
    assert reg.registered_bytes()["weights"] >= 256 * MIB

    params = list(model.parameters())
    view = model.layers[0].weight[5:9]  # a view made before the release
    want = checksums(model)

    before = rss()
    report = reg.release(level=2)
    after_release = rss()
    assert [p.untyped_storage().nbytes() for p in params] == [0] * len(params)
    assert reg.released_tags == ["weights", "kv_cache"]
    t0 = time.perf_counter()
    back = reg.rewake()
    rewake_s = time.perf_counter() - t0
    after_rewake = rss()
    print(f"\nlevel 2: released {released / MIB:.0f} MiB; RSS {before / MIB:.0f} -> "
          f"{after_release / MIB:.0f} -> {after_rewake / MIB:.0f} MiB; report freed "
          f"{report.freed_bytes / MIB:.0f} MiB in {report.duration_s:.3f}s; rewake {rewake_s:.2f}s")

    assert before - after_release >= 0.9 * released
    assert after_rewake - after_release >= 0.9 * released
    assert report.level == 2 and report.discarded_bytes == released
    assert report.offloaded_bytes == 0 and report.tensor_bytes == released
    assert report.freed_bytes >= 0.9 * released
    assert report.residual_bytes == report.devices[0].residual_bytes
    assert report.devices[0].device == "cpu"
    assert msgspec.convert(msgspec.to_builtins(report), MemoryReport) == report
    assert back.action == "rewake" and back.tags == ["weights", "kv_cache"]
    assert back.verified_tensors == len(want)
    assert reg.released_tags == []

    # the same objects, the same storage sharing, the same bits
    assert all(a is b for a, b in zip(params, model.parameters()))
    # (the allocator may or may not hand back the same addresses; old views follow either way)
    assert view.untyped_storage().data_ptr() == model.layers[0].weight.untyped_storage().data_ptr()
    assert torch.equal(view, model.layers[0].weight[5:9])
    assert checksums(model) == want
    assert torch.count_nonzero(kv) == 0  # scratch comes back zero-filled
    reference = safetensors.torch.load_file(source)  # after the RSS measurements
    for name, t in model.state_dict().items():
        assert torch.equal(as_bytes(t), as_bytes(reference[name])), name


def test_level1_on_cpu_frees_the_kv_cache_and_keeps_weights():
    model = Stack(1, 4096)  # 64 MiB
    kv = filled(192 * MIB, 2.0)
    reg = MemoryRegistry()
    reg.register("weights", model)
    reg.register("kv_cache", {"kv": kv})
    ptrs = [p.data_ptr() for p in model.parameters()]
    want = checksums(model)

    before = rss()
    report = reg.release(level=1)
    after = rss()
    back = reg.rewake()
    after_rewake = rss()
    print(f"\nlevel 1: KV {kv.numel() * 4 / MIB:.0f} MiB; RSS {before / MIB:.0f} -> "
          f"{after / MIB:.0f} -> {after_rewake / MIB:.0f} MiB; note: {report.devices[0].note}")

    kv_bytes = 192 * MIB
    assert before - after >= 0.9 * kv_bytes
    assert after_rewake - after >= 0.9 * kv_bytes
    weights = reg.registered_bytes()["weights"]
    assert report.offloaded_bytes == weights and report.discarded_bytes == kv_bytes
    assert "stay in host memory" in report.devices[0].note
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # untouched
    assert back.verified_tensors == len(want) and checksums(model) == want
    assert torch.count_nonzero(kv) == 0


def test_explicit_tags_release_only_those():
    model = Stack(1, 256)
    kv, sched = filled(MIB), torch.arange(1000)
    reg = MemoryRegistry()
    reg.register("sched", {"queue": sched})
    reg.register("kv_cache", {"kv": kv})
    reg.register("weights", model)
    report = reg.release(tags=["kv_cache"])
    assert report.tags == ["kv_cache"] and report.level is None
    assert reg.released_tags == ["kv_cache"]
    assert kv.untyped_storage().nbytes() == 0 and sched.untyped_storage().nbytes() > 0
    reg.rewake()

    # level 1 everywhere: a non-KV tag is preserved by default; re-wake order is fixed
    reg.release(level=1)
    back = reg.rewake()
    assert back.tags == ["weights", "kv_cache", "sched"]
    assert torch.equal(sched, torch.arange(1000))


def test_level0_and_idle_rewake_do_nothing():
    kv = filled(MIB)
    reg = MemoryRegistry(clock=ManualClock())
    reg.register("kv_cache", {"kv": kv})
    report = reg.release(0)
    assert report.level == 0 and report.tags == [] and report.tensor_bytes == 0
    assert report.duration_s == 0.0  # the injected clock did not move
    assert reg.released_tags == [] and kv.untyped_storage().nbytes() == MIB
    back = reg.rewake()
    assert back.tags == [] and back.tensor_bytes == 0


# ------------------------------------------------------------------- budget and verification


def test_residual_over_budget_raises_with_the_report_and_rewake_rolls_back():
    model = Stack(2, 512)
    kv = filled(8 * MIB, 3.0)
    reg = MemoryRegistry()
    reg.register("weights", model)
    reg.register("kv_cache", {"kv": kv})
    want = checksums(model)
    with pytest.raises(ResidualOverBudgetError) as info:
        reg.release(level=1, residual_budget_bytes=1)
    details = info.value.details
    report = msgspec.convert(details["report"], MemoryReport)
    assert report.action == "release" and report.budget_bytes == 1
    assert report.residual_bytes == details["residual_bytes"] > 1
    assert report.discarded_bytes == 8 * MIB
    assert reg.released_tags == ["weights", "kv_cache"]  # not re-woken by the registry
    back = reg.rewake()
    assert back.verified_tensors == len(want) and checksums(model) == want
    assert kv.untyped_storage().nbytes() == 8 * MIB
    big = reg.release(level=1, residual_budget_bytes=1 << 50)  # a budget that fits
    assert big.budget_bytes == 1 << 50
    reg.rewake()


def _released_at_level2(tmp_path):
    """Two layers with a safetensors source, registered and released at level 2."""
    model = Stack(2, 256)
    source = tmp_path / "w.safetensors"
    save_file(model.state_dict(), source)
    reg = MemoryRegistry()
    reg.register("weights", model, source=source)
    reg.release(level=2)
    return model, source, reg


def test_corrupted_source_is_detected_at_level2_rewake(tmp_path):
    model, source, reg = _released_at_level2(tmp_path)
    with SafetensorsFile(source) as f:  # flip one bit inside layers.1.weight's bytes
        at = f._data_start + f.entries["layers.1.weight"].begin + 1234
    with open(source, "r+b") as raw:
        raw.seek(at)
        byte = raw.read(1)[0]
        raw.seek(at)
        raw.write(bytes([byte ^ 0x10]))
    with pytest.raises(VerificationError) as info:
        reg.rewake()
    d = info.value.details
    assert d["tag"] == "weights" and d["tensor"] == "layers.1.weight"
    assert d["expected"] != d["got"] and d["mismatches"] == ["weights/layers.1.weight"]
    # the bad bytes are released again, to be reloaded and checked by the next re-wake
    assert reg.released_tags == ["weights"] and "reloads weights" in d["recovery"]
    with pytest.raises(VerificationError):
        reg.rewake()  # the file is still bad: never served
    with open(source, "r+b") as raw:  # the file repaired (e.g. copied again)
        raw.seek(at)
        raw.write(bytes([byte]))
    reg.rewake()
    assert reg.released_tags == [] and model.layers[1].weight.untyped_storage().nbytes() > 0


def test_corruption_through_the_kept_host_copy_is_detected_at_level1():
    model = Stack(1, 256)
    reg = MemoryRegistry()
    reg.register("weights", model)
    reg.release(level=1)  # CPU weights stay where they are: this is the host copy
    with torch.no_grad():
        model.layers[0].bias[3] += 1.0
    with pytest.raises(VerificationError) as info:
        reg.rewake()
    assert info.value.details["tensor"] == "layers.0.bias"
    assert "fails the same check" in info.value.details["recovery"]
    with pytest.raises(VerificationError):  # no source: the bad bytes are checked again
        reg.rewake()


def test_failed_reload_leaves_the_tag_released_and_a_retry_works(tmp_path):
    model = Stack(1, 256)
    source = tmp_path / "w.safetensors"
    save_file(model.state_dict(), source)
    want = checksums(model)
    reg = MemoryRegistry()
    reg.register("weights", model, source=source)
    reg.register("kv_cache", {"kv": filled(MIB)})
    reg.release(level=2)
    hidden = source.rename(tmp_path / "elsewhere")
    with pytest.raises(MemoryError_) as info:
        reg.rewake()
    assert info.value.details["tag"] == "weights"
    assert reg.released_tags == ["weights", "kv_cache"]
    assert model.layers[0].weight.untyped_storage().nbytes() == 0
    hidden.rename(source)
    assert reg.rewake().verified_tensors == len(want)
    assert checksums(model) == want


# ------------------------------------------------------------------- identity and sharing


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 64)
        self.head = torch.nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter under two names
        # two distinct Parameter objects over one storage (e.g. fused qkv and its q part)
        self.qkv = torch.nn.Parameter(torch.randn(3, 64, 64))
        self.q = torch.nn.Parameter(self.qkv.data[0])


@pytest.mark.parametrize("level", [1, 2])
def test_tied_weights_and_views_survive_a_cycle(tmp_path, level):
    model = Tied()
    source = tmp_path / "tied.safetensors"
    save_file(dict(model.named_parameters()), source)
    pool = filled(4 * 1024 * 64 * 4, 1.5).view(4, 1024, 64)  # one KV buffer...
    kv = {f"layer{i}": pool[i] for i in range(4)}  # ...registered as per-layer slices
    reg = MemoryRegistry()
    reg.register("weights", model, source=source)
    reg.register("kv_cache", kv)
    assert reg.registered_bytes() == {
        "weights": 300 * 64 * 4 + 3 * 64 * 64 * 4,  # each shared storage counted once
        "kv_cache": 4 * 1024 * 64 * 4,
    }
    want = checksums(model)
    q_view = model.q[1:4]
    reg.release(level=level)
    assert model.q.untyped_storage().nbytes() == (0 if level == 2 else 3 * 64 * 64 * 4)
    assert pool.untyped_storage().nbytes() == 0
    assert reg.rewake().verified_tensors == len(want)
    assert checksums(model) == want
    assert model.head.weight is model.embed.weight
    assert model.q.untyped_storage().data_ptr() == model.qkv.untyped_storage().data_ptr()
    assert model.q.data_ptr() == model.qkv.data_ptr()
    assert torch.equal(q_view, model.qkv[0, 1:4])
    with torch.no_grad():
        model.qkv[0, 2, 5] = 42.0  # still shared after the cycle
    assert model.q[2, 5] == 42.0 and q_view[1, 5] == 42.0
    assert all(t.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
               for t in kv.values())
    assert torch.count_nonzero(pool) == 0


def test_repeated_cycles_do_not_grow_rss(tmp_path):
    model = Stack(1, 4096)  # 64 MiB
    source = tmp_path / "w.safetensors"
    save_file(model.state_dict(), source)
    reg = MemoryRegistry()
    reg.register("weights", model, source=source)
    reg.register("kv_cache", {"kv": filled(64 * MIB)})
    seen = []
    for i in range(5):
        reg.release(level=2 if i % 2 == 0 else 1)
        reg.rewake()
        seen.append(rss())
    print(f"\nRSS after each of 5 cycles (MiB): {[round(r / MIB) for r in seen]}")
    assert max(seen) - seen[0] < 16 * MIB


# ------------------------------------------------------------------- validation


def test_plan_validation_errors(tmp_path):
    model = Stack(1, 64)
    reg = MemoryRegistry()
    reg.register("weights", model)
    reg.register("kv_cache", {"kv": filled(4096)})
    with pytest.raises(UsageError) as info:
        reg.plan(tags=["weights", "nope"])
    assert info.value.details["registered"] == ["weights", "kv_cache"]
    with pytest.raises(UsageError) as info:
        reg.plan(level=2)
    assert info.value.details["tag"] == "weights"
    with pytest.raises(UsageError, match="exactly one"):
        reg.plan(level=1, tags=["weights"])
    with pytest.raises(UsageError, match="exactly one"):
        reg.plan()
    for bad in (3, -1, 1.0, True):
        with pytest.raises(UsageError, match="unknown release level"):
            reg.plan(level=bad)
    with pytest.raises(UsageError, match="not a string"):
        reg.plan(tags="weights")

    plan = reg.plan(level=1)
    assert plan.actions == (("weights", "offload"), ("kv_cache", "discard"))
    reg.release(plan)
    with pytest.raises(UsageError, match="already released"):
        reg.release(level=1)
    with pytest.raises(UsageError, match="already released"):
        reg.plan(tags=["kv_cache"])
    with pytest.raises(UsageError, match="while memory is released"):
        reg.register("more", {"x": torch.zeros(4)})
    with pytest.raises(UsageError, match="cannot unregister a released tag"):
        reg.unregister("weights")
    reg.rewake(tags=["kv_cache"])
    with pytest.raises(UsageError, match="not released"):
        reg.rewake(tags=["kv_cache"])
    reg.rewake()


def test_level2_source_must_match_the_registered_tensors(tmp_path):
    model = Stack(1, 64)
    partial = tmp_path / "partial.safetensors"
    save_file({"layers.0.weight": model.layers[0].weight}, partial)
    reg = MemoryRegistry()
    reg.register("weights", model, source=partial)
    with pytest.raises(UsageError, match="missing from the source") as info:
        reg.plan(level=2)
    assert info.value.details["tensor"] == "layers.0.bias"

    other = tmp_path / "other.safetensors"
    state = model.state_dict()
    state["scale"] = torch.zeros(3)
    save_file(state, other)
    reg2 = MemoryRegistry()
    reg2.register("weights", model, source=other)
    with pytest.raises(UsageError, match="differs from the source"):
        reg2.plan(level=2)

    reg3 = MemoryRegistry()
    reg3.register("weights", model, source=tmp_path / "absent.safetensors")
    with pytest.raises(UsageError, match="not found"):
        reg3.plan(level=2)

    big = torch.arange(100, dtype=torch.float32)  # storage bytes no registered tensor covers
    save_file({"head": big[:10].clone()}, tmp_path / "head.safetensors")
    reg4 = MemoryRegistry()
    reg4.register("weights", {"head": big[:10]}, source=tmp_path / "head.safetensors")
    with pytest.raises(UsageError, match="outside the registered tensors"):
        reg4.plan(level=2)
    assert reg4.plan(level=1).actions == (("weights", "offload"),)


def test_registration_validation():
    reg = MemoryRegistry()
    with pytest.raises(UsageError, match="contiguous"):
        reg.register("weights", {"t": torch.zeros(4, 4).t()})
    with pytest.raises(UsageError, match="cannot be resized"):
        reg.register("weights", {"t": torch.frombuffer(bytearray(16), dtype=torch.float32)})
    with pytest.raises(UsageError, match="not a tensor"):
        reg.register("weights", {"t": [1.0]})
    with pytest.raises(UsageError, match="only cpu and cuda"):
        reg.register("weights", {"t": torch.zeros(4, device="meta")})
    with pytest.raises(UsageError, match="mapping of name"):
        reg.register("weights", [torch.zeros(4)])
    assert reg.tags() == []  # nothing half-registered

    shared = torch.zeros(64)
    reg.register("weights", {"a": shared[:32]})
    with pytest.raises(UsageError, match="registered twice"):
        reg.register("weights", {"a": torch.zeros(2)})
    with pytest.raises(UsageError, match="another tag"):
        reg.register("kv_cache", {"b": shared[32:]})
    with pytest.raises(UsageError, match="another preserve"):
        reg.register("weights", {"c": torch.zeros(2)}, preserve=False)
    reg.register("weights", {"b": shared[32:]})  # the same storage, same tag: one block
    assert reg.registered_bytes() == {"weights": 64 * 4}

    swapped = torch.nn.Linear(4, 4)
    reg.register("model", swapped)
    swapped.weight.data = torch.zeros(4, 4)  # the engine replaced the storage
    with pytest.raises(UsageError, match="storage changed"):
        reg.release(level=1)
    reg.unregister("model")
    assert reg.tags() == ["weights"]


def test_concurrent_releases_are_serialised():
    reg = MemoryRegistry()
    reg.register("kv_cache", {"kv": filled(4 * MIB)})
    outcomes: list[str] = []
    barrier = threading.Barrier(4)

    def worker() -> None:
        barrier.wait()
        try:
            reg.release(level=1)
            outcomes.append("released")
        except UsageError:
            # expected for all but one thread: already released
            outcomes.append("refused")

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["refused"] * 3 + ["released"]
    reg.rewake()


# ------------------------------------------------------------------- checksum


def _flip(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    out = t.clone()
    b = as_bytes(out)
    b[byte] ^= 1 << bit
    return out


def test_checksum_detects_every_single_bit_flip_in_a_small_tensor():
    t = torch.randint(0, 256, (8 * 256 + 8 * 3 + 5,), dtype=torch.uint8)  # rows, words, tail
    base = tensor_checksum(t)
    for byte in range(t.numel()):
        for bit in range(8):
            assert tensor_checksum(_flip(t, byte, bit)) != base, (byte, bit)


def test_checksum_detects_flips_across_chunks_swaps_and_zeroing():
    t = torch.randn((5 * MIB + 12) // 4)  # several CPU chunks and a partial row
    base = tensor_checksum(t)
    g = torch.Generator().manual_seed(1)
    n = t.numel() * 4
    spots = [0, 7, 8, 2 * MIB - 1, 2 * MIB, n - 1]
    spots += torch.randint(0, n, (40,), generator=g).tolist()
    for byte in spots:
        assert tensor_checksum(_flip(t, byte, byte % 8)) != base, byte
    words = t.view(torch.int64) if t.numel() % 2 == 0 else t[:-1].view(torch.int64)
    for i, j in [(0, 1), (3, 600_000), (10, words.numel() - 1)]:
        swapped = t.clone()
        w = swapped[: words.numel() * 2].view(torch.int64)
        w[i], w[j] = words[j].clone(), words[i].clone()
        assert tensor_checksum(swapped) != base, (i, j)
    assert tensor_checksum(torch.zeros_like(t)) != base
    assert tensor_checksum(t.clone()) == base


def test_checksum_is_bit_exact_not_value_equal():
    nan_a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan_b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert tensor_checksum(nan_a) != tensor_checksum(nan_b)
    assert tensor_checksum(nan_a) == tensor_checksum(nan_a.clone())
    assert tensor_checksum(torch.tensor([0.0])) != tensor_checksum(torch.tensor([-0.0]))
    # same bytes, another dtype or shape: another checksum
    t = torch.arange(16, dtype=torch.int32)
    assert tensor_checksum(t) != tensor_checksum(t.view(torch.float32))
    assert tensor_checksum(t) != tensor_checksum(t.view(4, 4))


def test_nan_payloads_survive_a_level1_and_level2_cycle(tmp_path):
    bits = torch.randint(0, 1 << 22, (4096,), dtype=torch.int32) | 0x7F800001  # NaNs
    w = bits.view(torch.float32).clone()
    source = tmp_path / "nan.safetensors"
    save_file({"w": w}, source)
    reg = MemoryRegistry()
    reg.register("weights", {"w": w}, source=source)
    for level in (1, 2):
        reg.release(level=level)
        assert reg.rewake().verified_tensors == 1
        assert torch.equal(w.view(torch.int32), bits)


def test_checksum_does_not_depend_on_offset_or_chunking(monkeypatch):
    big = torch.randint(0, 256, (3 * MIB + 11,), dtype=torch.uint8)
    window = big[3:]  # not 8-byte aligned in its storage
    assert window.storage_offset() % 8 == 3
    base = tensor_checksum(window)
    assert tensor_checksum(window.clone()) == base
    monkeypatch.setitem(ck.CHUNK_BYTES, "cpu", 1 << 30)  # one chunk, as on a GPU
    assert tensor_checksum(window) == base
    monkeypatch.setitem(ck.CHUNK_BYTES, "cpu", 8 * 256)  # one row per chunk
    assert tensor_checksum(window) == base


def test_a_release_checksums_its_tensors_side_by_side_each_once(monkeypatch):
    """The release's checksums are shared out over threads (largest first, to the least
    loaded): each distinct window once, on more than one thread, every name its own
    digest; a failing one fails the whole call."""
    from ckpt_controller.memory import fill, layout

    monkeypatch.setattr(fill, "THREADS", 3)
    model = Tied()
    extra = {f"w{i}": torch.randn(1 + 97 * i, 33) for i in range(7)}
    reg = MemoryRegistry()
    reg.register("weights", model)
    reg.register("weights", extra)
    seen: list[tuple[int, int, int]] = []
    real = layout.tensor_checksum

    def counted(t):
        seen.append((threading.get_ident(), t.data_ptr(), t.numel()))
        time.sleep(0.01)  # each a while: the other threads take their share meanwhile
        return real(t)

    monkeypatch.setattr(layout, "tensor_checksum", counted)
    got = layout.window_checksums(reg._tags["weights"])
    want = {**checksums(model), **{k: real(t) for k, t in extra.items()}}
    assert got == want
    # embed/head tied (one window), qkv and q (two windows of one storage), 7 of extra
    assert len(seen) == len({window[1:] for window in seen}) == 10
    assert len({thread for thread, *_ in seen}) == 3
    monkeypatch.setattr(layout, "tensor_checksum",
                        lambda t: (_ for _ in ()).throw(UsageError("no bytes")))
    with pytest.raises(UsageError):
        layout.window_checksums(reg._tags["weights"])
    fill.run_parts([])  # a tag without CPU tensors (all on a GPU) shares out nothing


def _reference_sums(data: bytes, row_words: int) -> tuple[int, int, bytes]:
    n = len(data) // 8
    words = struct.unpack(f"<{n}q", data[: 8 * n])
    total = sum(words) % (1 << 64)
    weighted = sum(k * w for k, w in enumerate(words)) % (1 << 64)
    return total, weighted, data[8 * n:]


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=3000), row_words=st.sampled_from([1, 4, 256]),
       chunk_rows=st.integers(1, 5))
def test_word_sums_match_a_plain_python_reference(data, row_words, chunk_rows):
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8)
    got = ck.word_sums(flat, chunk_bytes=chunk_rows * 8 * row_words, row_words=row_words)
    assert got == _reference_sums(data, row_words)


def test_without_glibc_trimming_is_a_no_op_that_says_so(monkeypatch):
    """Where ``malloc_trim`` is absent (musl, macOS; the reference engine trims after a
    flood through this one function too) nothing is trimmed and nothing fails."""
    def no_glibc(_name):
        raise OSError("no such library")

    measure._malloc_trim.cache_clear()
    monkeypatch.setattr(measure.ctypes, "CDLL", no_glibc)
    try:
        assert trim_host_heap() is False
    finally:
        monkeypatch.undo()
        measure._malloc_trim.cache_clear()
    assert isinstance(trim_host_heap(), bool)


_IN_A_PID_NAMESPACE = """
import torch
from ckpt_controller.memory import MemoryRegistry, measure
kv = torch.ones(64 << 20, dtype=torch.uint8)  # touched: 64 MiB in RSS
reg = MemoryRegistry()
reg.register("kv_cache", {"kv": kv})
own = int(open("/proc/self/statm").read().split()[1]) * 4096
print(abs(measure.rss_bytes() - own) < (16 << 20), reg.release(level=2).freed_bytes >> 20)
"""


def test_a_release_in_a_pid_namespace_of_its_own_measures_its_own_memory():
    """An engine that migrates runs as ``unshare --pid --fork`` under the host's /proc, where
    ``os.getpid()`` (1) names the host's init: its release measured that process (freed 0
    bytes whatever it freed, a ``--budget`` checked against another process's RSS)."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--pid", "--fork", "true"],
                                         capture_output=True).returncode != 0:
        pytest.skip("unshare --pid is not available here (it needs root or user namespaces)")
    out = subprocess.run([unshare, "--pid", "--fork", sys.executable, "-c",
                          _IN_A_PID_NAMESPACE], capture_output=True, text=True,
                         timeout=scaled(60), check=True).stdout.split()
    assert out[0] == "True"
    assert int(out[1]) >= 56  # MiB of the 64 released


def test_measure_on_a_cpu_only_host():
    assert measure.rss_bytes() > 0
    assert isinstance(trim_host_heap(), bool)
    cpu = measure.usage(torch.device("cpu"))
    assert cpu.device == "cpu" and cpu.cuda is None and cpu.held > 0
    if not torch.cuda.is_available():
        with pytest.raises(UsageError):
            measure.cuda_used("cuda:0")


def test_a_storage_exported_to_numpy_is_refused_before_anything_is_freed(tmp_path):
    """``.numpy()`` makes a storage non-resizable for good; plan and release say so up front
    instead of failing half way (level 1 keeps CPU weights in place, so it still works)."""
    model = Stack(1, 64)
    kv = filled(4096)
    source = tmp_path / "w.safetensors"
    save_file(model.state_dict(), source)
    reg = MemoryRegistry()
    reg.register("weights", model, source=source)
    reg.register("kv_cache", {"kv": kv})
    model.layers[0].weight.detach().view(torch.uint8).numpy()
    with pytest.raises(UsageError, match="exported") as info:
        reg.release(level=2)
    assert info.value.details["tensor"] == "layers.0.weight"
    assert reg.released_tags == [] and kv.untyped_storage().nbytes() == 4096
    reg.release(level=1)
    assert reg.rewake().verified_tensors == 3


def test_status_readers_do_not_wait_for_a_release_in_progress():
    """The agent's control thread reads these for status and heartbeats while a release or
    re-wake holds the registry's lock for seconds."""
    import threading

    reg = MemoryRegistry()
    reg.register("kv_cache", {"kv": filled(MIB)})
    got = {}
    with reg._lock:  # as a long release would
        t = threading.Thread(target=lambda: got.update(tags=reg.released_tags,
                                                       sizes=reg.registered_bytes()))
        t.start()
        t.join(scaled(2))
    assert got == {"tags": [], "sizes": {"kv_cache": MIB}}


def test_reloaded_bytes_are_checked_as_they_are_read(tmp_path, monkeypatch):
    """The reload's fused check (a checksum of each chunk as it arrives) catches what the
    second pass would: a source whose bytes differ from the release checksum."""
    from ckpt_controller.memory import fill

    monkeypatch.setattr(fill, "PARALLEL_BYTES", 1 << 16)
    monkeypatch.setattr(fill, "CHUNK_BYTES", 1 << 14)
    model, source, reg = _released_at_level2(tmp_path)
    report = reg.rewake()
    assert report.verified_tensors == len(model.state_dict()) and not reg._read_checksums
    reg.release(level=2)
    with torch.no_grad():
        other = Stack(2, 256)
        other.layers[1].weight.add_(1.0)
    save_file(other.state_dict(), source)  # a different file under the same name
    with pytest.raises(VerificationError) as info:
        reg.rewake()
    assert "weights/layers.1.weight" in info.value.details["mismatches"]


def test_a_model_of_small_tensors_reloads_on_every_thread_checked_as_read(tmp_path,
                                                                          monkeypatch):
    """Every tensor is below what one read splits over threads; the reload shares their
    chunks out over every thread all the same, and checks each chunk as it lands (no second
    pass over the re-woken weights)."""
    import threading

    from ckpt_controller.memory import checksum, fill, registry

    monkeypatch.setattr(fill, "PARALLEL_BYTES", 1 << 18)
    monkeypatch.setattr(fill, "CHUNK_BYTES", 1 << 14)
    monkeypatch.setattr(fill, "THREADS", 2)
    model = Stack(6, 128)  # 64 KiB per layer
    want = {k: v.clone() for k, v in model.state_dict().items()}
    source = tmp_path / "w.safetensors"
    save_file(model.state_dict(), source)
    reg = MemoryRegistry()
    reg.register("weights", model, source=source)
    reg.release(level=2)
    threads = set()
    real_update = checksum.ChecksumStream.update
    monkeypatch.setattr(checksum.ChecksumStream, "update", lambda self, lo, hi: (
        threads.add(threading.get_ident()), real_update(self, lo, hi))[1])
    monkeypatch.setattr(registry, "tensor_checksum",
                        lambda t: pytest.fail("a second pass over a reloaded CPU tensor"))
    report = reg.rewake()
    assert report.verified_tensors == len(want) and len(threads) == 2
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())


def test_a_level_0_release_measures_but_hands_nothing_back(monkeypatch):
    """Level 0 frees nothing: no ``malloc_trim``/``empty_cache`` and no wait for the device,
    but the report's device figures are still measured (RSS), so what it says is true."""
    handed_back: list[str] = []
    real = measure.return_freed
    monkeypatch.setattr(measure, "return_freed",  # a spy around the real call
                        lambda dev: (handed_back.append(str(dev)), real(dev))[1])
    reg = MemoryRegistry()
    reg.register("kv_cache", {"kv": filled(4 * MIB)})
    report = reg.release(level=0)
    assert handed_back == [] and report.freed_bytes == 0 and report.tensor_bytes == 0
    (cpu,) = report.devices
    assert cpu.device == "cpu" and cpu.residual_bytes > 0  # RSS, measured after
    reg.rewake()
    reg.release(level=2)  # something to free: handed back
    assert handed_back == ["cpu"]
    reg.rewake()
