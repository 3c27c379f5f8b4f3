"""How registered tensors map onto storages: the bookkeeping under ``MemoryRegistry``.

A ``TagEntry`` holds ``Block``s, one per distinct storage; a ``Block`` holds the ``Window``s
(registered tensors) that lie in it. Storages, not tensors, are what a release frees, so tied
weights, views and per-layer slices of one buffer are freed and refilled once. This module
validates tensors at registration and answers layout questions (which windows to refill,
whether a storage is fully covered, what their checksums are); it never frees anything.
Neighbours: ``registry`` above, ``checksum`` and ``fill`` (its threads) below.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ckpt_controller.errors import UsageError
from ckpt_controller.memory import fill
from ckpt_controller.memory.checksum import tensor_checksum

#: what a release does to one tag: ``offload`` keeps the bytes in host memory, ``reload``
#: frees them and reads them back from the source file, ``discard`` frees them for good,
#: ``verify`` (after a failed check, with no source) keeps them and checks them again
TagAction = Literal["offload", "reload", "discard", "verify"]


@dataclass
class Window:
    """One registered tensor: a window of ``nbytes`` at ``offset`` in its block's storage."""

    name: str
    tensor: torch.Tensor
    offset: int
    nbytes: int


@dataclass
class Block:
    """One storage, shared by one or more registered tensors of a tag."""

    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    windows: list[Window] = field(default_factory=list)
    host: torch.Tensor | None = None  # the offloaded bytes while a CUDA block is released

    def bytes_view(self) -> torch.Tensor:
        """All the storage's bytes as a 1-D uint8 tensor (valid while it is not released)."""
        out = torch.empty(0, dtype=torch.uint8, device=self.device)
        return out.set_(self.storage, 0, (self.nbytes,), (1,))

    def stays_in_host_memory(self, action: TagAction) -> bool:
        return action == "offload" and self.device.type == "cpu"


@dataclass
class TagEntry:
    """One tag: whether its content is preserved, where to reload it from, its storages."""

    name: str
    preserve: bool
    source: Path | None
    blocks: list[Block] = field(default_factory=list)
    names: dict[str, Window] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)


def attach(
    tags: Mapping[str, TagEntry], tag: TagEntry, items: list[tuple[str, torch.Tensor]]
) -> None:
    """Add ``items`` to ``tag``: validate them all first, so a bad tensor registers nothing;
    tensors sharing a storage join one ``Block``; a storage may not span two tags."""
    by_ptr = {
        (str(b.device), b.storage.data_ptr()): (t.name, b)
        for t in tags.values() for b in t.blocks if b.nbytes
    }
    new_blocks: list[Block] = []
    joins: list[tuple[Block, Window]] = []
    names = set(tag.names)
    for name, tensor in items:
        check_tensor(tag.name, name, tensor)
        if name in names:
            raise UsageError("tensor name registered twice", tag=tag.name, tensor=name)
        names.add(name)
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        owner, block = by_ptr.get(key, (tag.name, None))
        if owner != tag.name:
            raise UsageError("tensor shares its storage with another tag", tag=tag.name,
                             tensor=name, other_tag=owner)
        if block is None or not storage.nbytes():
            block = Block(storage, storage.nbytes(), tensor.device)
            new_blocks.append(block)
            if storage.nbytes():
                by_ptr[key] = (tag.name, block)
        item = Window(name, tensor, tensor.storage_offset() * tensor.element_size(),
                       tensor.numel() * tensor.element_size())
        joins.append((block, item))
    tag.blocks.extend(new_blocks)
    for block, item in joins:
        block.windows.append(item)
        tag.names[item.name] = item


