"""Server-rendered SVG charts: the dashboard needs no JavaScript library and no network.

Every chart is an ``<svg data-plot="<name>">`` whose data points are also attributes
(``data-x``/``data-y`` on each marker, ``data-count`` on each bar), so a test, or a
user's script, reads the plotted values from the page itself. An empty series renders
a chart that says "no data yet" instead of nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

W, H = 560, 220
PAD_L, PAD_R, PAD_T, PAD_B = 52, 16, 26, 34
COLORS = ("#d9480f", "#1c7ed6", "#2f9e44", "#7048e8", "#e8590c")


@dataclass
class Series:
    label: str
    points: list[tuple[float, float]] = field(default_factory=list)


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    out, t = [], start
    while t <= hi + 1e-9 * step:
        if t >= lo - 1e-9 * step:
            out.append(round(t, 10))
        t += step
    return out


def _fmt(v: float) -> str:
    if v == int(v) and abs(v) < 1e6:
        return str(int(v))
    return f"{v:.3g}"


def _frame(name: str, title: str, body: str, empty: bool) -> str:
    note = f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" class="empty">no data yet</text>' if empty else ""
    return (
        f'<svg data-plot="{escape(name)}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
        f'aria-label="{escape(title)}"><title>{escape(title)}</title>'
        f'<text x="{PAD_L}" y="16" class="title">{escape(title)}</text>{body}{note}</svg>'
    )


def _axes(xlo, xhi, ylo, yhi, xlabel: str, xticks: list[float] | None = None) -> tuple[str, callable, callable]:
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    sx = lambda x: PAD_L + (x - xlo) / ((xhi - xlo) or 1) * pw  # noqa: E731
    sy = lambda y: PAD_T + ph - (y - ylo) / ((yhi - ylo) or 1) * ph  # noqa: E731
    parts = [f'<rect x="{PAD_L}" y="{PAD_T}" width="{pw}" height="{ph}" class="area"/>']
    for t in _ticks(ylo, yhi):
        parts.append(f'<line x1="{PAD_L}" x2="{PAD_L + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>')
        parts.append(f'<text x="{PAD_L - 6}" y="{sy(t) + 4:.1f}" text-anchor="end" class="tick">{_fmt(t)}</text>')
    for t in xticks if xticks is not None else _ticks(xlo, xhi, 6):
        parts.append(f'<text x="{sx(t):.1f}" y="{PAD_T + ph + 14}" text-anchor="middle" class="tick">{_fmt(t)}</text>')
    parts.append(f'<text x="{PAD_L + pw / 2}" y="{H - 4}" text-anchor="middle" class="label">{escape(xlabel)}</text>')
    return "".join(parts), sx, sy


def line_chart(
    name: str, title: str, series: list[Series], *, xlabel: str, ylim: tuple[float, float] | None = None
) -> str:
    pts = [p for s in series for p in s.points]
    if not pts:
        return _frame(name, title, "", True)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    xlo, xhi = min(xs), max(xs)
    if xhi == xlo:
        xlo, xhi = xlo - 1, xhi + 1
    ylo, yhi = ylim if ylim else (min(0.0, min(ys)), max(ys) * 1.1 or 1.0)
    body, sx, sy = _axes(xlo, xhi, ylo, yhi, xlabel)
    parts = [body]
    for i, s in enumerate(series):
        color = COLORS[i % len(COLORS)]
        line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s.points)
        parts.append(f'<g data-series="{escape(s.label)}">')
        if len(s.points) > 1:
            parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in s.points:
            parts.append(
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}" data-x="{x:g}" data-y="{y:g}">'
                f"<title>{escape(s.label)}: {xlabel} {_fmt(x)} = {y:.4g}</title></circle>"
            )
        parts.append("</g>")
        parts.append(
            f'<rect x="{W - PAD_R - 150}" y="{8 + 14 * i}" width="10" height="10" fill="{color}"/>'
            f'<text x="{W - PAD_R - 136}" y="{17 + 14 * i}" class="legend">{escape(s.label)}</text>'
        )
    return _frame(name, title, "".join(parts), False)


def histogram(name: str, title: str, counts: dict[int, int], *, xlabel: str) -> str:
    """Bars for integer-valued data (e.g. staleness in versions)."""
    if not counts or not sum(counts.values()):
        return _frame(name, title, "", True)
    lo, hi = min(counts), max(counts)
    top = max(counts.values())
    body, sx, sy = _axes(lo - 0.5, hi + 0.5, 0, top * 1.1, xlabel, list(range(lo, hi + 1)))
    bw = (sx(1) - sx(0)) * 0.8
    parts = [body]
    for k in range(lo, hi + 1):
        n = counts.get(k, 0)
        parts.append(
            f'<rect x="{sx(k) - bw / 2:.1f}" y="{sy(n):.1f}" width="{bw:.1f}" height="{sy(0) - sy(n):.1f}" '
            f'fill="{COLORS[1]}" data-bin="{k}" data-count="{n}"><title>{xlabel} {k}: {n}</title></rect>'
        )
    return _frame(name, title, "".join(parts), False)
