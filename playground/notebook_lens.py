"""The attention lens in Jupyter: ``LensWidget`` (in the ``Playground`` widget) and ``show_lens``.

``LensWidget`` is a toggle, a layer and a head selector over a ``ClickableHTML`` that shows
``playground.lens_view.lens_html``: heat on the text and mass per physical KV block (the block
maps of the notebook ringed by mass). While the toggle is on, ``show(token_ids, position)``
computes a lens (``llm.attention_lens``, on demand) -- the ``Playground`` calls it for a clicked
reply token -- and a click on a token of the lens's text moves it there; the selectors redraw the
lens held without asking the engine. Bad input is named in the view; where the engine has no lens
(a server of another project) the view says why.

``show_lens(llm, token_ids, position, layer=None, head=None)`` is the one-shot view (an
``IPython.display.HTML``, kept in a saved notebook).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as widgets
from IPython.display import HTML

from .clickable import ClickableHTML
from .lens_panel import why_unavailable
from .lens_view import (MEAN_HEADS, MEAN_LAYERS, head_choices, layer_choices, lens_empty_html, lens_error_html,
                        lens_html, parse_choice, stored_by)

__all__ = ["LensWidget", "show_lens"]

MAP_CELLS = ".kv-map .kv-cell"        # the notebook's block maps (no element ids there)


def show_lens(llm: Any, token_ids: Sequence[int], position: int, *, layer: int | None = None,
              head: int | None = None) -> HTML:
    """The lens of ``position`` in ``token_ids``: heat on the text and mass per KV block."""
    lens = llm.attention_lens(list(token_ids), position, layer=layer, head=head)
    return HTML(lens_html(lens, layer=layer, head=head, on_map=False))


class LensWidget:
    """Attention lens controls and view, bound to ``llm`` (``monitor``: an ``EngineMonitor`` whose
    snapshot says which blocks are shared or cached now; ``name``: request id -> legend name)."""

    def __init__(self, llm: Any, monitor: Any = None, *, name: Callable[[str], str] = str):
        W, L = widgets, widgets.Layout
        self.llm, self.monitor, self.name = llm, monitor, name
        self.unavailable = why_unavailable(llm)
        self.lens = None
        self.error: str | None = None
        self._ids: list[int] = []
        self._sources: list = []
        self.toggle = W.ToggleButton(value=False, description="Attention lens", icon="eye",
                                     tooltip="while on, a click on a reply token shows where its attention went")
        self.layer = W.Dropdown(options=[MEAN_LAYERS], value=MEAN_LAYERS, description="layer", layout=L(width="220px"))
        self.head = W.Dropdown(options=[MEAN_HEADS], value=MEAN_HEADS, description="head", layout=L(width="200px"))
        self.view = ClickableHTML(value=lens_empty_html(self.unavailable), layout=L(width="100%"))
        self.widget = W.VBox([W.HBox([self.toggle, self.layer, self.head]), self.view])
        self.toggle.observe(lambda _: self.redraw(), "value")
        self.layer.observe(lambda _: self.redraw(), "value")
        self.head.observe(lambda _: self.redraw(), "value")
        self.view.observe(self._clicked, "clicked")

    @property
    def open(self) -> bool:
        return bool(self.toggle.value)

    def show(self, token_ids: Sequence[int], position: int, *, sources: Sequence = ()) -> Any:
        """Compute the lens of ``position`` in ``token_ids`` and draw it; returns the ``AttentionLens``
        (None where refused: the view names why). ``sources``: who stored which blocks
        (``lens_view.reply_sources`` of this chat's replies)."""
        if self.unavailable:
            self.view.value = lens_empty_html(self.unavailable)
            return None
        try:
            lens = self.llm.attention_lens(list(token_ids), position)
        except NotImplementedError as exc:
            self.view.value = lens_empty_html(str(exc))
            return None
        except ValueError as exc:                # named by the engine before any work
            self.error = str(exc)
            self.redraw()
            return None
        self.lens, self.error, self._ids, self._sources = lens, None, list(token_ids), list(sources)
        layer, head = self.layer.value, self.head.value
        self.layer.options, self.head.options = layer_choices(lens), head_choices(lens)
        self.layer.value = layer if layer in self.layer.options else MEAN_LAYERS
        self.head.value = head if head in self.head.options else MEAN_HEADS
        self.redraw()
        return lens

    def redraw(self) -> None:
        """The lens held, for the selected layer and head (no engine work)."""
        error, self.error = self.error, None
        if self.lens is None:
            self.view.value = lens_error_html(error) if error else lens_empty_html(self.unavailable)
            return
        lens = self.lens
        try:
            layer, head = parse_choice(self.layer.value, "layer", lens.num_layers), \
                parse_choice(self.head.value, "head", lens.num_heads)
        except ValueError as exc:
            layer, head, error = None, None, str(exc)
        snap = self.monitor.snapshot() if self.monitor is not None else None
        self.view.value = lens_html(lens, layer=layer, head=head, snapshot=snap, stored_by=stored_by(lens, self._sources),
                                    name=self.name, on_map=self.open, error=error, map_cells=MAP_CELLS,
                                    after=[self._decode(t) for t in self._ids[lens.position + 1: lens.position + 513]])

    def clear(self) -> None:
        self.lens, self.error, self._ids, self._sources = None, None, [], []
        self.view.value = lens_empty_html(self.unavailable)

    def _decode(self, token_id: int) -> str:
        return self.llm.get_tokenizer().decode([int(token_id)], skip_special_tokens=False)

    def _clicked(self, change: dict) -> None:
        position = (change.get("new") or {}).get("position")
        if position is not None and self.lens is not None and self._ids:
            self.show(self._ids, int(position), sources=self._sources)