def named_tensors(tag: str, tensors: object) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of a mapping, or of a module's parameters and buffers (tied
    parameters once, as ``named_parameters`` gives them)."""
    if isinstance(tensors, torch.nn.Module):
        return list(tensors.named_parameters()) + list(tensors.named_buffers())
    if isinstance(tensors, Mapping):
        items = list(tensors.items())
        for name, _ in items:
            if not isinstance(name, str) or not name:
                raise UsageError("a tensor name is a non-empty string", tag=tag, tensor=repr(name))
        return items
    raise UsageError("register takes a mapping of name -> tensor or an nn.Module", tag=tag,
                     got=type(tensors).__name__)


def check_tensor(tag: str, name: str, tensor: object) -> None:
    """A registrable tensor: dense, contiguous, on cpu or cuda, with a resizable storage."""
    if not isinstance(tensor, torch.Tensor):
        raise UsageError("not a tensor", tag=tag, tensor=name, got=type(tensor).__name__)
    if tensor.device.type not in ("cpu", "cuda"):
        raise UsageError("only cpu and cuda tensors can be registered", tag=tag, tensor=name,
                         device=str(tensor.device))
    if tensor.is_sparse or not tensor.is_contiguous():
        raise UsageError("tensor must be dense and contiguous", tag=tag, tensor=name)
    if not tensor.untyped_storage().resizable():
        raise UsageError("tensor storage cannot be resized (memory not owned by torch, e.g. "
                         "from_numpy, frombuffer or mmap)", tag=tag, tensor=name)


def check_unchanged(tag: TagEntry) -> None:
    """The engine must not have swapped a registered tensor's storage since registration."""
    for block in tag.blocks:
        for item in block.windows:
            storage = item.tensor.untyped_storage()
            if storage.data_ptr() != block.storage.data_ptr() or storage.nbytes() != block.nbytes:
                raise UsageError("tensor's storage changed since registration; unregister and "
                                 "register the tag again", tag=tag.name, tensor=item.name)


def check_resizable(tag: TagEntry, action: TagAction) -> None:
    """Every storage a release would free must still be resizable. Torch marks a storage
    non-resizable for good once a tensor on it was exported (``.numpy()``, the buffer
    protocol), since the export may still point at its memory; such a storage can never be
    freed in place. Checked at plan time, so a release never stops half way."""
    for block in tag.blocks:
        freed = block.nbytes and not block.stays_in_host_memory(action)
        if freed and not block.storage.resizable():
            raise UsageError("a storage can no longer be resized: a tensor on it was exported "
                             "(e.g. .numpy()) after registration; export a .clone() instead",
                             tag=tag.name, tensor=block.windows[0].name)


def distinct_windows(tag: TagEntry) -> list[Window]:
    """One tensor per distinct (storage, offset, size): tied tensors are filled once."""
    seen: dict[tuple[int, int, int], Window] = {}
    for index, block in enumerate(tag.blocks):
        for item in block.windows:
            seen.setdefault((index, item.offset, item.nbytes), item)
    return list(seen.values())


def window_checksums(tag: TagEntry) -> dict[str, str]:
    """Checksum of every tensor of ``tag``; tied tensors (same window) computed once. CPU
    tensors are shared out over ``fill.THREADS`` threads, about equal bytes each: torch's
    parallel ops started off the main thread (where the agent releases) pay tens of
    microseconds each, so a model's few hundred chunk reductions ran 1.8 times as long on
    one thread as on the main one; side by side on two threads they ran as fast as there."""
    keys: dict[str, tuple] = {}
    unique: dict[tuple, torch.Tensor] = {}
    for index, block in enumerate(tag.blocks):
        for item in block.windows:
            key = (index, item.offset, item.nbytes, item.tensor.dtype, tuple(item.tensor.shape))
            keys[item.name] = key
            unique.setdefault(key, item.tensor)
    memo: dict[tuple, str] = {}
    host = sorted((k for k, t in unique.items() if t.device.type == "cpu"),
                  key=lambda k: -k[2])
    runs: list[list[tuple]] = [[] for _ in range(max(1, min(fill.THREADS, len(host))))]
    loads = [0] * len(runs)
    for key in host:  # largest first, each to the least loaded run
        i = loads.index(min(loads))
        runs[i].append(key)
        loads[i] += key[2]

    def run(part: list[tuple]) -> None:
        for key in part:
            memo[key] = tensor_checksum(unique[key])

    fill.run_parts([functools.partial(run, part) for part in runs if part])
    for key, tensor in unique.items():
        if key not in memo:
            memo[key] = tensor_checksum(tensor)
    return {name: memo[key] for name, key in keys.items()}


def covered_bytes(block: Block) -> int:
    """How many bytes of the storage lie inside at least one registered tensor."""
    covered, reach = 0, 0
    for begin, end in sorted((t.offset, t.offset + t.nbytes) for t in block.windows):
        begin = max(begin, reach)
        if end > begin:
            covered += end - begin
            reach = end
    return covered
