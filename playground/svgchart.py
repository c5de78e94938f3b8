"""Small SVG bar charts inside the HTML panels shared with the notebook widgets.

The prefix panel's hit rate per turn and the engine panel's batch size per step are a few
bars inside HTML that the Gradio page and Jupyter's ``ipywidgets.HTML`` both show, so they
are drawn as inline SVG; every bar carries a ``<title>`` (its hover). The engine timeline,
lines over time, is a Plotly figure (``playground.timeline_chart``).
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

__all__ = ["bar_chart_svg"]

_FONT = "font-family:ui-sans-serif,system-ui,sans-serif;font-size:10px;fill:#475569"


def _nice_max(value: float) -> float:
    """Round ``value`` up to 1, 2 or 5 times a power of ten (axis maximum)."""
    if value <= 0:
        return 1.0
    magnitude = 1.0
    while magnitude * 10 <= value:
        magnitude *= 10
    while magnitude > value:
        magnitude /= 10
    for step in (1, 2, 5, 10):
        if step * magnitude >= value:
            return step * magnitude
    return 10 * magnitude


def _fmt(value: float, percent: bool) -> str:
    if percent:
        return f"{value * 100:.0f}%"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.2f}"


def bar_chart_svg(
    values: Sequence[float],
    *,
    labels: Sequence[str] | None = None,
    titles: Sequence[str] | None = None,
    y_max: float | None = None,
    percent: bool = False,
    color: str = "#6366f1",
    colors: Sequence[str] | None = None,
    width: int = 420,
    height: int = 120,
    x_caption: str = "",
    empty_text: str = "no data yet",
    css_class: str = "pg-chart",
) -> str:
    """Render ``values`` as an SVG bar chart and return the ``<svg>`` markup.

    Args:
        values: bar heights (non-negative).
        labels: x-axis label per bar; only a few are drawn when bars are many.
        titles: hover text per bar (defaults to ``label: value``).
        y_max: top of the y axis; defaults to a rounded-up maximum of ``values``
            (``1.0`` when ``percent``).
        percent: values are fractions in [0, 1]; the axis is labelled in %.
        color / colors: one colour for all bars, or one per bar.
        width, height: size of the drawing in pixels (it scales to its box).
        x_caption: text under the x axis.
        empty_text: shown instead of bars when ``values`` is empty.
        css_class: class of the ``<svg>`` element (tests and CSS select it).
    """
    left, right, top, bottom = 34, 6, 8, 28 if x_caption else 18
    plot_w = width - left - right
    plot_h = height - top - bottom
    parts = [(
        f'<svg class="{css_class}" viewBox="0 0 {width} {height}" '
        f'width="100%" preserveAspectRatio="xMidYMid meet" '
        f'xmlns="http://www.w3.org/2000/svg" role="img">'
    )]
    top_value = y_max if y_max is not None else (1.0 if percent else _nice_max(max(values, default=0)))
    # Horizontal grid lines at 0, 50 % and 100 % of the axis.
    for frac in (0.0, 0.5, 1.0):
        y = top + plot_h * (1 - frac)
        parts.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="#e2e8f0" stroke-width="1"/>'
        )
        parts.append(
            f'<text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end" style="{_FONT}">'
            f"{_fmt(top_value * frac, percent)}</text>"
        )
    if not values:
        parts.append(
            f'<text x="{left + plot_w / 2:.1f}" y="{top + plot_h / 2:.1f}" '
            f'text-anchor="middle" style="{_FONT}">{escape(empty_text)}</text>'
        )
    slot = plot_w / max(len(values), 1)
    bar_w = min(max(slot * 0.8, 1.0), 36.0) if len(values) < 60 else max(slot, 0.5)
    label_every = max(1, len(values) // 8)
    last_labelled = -label_every
    for i, value in enumerate(values):
        clipped = min(max(float(value), 0.0), top_value)
        bar_h = plot_h * clipped / top_value if top_value else 0.0
        x = left + i * slot + (slot - bar_w) / 2
        y = top + plot_h - bar_h
        label = labels[i] if labels is not None else str(i)
        title = titles[i] if titles is not None else f"{label}: {_fmt(float(value), percent)}"
        fill = colors[i] if colors is not None else color
        parts.append(
            f'<rect class="bar" x="{x:.2f}" y="{y:.2f}" width="{bar_w:.2f}" '
            f'height="{max(bar_h, 0.0):.2f}" fill="{fill}" data-value="{float(value):.6g}">'
            f"<title>{escape(title)}</title></rect>"
        )
        is_last = i == len(values) - 1 and i - last_labelled >= max(2, label_every // 2)
        if labels is not None and (i % label_every == 0 or is_last):
            last_labelled = i
            # A label centred under a bar at the right edge would be cut off: anchor it at its end.
            cx = x + bar_w / 2
            half = 3.0 * len(label)            # ~6 px per character at 10 px
            anchor, lx = ("end", min(cx + half, width - 1)) if cx + half > width - 1 else ("middle", cx)
            parts.append(
                f'<text x="{lx:.1f}" y="{top + plot_h + 11}" '
                f'text-anchor="{anchor}" style="{_FONT}">{escape(label)}</text>'
            )
    if x_caption:
        parts.append(
            f'<text x="{left + plot_w / 2:.1f}" y="{height - 3}" text-anchor="middle" '
            f'style="{_FONT}">{escape(x_caption)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)

