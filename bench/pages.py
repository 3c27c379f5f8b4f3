"""How this machine hands out fresh host memory: the floor under every CPU re-wake.

A level-2 re-wake writes into memory that a release gave back to the kernel. How fast that
can go depends on how the pages are faulted in, and on how long ago they were freed. For a
size (default 1 GiB) this measures, median of REPEAT, the time to fill freshly allocated
memory with ones:

- ``4 KiB faults``: a plain torch fill, one page-fault trap per 4 KiB page;
- ``pre-faulted``: each 4 MiB chunk's pages faulted in first with ``MADV_POPULATE_WRITE``
  on every thread, then filled (what ``ckpt_controller.memory.fill`` does in a re-wake);
- ``huge pages``: ``madvise(MADV_HUGEPAGE)`` on the range first, then a plain fill;

each right after the same amount was freed (``hot``) and after an idle wait of ``--idle``
seconds (``idle``). On a VM whose host takes free guest memory back (virtio-balloon free page
reporting), memory left free for a few seconds must be faulted in on the host as well, and
huge-page allocations draw on exactly the free blocks that were reported.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

from _common import median, parser, table, write

GiB = 1 << 30
MADV_HUGEPAGE = 14


def reporting_order() -> int | None:
    """The kernel's free page reporting order (None: no reporting module loaded)."""
    path = Path("/sys/module/page_reporting/parameters/page_reporting_order")
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def fill_once(nbytes: int, how: str) -> float:
    import torch

    from ckpt_controller.memory import fill

    t = torch.empty(nbytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    if how == "pre-faulted":
        fill.in_parts(t.data_ptr(), nbytes, lambda lo, hi, t=t: t[lo:hi].fill_(1))
    else:
        if how == "huge pages":
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            lo = -(-t.data_ptr() // 4096) * 4096
            madvise(lo, (t.data_ptr() + nbytes) // 4096 * 4096 - lo, MADV_HUGEPAGE)
        t.fill_(1)
    elapsed = time.perf_counter() - t0
    del t
    return elapsed


def main() -> int:
    p = parser("pages", __doc__)
    p.add_argument("--gib", type=float, default=1.0, help="size filled each time (default 1)")
    p.add_argument("--repeat", type=int, default=5, help="fills per cell (median)")
    p.add_argument("--idle", type=float, default=3.0,
                   help="seconds the memory stays free before an 'idle' fill (default 3)")
    args = p.parse_args()
    nbytes = int(args.gib * GiB)
    ways = ["4 KiB faults", "pre-faulted", "huge pages"]
    runs: dict[str, dict[str, list[float]]] = {w: {"hot": [], "idle": []} for w in ways}
    for _ in range(args.repeat):
        for way in ways:
            fill_once(nbytes, way)  # frees nbytes just before the hot fill
            runs[way]["hot"].append(fill_once(nbytes, way))
            time.sleep(args.idle)
            runs[way]["idle"].append(fill_once(nbytes, way))
    rows = []
    out = {}
    for way in ways:
        hot, idle = (nbytes / median(runs[way][k]) / 1e9 for k in ("hot", "idle"))
        out[way] = {"hot_gbps": hot, "idle_gbps": idle, "runs_s": runs[way]}
        rows.append([way, hot, idle, idle / hot])
    order = reporting_order()
    table(f"filling {args.gib:g} GiB of fresh memory (median of {args.repeat}; free page "
          f"reporting order: {order if order is not None else 'none'})",
          ["pages", "hot GB/s", f"after {args.idle:g} s idle GB/s", "idle / hot"], rows)
    write(args.out, "pages", args, {"bytes": nbytes, "reporting_order": order, "ways": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
