"""``ckptctl drill``: recovery drills (see ``ckpt_controller.drill``), which load when a drill
runs. Neighbours: ``cli.common``, ``drill.runner``, ``drill.faults``, ``drill.report``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ckpt_controller.cli.common import (
    PREPARE_HELP,
    add_deprecated,
    count,
    positive,
    prepare_flags,
    rate,
    seed,
    word_arg,
)
from ckpt_controller.cli.output import emit
from ckpt_controller.vocab import DrainMode, ReleaseLevel

FAULT_HELP = """\
faults (--faults KIND@WHERE[#CYCLE],...; 'all' = every one, one per cycle):
  kill-engine@drain|release|capture|rewake|resume   the engine dies in that phase
  stall-agent@drain|release|rewake|resume          the agent stops answering (no heartbeats)
  fail-hook@POINT, hang-hook@POINT                 a hook exits 7 / never ends (POINT: pre-prepare,
                                                   post-drain, post-release, dump, post-dump,
                                                   pre-restore, post-restore, post-resume, on-fail)
  kill-controller@preparing|prepared|restoring     kill -9 of the controller in that state
  corrupt-weight@rewake                            a weight bit flips before verification
  residual@release                                 untracked memory over the residual budget
Every fault hits the first engine named; docs/drills.md lists the outcome each must have.

exit codes:
  0  every cycle as documented, nothing lost, outputs identical, no leak
  1  otherwise (see report.json)
  2  usage error
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser(
        "drill", help="N checkpoint cycles under load, with faults; writes a report",
        description="Start a controller and one reference engine per ENGINE name, run "
                    "N full cycles (prepare, capture, restore) under load, inject the "
                    "faults asked for, and check that no request is lost, every completed "
                    "output equals an uninterrupted run, memory does not leak, and every "
                    "fault ends as documented. Writes REPORT/report.json and "
                    "REPORT/timeline.png; logs and the journal stay in REPORT/work.",
        epilog=FAULT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("engines", nargs="+", metavar="ENGINE", help="engine names")
    sp.add_argument("--cycles", type=count, required=True, metavar="N",
                    help="how many cycles")
    sp.add_argument("--report", type=Path, required=True, metavar="DIR",
                    help="where report.json, timeline.png and work/ go")
    sp.add_argument("--rate", type=rate, default=10.0, metavar="RATE",
                    help="requests per second to each engine, as `load --rate` (default 10)")
    sp.add_argument("--duration", type=positive, default=3.0, metavar="S",
                    help="seconds of load per cycle, as `load --duration`; the cycle starts "
                         "half way (default 3)")
    add_deprecated(sp, "--load", "--rate")
    add_deprecated(sp, "--load-seconds", "--duration")
    sp.add_argument("--drain", **word_arg(DrainMode), help=PREPARE_HELP["drain"])
    sp.add_argument("--level", **word_arg(ReleaseLevel), help=PREPARE_HELP["level"])
    sp.add_argument("--faults", default="", metavar="SPEC", help="faults to inject (below)")
    sp.add_argument("--model", default="tiny", help="the engines' model: tiny, small or a "
                                                    "safetensors path (default tiny)")
    sp.add_argument("--capture", action="store_true",
                    help="capture each cycle with the criu-dump hook (needs `make criu`)")
    sp.add_argument("--seed", type=seed, default=0, help="load seed (default 0)")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")
    sp.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ckpt_controller.drill import faults as f
    from ckpt_controller.drill import report, timeline
    from ckpt_controller.drill.runner import Drill, DrillOptions
    from ckpt_controller.endpoints import check_name
    from ckpt_controller.errors import UsageError

    flags = prepare_flags(args, controller=False)  # its controller's [defaults] from these
    args.drain, args.level = flags.drain, flags.level
    for name in args.engines:
        check_name(name)
    if len(set(args.engines)) != len(args.engines):
        raise UsageError("engine names must differ", engines=args.engines)
    spec = f.every_fault() if args.faults == "all" else args.faults
    faults = f.parse_faults(spec, args.cycles)
    say = (lambda text: None) if args.json else (lambda text: print(text, flush=True))
    opts = DrillOptions(engines=args.engines, cycles=args.cycles, report_dir=args.report,
                        rate=args.rate, drain=args.drain, level=args.level, faults=faults,
                        load_s=args.duration, model=args.model, capture=args.capture,
                        seed=args.seed)
    say(f"drill: {len(args.engines)} engine(s), {args.cycles} cycles, {args.rate:g} req/s, "
        f"drain {args.drain}, level {args.level}, {len(faults)} fault(s); report in "
        f"{args.report}")
    start = time.monotonic()
    cycles = Drill(opts, say=say).run()
    options = {"engines": args.engines, "cycles": args.cycles, "rate": args.rate,
               "load_seconds": args.duration, "drain": args.drain, "level": args.level,
               "faults": [{"cycle": x.cycle, "fault": str(x), "expected": x.expected.text}
                          for x in faults], "model": args.model, "capture": args.capture,
               "seed": args.seed}
    rep = report.build(options, cycles, time.monotonic() - start)
    path = report.write(rep, args.report)
    picture = timeline.draw(cycles, args.report / "timeline.png")
    if args.json:
        emit("drill-report", report=rep, report_file=str(path), timeline_file=str(picture))
    else:
        say("\n" + report.describe(rep))
        say(f"\nwrote {path} and {picture}")
    return 0 if rep["summary"]["ok"] else 1
