"""Fleet overhead: the same engines cycled by a fleet operation through etcd and by their
node controllers directly, in one run, and the etcd requests each way costs per engine.

One real etcd member (``tests/support/etcd_cluster.py`` starts it, from ``make etcd``); ``--nodes``
node controllers, each a real ``ControllerServer`` alone in its process with a ``[fleet]``
table (its node name, lease_ttl_s 5, publish_interval_s 0.5) and ``--agents`` engines: real
``Agent`` objects with nothing registered, in agent host processes. Once ``fleet status``
sees every node and every engine RUNNING, one direct and one fleet cycle are run untimed
(connections, imports, the coordinator's election), and then ``--repeat`` rounds of:

- direct: every node's controller is asked for ``cycle --all --max-unavailable <agents>``
  at the same moment (one ``ControllerClient`` per node, each from its own thread); its time
  runs until the last of them has answered;
- fleet: ``ckptctl fleet cycle --all --max-unavailable <nodes x agents> --json``, run in
  this process through the CLI's own ``main``, until it returns (the operation ended);
- quiet: nothing, for as long as the fleet cycle took, and at least ``QUIET_MIN_S`` (a
  lease renewal of every node falls within it: a quiet interval shorter than that, after a
  fast cycle, could see no request at all and make the idle rate look nil).

etcd requests are read from the member's own Prometheus metrics (``/metrics``):
``grpc_server_handled_total``, by method, summed over result codes. Each call of the JSON
gateway (what ``fleet/etcd.py`` speaks) moves it by exactly one (checked: Range, Put, Txn,
LeaseGrant, LeaseKeepAlive, LeaseRevoke; a watch counts when its stream ends) and reading
``/metrics`` moves nothing. The counters are read just before and just after each cycle and
after the quiet interval; the nodes publish and renew their leases all the time, so "net"
takes the quiet interval's rate over the cycle's time off ("gross"). The direct cycles use
etcd too (each node-local operation takes its engines' locks in etcd and keeps
``unavailable`` true): their counts are shown beside the fleet's.

Goals (issue 16): at most 6 etcd requests per engine per fleet cycle, net; a fleet cycle of
100 engines at --max-unavailable 100 within 1 s of the direct one (medians; measured at
``--nodes`` x ``--agents`` engines, 100 by default).
Neighbours: ``_hosts`` (agent and controller processes), ``_common`` (tables, JSON).
"""

from __future__ import annotations

import collections
import contextlib
import io
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from _common import ROOT, median, parser, table, write
from _hosts import ControllerHost, Fleet

sys.path.insert(0, str(ROOT / "tests"))
from support import etcd_cluster  # noqa: E402  (the tests' own way of starting a member)

#: issue 16's limits: (key, what, limit, unit)
GOALS = [("requests_per_engine", "etcd requests per engine per fleet cycle, net", 6.0,
          "requests"),
         ("fleet_minus_direct_s", "fleet cycle minus direct cycle (medians)", 1.0, "s")]
#: how long the nodes may take to register and publish every engine RUNNING
READY_S = 120.0
#: one cycle of every engine, direct or fleet, at most
CYCLE_TIMEOUT_S = 300.0
HANDLED = re.compile(r'^grpc_server_handled_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')
LABEL = re.compile(r'(\w+)="([^"]*)"')

#: the shortest quiet interval: more than a third of the nodes' lease TTL (5 s here, renewed
#: when a third has passed) plus a publish round (0.5 s)
QUIET_MIN_S = 2.5


def node_config(d: Path, node: int, names: list[str], etcd_url: str) -> Path:
    """Node ``n<node>``'s TOML: its controller, its ``[fleet]`` table and its engines."""
    engines = "".join(f'[[engine]]\nname = "{n}"\ncontrol = "ipc://{d}/{n}.ctl"\n'
                      for n in names)
    conf = d / f"n{node}.toml"
    conf.write_text(
        f'[controller]\nendpoint = "ipc://{d}/n{node}.sock"\nstate_dir = "{d}/state-n{node}"\n'
        f'heartbeat_interval_s = 1.0\n[defaults]\nlevel = 0\ndrain = "abort"\n'
        f'[fleet]\netcd = ["{etcd_url}"]\nnode = "n{node}"\nlease_ttl_s = 5\n'
        f'publish_interval_s = 0.5\n' + engines)
    return conf


