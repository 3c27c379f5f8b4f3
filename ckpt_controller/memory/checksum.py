"""A bit-exact tensor checksum computed with torch ops on the tensor's own device.

Used to prove that weights re-woken after a release are the very bits that were released:
CUDA weights are checked on the GPU, without a host copy. The checksum looks at the bytes,
never the values, so ``-0.0`` differs from ``0.0`` and NaN payloads count.

The tensor's bytes are read as little-endian int64 words ``w_k`` (plus a tail of fewer than 8
bytes). Two sums, both wrapping modulo 2**64:

    S = sum_k w_k                    a changed or zeroed word changes S
    P = sum_k k * w_k                a swap of two different words changes P

P is computed without an index as large as the data: with the words laid out as rows of
``ROW_WORDS`` columns (k = r*B + c), ``P = B * sum_r r*rowsum_r + sum_c c*colsum_c``. The
rows are taken in chunks that fit in the CPU's cache, so both reductions of a chunk cost one
pass over memory. The digest hashes dtype, shape, byte count, S, P and the tail.

Not a cryptographic hash: it detects corruption (bit flips, swapped, zeroed or truncated
data, reload from the wrong file), not tampering. Being linear modulo 2**64, it misses a
change d at word k paired with -d at word k' when (k - k') * d is a multiple of 2**64 (for
example two words that differ only in their top bit, swapped at an even distance), and
changes that cancel in both sums; every single-word change is caught by S.
Neighbours: ``registry`` (through ``layout``'s window checksums) checksums every preserved
tensor at release and again after re-wake; a reload from file feeds a ``ChecksumStream`` as
the bytes arrive.
"""

from __future__ import annotations

import hashlib
import threading

import torch

from ckpt_controller.errors import UsageError

#: columns of the word matrix (B)
ROW_WORDS = 256
#: bytes reduced per step: a cache-sized chunk on the CPU, a large one on accelerators
#: (where each step is a kernel launch and bandwidth is not the CPU cache's)
CHUNK_BYTES = {"cpu": 2 << 20}
DEFAULT_CHUNK_BYTES = 1 << 30
_MOD = 1 << 64


def tensor_checksum(tensor: torch.Tensor) -> str:
    """A hex digest of ``tensor``'s dtype, shape and exact bytes, computed on its device.

    Equal for equal bytes on any device (CPU, CUDA) and any storage offset; a non-contiguous
    tensor is checksummed as its contiguous copy. Raises ``UsageError`` for a tensor without
    dense bytes (sparse, meta).
    """
    if not isinstance(tensor, torch.Tensor):
        raise UsageError("tensor_checksum needs a tensor", got=type(tensor).__name__)
    if tensor.is_sparse or tensor.device.type == "meta":
        raise UsageError("tensor has no dense bytes to checksum", device=str(tensor.device))
    data = tensor.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    flat = data.reshape(-1).view(torch.uint8)
    chunk = CHUNK_BYTES.get(flat.device.type, DEFAULT_CHUNK_BYTES)
    total, weighted, tail = word_sums(flat, chunk_bytes=chunk)
    return _digest(tensor, flat.numel(), total, weighted, tail)


