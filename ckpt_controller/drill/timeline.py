"""The drill's timeline picture: one row per engine and cycle, its phases as coloured bars.

Rows are grouped by engine, cycles top to bottom; the x axis is seconds since the cycle's
operation started, so cycles line up and a slow phase stands out. A one-round-trip prepare is
drawn as its two parts, drain (as long as the agent says it drained) then release; what
followed a fault (the recovery of a FAILED engine, the wait for the controller's reconciler,
an engine started again) is drawn hatched in the same row. A row whose cycle had problems
has a red label; a phase that failed has a red edge. When a few rows run far longer than the
rest (a stalled agent waits out its deadline), the axis is broken in two: the left part shows
the usual cycle at its own scale, the right part, at a coarser one, the rest, so one long
stall does not squash every other bar to nothing.

Drawn with matplotlib's Agg canvas, imported inside ``render`` only (the CLI stays light).
``layout`` is the picture as data (rows, bars, where the axis breaks); ``render`` draws it and
returns what it drew, read back from the figure; ``draw`` is what the drill calls.
Neighbours: ``report`` and ``runner`` (the cycle records it draws).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckpt_controller.vocab import HookPoint, OperationKind, OutcomeStatus, PrepareStep, RestoreStep

#: kind of bar -> (legend label, colour), in legend order
KINDS: dict[str, tuple[str, str]] = {
    "hooks": ("hooks", "#9ecae1"),
    "prepare": ("prepare (no drain report to split it by)", "#08519c"),
    "drain": ("drain", "#3182bd"),
    "release": ("release", "#6baed6"),
    "seal": ("seal", "#c6dbef"),
    "capture": ("capture (dump hooks)", "#e6550d"),
    "rewake": ("restore / re-wake", "#31a354"),
    "resume": ("resume", "#74c476"),
    "rollback": ("rollback", "#756bb1"),
    "recovery": ("recovery (restore from FAILED)", "#9e9ac8"),
    "reconcile": ("reconciled by the controller", "#bcbddc"),
    "restart": ("engine started again", "#969696"),
    "other": ("other", "#d9d9d9"),
}
FAILED_LABEL = "failed (red edge)"
#: phase name -> kind; "prepare" (one round trip) is split into drain and release
PHASE_KINDS: dict[str, str] = {
    **{point.value: "hooks" for point in HookPoint},
    PrepareStep.DRAIN: "drain", PrepareStep.RELEASE: "release", PrepareStep.SEAL: "seal",
    OperationKind.CAPTURE: "capture", OperationKind.RESTORE: "rewake",
    RestoreStep.REWAKE: "rewake", RestoreStep.RESUME: "resume",
    OperationKind.ROLLBACK: "rollback", "recover": "recovery", "reconcile": "reconcile",
    OperationKind.PREPARE: "prepare",  # when it cannot be split (it failed before a report)
}
#: aftermath bars (hatched): what the runner records under a cycle's ``aftermath``
AFTERMATH = ("recovery", "reconcile", "restart")
#: the axis breaks when the longest row is this many times the cut (see ``_cut``)
BREAK_RATIO = 2.0
MIN_BAR_PX = 2.0  # a bar is never drawn narrower (a 1 ms seal stays visible)
WIDTH_IN, ROW_IN, DPI = 13.0, 0.27, 100
TITLE = "ckptctl drill: the phases of each cycle, per engine"


@dataclass(frozen=True)
class Bar:
    row: int
    kind: str
    start_s: float  # since the cycle's operation started
    end_s: float
    ok: bool = True


@dataclass
class Layout:
    rows: list[str]  # labels, top to bottom
    bad_rows: list[int]  # rows whose cycle had problems
    bars: list[Bar]
    end_s: float  # the longest row's end
    cut_s: float | None  # where the axis breaks (None: one axis)


@dataclass
class Picture:
    """What ``render`` drew, read back from the figure."""

    path: Path
    rows: list[str]
    kinds: list[str]  # the kinds of bar drawn
    legend: list[str]  # the legend's labels as drawn
    cut_s: float | None
    #: each bar's true width in pixels at the left (usual) part's scale
    bar_px: list[float] = field(default_factory=list)
    xlabel: str = ""


def draw(cycles: list[dict], path: Path) -> Path:
    return render(cycles, path).path


def layout(cycles: list[dict]) -> Layout:
    records = sorted(((e["engine"], c, e) for c in cycles for e in c["engines"]),
                     key=lambda r: (r[0], r[1]["cycle"]))
    rows, bad, bars = [], [], []
    for i, (engine, c, e) in enumerate(records):
        # each row its own engine's outcome, and the fault on the engine it struck only
        label = f"{engine}  #{c['cycle']}  {e.get('status') or c['status']}"
        struck = c.get("fault") and c.get("fault_engine", engine) == engine
        rows.append(label + (f"  {c['fault']}" if struck else ""))
        if _row_bad(engine, c, e, struck):
            bad.append(i)
        bars += _phase_bars(i, c["wall"], e)
        bars += [Bar(i, a["kind"] if a["kind"] in AFTERMATH else "other",
                     a["wall"] - c["wall"], a["wall"] - c["wall"] + a["duration_s"])
                 for a in c.get("aftermath", []) if a.get("engine") == engine]
    ends = [max((b.end_s for b in bars if b.row == i), default=0.0) for i in range(len(rows))]
    end = max(ends + [1e-3])
    return Layout(rows, bad, bars, end, _cut(ends, end))


def _row_bad(engine: str, cycle: dict, e: dict, struck: bool) -> bool:
    """Whether a row's label is red (its cycle had problems, and they are its engine's): its
    engine did not succeed, a problem names it, or a fault struck it; a problem that names
    no engine reds every row of its cycle."""
    if cycle.get("ok", True):
        return False
    problems = cycle.get("problems", [])
    named = [p for p in problems if any(p.startswith(f"{x['engine']}:") or
                                        p.startswith(f"{x['engine']} ") for x in cycle["engines"])]
    return (e.get("status") not in (None, OutcomeStatus.SUCCEEDED) or bool(struck)
            or any(p.startswith((f"{engine}:", f"{engine} ")) for p in named)
            or len(named) < len(problems))


def _phase_bars(row: int, wall: float, engine: dict) -> list[Bar]:
    out = []
    drain_s = (engine.get("drain") or {}).get("drain_s") or 0.0
    for ph in engine["phases"]:
        start = ph["wall"] - wall
        end = start + ph["duration_s"]
        if ph["name"] == OperationKind.PREPARE and 0 < drain_s:
            split = min(end, start + drain_s)
            out.append(Bar(row, "drain", start, split, ph["ok"]))
            if end > split:  # a drain that ran out the phase (stalled) released nothing
                out.append(Bar(row, "release", split, end, ph["ok"]))
        else:
            out.append(Bar(row, PHASE_KINDS.get(ph["name"], "other"), start, end, ph["ok"]))
    return out


def _cut(ends: list[float], end: float) -> float | None:
    """Where the axis breaks: a little past most rows' end (the upper quartile), when the
    longest row runs ``BREAK_RATIO`` times that or more; else nowhere."""
    if len(ends) < 2:
        return None
    cut = sorted(ends)[int(0.75 * (len(ends) - 1))] * 1.15
    return cut if cut > 0 and end >= BREAK_RATIO * cut else None


def render(cycles: list[dict], path: Path) -> Picture:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lay = layout(cycles)
    n = max(len(lay.rows), 1)
    fig = Figure(figsize=(WIDTH_IN, 1.9 + ROW_IN * n), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes, spans = _axes(fig, lay)
    # the minimum width in seconds, from about how wide each part will be (the layout places
    # the axes only when the figure is drawn, and drawing it twice costs seconds)
    plot_px = WIDTH_IN * DPI * 0.72
    shares = [1.0] if len(axes) == 1 else [0.8, 0.2]
    for ax, (lo, hi), share in zip(axes, spans, shares):
        _bars(ax, lay.bars, lo, MIN_BAR_PX * (hi - lo) / (plot_px * share))
    ax0 = axes[0]
    ax0.set_ylim(n - 0.5, -0.5)  # the first row on top
    ax0.set_yticks(range(len(lay.rows)), lay.rows, fontsize=9)
    for i in lay.bad_rows:
        ax0.get_yticklabels()[i].set_color("#cc0000")
    xlabel = "seconds since the cycle's operation started"
    if lay.cut_s is not None:
        xlabel += f" (axis broken at {lay.cut_s:.2g} s: to the right, a coarser scale)"
    fig.supxlabel(xlabel, fontsize=10)
    kinds = [k for k in KINDS if any(b.kind == k for b in lay.bars)]
    legend = _legend(fig, kinds, failed=any(not b.ok for b in lay.bars))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    px_per_s = ax0.bbox.width / (spans[0][1] - spans[0][0])  # as laid out and drawn
    return Picture(path=path, rows=[t.get_text() for t in ax0.get_yticklabels()], kinds=kinds,
                   legend=[t.get_text() for t in legend.get_texts()],
                   cut_s=lay.cut_s, xlabel=xlabel,
                   bar_px=[(b.end_s - b.start_s) * px_per_s for b in lay.bars])


def _axes(fig, lay: Layout) -> tuple[list, list[tuple[float, float]]]:
    """One axis, or the two parts of a broken one (the second a fifth as wide); each with
    round ticks in seconds and a light grid."""
    from matplotlib.ticker import MaxNLocator

    if lay.cut_s is None:
        axes = [fig.add_subplot()]
        spans = [(0.0, lay.end_s * 1.02)]
    else:
        grid = fig.add_gridspec(1, 2, width_ratios=[4, 1], wspace=0.02)
        axes = [fig.add_subplot(grid[0])]
        axes.append(fig.add_subplot(grid[1], sharey=axes[0]))
        spans = [(0.0, lay.cut_s), (lay.cut_s, lay.end_s * 1.02)]
        _mark_break(axes)
    for ax, (lo, hi) in zip(axes, spans):
        ax.set_xlim(lo, hi)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=10 if ax is axes[0] else 3,
                                               steps=[1, 2, 2.5, 5, 10]))
        ax.ticklabel_format(axis="x", useOffset=False, style="plain")
        ax.grid(axis="x", color="#e0e0e0", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.tick_params(labelsize=9)
    return axes, spans


def _legend(fig, kinds: list[str], failed: bool):
    """A legend entry for each kind of bar drawn (and the red edge, when a phase failed),
    headed by the title (a suptitle and an outside legend overlap in this layout)."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=KINDS[k][1], edgecolor="#555555" if k in AFTERMATH else None,
                     linewidth=0, hatch="///" if k in AFTERMATH else None, label=KINDS[k][0])
               for k in kinds]
    if failed:
        handles.append(Patch(facecolor="white", edgecolor="#cc0000", linewidth=1.4,
                             label=FAILED_LABEL))
    ncols = len(handles) if len(handles) <= 6 else -(-len(handles) // 2)  # two full rows
    return fig.legend(handles=handles, loc="outside upper center", ncols=max(1, ncols),
                      fontsize=9, frameon=False, title=TITLE, title_fontsize=12)


def _bars(ax, bars: list[Bar], lo: float, min_width_s: float) -> None:
    """The bars that reach past ``lo`` (where this part of the axis starts), none narrower
    than ``min_width_s``; one collection of rectangles per kind of bar and outcome (a few
    artists, not one per bar: a 60-cycle drill draws a thousand bars)."""
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    groups: dict[tuple[str, bool], list] = {}
    for b in bars:
        if b.end_s <= lo:
            continue
        start = max(b.start_s, lo)
        width = max(b.end_s - start, min_width_s)
        groups.setdefault((b.kind, b.ok), []).append(
            Rectangle((start, b.row - 0.36), width, 0.72))
    for (kind, ok), rects in groups.items():
        colour, hatched = KINDS[kind][1], kind in AFTERMATH
        # the edge colour is the hatch's too: dark where hatched, the edge itself unseen
        ax.add_collection(PatchCollection(
            rects, facecolor=colour,
            edgecolor="#cc0000" if not ok else "#555555" if hatched else colour,
            linewidth=0.0 if ok else 1.4, hatch="///" if hatched else None))


def _mark_break(axes) -> None:
    """The two parts of a broken axis: no spine between them, and a pair of slashes on each
    side of the gap."""
    left, right = axes
    left.spines["right"].set_visible(False)
    right.spines["left"].set_visible(False)
    right.tick_params(axis="y", left=False, labelleft=False)
    marks = dict(marker=[(-1, -1.5), (1, 1.5)], markersize=10, linestyle="none", color="k",
                 mec="k", mew=1, clip_on=False)
    left.plot([1, 1], [0, 1], transform=left.transAxes, **marks)
    right.plot([0, 0], [0, 1], transform=right.transAxes, **marks)
