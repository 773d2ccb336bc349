"""The plan's pictures beside topology.svg: memory per GPU by term (memory.svg) and the candidates'
cost against hours (cost.svg). Pure functions of the Plan: every figure and every mark (the chosen
run, the Pareto front) comes from it; every text goes through the SVG escaping filter."""

from __future__ import annotations

import math

from gpuprov.render.escape import svg
from gpuprov.units import GiB

# one colour per estimator term, in the order the estimator lists them; others cycle the tail
_COLOURS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#bab0ac", "#86bcb6", "#d37295")


def _text(x: float, y: float, text: object, size: int = 12, anchor: str = "start", weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}">'
            f"{svg(text)}</text>")


def _head(width: int, height: int, title: str) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
            f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
            _text(20, 24, title, 15, weight="bold")]


def render_memory_svg(plan) -> str:
    """One stacked bar: the per-GPU peak split into the estimator's terms, against usable and total memory."""
    m = plan.memory
    terms = [(name, b) for name, b in m.breakdown.items() if b > 0]
    width, left, bar_w, bar_y, bar_h = 760, 20, 720, 60, 36
    scale = bar_w / max(m.gpu_memory_bytes, m.per_gpu_bytes)
    usable = int(m.gpu_memory_bytes * (1 - m.safety_margin))
    height = bar_y + bar_h + 40 + 18 * len(terms) + 20
    parts = _head(width, height, f"Memory per GPU on {plan.gpu.name}: {m.per_gpu_bytes / GiB:,.1f} GiB peak of "
                                 f"{usable / GiB:,.1f} GiB usable ({plan.cluster.total_gpus} GPUs, "
                                 f"{plan.cluster.sharding})")
    parts.append(f'<rect x="{left}" y="{bar_y}" width="{m.gpu_memory_bytes * scale:.2f}" height="{bar_h}" '
                 f'fill="#f4f4f4" stroke="#999" data-total-bytes="{m.gpu_memory_bytes}"/>')
    x = float(left)
    for i, (name, b) in enumerate(terms):
        w = b * scale
        colour = _COLOURS[i % len(_COLOURS)]
        parts.append(f'<rect x="{x:.2f}" y="{bar_y}" width="{w:.2f}" height="{bar_h}" fill="{colour}" '
                     f'data-term="{svg(name)}" data-bytes="{b}"><title>{svg(name)}: {b / GiB:,.2f} GiB</title></rect>')
        x += w
    ux = left + usable * scale
    parts.append(f'<line x1="{ux:.2f}" y1="{bar_y - 8}" x2="{ux:.2f}" y2="{bar_y + bar_h + 8}" stroke="#c00" '
                 f'stroke-width="2" stroke-dasharray="4 3" data-usable-bytes="{usable}"/>')
    parts.append(_text(ux, bar_y - 12, f"usable ({1 - m.safety_margin:.0%})", 10, "middle"))
    y = bar_y + bar_h + 30
    for i, (name, b) in enumerate(terms):
        parts.append(f'<rect x="{left}" y="{y - 10}" width="12" height="12" fill="{_COLOURS[i % len(_COLOURS)]}"/>')
        parts.append(_text(left + 18, y, f"{name.replace('_', ' ')}: {b / GiB:,.2f} GiB "
                                         f"({b / m.per_gpu_bytes:.0%})", 12))
        y += 18
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _log_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks per decade covering [lo, hi] (lo > 0)."""
    out = []
    for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        out += [m * 10 ** e for m in (1, 2, 5)]
    below = [t for t in out if t <= lo]
    above = [t for t in out if t >= hi]
    return [t for t in out if (below and t >= below[-1] or not below) and (above and t <= above[0] or not above)]


class _Axis:
    """Linear, or logarithmic when the values span more than a factor of 10 (a 1 h run beside a 1,000 h one)."""

    def __init__(self, values: list[float], a: float, b: float):
        lo, hi = min(values), max(values)
        self.log = lo > 0 and hi / lo > 10
        self.ticks = _log_ticks(lo, hi) if self.log else _ticks(lo * 0.9, hi * 1.05)
        self.a, self.b = a, b

    def _f(self, v: float) -> float:
        return math.log10(v) if self.log else v

    def __call__(self, v: float) -> float:
        lo, hi = self._f(self.ticks[0]), self._f(self.ticks[-1])
        return self.a + (self._f(v) - lo) / ((hi - lo) or 1.0) * (self.b - self.a)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values covering [lo, hi]."""
    span = hi - lo or abs(hi) or 1.0
    step = 10 ** math.floor(math.log10(span / n))
    for mult in (1, 2, 5, 10):
        if span / (step * mult) <= n:
            step *= mult
            break
    first = math.floor(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step) + 2)]


