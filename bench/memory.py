"""Release and re-wake throughput of the memory registry, against this machine's own limits.

For each size (weights 3/4, KV cache 1/4, in 256 MiB tensors) it registers real tensors
(weights with a safetensors source), then in the same run measures:

- the limits, taken while the registry's memory is released (the state a re-wake starts
  from): a torch copy of the same number of bytes into freshly allocated memory (a 1 GiB
  destination allocated per step, so every page is faulted in during the copy, as a re-wake
  must; only the copies are timed, not allocating or freeing) and into already-touched memory
  (one destination reused);
- level 2 release (checksums taken, storages freed) and re-wake (storages back, weights read
  from their source file, KV zero-filled, every weight checked bit-exact), median of REPEAT.

Throughput is bytes re-woken (weights + KV) per second; the ratio to each limit, taken in
each run against the limits measured just before it (median over runs), is the figure of
merit. On CUDA (``--device cuda``) the limits are host-to-device and device-to-host copies
against a pinned-memory copy, and level 1 (offload to pinned host memory) is measured too.
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

from _common import median, parser, table, write

GiB = 1 << 30
TENSOR = 256 << 20


def make(size: int, device: str, source_dir: Path):
    import torch

    from ckpt_controller.memory import MemoryRegistry
    from ckpt_controller.memory.safetensors_io import save_file

    wbytes = size * 3 // 4
    weights = {}
    for i in range(max(1, wbytes // TENSOR)):
        t = torch.empty(TENSOR // 4, dtype=torch.float32, device=device)
        t.uniform_(-1, 1, generator=torch.Generator(device=device).manual_seed(i))
        weights[f"w{i:03d}"] = t
    kv = torch.zeros((size - wbytes) // 4, dtype=torch.float32, device=device)
    source = source_dir / f"weights-{size >> 20}MiB.safetensors"
    save_file(weights, source)
    reg = MemoryRegistry()
    reg.register("weights", weights, source=source)
    reg.register("kv_cache", {"kv": kv})
    return reg, weights, kv, source


def copy_limits(nbytes: int, device: str) -> tuple[float, float]:
    """(fresh, touched) seconds to copy ``nbytes``, 1 GiB at a time, from one touched source
    buffer: into a destination allocated for each chunk (every page faulted in during the
    copy; only the copies are timed) and into one destination reused. Measured while the
    registry's memory is released, so the machine is in the state a re-wake starts from."""
    import torch

    chunk = min(GiB, nbytes)
    src = torch.ones(chunk, dtype=torch.uint8, device=device)
    sizes = [min(chunk, nbytes - off) for off in range(0, nbytes, chunk)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fresh = 0.0
    for n in sizes:
        dst = torch.empty(n, dtype=torch.uint8, device=device)  # fresh pages
        t0 = time.perf_counter()
        dst.copy_(src[:n])
        sync()
        fresh += time.perf_counter() - t0
        del dst
    dst = torch.ones(chunk, dtype=torch.uint8, device=device)  # touched before timing
    t0 = time.perf_counter()
    for n in sizes:
        dst[:n].copy_(src[:n])
    sync()
    touched = time.perf_counter() - t0
    del dst, src
    return fresh, touched


def one_size(size: int, device: str, repeat: int, source_dir: Path) -> dict:
    reg, weights, kv, source = make(size, device, source_dir)
    nbytes = sum(t.nbytes for t in weights.values()) + kv.nbytes
    fresh, touched = [], []
    release_s, rewake_s, reports = [], [], []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        reg.release(level=2)
        release_s.append(time.perf_counter() - t0)
        f, t = copy_limits(nbytes, device)
        fresh.append(f)
        touched.append(t)
        t0 = time.perf_counter()
        report = reg.rewake()
        rewake_s.append(time.perf_counter() - t0)
        reports.append(report)
    source.unlink()
    row = {
        "bytes": nbytes, "weight_bytes": nbytes - kv.nbytes, "kv_bytes": kv.nbytes,
        "fresh_copy_gbps": nbytes / median(fresh) / 1e9,
        "touched_copy_gbps": nbytes / median(touched) / 1e9,
        "release_s": median(release_s), "rewake_s": median(rewake_s),
        "release_gbps": nbytes / median(release_s) / 1e9,
        "rewake_gbps": nbytes / median(rewake_s) / 1e9,
        "verified_tensors": reports[-1].verified_tensors,
        "runs": {"fresh_s": fresh, "touched_s": touched, "release_s": release_s,
                 "rewake_s": rewake_s},
    }
    # each run's re-wake against the limits measured just before it, then the median: the
    # machine's speed drifts between runs, a ratio within one run does not
    row["rewake_vs_fresh"] = median([f / r for f, r in zip(fresh, rewake_s)])
    row["rewake_vs_touched"] = median([t / r for t, r in zip(touched, rewake_s)])
    row["release_vs_touched"] = median([t / r for t, r in zip(touched, release_s)])
    del reg, weights, kv
    gc.collect()
    return row


def main() -> int:
    p = parser("memory", __doc__)
    p.add_argument("--sizes", default="1,2", help="GiB of weights + KV, comma-separated "
                                                  "(default 1,2; the full run: 1,2,4,8)")
    p.add_argument("--repeat", type=int, default=5, help="runs per size (median)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--source-dir", type=Path, default=None,
                   help="where the weights' safetensors files go (default: a temp dir)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    sizes = [int(float(s) * GiB) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.source_dir) as d:
        for size in sizes:
            rows.append(one_size(size, args.device, args.repeat, Path(d)))
    table(f"release / re-wake at level 2 ({args.device}; median of {args.repeat})",
          ["GiB", "fresh copy GB/s", "touched copy GB/s", "release GB/s", "re-wake GB/s",
           "re-wake / fresh", "re-wake / touched"],
          [[r["bytes"] / GiB, r["fresh_copy_gbps"], r["touched_copy_gbps"], r["release_gbps"],
            r["rewake_gbps"], r["rewake_vs_fresh"], r["rewake_vs_touched"]] for r in rows])
    write(args.out, "memory", args, {"device": args.device, "level": 2, "sizes": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
