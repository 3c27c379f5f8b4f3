"""Tagged engine memory: release it, re-wake it into the same tensor objects, verify it.

An engine registers its tensors under tags (``weights``, ``kv_cache``, its own). A release
frees their memory while every Python tensor object stays alive: the storage behind a tensor
is resized to zero bytes (``untyped_storage().resize_(0)``), so the ``nn.Parameter`` objects
the engine holds, and every view of them, remain the same objects; a re-wake resizes the
storage back and refills it. Preserved content (weights) comes back bit-exact, proved by a
checksum taken at release; scratch content (KV cache) comes back zero-filled.

    level 0   nothing
    level 1   preserved tags offloaded to host memory (pinned on CUDA; a CPU tensor already
              is in host memory and stays as it is), scratch tags discarded
    level 2   everything discarded; preserved tags reloaded from their safetensors ``source``
    tags=[..] the given tags, each as at level 1

Storages, not tensors, are the unit of memory: tensors sharing a storage (tied weights, views,
per-layer slices of one buffer) are released and re-woken once. CPU and CUDA tensors go
through the same code; device branches exist only for pinned memory, synchronisation,
``empty_cache`` and measurement (``measure``). Neighbours: ``layout``, ``checksum``,
``fill``, ``measure`` and ``safetensors_io`` below, ``vocab`` (release levels); the agent above calls
``plan``/``release``/``rewake`` (``rewake`` verifies); the reference engine registers tags.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from ckpt_controller.clock import Clock
from ckpt_controller.errors import (
    MemoryError_,
    ResidualOverBudgetError,
    UsageError,
    VerificationError,
)
from ckpt_controller.memory import fill, measure
from ckpt_controller.memory.checksum import ChecksumStream, tensor_checksum
from ckpt_controller.memory.layout import (
    Block,
    TagAction,
    TagEntry,
    attach,
    check_resizable,
    check_unchanged,
    covered_bytes,
    distinct_windows,
    named_tensors,
    window_checksums,
)
from ckpt_controller.memory.safetensors_io import SafetensorsFile
from ckpt_controller.protocol import DeviceMemory, MemoryReport
from ckpt_controller.vocab import MemoryAction, ReleaseLevel

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
LEVELS = tuple(ReleaseLevel)


@dataclass(frozen=True)
class ReleasePlan:
    """What a release will do: the level (or ``None`` for explicit tags) and, per tag in
    registration order, its ``TagAction``. Made by ``MemoryRegistry.plan``."""

    level: ReleaseLevel | None
    requested_tags: tuple[str, ...] | None
    actions: tuple[tuple[str, TagAction], ...]

    @property
    def tags(self) -> list[str]:
        return [tag for tag, _ in self.actions]


class MemoryRegistry:
    """Tensors under tags; release, re-wake and verify them. Thread-safe: one lock around
    every operation, so a release and a re-wake never interleave."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or Clock()
        self._lock = threading.RLock()
        self._tags: dict[str, TagEntry] = {}
        self._released: dict[str, TagAction] = {}
        self._released_level: ReleaseLevel | None = None
        #: tag -> {tensor name: checksum at release}; verified (and dropped) by ``rewake``
        self._checksums: dict[str, dict[str, str]] = {}
        #: called between refilling and verifying (a drill's failpoint corrupts a weight here;
        #: while set, reloaded bytes are checked after the refill, not as they are read)
        self.after_refill: Callable[[], None] | None = None
        #: (tag, tensor) -> checksum of the bytes as they were read back from the source
        self._read_checksums: dict[tuple[str, str], str] = {}

    # ---------------------------------------------------------------- registration

    def register(
        self,
        tag: str,
        tensors: Mapping[str, torch.Tensor] | torch.nn.Module,
        *,
        preserve: bool | None = None,
        source: str | Path | None = None,
    ) -> None:
        """Register ``tensors`` (a name -> tensor mapping, or a module's parameters and
        buffers) under ``tag``. ``preserve`` defaults to False for ``kv_cache`` and True for
        every other tag. ``source`` is a safetensors file holding the preserved tensors under
        the same names (needed for a level-2 release). A tag may be registered again to add
        tensors if ``preserve`` and ``source`` agree. Raises ``UsageError`` for a tensor that
        is not contiguous, not on cpu/cuda, or whose storage cannot be resized, a name given
        twice, a storage already under another tag, or a registration during a release.
        """
        with self._lock:
            if not isinstance(tag, str) or not tag:
                raise UsageError("a tag is a non-empty string", tag=repr(tag))
            if self._released:
                raise UsageError("cannot register while memory is released", tag=tag,
                                 released=self.released_tags)
            src = None if source is None else Path(source).absolute()
            entry = self._tags.get(tag)
            if entry is None:
                preserve = (tag != KV_CACHE) if preserve is None else bool(preserve)
                entry = TagEntry(tag, preserve, src)
            elif (preserve is not None and bool(preserve) != entry.preserve) or (
                src is not None and src != entry.source
            ):
                raise UsageError("tag already registered with another preserve/source", tag=tag,
                                 preserve=entry.preserve, source=str(entry.source))
            attach(self._tags, entry, named_tensors(tag, tensors))
            self._tags[tag] = entry

    def unregister(self, tag: str) -> None:
        """Forget ``tag`` (e.g. before registering re-created tensors). Not while released."""
        with self._lock:
            self._known(tag)
            if tag in self._released:
                raise UsageError("cannot unregister a released tag; re-wake it first", tag=tag)
            del self._tags[tag]
            self._checksums.pop(tag, None)

    def tags(self) -> list[str]:
        """Registered tags, in registration order."""
        with self._lock:
            return list(self._tags)

    # The two readers below take no lock: the agent's control thread calls them for status
    # and heartbeats while a release or re-wake (which holds the lock for seconds) runs.
    # ``dict(...)`` copies under the GIL, so each sees a consistent snapshot.

    @property
    def released_tags(self) -> list[str]:
        """Tags released and not yet re-woken, in registration order."""
        released = dict(self._released)
        return [t for t in dict(self._tags) if t in released]

    @property
    def released_level(self) -> ReleaseLevel | None:
        """The level of the release in force (None: nothing released, or tags named)."""
        return self._released_level

    def registered_bytes(self) -> dict[str, int]:
        """Tag -> bytes of its distinct storages (as registered, also while released)."""
        return {name: tag.nbytes for name, tag in dict(self._tags).items()}

    def reload_files(self) -> dict[str, str]:
        """Tag -> the safetensors file a level-2 re-wake reads it back from (preserved tags
        registered with a ``source``): what a node that restores this engine's image must
        be able to read, byte for byte the same (a migration checks it before the dump)."""
        return {name: str(tag.source) for name, tag in dict(self._tags).items()
                if tag.preserve and tag.source is not None}

    # ---------------------------------------------------------------- planning

    def plan(self, level: int | None = None, tags: Sequence[str] | None = None) -> ReleasePlan:
        """Check a release request and say what it would do, touching nothing.

        Exactly one of ``level`` (0, 1, 2) and ``tags`` (registered tags). Raises
        ``UsageError`` for both or neither, an unknown level or tag (``details['registered']``
        lists the tags), a request while something is released, or a level-2 release of a
        preserved tag without a usable ``source`` (missing file, or a tensor missing or
        different in it, or storage bytes outside the registered tensors).
        """
        with self._lock:
            if (level is None) == (tags is None):
                raise UsageError("give exactly one of level and tags", level=level, tags=tags)
            if self._released:
                raise UsageError("memory is already released; re-wake it first",
                                 released=self.released_tags)
            if self._checksums:
                raise UsageError("re-woken tags still await verification; call rewake()",
                                 unverified=list(self._checksums))
            if tags is not None:
                if isinstance(tags, str):
                    raise UsageError("tags is a list of tag names, not a string", tags=tags)
                wanted = list(dict.fromkeys(tags))
                for tag in wanted:
                    self._known(tag)
                actions = [(t, self._level1_action(t)) for t in self._tags if t in wanted]
                return self._checked(ReleasePlan(None, tuple(wanted), tuple(actions)))
            if not isinstance(level, int) or isinstance(level, bool) or level not in LEVELS:
                raise UsageError("unknown release level", level=level, levels=list(LEVELS))
            level = ReleaseLevel(level)
            if level is ReleaseLevel.NOTHING:
                return ReleasePlan(level, None, ())
            if level is ReleaseLevel.OFFLOAD:
                actions = [(t, self._level1_action(t)) for t in self._tags]
                return self._checked(ReleasePlan(level, None, tuple(actions)))
            actions = []
            for name, tag in self._tags.items():
                if tag.preserve:
                    self._check_source(tag)
                actions.append((name, "reload" if tag.preserve else "discard"))
            return self._checked(ReleasePlan(level, None, tuple(actions)))

    def _checked(self, plan: ReleasePlan) -> ReleasePlan:
        """The tensors are still where they were registered and can be freed in place."""
        for name, action in plan.actions:
            check_unchanged(self._tags[name])
            check_resizable(self._tags[name], action)
        return plan

    def _level1_action(self, tag: str) -> TagAction:
        return "offload" if self._tags[tag].preserve else "discard"

    def _known(self, tag: str) -> TagEntry:
        if tag not in self._tags:
            raise UsageError("unknown tag", tag=tag, registered=list(self._tags))
        return self._tags[tag]

    def _check_source(self, tag: TagEntry) -> None:
        """A level-2 release is only allowed when the source can give every byte back."""
        if tag.source is None:
            raise UsageError("level 2 needs a safetensors source for a preserved tag",
                             tag=tag.name, hint="register(..., source=path) or use level 1")
        if not tag.source.is_file():
            raise UsageError("source file not found", tag=tag.name, source=str(tag.source))
        with SafetensorsFile(tag.source) as src:
            for item in tag.names.values():
                entry = src.entries.get(item.name)
                if entry is None:
                    raise UsageError("tensor missing from the source file", tag=tag.name,
                                     tensor=item.name, source=str(tag.source))
                if entry.dtype != item.tensor.dtype or entry.shape != tuple(item.tensor.shape):
                    raise UsageError("tensor differs from the source file", tag=tag.name,
                                     tensor=item.name, source=str(tag.source),
                                     expected=f"{entry.dtype_name}{list(entry.shape)}",
                                     got=f"{item.tensor.dtype}{list(item.tensor.shape)}")
        for block in tag.blocks:
            if covered_bytes(block) != block.nbytes:
                raise UsageError("storage has bytes outside the registered tensors; a reload "
                                 "could not restore them", tag=tag.name,
                                 tensor=block.windows[0].name, storage_bytes=block.nbytes,
                                 covered_bytes=covered_bytes(block))

    # ---------------------------------------------------------------- release

    def release(
        self,
        plan: ReleasePlan | int | None = None,
        *,
        level: int | None = None,
        tags: Sequence[str] | None = None,
        residual_budget_bytes: int | None = None,
    ) -> MemoryReport:
        """Release memory as ``plan`` (a ``ReleasePlan`` or a level) or ``level``/``tags`` say.

        Takes a checksum of every preserved tensor, offloads or frees the storages, hands the
        freed memory back (``malloc_trim``, ``empty_cache``) and measures each device before
        and after. ``residual_bytes`` is what the process still holds on the registered
        devices (CPU: RSS; CUDA: allocator reserved). Raises ``UsageError`` as ``plan`` does,
        ``MemoryError_`` when offloading fails (nothing is released then), and
        ``ResidualOverBudgetError`` (``details['report']``) when the residual exceeds
        ``residual_budget_bytes``; the memory then stays released: call ``rewake`` to roll back.
        """
        with self._lock:
            if isinstance(plan, ReleasePlan):
                if level is not None or tags is not None:
                    raise UsageError("give a plan or level/tags, not both")
                level, tags = plan.level, plan.requested_tags
            elif plan is not None:
                if level is not None:
                    raise UsageError("level given twice", plan=plan, level=level)
                level = plan
            if residual_budget_bytes is not None and residual_budget_bytes < 0:
                raise UsageError("residual budget must be >= 0", budget=residual_budget_bytes)
            fresh = self.plan(level=level, tags=tags)  # re-checked under the lock
            return self._release(fresh, residual_budget_bytes)

    def _release(self, plan: ReleasePlan, budget: int | None) -> MemoryReport:
        t0 = self._clock.monotonic()
        work = [(self._tags[t], a) for t, a in plan.actions]
        devices = self._devices()
        for dev in devices if work else ():  # nothing to free (level 0): nothing to wait for
            measure.synchronize(dev)  # no engine kernel may still touch what we free
        before = {d: measure.usage(d) for d in devices}
        checksums = {tag.name: window_checksums(tag) for tag, _ in work if tag.preserve}
        self._offload([(tag, a) for tag, a in work if a == "offload"])
        # from here on the state is recorded first, so a failure still leaves a re-wakeable state
        self._released_level = plan.level if work else None
        self._checksums.update(checksums)
        offloaded = discarded = kept = 0
        for tag, action in work:
            self._released[tag.name] = action
            for block in tag.blocks:
                if block.stays_in_host_memory(action):
                    kept += block.nbytes
                    continue
                block.storage.resize_(0)
                if action != "offload":
                    discarded += block.nbytes
            if action == "offload":
                offloaded += tag.nbytes
        for dev in devices if work else ():  # nothing freed: no malloc_trim, no empty_cache
            measure.return_freed(dev)
        after = {d: measure.usage(d) for d in devices}
        report = MemoryReport(
            action=MemoryAction.RELEASE, level=plan.level, tags=plan.tags,
            tensor_bytes=offloaded + discarded, offloaded_bytes=offloaded,
            discarded_bytes=discarded, budget_bytes=budget,
            devices=[_device_memory(before[d], after[d], _note(d, work, kept)) for d in devices],
            duration_s=self._clock.monotonic() - t0,
        )
        report.freed_bytes = sum(d.freed_bytes for d in report.devices)
        report.residual_bytes = sum(d.residual_bytes for d in report.devices)
        if budget is not None and report.residual_bytes > budget:
            raise ResidualOverBudgetError(
                "memory still held after release exceeds the budget; call rewake to roll back",
                residual_bytes=report.residual_bytes, budget_bytes=budget,
                released=self.released_tags, report=msgspec.to_builtins(report),
            )
        return report

    def _offload(self, work: list[tuple[TagEntry, TagAction]]) -> None:
        """Copy offloaded CUDA blocks to pinned host memory; all or nothing."""
        copied: list[Block] = []
        try:
            for tag, _ in work:
                for block in tag.blocks:
                    if block.device.type == "cpu" or not block.nbytes:
                        continue  # a CPU tensor already is in host memory
                    host = torch.empty(block.nbytes, dtype=torch.uint8, pin_memory=True)
                    host.copy_(block.bytes_view(), non_blocking=True)
                    block.host = host
                    copied.append(block)
            for dev in {b.device for b in copied}:
                measure.synchronize(dev)
        except RuntimeError as exc:
            # policy: out of pinned host memory (or a CUDA error): undo the copies, release
            # nothing, and say so; the caller may retry with level 2
            for block in copied:
                block.host = None
            raise MemoryError_("offload to host memory failed; nothing was released",
                               tag=work[0][0].name if work else None, error=str(exc)) from exc

    # ---------------------------------------------------------------- re-wake

    def rewake(self, tags: Sequence[str] | None = None) -> MemoryReport:
        """Bring released tags back (all of them by default) into the same tensor objects.

        Order: ``weights``, then ``kv_cache``, then other tags in registration order.
        Preserved storages get their bytes back from the host copy or the source file;
        scratch storages come back zero-filled. Then every preserved tensor is checked
        against its release checksum. Raises ``UsageError`` for a tag that is not released,
        ``MemoryError_`` when a tag cannot be refilled (that tag stays released; the ones
        before it are re-woken and are verified by the next ``rewake``), and
        ``VerificationError`` (``details``: ``tag``, ``tensor``, ``expected``, ``got``,
        ``mismatches``) when bytes differ; the tags are re-woken then, and must not be served.
        With nothing released, returns an empty report. In the report, ``freed_bytes`` is
        negative: memory came back.
        """
        with self._lock:
            if tags is None:
                wanted = self.released_tags
            else:
                if isinstance(tags, str):
                    raise UsageError("tags is a list of tag names, not a string", tags=tags)
                wanted = list(dict.fromkeys(tags))
                for tag in wanted:
                    self._known(tag)
                    if tag not in self._released:
                        raise UsageError("tag is not released", tag=tag,
                                         released=self.released_tags)
            return self._rewake(_rewake_order(wanted, list(self._tags)))

    def _rewake(self, order: list[str]) -> MemoryReport:
        t0 = self._clock.monotonic()
        level = self._released_level
        devices = self._devices()
        before = {d: measure.usage(d) for d in devices}
        restored = 0
        for name in order:
            tag, action = self._tags[name], self._released[name]
            try:
                restored += self._refill(tag, action)
            except BaseException as exc:
                # policy: put this tag back to its released state so a retry starts clean;
                # tags re-woken before it keep their pending checksums for the next rewake
                for block in tag.blocks:
                    if not block.stays_in_host_memory(action):
                        block.storage.resize_(0)
                if isinstance(exc, MemoryError_):
                    exc.details.setdefault("tag", name)
                if isinstance(exc, MemoryError_) or not isinstance(exc, Exception):
                    raise
                raise MemoryError_("re-wake failed; the tag stays released", tag=name,
                                   action=action, error=str(exc)) from exc
            del self._released[name]
            for block in tag.blocks:
                block.host = None
        if not self._released:
            self._released_level = None
        for dev in devices:
            measure.synchronize(dev)
        if self.after_refill is not None:
            self.after_refill()
        verified = self._verify()
        after = {d: measure.usage(d) for d in devices}
        report = MemoryReport(
            action=MemoryAction.REWAKE, level=level, tags=order, tensor_bytes=restored,
            devices=[_device_memory(before[d], after[d], "") for d in devices],
            verified_tensors=verified, duration_s=self._clock.monotonic() - t0,
        )
        report.freed_bytes = sum(d.freed_bytes for d in report.devices)
        report.residual_bytes = sum(d.residual_bytes for d in report.devices)
        return report

    def _refill(self, tag: TagEntry, action: TagAction) -> int:
        """Give ``tag``'s storages their bytes back; returns the bytes restored."""
        moved = 0
        for block in tag.blocks:
            if block.stays_in_host_memory(action) or not block.nbytes:
                continue
            block.storage.resize_(block.nbytes)
            moved += block.nbytes
            if action == "offload":
                block.bytes_view().copy_(block.host, non_blocking=True)
            elif action == "discard":
                fill.zero_fresh(block.bytes_view())  # zero-filled: the pages are really back
        if action == "reload":
            for key in [k for k in self._read_checksums if k[0] == tag.name]:
                del self._read_checksums[key]  # a failed earlier attempt's, if any
            self._reload(tag)
        for dev in {b.device for b in tag.blocks if b.host is not None}:
            measure.synchronize(dev)  # the host copies are dropped once this returns
        return moved

    def _reload(self, tag: TagEntry) -> None:
        """Read ``tag``'s tensors back from its source: the CPU ones as one job on every
        thread, each chunk checksummed as it lands (while it is in the CPU's cache), the others
        one by one (checked after the refill, on their device)."""
        pending = self._checksums.get(tag.name, {}) if self.after_refill is None else {}
        items = distinct_windows(tag)
        host = [item for item in items if item.tensor.device.type == "cpu"]
        streams = [ChecksumStream(item.tensor) if item.name in pending else None
                   for item in host]

        def landed(i: int, lo: int, hi: int) -> None:
            if streams[i] is not None:
                streams[i].update(lo, hi)

        with SafetensorsFile(tag.source) as src:
            src.read_many([(item.name, item.tensor) for item in host], on_chunk=landed)
            for item in items:
                if item.tensor.device.type != "cpu":
                    src.read_into(item.name, item.tensor)
        for item, stream in zip(host, streams):
            if stream is not None:
                self._read_checksums[(tag.name, item.name)] = stream.digest()

    def _verify(self) -> int:
        """Check every pending checksum of the re-woken tags (all of them, so nothing stays
        pending after a failure) and raise on any mismatch. Returns the tensors verified."""
        verified = 0
        mismatches: list[tuple[str, str, str, str]] = []
        pending = [t for t in self._checksums if t not in self._released]
        checked: dict[str, dict[str, str]] = {}
        for name in _rewake_order(pending, list(self._tags)):
            tag = self._tags[name]
            checked[name] = self._checksums.pop(name)
            for tensor_name, want in checked[name].items():
                got = self._read_checksums.pop((name, tensor_name), None) \
                    or tensor_checksum(tag.names[tensor_name].tensor)
                if got == want:
                    verified += 1
                else:
                    mismatches.append((name, tensor_name, want, got))
        if mismatches:
            recovery = self._unverified({m[0] for m in mismatches}, checked)
            tag, tensor, want, got = mismatches[0]
            raise VerificationError(
                "re-woken bytes differ from the checksum taken at release", tag=tag,
                tensor=tensor, expected=want, got=got,
                mismatches=[f"{m[0]}/{m[1]}" for m in mismatches], verified_tensors=verified,
                recovery=recovery,
            )
        return verified

    def _unverified(self, names: set[str], checked: dict[str, dict[str, str]]) -> str:
        """After a mismatch, bad bytes must never be served by a later re-wake: each tag that
        failed keeps its checksums pending, and one with a source file is released again for
        a reload from it, so the next ``rewake`` (a recovery) reads good bytes and checks
        them. Returns what that recovery will do."""
        reload = []
        for name in names:
            self._checksums[name] = checked[name]
            tag = self._tags[name]
            if tag.source is not None:
                for block in tag.blocks:
                    if block.nbytes:
                        block.storage.resize_(0)
                self._released[name] = "reload"
                reload.append(name)
            else:  # the bytes stay; the next re-wake only checks them (and fails again)
                self._released[name] = "verify"
        if reload:
            return f"the next re-wake reloads {', '.join(sorted(reload))} from source"
        return "no source file to reload from: the next re-wake fails the same check"

    def flip_bit(self, tag: str = "weights") -> str:
        """Flip the lowest bit of the first byte of ``tag``'s first non-empty tensor (a
        drill's corrupted weight); returns ``tag/tensor``."""
        with self._lock:
            entry = self._known(tag)
            for name, item in entry.names.items():
                t = item.tensor
                if t.numel() and t.untyped_storage().nbytes():
                    view = t.detach().reshape(-1).view(torch.uint8) if t.is_contiguous() \
                        else None
                    if view is None:
                        continue
                    view[0] ^= 1
                    return f"{tag}/{name}"
        raise UsageError("no tensor to corrupt", tag=tag)

    # ---------------------------------------------------------------- helpers

    def _devices(self) -> list[torch.device]:
        """The devices holding registered bytes, CPU first."""
        devs = {b.device for t in self._tags.values() for b in t.blocks if b.nbytes}
        return sorted(devs, key=lambda d: (d.type != "cpu", str(d)))


