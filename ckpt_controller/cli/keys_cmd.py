"""``ckptctl keys NAME``: a CURVE key pair for a control endpoint or a client.

Neighbours: ``security`` (the key files), ``endpoints`` (name rules), ``cli.common``."""

from __future__ import annotations

import argparse
from pathlib import Path

from ckpt_controller.cli.common import EXIT_CODES
from ckpt_controller.cli.output import emit

EPILOG = """\
Give each agent, the controller and each operator or script its own pair. A server (agent,
controller) gets its NAME.key_secret (--curve-secret-key / curve_secret_key) and a directory
holding the NAME.key public files of the clients it admits (--curve-clients / curve_clients);
a client gets its own NAME.key_secret and the server's NAME.key.

""" + EXIT_CODES


def add_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("keys", help="make a CURVE key pair (NAME.key, NAME.key_secret)",
                        description="Write DIR/NAME.key (public) and DIR/NAME.key_secret "
                                    "(secret, mode 0600) for CURVE-secured TCP endpoints.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("name", metavar="NAME", help="file name stem (letters, digits, . _ -)")
    sp.add_argument("--dir", type=Path, default=Path("."), metavar="DIR",
                    help="where to write the files (default: here)")
    sp.add_argument("--force", action="store_true", help="replace existing files")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ckpt_controller.endpoints import check_name
    from ckpt_controller.security import generate, load

    check_name(args.name)
    public, secret = generate(args.dir, args.name, force=args.force)
    key = load(public, secret=False)[0].decode()
    if args.json:
        emit("keys", public=str(public), secret=str(secret), public_key=key)
    else:
        print(f"public key {key}\n  {public}  (give this to the other side)\n"
              f"  {secret}  (mode 0600; keep it here)")
    return 0