def _digest(tensor: torch.Tensor, nbytes: int, total: int, weighted: int, tail: bytes) -> str:
    text = f"v1|{tensor.dtype}|{tuple(tensor.shape)}|{nbytes}|{total}|{weighted}|{tail.hex()}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class ChecksumStream:
    """``tensor_checksum`` of a CPU tensor computed while its bytes arrive, a chunk at a time
    from any thread (e.g. right after each chunk is read from a file, while it is still in
    the CPU's cache), instead of in a second pass. S and P split over chunks: a chunk at
    word offset k0 adds its own S, and its own P plus k0 x S. Chunks must start at multiples
    of 8 bytes; the trailing bytes (``len % 8``) belong to the last chunk."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.flat = tensor.detach().reshape(-1).view(torch.uint8)
        self.nbytes = self.flat.numel()
        self._lock = threading.Lock()
        self._total = self._weighted = self._seen = 0
        self._tail = b""

    def update(self, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` are final."""
        if lo % 8:
            raise UsageError("checksum chunks start at multiples of 8 bytes", lo=lo)
        part = self.flat[lo:hi]
        row_bytes = 8 * ROW_WORDS
        if (hi - lo) % row_bytes == 0 and part.storage_offset() % 8 == 0:
            total, weighted, tail = _whole_rows(part, hi - lo)  # the common, fast case
        else:
            chunk = CHUNK_BYTES.get(self.flat.device.type, DEFAULT_CHUNK_BYTES)
            total, weighted, tail = word_sums(part, chunk_bytes=chunk)
        if tail and hi != self.nbytes:
            raise UsageError("only the last chunk may end off a multiple of 8", hi=hi)
        with self._lock:
            self._total = (self._total + total) % _MOD
            self._weighted = (self._weighted + weighted + (lo // 8) * total) % _MOD
            self._seen += hi - lo
            if tail:
                self._tail = tail

    def digest(self) -> str:
        if self._seen != self.nbytes:
            raise UsageError("not every byte reached the checksum", seen=self._seen,
                             nbytes=self.nbytes)
        return _digest(self.tensor, self.nbytes, self._total, self._weighted, self._tail)


def word_sums(
    flat: torch.Tensor, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, row_words: int = ROW_WORDS
) -> tuple[int, int, bytes]:
    """``(S, P, tail)`` of a 1-D uint8 tensor: S and P as unsigned ints below 2**64, the
    trailing ``len % 8`` bytes as they are. The result does not depend on ``chunk_bytes``
    or on the device; only ``row_words`` is part of the definition."""
    dev = flat.device
    nwords = flat.numel() // 8
    rows = nwords // row_words
    row_bytes = 8 * row_words
    rows_per_chunk = max(1, chunk_bytes // row_bytes)
    starts = range(0, rows, rows_per_chunk)
    rowsums = torch.empty(rows, dtype=torch.int64, device=dev)
    colsums = torch.empty(len(starts), row_words, dtype=torch.int64, device=dev)
    aligned = flat.storage_offset() % 8 == 0
    matrix = flat[:rows * row_bytes].view(torch.int64).view(rows, row_words) if aligned else None
    for i, r0 in enumerate(starts):
        r1 = min(rows, r0 + rows_per_chunk)
        if matrix is not None:
            block = matrix[r0:r1]
        else:
            block = _words(flat[r0 * row_bytes:r1 * row_bytes]).view(r1 - r0, row_words)
        torch.sum(block, 1, out=rowsums[r0:r1])
        torch.sum(block, 0, out=colsums[i])  # second pass over the chunk: served from cache
    colsum = colsums.sum(0)
    rest = _words(flat[rows * row_bytes:nwords * 8])
    rest_pos = torch.arange(rest.numel(), dtype=torch.int64, device=dev) + rows * row_words
    row_idx = torch.arange(rows, dtype=torch.int64, device=dev)
    col_idx = torch.arange(row_words, dtype=torch.int64, device=dev)
    parts = torch.stack([
        rowsums.sum(),
        (row_idx * rowsums).sum(),
        (col_idx * colsum).sum(),
        rest.sum(),
        (rest_pos * rest).sum(),
    ])
    # one transfer for everything (one sync on an accelerator)
    values = torch.cat([parts, flat[nwords * 8:].to(torch.int64)]).tolist()
    s_rows, p_rows, p_cols, s_rest, p_rest = values[:5]
    total = (s_rows + s_rest) % _MOD
    weighted = (row_words * p_rows + p_cols + p_rest) % _MOD
    return total, weighted, bytes(values[5:])


_INDEX: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _whole_rows(part: torch.Tensor, nbytes: int) -> tuple[int, int, bytes]:
    """``word_sums`` of a chunk of whole rows, aligned: two reductions and two dot
    products (int64 arithmetic wraps, as the sums do modulo 2**64)."""
    rows = nbytes // (8 * ROW_WORDS)
    matrix = part.view(torch.int64).view(rows, ROW_WORDS)
    if rows not in _INDEX:
        _INDEX[rows] = (torch.arange(rows, dtype=torch.int64),
                        torch.arange(ROW_WORDS, dtype=torch.int64))
    row_idx, col_idx = _INDEX[rows]
    rowsums = matrix.sum(1)
    colsums = matrix.sum(0)
    s, p_rows, p_cols = torch.stack([rowsums.sum(), row_idx.dot(rowsums),
                                     col_idx.dot(colsums)]).tolist()
    return s % _MOD, (ROW_WORDS * p_rows + p_cols) % _MOD, b""


def _words(byte_view: torch.Tensor) -> torch.Tensor:
    """The bytes as int64 words; a view at an offset that is not 8-byte aligned (a tensor
    starting mid-storage) is copied first, one chunk at a time."""
    if byte_view.storage_offset() % 8:
        byte_view = byte_view.clone()
    return byte_view.view(torch.int64)
