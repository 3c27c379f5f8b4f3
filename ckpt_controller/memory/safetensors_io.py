"""The safetensors format: the package's writer, and our own reader straight into live tensors.

The format: 8 bytes little-endian header length N, then N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
(padded with spaces to an 8-byte boundary), then the raw little-endian tensor bytes; offsets
count from the end of the header.

Writing goes through the ``safetensors`` package (``save_file`` adds our checks, the atomic
rename and the fsync). Reading stays ours: re-waking at level 2 must fill the *existing*
storage of the engine's parameters (their identity and address survive a release, and the
engine's graphs and views point at them), which ``safetensors.torch.load_file`` cannot do (it
returns new tensors, whose bytes would then be copied once more), so ``read_into`` reads the
file bytes directly into a tensor's memory: a CPU tensor gets ``pread`` on a buffer over its own
bytes (no intermediate tensor; a large one in parallel parts, each chunk's pages faulted in
ahead by ``fill``); a CUDA tensor gets the bytes through two reusable pinned host
buffers, chunk by chunk, so disk reads overlap host-to-device copies. The tests cross-check the
reader against files the package wrote by itself.

Several CPU tensors are read as one job (``read_many``): their chunks are shared out over every
thread, so a model of many middle-sized tensors reads on every core.

Neighbours: ``registry`` uses ``SafetensorsFile.read_many`` and ``read_into`` to reload released
weights and the engine uses ``save_file`` to write their source; errors come from ``ckpt_controller.errors``
(``MemoryError_`` for a broken file, ``UsageError`` for a request that cannot fit the file).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from ckpt_controller.errors import MemoryError_, UsageError
from ckpt_controller.memory import fill

#: safetensors dtype name -> torch dtype (the float8 ones only where this torch has them)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

#: the reference implementation refuses headers above 100 MB; so do we
MAX_HEADER_BYTES = 100_000_000
#: size of each of the two host staging buffers used to fill a non-CPU tensor
STAGING_BYTES = 64 << 20
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a file: where its bytes are (offsets from the end of the header)."""

    name: str
    dtype: torch.dtype
    dtype_name: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def host_buffer(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's own bytes (no copy).

    Built with ctypes on ``data_ptr`` rather than numpy: numpy is not a dependency of torch,
    and ``.numpy()`` refuses tensors that require grad. The caller keeps ``tensor`` alive.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` to ``path`` in the safetensors format, atomically.

    The ``safetensors`` package writes the file (``safetensors.torch.save_file``: straight from
    the tensors' memory, no copy) to a temporary file in the same folder, which is fsynced and
    then renamed over ``path`` (``os.replace``), so a reader never sees half a file. Tensors on
    other devices are copied to the host first; tensors sharing a storage are each written in
    full (a copy for each one after the first), where the package alone refuses them.
    Raises ``UsageError`` for a name, tensor, dtype or metadata value that cannot be written.
    """
    _require_little_endian(path)
    path = Path(path)
    _check(tensors, metadata, path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        safetensors.torch.save_file(_on_host(tensors), tmp,
                                    metadata=dict(metadata) if metadata is not None else None)
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    except BaseException:
        # policy: never leave a partial temp file behind; the old file (if any) stays intact
        Path(tmp).unlink(missing_ok=True)
        raise


def _check(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None,
           path: Path) -> None:
    """Refuse what our reader could not read back, naming the file and the tensor."""
    if not isinstance(tensors, Mapping):
        raise UsageError("save_file needs a mapping of name -> tensor", path=str(path))
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise UsageError("invalid tensor name", path=str(path), tensor=repr(name))
        if not isinstance(tensor, torch.Tensor):
            raise UsageError("not a tensor", path=str(path), tensor=name, got=type(tensor).__name__)
        if tensor.dtype not in _NAMES:
            raise UsageError("dtype not supported by safetensors_io", path=str(path),
                             tensor=name, dtype=str(tensor.dtype), supported=sorted(DTYPES))
        if tensor.is_sparse or tensor.device.type == "meta":
            raise UsageError("tensor has no dense bytes to write", path=str(path), tensor=name)
    if metadata is not None and (not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise UsageError("metadata must map str to str", path=str(path))


def _on_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor dense and contiguous in host memory (itself when it already is); one whose
    storage an earlier one uses too is copied, as the package refuses shared storages."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        host = tensor.detach().to("cpu").contiguous()
        if host.numel():
            storage = host.untyped_storage().data_ptr()
            if storage in seen:
                host = host.clone()
            seen.add(storage)
        out[name] = host
    return out


class SafetensorsFile:
    """An open safetensors file whose header has been parsed and checked.

    ``entries`` maps name -> ``SafetensorsEntry``; ``metadata`` is the ``__metadata__`` map.
    Raises ``MemoryError_`` (``details``: ``path``, ``problem``) when the file is missing,
    truncated or its header is malformed, names an unknown dtype, or has offsets outside the
    data or inconsistent with the shape. Use as a context manager, or call ``close``.
    """

    def __init__(self, path: str | os.PathLike, *, staging_bytes: int = STAGING_BYTES) -> None:
        _require_little_endian(path)
        self.path = Path(path)
        self._staging_bytes = max(1, int(staging_bytes))
        self._staging: list[torch.Tensor] = []
        self._lock = threading.Lock()
        try:
            self._file = open(self.path, "rb", buffering=0)  # raw: readinto hits our buffer
        except OSError as exc:
            # policy: a missing or unreadable source is a failed step, reported with the path
            raise MemoryError_("cannot open safetensors file", path=str(self.path),
                               problem=exc.strerror or str(exc)) from None
        try:
            self._data_start, self.entries, self.metadata = self._parse()
        except BaseException:
            # policy: a constructor that fails half way closes what it opened
            self._file.close()
            raise

    # ---------------------------------------------------------------- header

    def _bad(self, problem: str, **details) -> MemoryError_:
        return MemoryError_(f"bad safetensors file: {problem}", path=str(self.path),
                            problem=problem, **details)

    def _parse(self) -> tuple[int, dict[str, SafetensorsEntry], dict[str, str]]:
        size = os.fstat(self._file.fileno()).st_size
        head = self._file.read(8)
        if len(head) < 8:
            raise self._bad("truncated before the header length", file_bytes=size)
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES:
            raise self._bad("header length too large", header_bytes=n, limit=MAX_HEADER_BYTES)
        if 8 + n > size:
            raise self._bad("truncated header", header_bytes=n, file_bytes=size)
        raw = self._file.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            # policy: any undecodable header is a broken file, never a crash
            raise self._bad("header is not UTF-8 JSON", error=str(exc)) from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        metadata = header.pop("__metadata__", None)
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._bad("__metadata__ must map str to str")
        data_bytes = size - 8 - n
        entries = {name: self._entry(name, info, data_bytes) for name, info in header.items()}
        spans = sorted((e.begin, e.end, e.name) for e in entries.values() if e.nbytes)
        for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:]):
            if begin_b < end_a:
                raise self._bad("tensors overlap", tensor=name_b, other=name_a)
        return 8 + n, entries, metadata

    def _entry(self, name: str, info: object, data_bytes: int) -> SafetensorsEntry:
        if not isinstance(info, dict):
            raise self._bad("entry is not an object", tensor=name)
        dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype_name not in DTYPES:
            raise self._bad("unknown dtype", tensor=name, dtype=dtype_name,
                            supported=sorted(DTYPES))
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise self._bad("shape must be a list of non-negative ints", tensor=name, shape=shape)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
            raise self._bad("data_offsets must be [begin, end]", tensor=name, data_offsets=offsets)
        begin, end = offsets
        if not begin <= end <= data_bytes:
            raise self._bad("data_offsets out of range", tensor=name, data_offsets=offsets,
                            data_bytes=data_bytes)
        dtype = DTYPES[dtype_name]
        want = math.prod(shape) * dtype.itemsize
        if end - begin != want:
            raise self._bad("data_offsets disagree with dtype and shape", tensor=name,
                            data_offsets=offsets, expected_bytes=want)
        return SafetensorsEntry(name, dtype, dtype_name, tuple(shape), begin, end)

    # ---------------------------------------------------------------- reading

    def read_into(self, name: str, tensor: torch.Tensor,
                  on_chunk: Callable[[int, int], None] | None = None) -> None:
        """Fill ``tensor`` (contiguous, same dtype and shape) with the bytes of entry ``name``.

        No intermediate tensor: a CPU tensor's memory is the read buffer; any other device is
        filled through reusable host staging buffers (pinned on CUDA). Raises ``UsageError``
        when the entry is missing or the tensor does not match it, ``MemoryError_`` when the
        file ends early (it changed after the header was read). ``on_chunk(lo, hi)`` (CPU
        tensors) is called, on the reading thread, as soon as bytes ``[lo, hi)`` are in: a
        checksum of each chunk then reads it from the CPU cache instead of memory.
        """
        entry = self.entries.get(name)
        if entry is None:
            raise UsageError("no such tensor in safetensors file", path=str(self.path),
                             tensor=name, available=sorted(self.entries)[:20])
        self._check_destination(entry, tensor)
        if entry.nbytes == 0:
            return
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu" and entry.nbytes >= fill.PARALLEL_BYTES:
            self._read_parallel(entry.begin, flat, entry.name, on_chunk)
        elif flat.device.type == "cpu":
            self._read_exact(entry.begin, host_buffer(flat), entry.name)
            if on_chunk is not None:
                on_chunk(0, entry.nbytes)
        else:
            self._read_staged(entry, flat)

    def read_many(self, items: Sequence[tuple[str, torch.Tensor]],
                  on_chunk: Callable[[int, int, int], None] | None = None) -> None:
        """Fill several CPU tensors (``(entry name, tensor)`` each, checked as ``read_into``
        checks one) as one job: their bytes, cut in chunks, are shared out over every thread
        (``fill.in_chunks``), each chunk's pages faulted in ahead and read with ``pread``
        straight into the tensor's memory, so many middle-sized tensors (a model's layers)
        fill as fast as one large one. ``on_chunk(i, lo, hi)`` is called, on the reading
        thread, as soon as bytes ``[lo, hi)`` of the ``i``-th tensor are in (a checksum then
        reads them from the CPU's cache). Raises as ``read_into`` does; a tensor on another
        device is a ``UsageError`` (use ``read_into``)."""
        dests: list[tuple[SafetensorsEntry, memoryview, int]] = []
        for name, tensor in items:
            entry = self.entries.get(name)
            if entry is None:
                raise UsageError("no such tensor in safetensors file", path=str(self.path),
                                 tensor=name, available=sorted(self.entries)[:20])
            self._check_destination(entry, tensor)
            if tensor.device.type != "cpu":
                raise UsageError("read_many fills CPU tensors; use read_into for others",
                                 path=str(self.path), tensor=name, device=str(tensor.device))
            flat = tensor.detach().reshape(-1).view(torch.uint8)
            dests.append((entry, host_buffer(flat), flat.data_ptr()))
        fd = self._file.fileno()

        def read(i: int, lo: int, hi: int) -> None:
            entry, buf, _ = dests[i]
            self._pread(fd, buf, lo, hi, self._data_start + entry.begin, entry.name)
            if on_chunk is not None:
                on_chunk(i, lo, hi)

        fill.in_chunks([(address, len(buf)) for _, buf, address in dests], read)

    def _pread(self, fd: int, buf: memoryview, lo: int, hi: int, offset: int, name: str) -> None:
        """Bytes ``[lo, hi)`` of ``buf`` from the file at ``offset + lo``; a short read is the
        file's fault (it changed after the header was read)."""
        got = lo
        while got < hi:
            n = os.preadv(fd, [buf[got:hi]], offset + got)
            if not n:
                raise self._bad("file ended inside a tensor (changed on disk?)", tensor=name,
                                expected_bytes=len(buf), got_bytes=got)
            got += n

    def _check_destination(self, entry: SafetensorsEntry, tensor: torch.Tensor) -> None:
        details = {"path": str(self.path), "tensor": entry.name}
        if not isinstance(tensor, torch.Tensor):
            raise UsageError("destination is not a tensor", **details)
        if tensor.dtype != entry.dtype:
            raise UsageError("dtype differs from the file", expected=entry.dtype_name,
                             got=str(tensor.dtype), **details)
        if tuple(tensor.shape) != entry.shape:
            raise UsageError("shape differs from the file", expected=list(entry.shape),
                             got=list(tensor.shape), **details)
        if not tensor.is_contiguous():
            raise UsageError("destination tensor is not contiguous", **details)
        have = tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
        if have < entry.nbytes:
            raise UsageError("destination storage is smaller than the tensor (released?)",
                             storage_bytes=have, needed=entry.nbytes, **details)

    def _read_exact(self, begin: int, buf: memoryview, name: str) -> None:
        got = 0
        with self._lock:  # seek + read must not interleave between threads
            self._file.seek(self._data_start + begin)
            while got < len(buf):
                n = self._file.readinto(buf[got:])
                if not n:
                    raise self._bad("file ended inside a tensor (changed on disk?)", tensor=name,
                                    expected_bytes=len(buf), got_bytes=got)
                got += n

    def _read_parallel(self, begin: int, flat: torch.Tensor, name: str,
                       on_chunk: Callable[[int, int], None] | None) -> None:
        """``pread`` of ``flat``'s bytes in parts, one per thread (no seek, so no lock: each
        read has its own offset), a chunk at a time, each chunk's pages faulted in first
        (``fill.in_parts``: a re-woken storage is untouched memory) and handed to
        ``on_chunk`` as soon as it is in. Any short read is the file's fault."""
        buf = host_buffer(flat)
        fd = self._file.fileno()
        offset = self._data_start + begin

        def read(lo: int, hi: int) -> None:
            self._pread(fd, buf, lo, hi, offset, name)
            if on_chunk is not None:
                on_chunk(lo, hi)

        fill.in_parts(flat.data_ptr(), len(buf), read)

    def _read_staged(self, entry: SafetensorsEntry, flat: torch.Tensor) -> None:
        """Read through two host buffers; on CUDA the copy of one chunk to the device runs
        while the next chunk is read into the other buffer (an event guards each reuse)."""
        cuda = flat.device.type == "cuda"
        staging = self._staging_buffers(pinned=cuda)
        done: list[torch.cuda.Event | None] = [None, None]
        chunk = staging[0].numel()
        with torch.cuda.device(flat.device) if cuda else contextlib.nullcontext():
            for i, off in enumerate(range(0, entry.nbytes, chunk)):
                k = i % 2
                if done[k] is not None:
                    done[k].synchronize()  # the previous copy out of this buffer has finished
                n = min(chunk, entry.nbytes - off)
                self._read_exact(entry.begin + off, host_buffer(staging[k][:n]), entry.name)
                flat[off:off + n].copy_(staging[k][:n], non_blocking=cuda)
                if cuda:
                    done[k] = torch.cuda.Event()
                    done[k].record()
            if cuda:
                torch.cuda.current_stream().synchronize()

    def _staging_buffers(self, *, pinned: bool) -> list[torch.Tensor]:
        if not self._staging or self._staging[0].is_pinned() != pinned:
            self._staging = [
                torch.empty(self._staging_bytes, dtype=torch.uint8, pin_memory=pinned)
                for _ in range(2)
            ]
        return self._staging

    # ---------------------------------------------------------------- lifetime

    def close(self) -> None:
        self._staging = []
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self.entries)} tensors)"


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _require_little_endian(path: str | os.PathLike) -> None:
    if not _LITTLE_ENDIAN:
        raise UsageError("safetensors_io needs a little-endian host", path=str(path))
