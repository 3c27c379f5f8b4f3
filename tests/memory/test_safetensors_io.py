"""Our safetensors reader and writer, cross-checked both ways against the real package."""

from __future__ import annotations

import json
import os
import struct
import threading

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from ckpt_controller.errors import MemoryError_, UsageError
from ckpt_controller.memory import safetensors_io as sio
from ckpt_controller.memory.safetensors_io import DTYPES, SafetensorsFile, save_file


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype (made as raw bytes, so NaNs and odd patterns occur too)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def _empty_like_entry(f: SafetensorsFile, name: str) -> torch.Tensor:
    e = f.entries[name]
    return torch.empty(e.shape, dtype=e.dtype)


ALL = {name: _sample(dtype, (3, 5), seed=i) for i, (name, dtype) in enumerate(DTYPES.items())}


def test_float8_dtypes_are_supported_when_torch_has_them():
    assert hasattr(torch, "float8_e4m3fn") == ("F8_E4M3" in DTYPES)
    assert hasattr(torch, "float8_e5m2") == ("F8_E5M2" in DTYPES)


def test_our_files_load_with_the_safetensors_package(tmp_path):
    tensors = dict(ALL)
    tensors["scalar"] = torch.tensor(3.5, dtype=torch.bfloat16)
    tensors["empty"] = torch.empty(0, 4, dtype=torch.float32)
    tensors["odd"] = _sample(torch.int8, (7,))
    path = tmp_path / "ours.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "who": "ckpt"})
    loaded = safetensors.torch.load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert _bytes(loaded[name]) == _bytes(t), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "who": "ckpt"}
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert header_len % 8 == 0


def test_package_files_are_read_by_ours(tmp_path):
    tensors = {k: v for k, v in ALL.items()}
    tensors["big_bf16"] = _sample(torch.bfloat16, (257, 33), seed=9)
    path = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(tensors, path, metadata={"k": "v"})
    with SafetensorsFile(path) as f:
        assert f.metadata == {"k": "v"}
        assert set(f.entries) == set(tensors)
        for name, t in tensors.items():
            out = _empty_like_entry(f, name)
            f.read_into(name, out)
            assert _bytes(out) == _bytes(t), name


def test_read_into_fills_the_same_tensor_in_place(tmp_path):
    path = tmp_path / "w.safetensors"
    w = _sample(torch.bfloat16, (64, 32), seed=3)
    save_file({"w": w}, path)
    target = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16))
    ptr, view = target.data_ptr(), target[1:3]
    with SafetensorsFile(path) as f:
        f.read_into("w", target)  # a Parameter that requires grad is filled too
    assert target.data_ptr() == ptr
    assert _bytes(target) == _bytes(w) and _bytes(view) == _bytes(w[1:3])


def test_nan_payloads_and_signed_zeros_survive_bit_exact(tmp_path):
    bits = torch.tensor([0x7FC00001, 0x7F800001, 0xFFC12345, 0x80000000, 0], dtype=torch.int64)
    t = bits.to(torch.int32).view(torch.float32)
    path = tmp_path / "nan.safetensors"
    save_file({"t": t}, path)
    out = torch.empty_like(t)
    with SafetensorsFile(path) as f:
        f.read_into("t", out)
    assert torch.equal(out.view(torch.int32), t.view(torch.int32))
    assert not torch.equal(out, t)  # value comparison says NaN != NaN: bits are what count
    theirs = safetensors.torch.load_file(path)["t"]
    assert torch.equal(theirs.view(torch.int32), t.view(torch.int32))


def test_staged_path_in_chunks(tmp_path):
    """The path a CUDA tensor takes (host staging buffers, chunk by chunk), run on a CPU
    destination with tiny buffers so many chunks and the last partial one are exercised."""
    path = tmp_path / "s.safetensors"
    t = _sample(torch.float16, (1001,), seed=5)
    save_file({"a": _sample(torch.int8, (3,)), "t": t}, path)
    out = torch.zeros_like(t)
    with SafetensorsFile(path, staging_bytes=64) as f:
        f._read_staged(f.entries["t"], out.view(torch.uint8))
        assert len(f._staging) == 2 and f._staging[0].numel() == 64
    assert _bytes(out) == _bytes(t)


