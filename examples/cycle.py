"""Cycle one engine through a controller with the Python client, and print the outcome.

    CKPT_CONTROLLER=ipc:///run/user/1000/ckpt-controller/controller.sock \
        python examples/cycle.py ENGINE [--drain keep] [--level 2] [--budget 2GiB]

It prints each engine's state (``status``), cycles ENGINE (prepare, capture, restore) with
the keywords given, and prints the outcome: the operation's status, and per engine its
state, its phases with their durations and what its drain and release did. Exit status: 0
when the cycle succeeded, 1 when it failed or rolled back, else the error's own (2 for a bad
value, refused before anything is sent; 4 when the controller is unreachable). docs/client.md
explains it; tests/controller/test_client_api.py runs it against a real controller.
"""

from __future__ import annotations

import argparse
import sys

from ckpt_controller import ControllerClient
from ckpt_controller.errors import CkptError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="cycle one engine and print the outcome")
    parser.add_argument("engine")
    parser.add_argument("--drain", default="keep", help="wait | abort | keep (default keep)")
    parser.add_argument("--level", type=int, default=2, help="0 | 1 | 2 (default 2)")
    parser.add_argument("--budget", default=None, help="e.g. 2GiB (default: none)")
    args = parser.parse_args(argv)
    try:
        with ControllerClient() as client:  # $CKPT_CONTROLLER, else the CLI's default
            for view in client.status().engines:
                state = view.status.state if view.status else "unreachable"
                print(f"{view.engine}: {state}")
            client.subscribe()  # heartbeats bound the wait: a controller that dies is noticed
            result = client.cycle([args.engine], drain=args.drain, level=args.level,
                                  budget=args.budget, drain_timeout=30)
    except CkptError as err:  # policy: a typed error, printed with its documented exit code
        print(f"{err.kind}: {err}", file=sys.stderr)
        return err.exit_code
    print(f"cycle {result.op_id}: {result.status} in {result.duration_s:.3f}s")
    for outcome in result.engines:
        phases = ", ".join(f"{ph.name} {ph.duration_s:.3f}s" for ph in outcome.phases)
        print(f"  {outcome.engine}: {outcome.status}, now {outcome.state} [{phases}]")
        if outcome.drain:
            print(f"    drain {outcome.drain.mode}: {outcome.drain.kept} kept, "
                  f"{outcome.drain.completed} completed")
        if outcome.released:
            print(f"    released {outcome.released.tensor_bytes} bytes at level "
                  f"{outcome.released.level}")
        if outcome.error:
            print(f"    {outcome.error.kind}: {outcome.error.message}")
    return 0 if result.status == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