def render_cost_svg(plan) -> str:
    """The candidates (best per GPU type on each cloud) as cost against hours: the chosen run ringed, the
    Pareto front (no candidate both cheaper and faster) joined; rows without a price listed below."""
    rows = [r for r in plan.candidates if r.cost_usd is not None]
    unpriced = [r for r in plan.candidates if r.cost_usd is None]
    width, height, left, right, top, bottom = 760, 440, 80, 30, 50, 70
    parts = _head(width, height + 18 * min(len(unpriced), 1), f"Candidates: cost against time "
                                                              f"({plan.spec.objective} objective)")
    if not rows:
        parts += [_text(20, 60, "no candidate has a price (on-prem or unpriced offers): nothing to draw"), "</svg>"]
        return "\n".join(parts) + "\n"
    px = _Axis([r.time_hours for r in rows], left, width - right)
    py = _Axis([r.cost_usd for r in rows], height - bottom, top)
    xt, yt = px.ticks, py.ticks

    parts.append(f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="#333"/>')
    parts.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#333"/>')
    for t in xt:
        parts.append(_text(px(t), height - bottom + 16, f"{t:,.0f}" if t >= 10 else f"{t:g}", 10, "middle"))
    for t in yt:
        parts.append(_text(left - 6, py(t) + 4, f"${t:,.0f}", 10, "end"))
    parts.append(_text((left + width - right) / 2, height - bottom + 36, "hours (steps x step time + start-up)"
                       + (", log scale" if px.log else ""), 12, "middle"))
    parts.append(_text(16, top - 10, "total $" + (", log scale" if py.log else ""), 12))
    front = sorted((r for r in rows if r.pareto), key=lambda r: r.time_hours)
    if front:
        points = " ".join(f"{px(r.time_hours):.1f},{py(r.cost_usd):.1f}" for r in front)
        parts.append(f'<polyline points="{points}" fill="none" stroke="#59a14f" stroke-width="2" '
                     f'stroke-dasharray="6 3" data-pareto="{len(front)}"/>')
    for r in rows:
        colour = "#e15759" if r.chosen else ("#59a14f" if r.pareto else "#4e79a7")
        label = f"{r.nodes} x {r.instance_type} ({r.cloud}, {r.layout})"
        parts.append(f'<circle cx="{px(r.time_hours):.1f}" cy="{py(r.cost_usd):.1f}" r="{7 if r.chosen else 5}" '
                     f'fill="{colour}" data-instance="{svg(r.instance_type)}" data-cloud="{svg(r.cloud)}" '
                     f'data-hours="{r.time_hours}" data-cost="{r.cost_usd}" data-chosen="{str(r.chosen).lower()}" '
                     f'data-pareto="{str(r.pareto).lower()}"><title>{svg(label)}: {r.time_hours:,.1f} h, '
                     f'${r.cost_usd:,.0f}</title></circle>')
        if r.chosen or r.pareto:
            parts.append(_text(px(r.time_hours) + 9, py(r.cost_usd) - 6,
                               ("chosen: " if r.chosen else "") + label, 10))
    parts.append(_text(left, height - 12, "red: chosen; green: Pareto front (no candidate both cheaper and faster); "
                                          "blue: others", 10))
    if unpriced:
        parts.append(_text(left, height + 8, "no price, not drawn: " + ", ".join(
            f"{r.instance_type} ({r.cloud})" for r in unpriced), 10))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def render_pictures(plan) -> dict[str, str]:
    """The pictures `plan --svg DIR` writes and the bundle carries beside README.md."""
    from gpuprov.render.report import render_topology

    return {"topology.svg": render_topology(plan), "memory.svg": render_memory_svg(plan),
            "cost.svg": render_cost_svg(plan)}