@settings(max_examples=40, deadline=None)
@given(
    specs=st.dictionaries(
        st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12)
        .filter(lambda s: s != "__metadata__"),
        st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 6), max_size=3)),
        max_size=6,
    ),
    seed=st.integers(0, 1000),
)
def test_round_trip_property(tmp_path_factory, specs, seed):
    path = tmp_path_factory.mktemp("prop") / "p.safetensors"
    tensors = {
        name: _sample(DTYPES[d], tuple(shape), seed=seed + i)
        for i, (name, (d, shape)) in enumerate(specs.items())
    }
    save_file(tensors, path)
    theirs = safetensors.torch.load_file(path)
    with SafetensorsFile(path) as f:
        for name, t in tensors.items():
            out = _empty_like_entry(f, name)
            f.read_into(name, out)
            assert _bytes(out) == _bytes(t) == _bytes(theirs[name])


# ------------------------------------------------------------------- broken files


def _file_with_header(path, header: object, data: bytes = b"", raw: bytes | None = None):
    body = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


GOOD = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(
    ("header", "data", "raw", "problem"),
    [
        (None, b"", b"", "truncated before the header length"),
        (GOOD, b"", b"{", "header is not UTF-8 JSON"),
        (GOOD, b"", b"\xff\xfe", "header is not UTF-8 JSON"),
        ([1, 2], b"", None, "header is not a JSON object"),
        ({"t": {"dtype": "F12", "shape": [2], "data_offsets": [0, 8]}}, b"x" * 8, None,
         "unknown dtype"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, b"x" * 8, None,
         "data_offsets out of range"),
        ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"x" * 8, None,
         "data_offsets disagree with dtype and shape"),
        ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"x" * 8, None,
         "shape must be a list of non-negative ints"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8]}}, b"x" * 8, None,
         "data_offsets must be [begin, end]"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"x" * 12, None,
         "tensors overlap"),
        ({"__metadata__": {"k": 1}}, b"", None, "__metadata__ must map str to str"),
    ],
)
def test_bad_files_raise_typed_errors_naming_the_file(tmp_path, header, data, raw, problem):
    path = tmp_path / "bad.safetensors"
    if header is None:
        path.write_bytes(b"\x01\x02")
    else:
        _file_with_header(path, header, data, raw)
    with pytest.raises(MemoryError_) as info:
        SafetensorsFile(path)
    assert info.value.details["path"] == str(path)
    assert info.value.details["problem"] == problem


def test_header_length_beyond_the_file(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(MemoryError_, match="truncated header"):
        SafetensorsFile(path)


def test_missing_file(tmp_path):
    with pytest.raises(MemoryError_) as info:
        SafetensorsFile(tmp_path / "nope.safetensors")
    assert info.value.details["path"].endswith("nope.safetensors")


def test_file_truncated_after_parsing_is_reported(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"t": torch.arange(1000, dtype=torch.int32)}, path)
    with SafetensorsFile(path) as f:
        os.truncate(path, path.stat().st_size - 10)
        with pytest.raises(MemoryError_, match="file ended inside a tensor"):
            f.read_into("t", torch.empty(1000, dtype=torch.int32))


def test_read_into_refuses_a_mismatched_destination(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"t": torch.zeros(4, 6)}, path)
    with SafetensorsFile(path) as f:
        with pytest.raises(UsageError, match="no such tensor"):
            f.read_into("u", torch.zeros(4, 6))
        with pytest.raises(UsageError, match="dtype differs"):
            f.read_into("t", torch.zeros(4, 6, dtype=torch.float64))
        with pytest.raises(UsageError, match="shape differs"):
            f.read_into("t", torch.zeros(6, 4))
        with pytest.raises(UsageError, match="not contiguous"):
            f.read_into("t", torch.zeros(6, 4).t())
        released = torch.zeros(4, 6)
        released.untyped_storage().resize_(0)
        with pytest.raises(UsageError, match="smaller than the tensor"):
            f.read_into("t", released)


def test_save_file_validates_input(tmp_path):
    path = tmp_path / "v.safetensors"
    with pytest.raises(UsageError, match="not a tensor"):
        save_file({"a": [1, 2]}, path)
    with pytest.raises(UsageError, match="invalid tensor name"):
        save_file({"__metadata__": torch.zeros(1)}, path)
    with pytest.raises(UsageError, match="dtype not supported"):
        save_file({"c": torch.zeros(2, dtype=torch.complex64)}, path)
    with pytest.raises(UsageError, match="metadata must map str to str"):
        save_file({"a": torch.zeros(1)}, path, metadata={"k": 1})
    assert not path.exists()


