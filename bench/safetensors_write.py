"""Write speed of ``safetensors_io.save_file`` against a plain write of the same bytes.

One file of ``--mib`` MiB (default 256) in ``--tensors`` float32 tensors of seeded random
values, written ``--repeat`` times by ``save_file`` (header, tensor bytes, fsync, rename), each
run followed by the limit: the same bytes from the same tensors written with one ``write`` per
tensor and an fsync into a new file in the same folder. Runs alternate, so the disk's and the
machine's moods fall on both; the figure of merit is the median of each run's ratio.
Files go to ``--dir`` (default: a temporary folder on the disk under ``bench/results``, not
``/tmp``, which may be memory).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from _common import RESULTS, median, parser, table, write

MiB = 1 << 20


def tensors(nbytes: int, count: int) -> dict:
    import torch

    each = nbytes // count // 4
    return {f"w{i:02d}": torch.empty(each, dtype=torch.float32).uniform_(
        -1, 1, generator=torch.Generator().manual_seed(i)) for i in range(count)}


def save(weights: dict, path: Path) -> float:
    from ckpt_controller.memory.safetensors_io import save_file

    t0 = time.perf_counter()
    save_file(weights, path)
    return time.perf_counter() - t0


def limit(weights: dict, path: Path) -> float:
    from ckpt_controller.memory.safetensors_io import host_buffer

    t0 = time.perf_counter()
    with open(path, "wb") as out:
        for t in weights.values():
            out.write(host_buffer(t))
        out.flush()
        os.fsync(out.fileno())
    return time.perf_counter() - t0


def main() -> int:
    p = parser("safetensors_write", __doc__)
    p.add_argument("--mib", type=int, default=256, help="file size in MiB (default 256)")
    p.add_argument("--tensors", type=int, default=4, help="tensors in the file (default 4)")
    p.add_argument("--repeat", type=int, default=5, help="runs (median; default 5)")
    p.add_argument("--dir", type=Path, default=None, help="where the files go")
    args = p.parse_args()
    weights = tensors(args.mib * MiB, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    where = args.dir or RESULTS
    where.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[float]] = {"save_file_s": [], "plain_write_s": []}
    with tempfile.TemporaryDirectory(dir=where, prefix=".bench-") as d:
        for i in range(args.repeat):
            runs["save_file_s"].append(save(weights, Path(d) / f"s{i}.safetensors"))
            runs["plain_write_s"].append(limit(weights, Path(d) / f"p{i}.bin"))
            for f in Path(d).iterdir():
                f.unlink()
    ratios = [p_ / s for s, p_ in zip(runs["save_file_s"], runs["plain_write_s"])]
    row = {"bytes": nbytes, "tensors": args.tensors, "runs": runs,
           "save_file_gbps": nbytes / median(runs["save_file_s"]) / 1e9,
           "plain_write_gbps": nbytes / median(runs["plain_write_s"]) / 1e9,
           "save_file_vs_plain_write": median(ratios)}
    table(f"safetensors write, {nbytes / MiB:.0f} MiB in {args.tensors} tensors "
          f"(median of {args.repeat})",
          ["MiB", "save_file GB/s", "plain write GB/s", "save_file / plain write"],
          [[nbytes / MiB, row["save_file_gbps"], row["plain_write_gbps"],
            row["save_file_vs_plain_write"]]])
    write(args.out, "safetensors_write", args, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
