"""The drill's timeline picture: one row per engine and cycle, its phases as coloured bars.

Rows are grouped by engine, cycles top to bottom; the x axis is milliseconds since the
cycle's operation started, so cycles line up and a slow phase stands out. A cycle with a
fault is labelled with it; a cycle with problems is marked in red. Drawn with Pillow.
Neighbours: ``report`` (the records it draws).
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

COLOURS = {
    "pre-prepare": (158, 202, 225), "prepare": (49, 130, 189), "drain": (49, 130, 189),
    "post-drain": (158, 202, 225), "release": (107, 174, 214), "post-release": (158, 202, 225),
    "seal": (198, 219, 239), "capture": (230, 85, 13), "pre-restore": (253, 174, 107),
    "restore": (49, 163, 84), "rewake": (49, 163, 84), "post-restore": (161, 217, 155),
    "resume": (116, 196, 118), "rollback": (117, 107, 177), "recover": (158, 154, 200),
    "reconcile": (158, 154, 200),
}
OTHER = (150, 150, 150)
LABEL_W, ROW_H, BAR_H, PLOT_W, TOP, BOTTOM = 330, 18, 12, 900, 56, 40


def draw(cycles: list[dict], path: Path) -> Path:
    rows = [(e["engine"], c, e) for c in cycles for e in c["engines"]]
    rows.sort(key=lambda r: (r[0], r[1]["cycle"]))
    font = ImageFont.load_default()
    span = max([_end_ms(c, e) for _, c, e in rows] + [1.0])
    scale = PLOT_W / span
    height = TOP + ROW_H * max(len(rows), 1) + BOTTOM
    img = Image.new("RGB", (LABEL_W + PLOT_W + 20, height), "white")
    d = ImageDraw.Draw(img)
    d.text((8, 6), "ckptctl drill: phases of each cycle (ms since the operation started)",
           fill="black", font=font)
    x = 8
    for name in ("prepare", "release", "capture", "restore", "rollback", "pre-restore",
                 "post-restore", "recover"):
        d.rectangle([x, 26, x + 10, 36], fill=COLOURS[name])
        d.text((x + 14, 25), name, fill="black", font=font)
        x += 18 + int(d.textlength(name, font=font)) + 10
    for i, (engine, c, e) in enumerate(rows):
        y = TOP + i * ROW_H
        label = f"{engine}  #{c['cycle']}  {c['status']}"
        if c["fault"]:
            label += f"  {c['fault']}"
        d.text((8, y + 2), label, fill="black" if c["ok"] else (200, 0, 0), font=font)
        if not c["ok"]:
            d.rectangle([LABEL_W - 8, y + 3, LABEL_W - 3, y + 3 + BAR_H], fill=(200, 0, 0))
        for ph in e["phases"]:
            x0 = LABEL_W + (ph["wall"] - c["wall"]) * 1000 * scale
            x1 = x0 + max(1.0, ph["duration_s"] * 1000 * scale)
            d.rectangle([x0, y + 3, x1, y + 3 + BAR_H], fill=COLOURS.get(ph["name"], OTHER),
                        outline=None if ph["ok"] else (200, 0, 0))
    axis_y = TOP + ROW_H * max(len(rows), 1) + 4
    d.line([LABEL_W, axis_y, LABEL_W + PLOT_W, axis_y], fill="black")
    for k in range(6):
        ms = span * k / 5
        tx = LABEL_W + ms * scale
        d.line([tx, axis_y, tx, axis_y + 4], fill="black")
        d.text((tx - 10, axis_y + 8), f"{ms:.0f}", fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, "PNG")
    return path


def _end_ms(cycle: dict, engine: dict) -> float:
    ends = [(ph["wall"] - cycle["wall"] + ph["duration_s"]) * 1000 for ph in engine["phases"]]
    return max(ends, default=0.0)