def requests(url: str) -> collections.Counter:
    """etcd's handled gRPC calls so far, by ``Service.Method`` (result codes summed)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: collections.Counter = collections.Counter()
    for line in text.splitlines():
        m = HANDLED.match(line)
        if m:
            labels = dict(LABEL.findall(m["labels"]))
            service = labels["grpc_service"].rsplit(".", 1)[-1]
            out[f"{service}.{labels['grpc_method']}"] += int(float(m["value"]))
    return out


def ckptctl_json(*argv: str) -> tuple[int, dict]:
    """``ckptctl argv --json`` run in this process: its exit code and its document."""
    import json

    from ckpt_controller.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    text = out.getvalue().strip()
    return rc, (json.loads(text) if text else {})


def fleet_ready(url: str, nodes: int, engines: int) -> dict:
    """``fleet status --json`` once it shows ``nodes`` nodes and ``engines`` engines, every
    one reachable and RUNNING; an error after ``READY_S``."""
    deadline = time.monotonic() + READY_S
    while True:
        rc, doc = ckptctl_json("--etcd", url, "fleet", "status", "--json")
        rows = doc.get("engines", [])
        if (rc == 0 and len(doc.get("nodes", [])) == nodes and len(rows) == engines
                and all(r["engine"]["state"] == "running" for r in rows)):
            return doc
        if time.monotonic() > deadline:
            raise RuntimeError(f"the fleet was not ready in {READY_S:.0f} s: "
                               f"{len(doc.get('nodes', []))} node(s), {len(rows)} engine(s), "
                               f"fleet status exit {rc}")
        time.sleep(0.2)  # polling etcd for the nodes' first publications


def direct_cycle(endpoints: list[str], per_node: int) -> float:
    """Every node's controller asked for ``cycle --all`` at once: seconds until the last
    answered."""
    from ckpt_controller.controller.client import ControllerClient
    from ckpt_controller.vocab import OperationStatus

    start = threading.Barrier(len(endpoints) + 1)
    results: list = [None] * len(endpoints)

    def one(i: int) -> None:
        try:  # a client per thread (they are not thread-safe), connected before the start
            with ControllerClient(endpoints[i], timeout_s=CYCLE_TIMEOUT_S) as client:
                client.subscribe()  # heartbeats bound the wait, as the CLI does
                start.wait()
                results[i] = client.cycle(all_engines=True, max_unavailable=per_node,
                                          timeout_s=CYCLE_TIMEOUT_S)
        except Exception as err:  # policy: recorded; the round fails below
            start.abort()  # the others are not held at the start for ever
            results[i] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(endpoints))]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # policy: a thread failed: below
        start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    for ep, r in zip(endpoints, results):
        if isinstance(r, BaseException) or r.status != OperationStatus.SUCCEEDED:
            raise RuntimeError(f"direct cycle on {ep}: {getattr(r, 'error', r)}")
    return took


def fleet_cycle(url: str, engines: int) -> tuple[float, str]:
    """``ckptctl fleet cycle --all --max-unavailable <engines>``: its seconds and op id."""
    t0 = time.perf_counter()
    rc, doc = ckptctl_json("--etcd", url, "fleet", "cycle", "--all", "--max-unavailable",
                           str(engines), "--json")
    took = time.perf_counter() - t0
    op = doc.get("op", {})
    if rc != 0 or op.get("status") != "succeeded" or len(op.get("engines", [])) != engines:
        why = str(doc.get("error") or op.get("error"))
        raise RuntimeError(f"fleet cycle {op.get('op_id')}: exit {rc}, {op.get('status')}: "
                           f"{why[:800]}{' ...' if len(why) > 800 else ''} (--keep DIR "
                           "keeps the nodes' logs)")
    return took, op["op_id"]


def diff(after: collections.Counter, before: collections.Counter) -> dict[str, int]:
    return {k: after[k] - before[k] for k in sorted(after) if after[k] != before[k]}


def one_round(url: str, endpoints: list[str], per_node: int, engines: int) -> dict:
    c0 = requests(url)
    direct_s = direct_cycle(endpoints, per_node)
    c1 = requests(url)
    fleet_s, op_id = fleet_cycle(url, engines)
    c2 = requests(url)
    t0 = time.perf_counter()
    time.sleep(max(fleet_s, QUIET_MIN_S))  # the same nodes, doing only what they always do
    quiet_s = time.perf_counter() - t0
    c3 = requests(url)
    return {"direct_s": direct_s, "fleet_s": fleet_s, "quiet_s": quiet_s, "fleet_op": op_id,
            "direct_requests": diff(c1, c0), "fleet_requests": diff(c2, c1),
            "quiet_requests": diff(c3, c2)}


def per_engine(rounds: list[dict], way: str, engines: int) -> dict:
    """``way``'s etcd requests per engine per cycle, gross and net of the quiet rate: the
    median over the rounds, and by method over all of them."""
    gross, net = [], []
    methods: dict[str, dict[str, float]] = {}
    for r in rounds:
        scale = r[f"{way}_s"] / r["quiet_s"]
        g = sum(r[f"{way}_requests"].values())
        idle = sum(r["quiet_requests"].values()) * scale
        gross.append(g / engines)
        net.append((g - idle) / engines)
        for m in set(r[f"{way}_requests"]) | set(r["quiet_requests"]):
            row = methods.setdefault(m, {"gross": 0.0, "idle": 0.0})
            row["gross"] += r[f"{way}_requests"].get(m, 0) / (engines * len(rounds))
            row["idle"] += r["quiet_requests"].get(m, 0) * scale / (engines * len(rounds))
    for row in methods.values():
        row["net"] = row["gross"] - row["idle"]
    return {"gross_median": median(gross), "net_median": median(net), "gross_runs": gross,
            "net_runs": net, "by_method": dict(sorted(methods.items()))}


def summarize(rounds: list[dict], nodes: int, agents: int) -> dict:
    engines = nodes * agents
    direct = [r["direct_s"] for r in rounds]
    fleet = [r["fleet_s"] for r in rounds]
    out = {"nodes": nodes, "agents_per_node": agents, "engines": engines, "rounds": rounds,
           "direct": {"median_s": median(direct), "min_s": min(direct), "max_s": max(direct),
                      "runs_s": direct},
           "fleet": {"median_s": median(fleet), "min_s": min(fleet), "max_s": max(fleet),
                     "runs_s": fleet},
           "requests": {way: per_engine(rounds, way, engines) for way in ("direct", "fleet")}}
    out["fleet_minus_direct_s"] = out["fleet"]["median_s"] - out["direct"]["median_s"]
    out["fleet_over_direct"] = out["fleet"]["median_s"] / out["direct"]["median_s"]
    size = (f"{engines} engines ({nodes} nodes x {agents}), median of {len(rounds)} "
            f"round{'s' if len(rounds) != 1 else ''}")
    measured = {"requests_per_engine": (out["requests"]["fleet"]["net_median"], size),
                "fleet_minus_direct_s": (out["fleet_minus_direct_s"], size)}
    out["goals"] = [{"goal": key, "what": what, "value": measured[key][0], "limit": limit,
                     "unit": unit, "where": measured[key][1],
                     "met": measured[key][0] <= limit} for key, what, limit, unit in GOALS]
    return out


def measure(args) -> dict:
    if not etcd_cluster.installed():
        raise SystemExit(f"bench/fleet.py: etcd is not installed ({etcd_cluster.ETCD}): "
                         "run `make etcd`")
    n, m = args.nodes, args.agents
    # ipc paths must stay short: a private dir under /tmp, not a long one from $TMPDIR
    with (contextlib.nullcontext(str(args.keep)) if args.keep else
          tempfile.TemporaryDirectory(prefix="ckpt-fleet-", dir="/tmp")) as tmp:
        d = Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        cluster = etcd_cluster.EtcdCluster(d / "etcd", size=1)
        with contextlib.closing(cluster):
            url = cluster.urls[0]
            names = [[f"a{k * m + j}" for j in range(m)] for k in range(n)]
            configs = [node_config(d, k, names[k], url) for k in range(n)]
            fleet = Fleet(d, n * m, args.per_process)
            with contextlib.closing(fleet), contextlib.ExitStack() as stack:
                hosts = ControllerHost.many(configs)
                stack.callback(ControllerHost.close_all, hosts)
                t0 = time.perf_counter()
                fleet_ready(url, n, n * m)
                print(f"{n} nodes, {n * m} engines in etcd after "
                      f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
                endpoints = [h.endpoint for h in hosts]
                direct_cycle(endpoints, m)  # warm: connections, imports
                fleet_cycle(url, n * m)  # warm: the coordinator's election, its first drive
                rounds = []
                for i in range(args.repeat):
                    r = one_round(url, endpoints, m, n * m)
                    rounds.append(r)
                    print(f"round {i + 1}: direct {r['direct_s']:.2f} s, fleet "
                          f"{r['fleet_s']:.2f} s", file=sys.stderr, flush=True)
    return summarize(rounds, n, m)


def print_tables(res: dict) -> None:
    dr, fl = res["direct"], res["fleet"]
    size = (f"{res['engines']} engines: {res['nodes']} nodes x {res['agents_per_node']} "
            f"agents, {len(res['rounds'])} round{'s' if len(res['rounds']) != 1 else ''}")
    table(f"one cycle of every engine, direct vs fleet ({size})",
          ["", "median s", "min s", "max s", "vs direct s", "vs direct"],
          [["direct: each node's controller, all at once", dr["median_s"], dr["min_s"],
            dr["max_s"], 0.0, 1.0],
           ["fleet: ckptctl fleet cycle", fl["median_s"], fl["min_s"], fl["max_s"],
            res["fleet_minus_direct_s"], res["fleet_over_direct"]]])
    rq = res["requests"]
    table("etcd requests per engine per cycle (median over the rounds; net: less the quiet "
          "rate over the cycle's time)", ["", "gross", "net"],
          [[way, rq[way]["gross_median"], rq[way]["net_median"]] for way in ("direct",
                                                                             "fleet")])
    methods = sorted(set(rq["direct"]["by_method"]) | set(rq["fleet"]["by_method"]))
    zero = {"gross": 0.0, "idle": 0.0, "net": 0.0}
    table("etcd requests per engine per cycle, by method (all rounds)",
          ["method", "fleet gross", "quiet", "fleet net", "direct gross", "quiet", "direct net"],
          [[m] + [rq[way]["by_method"].get(m, zero)[k] for way in ("fleet", "direct")
                  for k in ("gross", "idle", "net")] for m in methods])
    table("goals (issue 16), each measured in this run",
          ["goal", "measured", "limit", "unit", "met", "from"],
          [[g["what"], g["value"], g["limit"], g["unit"], "yes" if g["met"] else "NO",
            g["where"]] for g in res["goals"]])


def main() -> int:
    p = parser("fleet", __doc__)
    p.add_argument("--nodes", type=int, default=10, help="node controllers")
    p.add_argument("--agents", type=int, default=10, help="no-op agents per node")
    p.add_argument("--repeat", type=int, default=5, help="rounds of direct, fleet, quiet")
    p.add_argument("--per-process", type=int, default=50, help="agents per host process")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="run in DIR and leave it (the nodes' logs, etcd's); a short path: "
                        "the agents' ipc sockets are made there")
    args = p.parse_args()
    if min(args.nodes, args.agents, args.repeat, args.per_process) < 1:
        p.error("--nodes, --agents, --repeat and --per-process must be at least 1")
    results = measure(args)
    print_tables(results)
    write(args.out, "fleet", args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
