"""``ckptctl fleet ...``: the fleet in etcd, read (and, later, driven) across node controllers.

``--etcd URL[,URL...]`` (default ``$CKPT_ETCD``) names etcd's members; ``--etcd-ca``,
``--etcd-cert`` and ``--etcd-key`` (``$CKPT_ETCD_CA``, ``$CKPT_ETCD_CERT``,
``$CKPT_ETCD_KEY``) give TLS, ``--etcd-prefix`` (``$CKPT_ETCD_PREFIX``, default ``/ckpt``) the
keys' prefix, as the node controllers' ``[fleet]`` tables do. etcd unavailable: exit 4 at once
(each member is given ``REQUEST_TIMEOUT_S``). Neighbours: ``fleet.registry`` (the view),
``cli.common``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

from ckpt_controller.cli.common import EXIT_CODES, print_json
from ckpt_controller.errors import UsageError

EPILOG = """\
The fleet's node controllers register in etcd when their TOML has a [fleet] table
(docs/fleet.md); this command reads what they published. STATE is the agent's state as its
node last saw it; UNREACHABLE when the node could not reach the agent, and NODE-DOWN (with
the last state known) when the node controller itself is gone (its lease expired). AGE is the
time since the engine entered its state.

""" + EXIT_CODES + """
  (fleet status: 4 also when etcd is unavailable, or an engine is unreachable or its node down)"""


def add_global_args(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--etcd", metavar="URL[,URL...]", default=env("CKPT_ETCD"),
                        help="etcd's client URLs, for `fleet` (default: $CKPT_ETCD)")
    parser.add_argument("--etcd-ca", metavar="FILE", default=env("CKPT_ETCD_CA"),
                        help="CA certificate etcd's certificate is checked against "
                             "(default: $CKPT_ETCD_CA)")
    parser.add_argument("--etcd-cert", metavar="FILE", default=env("CKPT_ETCD_CERT"),
                        help="TLS client certificate for etcd (default: $CKPT_ETCD_CERT)")
    parser.add_argument("--etcd-key", metavar="FILE", default=env("CKPT_ETCD_KEY"),
                        help="its key (default: $CKPT_ETCD_KEY)")
    parser.add_argument("--etcd-prefix", metavar="PREFIX",
                        default=env("CKPT_ETCD_PREFIX") or "/ckpt",
                        help="where the fleet's keys are (default: $CKPT_ETCD_PREFIX, else "
                             "/ckpt)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    fmt = {"epilog": EPILOG, "formatter_class": argparse.RawDescriptionHelpFormatter}
    sp = sub.add_parser("fleet", help="the fleet of node controllers, through etcd", **fmt)
    fsub = sp.add_subparsers(dest="fleet_command", metavar="COMMAND", required=True)
    st = fsub.add_parser("status", help="every node and engine in one table", **fmt)
    st.add_argument("--json", action="store_true",
                    help="one JSON document (docs/fleet.md gives its shape)")
    st.set_defaults(run=_status)


def client(args: argparse.Namespace):
    from ckpt_controller.fleet.etcd import Etcd

    if not args.etcd:
        raise UsageError("no etcd given: --etcd URL or $CKPT_ETCD")
    urls = [u.strip() for u in args.etcd.split(",") if u.strip()]
    files = {}
    for name in ("ca", "cert", "key"):
        value = getattr(args, f"etcd_{name}")
        if value:
            path = Path(value)
            if not path.is_file():
                raise UsageError(f"--etcd-{name}: {path} is not a readable file")
            files[name] = path
    if ("cert" in files) != ("key" in files):
        raise UsageError("--etcd-cert and --etcd-key go together")
    return Etcd(urls, ca_cert=files.get("ca"), cert=files.get("cert"), key=files.get("key"))


def _iso(wall: float | None) -> str | None:
    if wall is None:
        return None
    return datetime.datetime.fromtimestamp(wall, datetime.timezone.utc).isoformat(
        timespec="milliseconds")


def age(seconds: float) -> str:
    """kubectl's way: 45s, 3m12s, 5h4m, 2d3h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def _status(args: argparse.Namespace) -> int:
    from ckpt_controller.fleet import registry
    from ckpt_controller.fleet.keys import Keys

    with client(args) as c:
        view = registry.read(c, Keys(args.etcd_prefix))
    now = time.time()
    healthy = all(r.node_up and r.engine.reachable for r in view.engines)
    if args.json:
        import msgspec

        doc = msgspec.to_builtins(view)
        for row in doc["engines"]:
            rec = row["engine"]
            rec["since_iso"], rec["updated_iso"] = _iso(rec["since"]), _iso(rec["updated"])
            rec["age_s"] = None if rec["since"] is None else round(now - rec["since"], 3)
        for node in doc["nodes"]:
            node["started_iso"] = _iso(node["started"])
        print_json(doc)
        return 0 if healthy else 4
    rows = [("NODE", "NAME", "STATE", "GEN", "HELD-BY", "LAST-OP", "AGE")]
    for r in view.engines:
        e = r.engine
        state = (f"NODE-DOWN ({e.state or 'unknown'})" if not r.node_up
                 else (e.state or "UNKNOWN") if e.reachable else "UNREACHABLE")
        rows.append((e.node, e.engine, state, "-" if e.generation is None else str(e.generation),
                     e.holder or "-", e.last_op or "-",
                     "-" if e.since is None else age(now - e.since)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    up = {n.node for n in view.nodes}
    down = sorted({r.engine.node for r in view.engines} - up)
    print(f"\n{len(view.nodes)} node(s) up" + (f"; down: {', '.join(down)}" if down else "")
          + f"; {len(view.engines)} engine(s)")
    for key, why in view.unreadable.items():
        print(f"ckptctl: unreadable record {key}: {why}", file=sys.stderr)
    return 0 if healthy else 4
