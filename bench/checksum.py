"""How fast the weight checksum runs on this machine, beside a plain ``torch.sum``.

A level-2 re-wake checksums every weight it reads back, and a release checksums them first
(``ckpt_controller.memory.checksum``). For a size (default 256 MiB of int64 words) this takes
the best of REPEAT runs of ``tensor_checksum`` and of ``torch.sum`` over the same bytes, after
one warm-up each, and prints both as GB/s with their ratio (the checksum makes two reductions
per chunk). It was a test that printed these figures and asserted nothing.
"""

from __future__ import annotations

import time

from _common import parser, table, write

MIB = 1 << 20


def best_of(repeat: int, fn) -> tuple[float, list[float]]:
    fn()  # warm up
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return min(runs), runs


def main() -> int:
    p = parser("checksum", __doc__)
    p.add_argument("--mib", type=int, default=256, help="bytes checksummed, in MiB (default 256)")
    p.add_argument("--repeat", type=int, default=3, help="runs per way (the best counts)")
    args = p.parse_args()
    import torch

    from ckpt_controller.memory import tensor_checksum

    nbytes = args.mib * MIB
    t = torch.randint(-(2**62), 2**62, (nbytes // 8,), dtype=torch.int64)
    check_s, check_runs = best_of(args.repeat, lambda: tensor_checksum(t))
    sum_s, sum_runs = best_of(args.repeat, lambda: t.sum())
    check_gbps, sum_gbps = nbytes / check_s / 1e9, nbytes / sum_s / 1e9
    table(f"checksum of {args.mib} MiB (best of {args.repeat}, "
          f"{torch.get_num_threads()} threads)", ["way", "GB/s", "vs torch.sum"],
          [["tensor_checksum", check_gbps, check_gbps / sum_gbps],
           ["torch.sum", sum_gbps, 1.0]])
    write(args.out, "checksum", args, {
        "bytes": nbytes, "threads": torch.get_num_threads(),
        "checksum": {"gbps": check_gbps, "runs_s": check_runs},
        "sum": {"gbps": sum_gbps, "runs_s": sum_runs}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
