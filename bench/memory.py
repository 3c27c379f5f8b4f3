"""Release and re-wake throughput of the memory registry, against this machine's own limits.

For each size (weights 3/4, KV cache 1/4, in 256 MiB tensors) it registers real tensors
(weights with a safetensors source), then in the same run measures:

- the limits, taken while the registry's memory is released (the state a re-wake starts
  from): a torch copy of the same number of bytes into freshly allocated memory (1 GiB
  destinations, as many as the size needs, allocated one by one and all kept until the end,
  so as much new memory is faulted in during the copy as a re-wake faults in; only the
  copies are timed, not allocating or freeing), then into the same, now touched, memory,
  then (CPU) into new memory whose pages are faulted in ahead, chunk by chunk on every
  thread, as the re-wake itself does: the best fresh-memory copy we know here;
- level 2 release (checksums taken, storages freed) and re-wake (storages back, weights read
  from their source file, KV zero-filled, every weight checked bit-exact), median of REPEAT.

Each run times a release and a re-wake, then releases again and times the limits, then
re-wakes (untimed): the limits and the timed re-wake both start right after a release, and
draw only on the memory it gave back (the copies' source is allocated once, before). The
order matters on a VM whose host takes freed guest memory back (free page reporting):
memory freed a few seconds ago is slow to touch again, memory freed just now is not.

Throughput is bytes re-woken (weights + KV) per second; the ratio to each limit, taken
within each run, then the median over runs, is the figure of merit. ``--device cuda`` runs
the same level-2 measurement on CUDA tensors against device copies.

``--device cuda --level 1`` measures the GPU's own path: release offloads the weights to
pinned host memory (device to host) and discards the KV cache; re-wake copies the weights
back (host to device), zero-fills the KV cache and checks every weight bit-exact. Its limits
are plain copies of the weights' bytes between one device buffer and one pinned host buffer,
allocated and touched before they are timed: device-to-host against the release,
host-to-device against the re-wake. Throughput there is weight bytes moved per second. On the
CPU level 1 moves no weights (they already are in host memory), so it is refused.
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

from _common import median, parser, table, write

GiB = 1 << 30
TENSOR = 256 << 20


def tensors(size: int, device: str):
    """Weights (3/4 of ``size``, in 256 MiB float32 tensors of seeded random values) and a KV
    cache (the rest, zeros) on ``device``."""
    import torch

    wbytes = size * 3 // 4
    weights = {}
    for i in range(max(1, wbytes // TENSOR)):
        t = torch.empty(TENSOR // 4, dtype=torch.float32, device=device)
        t.uniform_(-1, 1, generator=torch.Generator(device=device).manual_seed(i))
        weights[f"w{i:03d}"] = t
    kv = torch.zeros((size - wbytes) // 4, dtype=torch.float32, device=device)
    return weights, kv


def make(size: int, device: str, source_dir: Path):
    from ckpt_controller.memory import MemoryRegistry
    from ckpt_controller.memory.safetensors_io import save_file

    weights, kv = tensors(size, device)
    source = source_dir / f"weights-{size >> 20}MiB.safetensors"
    save_file(weights, source)
    reg = MemoryRegistry()
    reg.register("weights", weights, source=source)
    reg.register("kv_cache", {"kv": kv})
    return reg, weights, kv, source


def fresh_copy(src, nbytes: int, device: str) -> tuple[float, list]:
    """The fresh-copy limit: seconds to copy ``nbytes``, 1 GiB at a time, from ``src`` (a
    touched tensor of at least ``min(1 GiB, nbytes)`` bytes) into destinations allocated for
    it, one by one and all kept, every page faulted in by the copy itself; only the copies are
    timed, not allocating. Returns the seconds and the destinations (the caller drops them,
    or copies into them again, now touched). ``bench/capture.py`` takes it too."""
    import torch

    chunk = min(GiB, nbytes)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fresh = 0.0
    dsts = []
    for n in [min(chunk, nbytes - off) for off in range(0, nbytes, chunk)]:
        dsts.append(torch.empty(n, dtype=torch.uint8, device=device))  # fresh pages
        t0 = time.perf_counter()
        dsts[-1].copy_(src[:n])
        sync()
        fresh += time.perf_counter() - t0
    return fresh, dsts


def copy_limits(src, nbytes: int, device: str) -> tuple[float, float, float | None]:
    """(fresh, touched, prefaulted) seconds to copy ``nbytes``, 1 GiB at a time, from ``src``
    (1 GiB, touched, allocated before the registry's memory was released, so the copies draw
    only on the memory the release gave back, as a re-wake does): into destinations allocated for it, ``nbytes`` in all, every page
    faulted in by the copy itself (only the copies are timed, not allocating); then again
    into the same destinations, now touched; then (CPU) into new destinations, each chunk's
    pages faulted in ahead on every thread as a re-wake does (``fill.in_parts``), the best
    fresh-memory copy we know on this machine. Called while the registry's memory is
    released, so each fresh copy touches as much new memory as a re-wake does."""
    import torch

    from ckpt_controller.memory import fill

    fresh, dsts = fresh_copy(src, nbytes, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sizes = [dst.numel() for dst in dsts]
    t0 = time.perf_counter()
    for dst in dsts:
        dst.copy_(src[:dst.numel()])
    sync()
    touched = time.perf_counter() - t0
    del dsts
    if device != "cpu":
        return fresh, touched, None
    prefaulted = 0.0
    dsts = []
    for n in sizes:
        dst = torch.empty(n, dtype=torch.uint8)
        dsts.append(dst)
        t0 = time.perf_counter()
        fill.in_parts(dst.data_ptr(), n,
                      lambda lo, hi, dst=dst: dst[lo:hi].copy_(src[lo:hi]))
        prefaulted += time.perf_counter() - t0
    del dsts
    return fresh, touched, prefaulted


def one_size(size: int, device: str, repeat: int, source_dir: Path) -> dict:
    reg, weights, kv, source = make(size, device, source_dir)
    nbytes = sum(t.nbytes for t in weights.values()) + kv.nbytes
    import torch

    src = torch.ones(min(GiB, nbytes), dtype=torch.uint8, device=device)
    fresh, touched, prefaulted = [], [], []
    release_s, rewake_s, reports = [], [], []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        reg.release(level=2)
        release_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        report = reg.rewake()
        rewake_s.append(time.perf_counter() - t0)
        reports.append(report)
        # the limits in the state the re-wake started from: right after the registry's
        # memory was given back (fresh memory's speed depends on how long ago it was freed)
        reg.release(level=2)
        f, t, p = copy_limits(src, nbytes, device)
        fresh.append(f)
        touched.append(t)
        prefaulted.append(p)
        reg.rewake()
    source.unlink()
    row = {
        "bytes": nbytes, "weight_bytes": nbytes - kv.nbytes, "kv_bytes": kv.nbytes,
        "fresh_copy_gbps": nbytes / median(fresh) / 1e9,
        "touched_copy_gbps": nbytes / median(touched) / 1e9,
        "release_s": median(release_s), "rewake_s": median(rewake_s),
        "release_gbps": nbytes / median(release_s) / 1e9,
        "rewake_gbps": nbytes / median(rewake_s) / 1e9,
        "verified_tensors": reports[-1].verified_tensors,
        "runs": {"fresh_s": fresh, "touched_s": touched, "prefaulted_s": prefaulted,
                 "release_s": release_s, "rewake_s": rewake_s},
    }
    # each run's re-wake against the limits measured in the same run, then the median: the
    # machine's speed drifts between runs, a ratio within one run does not
    row["rewake_vs_fresh"] = median([f / r for f, r in zip(fresh, rewake_s)])
    if device == "cpu":
        row["prefaulted_copy_gbps"] = nbytes / median(prefaulted) / 1e9
        row["rewake_vs_prefaulted"] = median([p / r for p, r in zip(prefaulted, rewake_s)])
    row["rewake_vs_touched"] = median([t / r for t, r in zip(touched, rewake_s)])
    row["release_vs_touched"] = median([t / r for t, r in zip(touched, release_s)])
    del reg, weights, kv, src
    gc.collect()
    return row


def pinned_limits(nbytes: int, device: str) -> tuple[float, float]:
    """(device-to-host, host-to-device) seconds to copy ``nbytes`` between one touched device
    buffer and one pinned host buffer, allocated before the copies are timed."""
    import torch

    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    d2h = time.perf_counter() - t0
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d = time.perf_counter() - t0
    del host, dev
    torch.cuda.empty_cache()
    return d2h, h2d


def one_size_level1(size: int, device: str, repeat: int) -> dict:
    """Level 1 on a GPU: offload to pinned host memory and back, against pinned copies of the
    weights' bytes measured in the same run (while the registry's memory is released)."""
    import torch

    from ckpt_controller.memory import MemoryRegistry

    weights, kv = tensors(size, device)
    reg = MemoryRegistry()
    reg.register("weights", weights)
    reg.register("kv_cache", {"kv": kv})
    moved = sum(t.nbytes for t in weights.values())
    d2h, h2d, release_s, rewake_s, reports = [], [], [], [], []
    for _ in range(repeat):
        gc.collect()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        released = reg.release(level=1)
        release_s.append(time.perf_counter() - t0)
        a, b = pinned_limits(moved, device)  # the device memory the release gave back
        d2h.append(a)
        h2d.append(b)
        t0 = time.perf_counter()
        report = reg.rewake()
        torch.cuda.synchronize()
        rewake_s.append(time.perf_counter() - t0)
        reports.append((released, report))
    released, report = reports[-1]
    row = {
        "bytes": moved + kv.nbytes, "weight_bytes": moved, "kv_bytes": kv.nbytes,
        "offloaded_bytes": released.offloaded_bytes, "freed_bytes": released.freed_bytes,
        "d2h_pinned_gbps": moved / median(d2h) / 1e9, "h2d_pinned_gbps": moved / median(h2d) / 1e9,
        "release_s": median(release_s), "rewake_s": median(rewake_s),
        "release_gbps": moved / median(release_s) / 1e9,
        "rewake_gbps": moved / median(rewake_s) / 1e9,
        "release_vs_d2h": median([a / r for a, r in zip(d2h, release_s)]),
        "rewake_vs_h2d": median([b / r for b, r in zip(h2d, rewake_s)]),
        "verified_tensors": report.verified_tensors,
        "runs": {"d2h_s": d2h, "h2d_s": h2d, "release_s": release_s, "rewake_s": rewake_s},
    }
    del reg, weights, kv
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    p = parser("memory", __doc__)
    p.add_argument("--sizes", default="1,2", help="GiB of weights + KV, comma-separated "
                                                  "(default 1,2; the full run: 1,2,4,8)")
    p.add_argument("--repeat", type=int, default=5, help="runs per size (median)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--level", type=int, default=2, choices=[1, 2],
                   help="2 (default): discard and reload from file; 1 (cuda only): offload "
                        "to pinned host memory, against pinned copies")
    p.add_argument("--source-dir", type=Path, default=None,
                   help="where the weights' safetensors files go (default: a temp dir)")
    args = p.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA device, and torch sees none here")
    if args.level == 1 and args.device != "cuda":
        p.error("--level 1 moves weights only on a GPU (on the CPU they already are in host "
                "memory); use it with --device cuda")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sizes = [int(float(s) * GiB) for s in args.sizes.split(",")]
    if args.level == 1:
        rows = [one_size_level1(size, args.device, args.repeat) for size in sizes]
        table(f"release / re-wake at level 1 ({args.device}; weight bytes moved; median of "
              f"{args.repeat})",
              ["GiB", "pinned D2H GB/s", "release GB/s", "release / D2H", "pinned H2D GB/s",
               "re-wake GB/s", "re-wake / H2D"],
              [[r["bytes"] / GiB, r["d2h_pinned_gbps"], r["release_gbps"], r["release_vs_d2h"],
                r["h2d_pinned_gbps"], r["rewake_gbps"], r["rewake_vs_h2d"]] for r in rows])
        write(args.out, "memory", args, {"device": args.device, "level": 1, "sizes": rows})
        return 0
    rows = []
    with tempfile.TemporaryDirectory(dir=args.source_dir) as d:
        for size in sizes:
            rows.append(one_size(size, args.device, args.repeat, Path(d)))
    cpu = args.device == "cpu"
    table(f"release / re-wake at level 2 ({args.device}; median of {args.repeat})",
          ["GiB", "fresh copy GB/s"] + (["pre-faulted fresh copy GB/s"] if cpu else [])
          + ["touched copy GB/s", "release GB/s", "re-wake GB/s", "re-wake / fresh"]
          + (["re-wake / pre-faulted"] if cpu else []) + ["re-wake / touched"],
          [[r["bytes"] / GiB, r["fresh_copy_gbps"]]
           + ([r["prefaulted_copy_gbps"]] if cpu else [])
           + [r["touched_copy_gbps"], r["release_gbps"], r["rewake_gbps"], r["rewake_vs_fresh"]]
           + ([r["rewake_vs_prefaulted"]] if cpu else []) + [r["rewake_vs_touched"]]
           for r in rows])
    write(args.out, "memory", args, {"device": args.device, "level": 2, "sizes": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
