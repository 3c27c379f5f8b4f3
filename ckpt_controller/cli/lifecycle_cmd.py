"""``ckptctl lifecycle [--format text|mermaid]``: the lifecycle's diagram, drawn from its one
table (``lifecycle.TRANSITIONS``), so the README and docs/agent.md can show it without keeping
a copy by hand (tests/core/test_lifecycle.py compares them with this output).

Building the parser loads nothing of the lifecycle: ``run`` imports it, and the mermaid form
alone loads transitions' diagrams extension. Neighbours: ``lifecycle`` (the table and its
diagrams), ``cli.common`` (exit codes), ``cli.completion`` (completes the command and its
formats, read from this parser).
"""

from __future__ import annotations

import argparse

from ckpt_controller.cli.common import EXIT_CODES

#: what --format takes: the first is the default
FORMATS = ("text", "mermaid")


def add_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser(
        "lifecycle", help="print the lifecycle's states and triggers as a diagram",
        description="Print the lifecycle's diagram, drawn from the one transition table the\n"
                    "agents move by: every state, every trigger and where it leads.\n"
                    "text: plain text (as in the README); mermaid: a Mermaid stateDiagram-v2\n"
                    "made by the transitions library's diagrams extension (as in\n"
                    "docs/agent.md; GitHub and most Markdown viewers draw it).",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--format", choices=FORMATS, default=FORMATS[0],
                    help="text (default) or mermaid")
    sp.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ckpt_controller import lifecycle

    draw = lifecycle.mermaid_diagram if args.format == "mermaid" else lifecycle.text_diagram
    print(draw(), end="")
    return 0
