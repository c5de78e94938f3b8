"""What a prompt will cost and the preemption replay in Jupyter: the playground's two views as
widgets and rich displays.

* ``show_edit_cost(llm, prompt, *, actual=None)``: the edit-cost panel (``edit_cost_view``) of a
  string, chat messages or token ids, read from the prefix cache without touching it
  (``llm.estimate_prefill``); ``PrefillEstimate`` displays itself the same way.
* ``ReplayWidget(llm)`` / ``show_replay(llm)``: the KV event log (``llm.kv_events``) as the page's
  Plotly timeline (its range slider scrubs) above an ``IntSlider`` over the events and the pool as it
  stood after the one chosen, its cause in words (``replay_view``); ``refresh()`` reads the log again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ipywidgets as widgets
from IPython.display import HTML

from .edit_cost_view import edit_cost_html
from .replay_view import replay_figure, replay_state_html, replay_summary_html

__all__ = ["show_edit_cost", "ReplayWidget", "show_replay"]


def _ids(llm: Any, prompt: Any) -> list[int]:
    tok = llm.get_tokenizer()
    if isinstance(prompt, str):
        return tok.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], Mapping):
        return tok.encode(tok.apply_chat_template(list(prompt), add_generation_prompt=True), add_special_tokens=False)
    return list(prompt)


def show_edit_cost(llm: Any, prompt: Any, *, actual: dict | None = None) -> HTML:
    """The cost of sending ``prompt`` now (``actual``: ``{"cached", "computed", "prefill_s"}`` beside it)."""
    return HTML(edit_cost_html(llm.estimate_prefill(_ids(llm, prompt)), actual))


class ReplayWidget:
    """The KV event log of ``llm``: a Plotly timeline, a slider over its events, the pool at the one chosen."""

    def __init__(self, llm: Any):
        import plotly.graph_objects as go

        self.llm = llm
        self.summary = widgets.HTML()
        self.figure = go.FigureWidget()
        self.slider = widgets.IntSlider(0, 0, 0, description="event", continuous_update=False,
                                        layout=widgets.Layout(width="100%"))
        self.state = widgets.HTML()
        self.slider.observe(lambda change: self.show(change["new"]), names="value")
        self.view = widgets.VBox([self.summary, self.figure, self.slider, self.state])
        self.log: dict = {"events": [], "counters": {}}
        self.refresh()

    def refresh(self) -> None:
        """Read the engine's log again and show its last event."""
        self.log = self.llm.kv_events()
        last = max(0, len(self.log["events"]) - 1)
        self.summary.value = replay_summary_html(self.log)
        self.slider.max = last
        if self.slider.value != last:
            self.slider.value = last         # shows it (the observer)
        else:
            self.show(last)

    def show(self, at: int) -> None:
        fig = replay_figure(self.log, at)
        with self.figure.batch_update():
            self.figure.data = ()
            self.figure.add_traces(fig["data"])
            self.figure.layout = fig["layout"]
        self.state.value = replay_state_html(self.log, at)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.view)


def show_replay(llm: Any) -> ReplayWidget:
    return ReplayWidget(llm)
