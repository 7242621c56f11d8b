"""Charts drawn on the server as SVG: the lineage tree, line charts with interval whiskers, a confusion matrix,
the accuracy matrix (a heat map).

Written by hand rather than with a plotting library: the pages must work offline with no script, and an
SVG of a few dozen elements is less code than adapting matplotlib's output to a strict Content-Security-
Policy (no inline styles). Every text that reaches a chart goes through ``markupsafe.escape``; the result
is ``Markup`` so that templates embed it as is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

__all__ = ["LinePoint", "Series", "confusion_svg", "line_chart_svg", "lineage_svg", "matrix_svg"]

STATUS_FILL = {
    "promoted": "#1a7f37",
    "retired": "#8c959f",
    "rejected": "#cf222e",
    "failed": "#6e2b2b",
    "candidate": "#bf8700",
    "training": "#bf8700",
    "evaluating": "#bf8700",
}
PALETTE = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#1b7c83", "#d1242f", "#57606a")


def _f(value: float) -> str:
    return f"{value:.1f}"


def lineage_svg(nodes: Sequence[Mapping], *, link: str = "/generations/{number}") -> Markup:
    """The generation tree: one box per generation (status colour, overall held-out score, method), an edge
    from each parent, the champion outlined; each box links to its generation page.

    ``nodes``: dicts with ``number``, ``parent`` (number or None), ``status``, ``overall`` (or None),
    ``method`` (a short label) and ``champion`` (bool)."""
    if not nodes:
        return Markup('<svg class="chart" viewBox="0 0 10 10" role="img" aria-label="no generations"></svg>')
    by_number = {n["number"]: n for n in nodes}
    children: dict[int | None, list[int]] = {}
    for n in sorted(nodes, key=lambda n: n["number"]):
        parent = n["parent"] if n["parent"] in by_number else None
        children.setdefault(parent, []).append(n["number"])
    # Top to bottom by depth (one level per promotion); a champion's attempts side by side, the first
    # child under its parent. Iterative post-order: a lineage may be hundreds of generations deep.
    depth: dict[int, int] = {}
    column: dict[int, int] = {}
    leaves = 0
    stack: list[tuple[int, int, bool]] = [(r, 0, False) for r in reversed(children.get(None, []))]
    while stack:
        number, d, seen = stack.pop()
        kids = children.get(number, [])
        if seen:
            column[number] = column[kids[0]]
            continue
        depth[number] = d
        if not kids:
            column[number], leaves = leaves, leaves + 1
            continue
        stack.append((number, d, True))
        stack.extend((k, d + 1, False) for k in reversed(kids))
    w, h, gx, gy, pad = 132, 56, 18, 30, 12
    cols = max(column.values()) + 1
    rows = max(depth.values()) + 1
    width, height = pad * 2 + cols * w + (cols - 1) * gx, pad * 2 + rows * h + (rows - 1) * gy

    def xy(number: int) -> tuple[float, float]:
        return pad + column[number] * (w + gx), pad + depth[number] * (h + gy)

    parts = [
        f'<svg class="chart lineage" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        'role="img" aria-label="lineage tree" xmlns="http://www.w3.org/2000/svg">'
    ]
    for n in nodes:
        parent = n["parent"]
        if parent in by_number and n["number"] in depth:
            (x0, y0), (x1, y1) = xy(parent), xy(n["number"])
            parts.append(
                f'<path d="M{_f(x0 + w / 2)},{_f(y0 + h)} C{_f(x0 + w / 2)},{_f(y0 + h + gy / 2)} '
                f'{_f(x1 + w / 2)},{_f(y1 - gy / 2)} {_f(x1 + w / 2)},{_f(y1)}" fill="none" stroke="#8c959f" '
                'stroke-width="1.5"/>'
            )
    for n in sorted(nodes, key=lambda n: n["number"]):
        if n["number"] not in depth:
            continue
        x, y = xy(n["number"])
        fill = STATUS_FILL.get(str(n["status"]), "#57606a")
        score = "–" if n.get("overall") is None else f"{n['overall']:.3f}"
        href = escape(link.format(number=n["number"]))
        outline = ' stroke="#000" stroke-width="3"' if n.get("champion") else ' stroke="none"'
        parts.append(
            f'<a href="{href}" class="node" data-generation="{int(n["number"])}">'
            f'<rect x="{_f(x)}" y="{_f(y)}" width="{w}" height="{h}" rx="6" fill="{fill}"{outline}/>'
            f'<text x="{_f(x + 8)}" y="{_f(y + 18)}" fill="#fff" font-size="13" font-weight="bold">'
            f"gen {int(n['number'])}{' ★' if n.get('champion') else ''}</text>"
            f'<text x="{_f(x + 8)}" y="{_f(y + 34)}" fill="#fff" font-size="12">{escape(n["status"])} · '
            f"{escape(score)}</text>"
            f'<text x="{_f(x + 8)}" y="{_f(y + 49)}" fill="#fff" font-size="11">'
            f"{escape(str(n.get('method') or '')[:24])}</text>"
            "</a>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))


@dataclass(frozen=True)
class LinePoint:
    x: float
    y: float
    low: float | None = None  # an interval's ends, drawn as a whisker
    high: float | None = None
    label: str = ""


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[LinePoint]


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    out, v = [], start
    while v <= hi + step * 1e-9:
        out.append(round(v, 10))
        v += step
    return out


def line_chart_svg(
    series: Sequence[Series],
    *,
    title: str,
    x_label: str,
    y_label: str,
    width: int = 640,
    height: int = 280,
    y_range: tuple[float, float] | None = None,
) -> Markup:
    """Lines with markers (and whiskers where a point has an interval), axes with ticks, and a legend."""
    points = [p for s in series for p in s.points]
    if not points:
        return Markup(f'<p class="empty">{escape(title)}: nothing recorded yet.</p>')
    left, right, top, bottom = 52, 130, 28, 40
    xs = [p.x for p in points]
    ys = [v for p in points for v in (p.y, p.low, p.high) if v is not None]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = y_range or (min(ys), max(ys))
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    margin = (y1 - y0) * 0.05
    y0, y1 = (y0, y1) if y_range else (y0 - margin, y1 + margin)
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="{left}" y="16" font-size="13" font-weight="bold">{escape(title)}</text>',
        f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="#57606a"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="#57606a"/>',
    ]
    for t in _ticks(y0, y1):
        parts.append(
            f'<line x1="{left - 4}" y1="{_f(sy(t))}" x2="{left + pw}" y2="{_f(sy(t))}" stroke="#d0d7de" '
            f'stroke-width="0.5"/><text x="{left - 6}" y="{_f(sy(t) + 4)}" font-size="10" '
            f'text-anchor="end">{t:g}</text>'
        )
    integer_x = all(float(x).is_integer() for x in xs)
    for t in _ticks(x0, x1, 8):
        if integer_x and not float(t).is_integer():
            continue
        parts.append(
            f'<text x="{_f(sx(t))}" y="{top + ph + 14}" font-size="10" text-anchor="middle">{t:g}</text>'
        )
    parts.append(
        f'<text x="{left + pw / 2}" y="{height - 6}" font-size="11" text-anchor="middle">{escape(x_label)}</text>'
        f'<text x="12" y="{top + ph / 2}" font-size="11" text-anchor="middle" '
        f'transform="rotate(-90 12 {top + ph / 2})">{escape(y_label)}</text>'
    )
    for i, s in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        pts = sorted(s.points, key=lambda p: p.x)
        if len(pts) > 1:
            path = " ".join(f"{'M' if j == 0 else 'L'}{_f(sx(p.x))},{_f(sy(p.y))}" for j, p in enumerate(pts))
            parts.append(f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="1.8"/>')
        for p in pts:
            if p.low is not None and p.high is not None:
                cx = sx(p.x)
                parts.append(
                    f'<line x1="{_f(cx)}" y1="{_f(sy(p.low))}" x2="{_f(cx)}" y2="{_f(sy(p.high))}" '
                    f'stroke="{colour}" stroke-width="1"/>'
                    f'<line x1="{_f(cx - 3)}" y1="{_f(sy(p.low))}" x2="{_f(cx + 3)}" y2="{_f(sy(p.low))}" '
                    f'stroke="{colour}"/><line x1="{_f(cx - 3)}" y1="{_f(sy(p.high))}" x2="{_f(cx + 3)}" '
                    f'y2="{_f(sy(p.high))}" stroke="{colour}"/>'
                )
            if len(pts) <= 60:
                tip = escape(p.label or f"{s.name} {p.x:g}: {p.y:.3f}")
                parts.append(
                    f'<circle cx="{_f(sx(p.x))}" cy="{_f(sy(p.y))}" r="2.8" fill="{colour}"><title>{tip}</title>'
                    "</circle>"
                )
        ly = top + 14 * i
        parts.append(
            f'<rect x="{left + pw + 12}" y="{ly}" width="10" height="10" fill="{colour}"/>'
            f'<text x="{left + pw + 26}" y="{ly + 9}" font-size="11">{escape(s.name)}</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def confusion_svg(confusion: Mapping[str, Mapping[str, int]], *, title: str = "router confusion") -> Markup:
    """A confusion matrix (rows: expected specialist, columns: routed to) as shaded cells with counts."""
    labels = sorted(set(confusion) | {c for row in confusion.values() for c in row})
    if not labels:
        return Markup(f'<p class="empty">{escape(title)}: no routing suite.</p>')
    cell, left, top = 44, 90, 80
    size = len(labels) * cell
    peak = max([v for row in confusion.values() for v in row.values()] or [1]) or 1
    width, height = left + size + 10, top + size + 10
    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="4" y="14" font-size="12" font-weight="bold">{escape(title)}</text>',
        f'<text x="{left}" y="30" font-size="10">routed to →</text>',
        f'<text x="4" y="{top - 6}" font-size="10">expected ↓</text>',
    ]
    for j, lab in enumerate(labels):
        x = left + j * cell + cell / 2
        parts.append(
            f'<text x="{_f(x)}" y="{top - 8}" font-size="10" text-anchor="start" '
            f'transform="rotate(-40 {_f(x)} {top - 8})">{escape(lab)}</text>'
        )
    for i, expected in enumerate(labels):
        y = top + i * cell
        parts.append(
            f'<text x="{left - 6}" y="{_f(y + cell / 2 + 4)}" font-size="10" text-anchor="end">'
            f"{escape(expected)}</text>"
        )
        for j, routed in enumerate(labels):
            v = int((confusion.get(expected) or {}).get(routed, 0))
            shade = v / peak
            fill = "#1a7f37" if i == j else "#cf222e"
            opacity = 0.08 + 0.85 * shade if v else 0.03
            ink = "#fff" if shade > 0.55 else "#1f2328"
            x = left + j * cell
            parts.append(
                f'<rect x="{x}" y="{y}" width="{cell - 2}" height="{cell - 2}" fill="{fill}" '
                f'fill-opacity="{opacity:.2f}"/><text x="{_f(x + cell / 2 - 1)}" y="{_f(y + cell / 2 + 4)}" '
                f'font-size="11" text-anchor="middle" fill="{ink}">{v}</text>'
            )
    parts.append("</svg>")
    return Markup("".join(parts))


def _heat(value: float) -> str:
    """A score in [0, 1] as a colour from red (0) through amber to green (1)."""
    v = min(1.0, max(0.0, value))
    stops = ((0.0, (207, 34, 46)), (0.5, (191, 135, 0)), (1.0, (26, 127, 55)))
    for (a, ca), (b, cb) in zip(stops, stops[1:], strict=False):
        if v <= b:
            t = (v - a) / (b - a)
            return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(ca, cb, strict=True))
    return "#1a7f37"


def matrix_svg(
    suites: Sequence[str],
    rows: Sequence[Mapping],
    *,
    title: str = "accuracy matrix",
    link: str = "/generations/{number}",
) -> Markup:
    """The accuracy matrix as a heat map: one row per generation (``rows``: dicts with ``generation``,
    ``status``, ``champion`` and ``scores``, one score or None per suite), one column per suite; each cell
    coloured by its score (red 0, green 1) and labelled with it, blank where the suite was not measured; a
    row's label links to its generation and marks the champion."""
    if not suites or not rows:
        return Markup(f'<p class="empty">{escape(title)}: nothing measured yet.</p>')
    cell_w, cell_h, left, top = 74, 22, 96, 110
    # the column labels lean right at 40 degrees: room for the last one's length beyond the grid
    overhang = max(0, int(max(len(s) for s in suites[-3:]) * 5.2) - cell_w)
    width, height = left + len(suites) * cell_w + overhang + 10, top + len(rows) * cell_h + 10
    parts = [
        f'<svg class="chart matrix" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="4" y="14" font-size="12" font-weight="bold">{escape(title)}</text>',
    ]
    for j, suite in enumerate(suites):
        x = left + j * cell_w + cell_w / 2
        parts.append(
            f'<text x="{_f(x)}" y="{top - 6}" font-size="10" text-anchor="start" class="suite" '
            f'transform="rotate(-40 {_f(x)} {top - 6})">{escape(suite)}</text>'
        )
    for i, row in enumerate(rows):
        y = top + i * cell_h
        number = int(row["generation"])
        star = " ★" if row.get("champion") else ""
        parts.append(
            f'<a href="{escape(link.format(number=number))}"><text x="{left - 6}" y="{_f(y + cell_h / 2 + 4)}" '
            f'font-size="11" text-anchor="end">gen {number}{star}</text></a>'
        )
        for j, value in enumerate(row["scores"]):
            x = left + j * cell_w
            if value is None:
                parts.append(
                    f'<rect x="{x}" y="{y}" width="{cell_w - 2}" height="{cell_h - 2}" fill="#f6f8fa"/>'
                )
                continue
            tip = escape(f"generation {number}, {suites[j]}: {value:.3f}")
            parts.append(
                f'<g class="cell" data-generation="{number}" data-suite="{escape(suites[j])}" '
                f'data-score="{value:.4f}"><rect x="{x}" y="{y}" width="{cell_w - 2}" height="{cell_h - 2}" '
                f'fill="{_heat(value)}"><title>{tip}</title></rect><text x="{_f(x + cell_w / 2 - 1)}" '
                f'y="{_f(y + cell_h / 2 + 4)}" font-size="11" text-anchor="middle" fill="#fff">{value:.3f}</text>'
                "</g>"
            )
    parts.append("</svg>")
    return Markup("".join(parts))