# -------------------------------------------------------------------- module helpers


def _rewake_order(tags: list[str], registration: list[str]) -> list[str]:
    first = {WEIGHTS: 0, KV_CACHE: 1}
    return sorted(tags, key=lambda t: (first.get(t, 2), registration.index(t)))


def _device_memory(before: measure.Usage, after: measure.Usage, note: str) -> DeviceMemory:
    if after.cuda is not None and before.cuda is not None:
        cuda = (f"allocated {before.cuda.allocated}->{after.cuda.allocated}, device used "
                f"(mem_get_info) {before.cuda.device_used}->{after.cuda.device_used} "
                f"of {after.cuda.total}")
        note = f"{note}; {cuda}" if note else cuda
        what = "torch allocator reserved bytes"
    else:
        what = "process RSS"
    return DeviceMemory(
        device=after.device, before_bytes=before.held, after_bytes=after.held,
        freed_bytes=before.held - after.held, residual_bytes=after.held,
        note=f"{what}; {note}" if note else what,
    )


def _note(device: torch.device, work: list[tuple[TagEntry, TagAction]], kept: int) -> str:
    if device.type == "cpu":
        if not kept:
            return ""
        return (f"{kept} bytes of preserved CPU tensors stay in host memory (counted as "
                f"offloaded, not freed)")
    pinned = sum(b.nbytes for tag, a in work if a == "offload" for b in tag.blocks
                 if b.device == device)
    return f"{pinned} bytes offloaded to pinned host memory" if pinned else ""