def test_save_file_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "a.safetensors"
    save_file({"old": torch.ones(3)}, path)
    before = path.read_bytes()

    def broken_fsync(fd):  # an injected disk failure after the bytes were written
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(sio.os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        save_file({"new": torch.zeros(1000)}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


def test_large_tensors_are_read_in_parallel_parts(tmp_path, monkeypatch):
    import ckpt_controller.memory.safetensors_io as sio
    from ckpt_controller.memory import fill

    monkeypatch.setattr(fill, "PARALLEL_BYTES", 1 << 16)  # this tensor takes that path
    populated = []
    real_populate = fill.populate_pages
    monkeypatch.setattr(fill, "populate_pages",
                        lambda a, n: populated.append((a, n)) or real_populate(a, n))
    want = torch.arange(300_001, dtype=torch.float32)  # parts of unequal size
    path = tmp_path / "big.safetensors"
    sio.save_file({"big": want}, path)
    got = torch.empty_like(want)
    with sio.SafetensorsFile(path) as f:
        f.read_into("big", got)
    assert torch.equal(got, want)
    # every chunk's pages were faulted in ahead of its read, and only the tensor's own
    start = got.data_ptr()
    assert sum(n for _, n in populated) == want.nbytes
    assert min(a for a, _ in populated) == start
    assert max(a + n for a, n in populated) == start + want.nbytes
    with open(path, "r+b") as raw:  # the file shrinks after its header was read
        f = sio.SafetensorsFile(path)
        raw.truncate(path.stat().st_size - 1000)
    with f, pytest.raises(MemoryError_, match="file ended inside a tensor"):
        f.read_into("big", got)


def test_tensors_sharing_a_storage_are_each_written_in_full(tmp_path):
    # tied weights and views: the package alone refuses them; each is written on its own
    base = torch.arange(12, dtype=torch.float32)
    tensors = {"embed": base, "tied": base, "head": base[4:], "grid": base.reshape(3, 4).t()}
    path = tmp_path / "shared.safetensors"
    save_file(tensors, path)
    with SafetensorsFile(path) as f:
        for name, t in tensors.items():
            out = _empty_like_entry(f, name)
            f.read_into(name, out)
            assert torch.equal(out, t), name
    assert torch.equal(base, torch.arange(12, dtype=torch.float32))  # the sources untouched


def test_many_tensors_are_read_as_one_job_on_every_thread(tmp_path, monkeypatch):
    import ckpt_controller.memory.safetensors_io as sio
    from ckpt_controller.memory import fill

    monkeypatch.setattr(fill, "PARALLEL_BYTES", 1 << 16)
    monkeypatch.setattr(fill, "CHUNK_BYTES", 1 << 14)
    monkeypatch.setattr(fill, "THREADS", 2)
    populated = []
    real_populate = fill.populate_pages
    monkeypatch.setattr(fill, "populate_pages",
                        lambda a, n: populated.append(n) or real_populate(a, n))
    # each tensor alone is below what read_into splits over threads
    want = {f"t{i}": torch.arange(i * 1000, i * 1000 + n, dtype=torch.float64)
            for i, n in enumerate([7000, 1, 5000, 8192, 3])}
    path = tmp_path / "many.safetensors"
    sio.save_file(want, path)
    got = {name: torch.empty_like(t) for name, t in want.items()}
    chunks: list[tuple[int, int, int]] = []
    threads = set()

    def landed(i: int, lo: int, hi: int) -> None:
        threads.add(threading.get_ident())
        chunks.append((i, lo, hi))

    with sio.SafetensorsFile(path) as f:
        f.read_many(list(got.items()), on_chunk=landed)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert sum(populated) == sum(t.nbytes for t in want.values())  # pages faulted in ahead
    assert sum(hi - lo for _, lo, hi in chunks) == sum(t.nbytes for t in want.values())
    assert len(threads) == 2
    with sio.SafetensorsFile(path) as f:
        with pytest.raises(UsageError, match="shape differs"):
            f.read_many([("t0", torch.empty(3, dtype=torch.float64))])
        with pytest.raises(UsageError, match="no such tensor"):
            f.read_many([("nope", got["t0"])])
    with open(path, "r+b") as raw:  # the file shrinks after its header was read
        f = sio.SafetensorsFile(path)
        raw.truncate(path.stat().st_size - 100)
    with f, pytest.raises(MemoryError_, match="file ended inside a tensor"):
        f.read_many(list(got.items()))
