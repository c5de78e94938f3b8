"""Jupyter widgets on the engine: a live ``Playground`` and one-shot views.

::

    from engine import LLM
    from playground.notebook import Playground, show_blocks, show_logprobs, show_prefix_stats

    llm = LLM()
    pg = Playground(llm)     # as a cell's last expression: displays the app
    pg.send("Hi!")           # or type in the box and press Send
    show_blocks(llm)         # the KV block map as it is now

Works wherever ipywidgets does (JupyterLab, Notebook 7, VS Code, Colab).
Every panel is an HTML widget whose value comes from the same renderers as the
Gradio app (``playground.render``): the KV block map, the prefix-cache panel,
the logprob view (hover a token for its alternatives) and the engine panel.
The map and the logprob view are ``ClickableHTML`` (``playground.clickable``):
a click on a block opens it in the block inspector (``playground.inspector``),
a click on a reply token offers its alternatives to branch from
(``pick_token``, ``branch``). Every display of the app carries a picture of
it (``text/html``, ``picture_html``) kept at its last state, for where no
kernel runs; ``close()`` leaves the picture alone. The ``show_*`` functions
return ``IPython.display.HTML`` of the views, so they also survive in a saved
notebook.

Threading: a reply streams on a background thread, so the kernel stays free
(the Stop button works, other cells run). That thread only *sets widget
values*; ipywidgets sends such changes to the front end from any thread. It
never prints and never enters an ``Output`` widget's context manager, whose
capture belongs to the cell being executed, not to the thread.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from html import escape
from typing import Any

try:
    import ipywidgets as widgets
    from IPython.display import HTML
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError('playground.notebook needs ipywidgets: pip install "fleet-playground[notebook]" '
                      "(or the conda environment in environment.yml)") from exc

from engine import SamplingParams

from . import render
from .chat import ChatSession, Reply, branch_prompt, start_branch, stream_reply
from .clickable import ClickableHTML
from .inspector import block_inspector_html
from .logprobs import token_records
from .monitor import EngineMonitor
from .notebook_lens import LensWidget
from .lens_view import reply_sources
from .prompt_view import prompt_view_html, score_prompt
from .provenance_view import PROVENANCE_EMPTY, batch_figure, provenance_html
from .sampler_view import SAMPLER_EMPTY, pipeline_note, reply_pipeline, sampler_pipeline_html
from .reprs import HOVER_HINT, logprob_strip_html

__all__ = ["Playground", "show_blocks", "show_logprobs", "show_prompt", "show_prefix_stats", "show_alignment",
           "chat_html", "DEFAULT_SYSTEM_PROMPT"]

DEFAULT_SYSTEM_PROMPT = "You are a concise, friendly assistant. Answer in a few sentences."

_CHAT_CSS = """<style>
.nb-chat{font-family:ui-sans-serif,system-ui,sans-serif;font-size:14px;color:#0f172a;height:320px;
 overflow-y:auto;display:flex;flex-direction:column-reverse;border:1px solid #e2e8f0;border-radius:8px;
 padding:6px;background:#fff}
.nb-msg{border-radius:8px;padding:6px 10px;margin:4px 0;white-space:pre-wrap;word-break:break-word;max-width:88%}
.nb-msg .who{font-size:11px;font-weight:600;color:#64748b;margin-bottom:2px}
.nb-user{background:#eef2ff;margin-left:auto}
.nb-assistant{background:#f1f5f9;margin-right:auto}
.nb-error{background:#fef2f2;color:#991b1b;margin-right:auto}
.nb-empty{color:#94a3b8;font-style:italic;margin:auto}
</style>"""


# --------------------------------------------------------------------------- #
# One-shot views
# --------------------------------------------------------------------------- #
def _snapshot_dict(source: Any) -> dict:
    """A snapshot dict from an ``LLM``, an ``EngineSnapshot`` or a snapshot dict."""
    if isinstance(source, Mapping):
        return dict(source)
    if hasattr(source, "snapshot"):
        source = source.snapshot()
    if hasattr(source, "to_dict"):
        return source.to_dict()
    raise TypeError(f"expected an LLM, an EngineSnapshot or a snapshot dict; got {type(source).__name__}")


def show_blocks(source: Any, *, labels: Mapping[str, str] | None = None) -> HTML:
    """The KV block map of ``source`` (an ``LLM``, ``EngineSnapshot`` or snapshot dict).

    ``labels`` renames request ids in the legend, e.g. ``{"req-3": "long prompt"}``.
    """
    return HTML(render.block_map_html(_snapshot_dict(source), labels=labels))


def _turn(output: Any, label: str) -> dict:
    return {"label": label, "num_prompt_tokens": len(output.prompt_token_ids),
            "num_cached_tokens": int(output.num_cached_tokens or 0)}


def show_prefix_stats(source: Any, outputs: Iterable[Any] = ()) -> HTML:
    """The prefix-cache panel: engine-wide statistics of ``source`` and, per
    ``RequestOutput`` in ``outputs`` (oldest first), how many prompt tokens
    came from the cache."""
    history = [_turn(o, str(i + 1)) for i, o in enumerate(outputs)]
    return HTML(render.prefix_cache_html(_snapshot_dict(source), history))


def _logprob_records(output: Any, decode: Any = None) -> list[dict]:
    if isinstance(output, Reply):
        return output.records
    completion = output.outputs[0] if hasattr(output, "outputs") else output
    if completion.logprobs is None:
        raise ValueError("this output has no logprobs: generate it with SamplingParams(logprobs=k), k >= 1")
    return token_records(completion.token_ids, completion.logprobs, decode=decode)


def _logprob_view(records: Sequence[Mapping[str, Any]], selected: int | None = None, *,
                  branch: bool = False) -> str:
    """The logprob strip with room under it for the hover table of its last line (a notebook's
    output area clips what overflows it); ``branch``: the widget's, whose tokens branch on a click."""
    if not branch:
        return logprob_strip_html(records)
    html = render.logprob_html(records, selected=selected)
    return f'<div class="lp-room" style="padding-bottom:{"12em" if records else "0"}">{html}</div>'


def show_logprobs(output: Any, *, tokenizer: Any = None) -> HTML:
    """A reply's tokens coloured by probability; hover one for its top-k alternatives.

    ``output`` is a ``RequestOutput`` (its first completion), a
    ``CompletionOutput`` or a ``Playground`` reply, generated with
    ``SamplingParams(logprobs=k)``. ``tokenizer`` (``llm.get_tokenizer()``)
    spells tokens whose text the engine did not send.
    """
    decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else None
    return HTML(_logprob_view(_logprob_records(output, decode)))


def _prompt_view(records: Sequence[Mapping[str, Any]] | None) -> str:
    html = prompt_view_html(records)
    return f'<div class="lp-room" style="padding-bottom:{"12em" if records else "0"}">{html}</div>'


def show_prompt(llm: Any, prompt: Any, *, top_k: int = 5) -> HTML:
    """Which tokens of ``prompt`` surprised the model: each coloured by its probability given the
    tokens before it; hover one for the top-k the model expected there.

    ``prompt`` is a string, chat messages (the chat template is applied, as ``llm.chat`` does),
    a token-id list, or a ``RequestOutput``/``Playground`` reply (its prompt)."""
    tokenizer = llm.get_tokenizer()
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], Mapping):
        ids = tokenizer.encode(tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True),
                               add_special_tokens=False)
    elif hasattr(prompt, "prompt_token_ids"):
        ids = prompt.prompt_token_ids
    else:
        ids = list(prompt)
    return HTML(_prompt_view(score_prompt(llm, ids, top_k=top_k)))


def show_alignment(report: Any) -> HTML:
    """An ``engine.align.ConsistencyReport`` as the app's alignment table."""
    data = report.to_dict()
    data.update(top1_agreement=report.top1_agreement, max_abs_logprob_diff=report.max_abs_logprob_diff,
                all_greedy_identical=report.all_greedy_identical)
    return HTML(render.alignment_html(data))


def chat_html(messages: Sequence[Mapping[str, Any]], *, streaming: bool = False) -> str:
    """The chat transcript: one bubble per ``{"role", "content"}`` message.

    ``role`` is ``user``, ``assistant`` or ``error``; with ``streaming`` the
    last bubble gets a cursor. Newest messages stay in view at the bottom.
    """
    if not messages:
        body = '<div class="nb-empty">Type a message below and press Send.</div>'
    else:
        bubbles = []
        for i, m in enumerate(messages):
            role = m.get("role", "assistant")
            text = str(m.get("content", ""))
            if streaming and i == len(messages) - 1:
                text += " ▌"
            who = {"user": "you", "assistant": "assistant", "error": "engine error"}.get(role, role)
            bubbles.append(f'<div class="nb-msg nb-{escape(role)}" data-role="{escape(role)}">'
                           f'<div class="who">{who}</div>{escape(text)}</div>')
        body = "<div>" + "".join(bubbles) + "</div>"
    return f'{_CHAT_CSS}<div class="nb-chat">{body}</div>'


# --------------------------------------------------------------------------- #
# The live app
# --------------------------------------------------------------------------- #
_SHOWN: "weakref.WeakSet[Playground]" = weakref.WeakSet()     # apps displayed in this kernel


def _leave_pictures() -> None:
    """At the kernel's exit (a restart, a shutdown): every displayed app becomes its picture alone, so
    a notebook saved afterwards does not reopen on a view of a widget that no kernel holds ("Error
    displaying widget: model not found" in JupyterLab, whichever other types the output has)."""
    for app in list(_SHOWN):
        try:
            app._update_picture(live=False)
        except Exception:   # noqa: BLE001  (the kernel is exiting: leave the others their chance)
            pass


atexit.register(_leave_pictures)


def _figure_widget():
    """An empty Plotly ``FigureWidget`` of the batch view's traces (None where plotly's widget is missing)."""
    try:
        import plotly.graph_objects as go
    except ImportError:
        return None
    from .provenance_view import batch_figure
    from engine.provenance import Provenance

    fig = batch_figure(Provenance(), {}, "", str)
    try:
        return go.FigureWidget({"data": fig["data"], "layout": fig["layout"]})
    except Exception:  # noqa: BLE001 - no widget front end (anywidget) for it
        return None


class Playground:
    """An ipywidgets app on ``llm``: chat with streaming replies next to live
    views of the KV block map, the prefix cache, the reply's logprobs and the
    engine.

    Args:
        llm: an ``engine.LLM``.
        system_prompt, max_tokens, temperature, top_p, logprobs, seed: the
            initial values of the settings controls (``seed=None``: random).
        refresh_interval: seconds between redraws of the engine panels while a
            reply streams (the chat text updates with every token).

    Drive it from code with :meth:`send` (``wait=True`` returns the finished
    ``Reply``); :meth:`stop`, :meth:`clear`, :meth:`refresh`, :meth:`close`
    do what their buttons do. The widgets are attributes (``chat``,
    ``block_map``, ``prefix_panel``, ``logprob_view``, ``engine_panel``,
    ``status``, ``input``...) and ``widget`` is the whole app.
    """

    def __init__(self, llm: Any, *, system_prompt: str = DEFAULT_SYSTEM_PROMPT, max_tokens: int = 128,
                 temperature: float = 0.7, top_p: float = 0.9, logprobs: int = 5, seed: int | None = None,
                 refresh_interval: float = 0.3):
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        self.refresh_interval = refresh_interval
        self.session = ChatSession()
        self.monitor = EngineMonitor(llm, interval=refresh_interval)
        self._ui_lock = threading.Lock()        # widget writes from the UI and the streaming thread
        self._busy = threading.Lock()           # held while a reply streams: one at a time
        self.reply: Reply | None = None         # the reply streaming now, or the last one
        self.replies: list[Reply] = []          # earlier replies (turns before, and replies branched from)
        self.selected: int | None = None        # the token of the reply picked to branch from
        self.inspected: int | None = None       # the block shown in the inspector
        self._build(system_prompt, max_tokens, temperature, top_p, logprobs, seed)
        self.refresh()

    # -- layout -------------------------------------------------------------------
    def _build(self, system_prompt, max_tokens, temperature, top_p, logprobs, seed) -> None:
        W, L = widgets, widgets.Layout
        snap = self.monitor.snapshot()
        badges = " · ".join(escape(v) for v in render.engine_badges(snap))
        self.header = W.HTML(f"<b style='font-size:16px'>Fleet Playground</b> <span style='color:#64748b'>"
                             f"{badges}</span>")
        self.chat = W.HTML(chat_html([]), layout=L(width="100%"))
        self.input = W.Textarea(placeholder="Message…", rows=2, layout=L(width="100%"))
        self.send_button = W.Button(description="Send", button_style="primary", icon="paper-plane")
        self.stop_button = W.Button(description="Stop", icon="stop", disabled=True)
        self.clear_button = W.Button(description="Clear", icon="trash")
        self.refresh_button = W.Button(description="Refresh views", icon="refresh")
        self.reset_button = W.Button(description="Reset prefix cache")
        self.status = W.HTML("ready")
        self.system_prompt = W.Textarea(value=system_prompt, description="system", rows=2, layout=L(width="100%"))
        # Labels at their natural width and sliders that share the row: JupyterLab's defaults
        # give a fixed 80 px label column (cut labels) and squeeze the slider track.
        knob = dict(style={"description_width": "initial"}, layout=L(flex="1 1 0", min_width="220px"))
        self.max_tokens = W.IntSlider(value=max_tokens, min=1, max=1024, description="max tokens", **knob)
        self.temperature = W.FloatSlider(value=temperature, min=0.0, max=2.0, step=0.05, description="temperature",
                                         **knob)
        self.top_p = W.FloatSlider(value=top_p, min=0.05, max=1.0, step=0.05, description="top-p", **knob)
        self.logprobs = W.IntSlider(value=logprobs, min=0, max=20, description="logprobs", **knob)
        self.seed = W.IntText(value=-1 if seed is None else seed, description="seed (-1 random)", **knob)
        settings = W.Accordion([W.VBox([self.system_prompt, W.HBox([self.max_tokens, self.temperature]),
                                        W.HBox([self.top_p, self.logprobs]), self.seed])])
        settings.set_title(0, "System prompt and sampling")
        settings.selected_index = None

        # The map and the logprob view report clicks: a block opens in the inspector, a token offers
        # its alternatives to branch from.
        self.block_map = ClickableHTML(layout=L(width="100%"))
        self.inspector = W.HTML(block_inspector_html(None, None), layout=L(width="100%"))
        self.prefix_panel = W.HTML(layout=L(width="100%"))
        self.logprob_view = ClickableHTML(value=_logprob_view([], branch=True), layout=L(width="100%"))
        self.branch_choice = W.Dropdown(options=[], description="alternative",
                                        style={"description_width": "initial"}, layout=L(flex="1 1 0"))
        self.branch_button = W.Button(description="Branch", icon="code-fork", disabled=True,
                                      tooltip="regenerate the reply from the picked token, with this alternative")
        self.branch_row = W.HBox([self.branch_choice, self.branch_button], layout=L(display="none"))
        self.block_map.observe(lambda change: self._clicked_block(change["new"]), "clicked")
        self.logprob_view.observe(lambda change: self._clicked_token(change["new"]), "clicked")
        self.branch_button.on_click(lambda _: self._branch_from_ui())
        self.prompt_button = W.Button(description="Score the prompt", icon="search",
                                      tooltip="which tokens of the last reply's prompt surprised the model",
                                      layout=L(width="auto"))
        self.prompt_view = W.HTML(_prompt_view(None), layout=L(width="100%"))
        self.engine_panel = W.HTML(layout=L(width="100%"))
        # With the lens on, a click on a reply token shows where its attention went (playground.notebook_lens).
        self.lens_panel = LensWidget(self.llm, self.monitor, name=lambda rid: self.session.labels.get(rid, rid))
        # A click on a reply token also shows how the sampler picked it; a finished reply, where its K/V came from.
        self.sampler_view = W.HTML(SAMPLER_EMPTY, layout=L(width="100%"))
        self.provenance_view = W.HTML(PROVENANCE_EMPTY, layout=L(width="100%"))
        self.batch_chart = _figure_widget()

        self.send_button.on_click(lambda _: self._send_from_ui())
        self.stop_button.on_click(lambda _: self.stop())
        self.clear_button.on_click(lambda _: self.clear())
        self.refresh_button.on_click(lambda _: self.refresh())
        self.reset_button.on_click(lambda _: self.reset_prefix_cache())
        self.prompt_button.on_click(lambda _: self._score_from_ui())

        def titled(title, *children):
            return W.VBox([W.HTML(f"<b>{title}</b>"), *children], layout=L(width="50%", padding="0 6px"))

        buttons = W.HBox([self.send_button, self.stop_button, self.clear_button])
        self.widget = W.VBox([
            self.header,
            W.HBox([titled("Chat", self.chat, self.input, buttons, self.status, settings),
                    titled("KV cache blocks (one cell per physical block; click one)", self.block_map,
                           self.inspector, self.refresh_button)]),
            W.HBox([titled("Logprobs of the reply (click a token to branch)", self.logprob_view, self.branch_row,
                           self.prompt_button, self.prompt_view),
                    titled("Prefix cache", self.prefix_panel, self.reset_button)]),
            W.HBox([titled("Sampler pipeline of the clicked token", self.sampler_view),
                    titled("Where the reply's K/V came from; the batches of its tokens", self.provenance_view,
                           *([self.batch_chart] if self.batch_chart is not None else []))]),
            titled("Attention lens of a clicked reply token", self.lens_panel.widget),
            titled("Engine", self.engine_panel),
        ])
        self._handles: list = []            # the displays of this app, kept at its last state (picture)
        self._shown_picture: str | None = None
        self._hook = None

    # -- display ------------------------------------------------------------------------
    def picture_html(self) -> str:
        """The app as it is now, as static HTML: the same views side by side, no controls. It stands
        beside the live widget in every display, so a saved notebook shows it where no kernel runs
        (nbviewer, GitHub, a notebook reopened without its kernel)."""
        def column(title, *parts):
            return (f'<div style="flex:1 1 0;min-width:320px;padding:0 6px"><b>{title}</b>'
                    + "".join(parts) + "</div>")

        row = '<div style="display:flex;flex-wrap:wrap;gap:8px;margin-bottom:8px">'
        inspected = self.inspector.value if self.inspected is not None else ""
        logprobs = self.logprob_view.value.replace(render.BRANCH_HINT, HOVER_HINT)   # nothing to click here
        # Drawn from the widgets' values alone, so it changes only when the app does (each change
        # redraws every display of it).
        return ('<div class="pg-picture" style="font-family:ui-sans-serif,system-ui,sans-serif;font-size:13px">'
                f"<div style='margin-bottom:6px'>{self.header.value} <span style='color:#94a3b8'>"
                "(a picture of the Playground widget: run the notebook to use it)</span></div>"
                f'{row}{column("Chat", self.chat.value, "<div>" + self.status.value + "</div>")}'
                f'{column("KV cache blocks", self.block_map.value, inspected)}</div>'
                f'{row}{column("Logprobs of the reply", logprobs)}'
                f'{column("Prefix cache", self.prefix_panel.value)}</div>'
                f'{row}{column("Sampler pipeline", self.sampler_view.value)}'
                f'{column("Where the K/V came from", self.provenance_view.value)}</div>'
                + (f'{row}{column("Attention lens", self.lens_panel.view.value)}</div>' if self.lens_panel.lens else "")
                + f'{column("Engine", self.engine_panel.value)}</div>')

    def _bundle(self, live: bool = True) -> dict:
        bundle = self.widget._repr_mimebundle_() if live else {}
        bundle["text/plain"] = f"Playground({self.llm.model_name}, {len(self.session.messages) // 2} turns)"
        bundle["text/html"] = self.picture_html()
        return bundle

    def _repr_mimebundle_(self, **kwargs):
        return self._bundle()

    def _ipython_display_(self) -> None:
        """Display the app under a display id whose picture follows it: after every cell that ran
        while it is shown, and on ``close()``, which leaves the picture alone."""
        from IPython import get_ipython
        from IPython.display import display

        self._shown_picture = None
        bundle = self._bundle()
        self._handles.append(display(bundle, raw=True, display_id=True))
        self._shown_picture = bundle["text/html"]
        _SHOWN.add(self)
        shell = get_ipython()
        if shell is not None and self._hook is None:
            self._hook = self._update_picture
            shell.events.register("post_execute", self._hook)

    def _update_picture(self, live: bool = True) -> None:
        if not self._handles:
            return
        bundle = self._bundle(live)
        if live and bundle["text/html"] == self._shown_picture:
            return
        self._shown_picture = bundle["text/html"]
        for handle in self._handles:
            handle.update(bundle, raw=True)

    # -- settings --------------------------------------------------------------------
    def sampling_params(self) -> SamplingParams:
        """``SamplingParams`` from the settings controls."""
        seed = int(self.seed.value)
        return SamplingParams(max_tokens=int(self.max_tokens.value), temperature=float(self.temperature.value),
                              top_p=float(self.top_p.value), seed=None if seed < 0 else seed,
                              logprobs=int(self.logprobs.value) or None)

    @property
    def messages(self) -> list[dict]:
        """The conversation as the model sees it (user and assistant turns)."""
        return list(self.session.messages)

    # -- actions ------------------------------------------------------------------------
    def send(self, message: str, *, wait: bool = True, timeout: float | None = None) -> Reply | Future:
        """Send a user message and stream the reply into the widgets.

        With ``wait=True`` return the finished ``Reply`` (``.text``,
        ``.records``, ``.num_cached_tokens``, ``.finish_reason``, ``.error``);
        otherwise return at once with a ``concurrent.futures.Future`` of it.
        Raises ``RuntimeError`` while another reply is streaming.
        """
        message = (message or "").strip()
        if not message:
            raise ValueError("the message is empty")
        return self._start(lambda params: self._run_turn(message, params), wait=wait, timeout=timeout)

    def _start(self, run, *, wait: bool, timeout: float | None) -> Reply | Future:
        """Run ``run(params)`` (a turn or a branch) on the streaming thread."""
        params = self.sampling_params()
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("a reply is still streaming: wait for it, or call stop() first")
        future: Future = Future()
        future.set_running_or_notify_cancel()
        try:
            self._set(self.send_button, "disabled", True)
            self._set(self.branch_button, "disabled", True)
            self._set(self.stop_button, "disabled", False)
            threading.Thread(target=self._stream, args=(run, params, future),
                             name="playground-reply", daemon=True).start()
        except BaseException:
            self._busy.release()
            raise
        return future.result(timeout) if wait else future

    def stop(self) -> bool:
        """Abort the reply that is streaming (its blocks are freed); False if none is."""
        rid = self.session.active_request_id
        return bool(rid) and self.llm.abort(rid)

    def clear(self) -> None:
        """Stop any reply and forget the conversation."""
        self.stop()
        with self._busy:                 # wait for the streaming thread to finish the turn
            self.session.reset()
            self.reply, self.replies, self.selected = None, [], None
        self._set(self.branch_choice, "options", [])
        self.branch_row.layout.display = "none"
        self._set(self.prompt_view, "value", _prompt_view(None))
        self.lens_panel.clear()
        self._set(self.sampler_view, "value", SAMPLER_EMPTY)
        self._set(self.provenance_view, "value", PROVENANCE_EMPTY)
        self._set(self.status, "value", "ready")
        self.refresh()

    def score_prompt(self) -> list[dict]:
        """Score the last reply's prompt into the prompt view; return its token records."""
        reply = self.reply
        if reply is None or not reply.prompt_token_ids:
            raise ValueError("send a message first: the prompt view scores the last reply's prompt")
        records = score_prompt(self.llm, reply.prompt_token_ids, top_k=max(int(self.logprobs.value), 1))
        self._set(self.prompt_view, "value", _prompt_view(records))
        return records

    def _score_from_ui(self) -> None:
        try:
            self.score_prompt()
        except Exception as exc:   # shown, not raised into the front end's comm handler
            self._set(self.status, "value", f"<span style='color:#b91c1c'>{escape(str(exc))}</span>")

    def reset_prefix_cache(self) -> None:
        """Evict every cached block (the next prompts are computed from scratch)."""
        self.llm.reset_prefix_cache()
        self.refresh()

    def refresh(self) -> None:
        """Redraw every view from a fresh engine snapshot."""
        snap = self.monitor.refresh()
        streaming = self.reply is not None and not self.reply.finished
        self._set(self.chat, "value", chat_html(self.session.display, streaming=streaming))
        self._render_panels(snap, self.reply)

    def close(self) -> None:
        """Stop any reply and stop following the engine; where the app is displayed, its picture
        takes its place (a closed widget would read "model not found" once the notebook reopens)."""
        self.stop()
        self.monitor.close()
        if self._hook is not None:
            from IPython import get_ipython

            shell = get_ipython()
            if shell is not None:
                shell.events.unregister("post_execute", self._hook)
            self._hook = None
        self._update_picture(live=False)
        self._handles = []
        _SHOWN.discard(self)

    # -- the block inspector and branching ------------------------------------------------------
    def inspect_block(self, block_id: int | None) -> str:
        """Show what block ``block_id`` holds in the inspector (as a click on its cell does): its
        state, owners and token positions, and the text of this chat's tokens in it."""
        snap = self.monitor.snapshot()
        own = {}
        for reply in [*self.replies, self.reply]:
            if reply is not None and reply.prompt_token_ids:
                own[reply.request_id] = list(reply.prompt_token_ids) + reply.all_token_ids
        html = block_inspector_html(snap, None if block_id is None else int(block_id),
                                    name=lambda rid: self.session.labels.get(rid, rid), own_tokens=own,
                                    decode=lambda ids: self.tokenizer.decode(list(ids)))
        self._set(self.inspector, "value", html)
        self.inspected = block_id
        return html

    def pick_token(self, index: int) -> list[tuple[str, int]]:
        """Pick token ``index`` of the reply (as a click on it does): its alternatives fill the branch
        list. Returns them as (label, token id)."""
        reply = self.reply
        if reply is None or not reply.finished or reply.error or not reply.records:
            raise ValueError("nothing to branch from: send a message and wait for the reply first")
        if not 0 <= int(index) < len(reply.records):
            raise ValueError(f"token index {index} is outside the reply (0..{len(reply.records) - 1})")
        record = reply.records[int(index)]
        choices = [(f"{a['text']!r} · {a['prob'] * 100:.1f}%", int(a["token_id"]))
                   for a in record["alternatives"] if a["token_id"] != record["token_id"]]
        self.selected = int(index)
        self._set(self.branch_choice, "options", choices)
        if choices:
            self._set(self.branch_choice, "value", choices[0][1])
        self._set(self.branch_button, "disabled", not choices)
        self.branch_row.layout.display = "flex"
        self._set(self.logprob_view, "value", _logprob_view(reply.records, self.selected, branch=True))
        return choices

    def branch(self, index: int, token_id: int, *, wait: bool = True,
               timeout: float | None = None) -> Reply | Future:
        """A new reply in place of the last one: its first ``index`` tokens, then ``token_id`` forced,
        then what the model samples after it (the settings' sampling). The replaced reply stays in
        ``replies``. Like :meth:`send`, returns the finished ``Reply`` or a ``Future`` of it."""
        last = self.reply
        if last is None or not last.finished or last.error or not self.session.messages:
            raise ValueError("nothing to branch from: send a message and wait for the reply first")
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if not isinstance(token_id, int) or token_id < 0 or (vocab and token_id >= vocab):
            raise ValueError(f"token_id must be a token id in 0..{(vocab or 0) - 1}; got {token_id!r}")
        prompt = {"prompt_token_ids": branch_prompt(last, int(index), token_id)}
        return self._start(lambda params: self._run_branch(last, int(index), token_id, prompt, params),
                           wait=wait, timeout=timeout)

    def sampler_pipeline(self, index: int):
        """Show how the sampler picked token ``index`` of the reply (as a click on it does): each stage's
        distribution and kept set under the reply's settings. Returns the ``SamplerPipeline``."""
        reply = self.reply
        if reply is None or not reply.finished:
            raise ValueError("nothing to show: send a message and wait for the reply first")
        pipe = reply_pipeline(self.llm, reply, int(index))
        self._set(self.sampler_view, "value", sampler_pipeline_html(pipe, decode=self._decode, index=int(index)))
        return pipe

    def _names(self):
        own = {r.request_id: f"reply {i + 1}" for i, r in enumerate([*self.replies, self.reply]) if r is not None}
        return lambda rid: own.get(rid, "another request") if rid is not None else "an earlier request"

    def _draw_provenance(self, reply: Reply) -> None:
        """Where ``reply``'s K/V came from, and its tokens' batches (from the record it finished with)."""
        prov = reply.provenance
        if prov is None:
            return
        decode = lambda t: self.tokenizer.decode([int(t)], skip_special_tokens=False)   # noqa: E731
        prompt = [*reply.prompt_token_ids, *reply.prefix_token_ids]
        self._set(self.provenance_view, "value", provenance_html(
            prov, [decode(t) for t in prompt], [decode(t) for t in reply.token_ids], name=self._names()))
        if self.batch_chart is not None:
            fig = batch_figure(prov, self.monitor.batches(t.step for t in prov.reply), reply.request_id,
                               self._names())
            with self._ui_lock, self.batch_chart.batch_update():
                for trace, new in zip(self.batch_chart.data, fig["data"]):
                    trace.x, trace.y, trace.customdata = new.get("x", ()), new.get("y", ()), new.get("customdata")

    def _clicked_block(self, clicked: dict) -> None:
        if "block" in (clicked or {}):
            self.inspect_block(int(clicked["block"]))

    def attention_lens(self, index: int):
        """Where token ``index`` of the reply attended (as a click on it with the lens on): shown in the lens
        panel; returns the ``AttentionLens`` (None where refused: the panel names why)."""
        reply = self.reply
        if reply is None or not reply.prompt_token_ids:
            raise ValueError("send a message first: the lens opens on a token of the reply")
        named = [(f"reply {i + 1}", r) for i, r in enumerate([*self.replies, reply])]
        return self.lens_panel.show(list(reply.prompt_token_ids) + reply.all_token_ids,
                                    len(reply.prompt_token_ids) + int(index), sources=reply_sources(named))

    def _clicked_token(self, clicked: dict) -> None:
        if "index" not in (clicked or {}):
            return
        if self.lens_panel.open:
            try:
                self.attention_lens(int(clicked["index"]))
            except ValueError as exc:
                self._set(self.status, "value", f"<span style='color:#b91c1c'>{escape(str(exc))}</span>")
        try:
            self.pick_token(int(clicked["index"]))
        except ValueError as exc:   # shown, not raised into the front end's comm handler
            self._set(self.status, "value", f"<span style='color:#b91c1c'>{escape(str(exc))}</span>")
            return
        try:
            self.sampler_pipeline(int(clicked["index"]))
        except ValueError as exc:   # a forced token, a foreign server: the panel says why
            self._set(self.sampler_view, "value", pipeline_note(str(exc)))

    def _branch_from_ui(self) -> None:
        if self.selected is None or self.branch_choice.value is None:
            return
        try:
            self.branch(self.selected, int(self.branch_choice.value), wait=False)
        except (RuntimeError, ValueError) as exc:
            self._set(self.status, "value", f"<span style='color:#b91c1c'>{escape(str(exc))}</span>")

    # -- streaming (background thread) -----------------------------------------------------
    def _send_from_ui(self) -> None:
        text = self.input.value
        if not text.strip():
            return
        try:
            self.send(text, wait=False)
        except RuntimeError as exc:
            self._set(self.status, "value", f"<span style='color:#b91c1c'>{escape(str(exc))}</span>")
            return
        self._set(self.input, "value", "")

    def _stream(self, run, params: SamplingParams, future: Future) -> None:
        reply, error = None, None
        try:
            reply = run(params)
        except BaseException as exc:   # surfaced through the future (and the status line)
            self._set(self.status, "value", f"<span style='color:#b91c1c'>{escape(repr(exc))}</span>")
            error = exc
        finally:
            self.session.active_request_id = None
            self._set(self.send_button, "disabled", False)
            self._set(self.stop_button, "disabled", True)
            self._busy.release()
        # Only now: whoever waits on the future may send the next message at once.
        if error is None:
            future.set_result(reply)
        else:
            future.set_exception(error)

    def _run_turn(self, message: str, params: SamplingParams) -> Reply:
        session = self.session
        system = self.system_prompt.value.strip()
        user = {"role": "user", "content": message}
        prompt = ([{"role": "system", "content": system}] if system else []) + session.messages + [user]
        reply = Reply(request_id=session.new_request_id("chat"))
        session.display += [user, {"role": "assistant", "content": ""}]
        reply = self._stream_into(reply, prompt, params)
        self._finish_turn(user, reply)
        self.refresh()
        return reply

    def _run_branch(self, last: Reply, index: int, token_id: int, prompt: dict, params: SamplingParams) -> Reply:
        """Regenerate the last reply from token ``index`` with ``token_id`` forced there."""
        session = self.session
        kept = last.all_token_ids[:index] + [token_id]
        reply = start_branch(last, index, token_id, session.new_request_id("chat"), self.tokenizer.decode(kept),
                             decode=self._decode)
        user = session.messages[-2]
        session.messages = session.messages[:-2]           # the branch answers the same user message
        session.turns = session.turns[:-1]
        session.display[-1] = {"role": "assistant", "content": reply.text}
        self.selected = None
        self._set(self.branch_choice, "options", [])
        self.branch_row.layout.display = "none"
        reply = self._stream_into(reply, prompt, params)
        self._finish_turn(user, reply)
        self.refresh()
        return reply

    def _stream_into(self, reply: Reply, prompt: Any, params: SamplingParams) -> Reply:
        session = self.session
        if self.reply is not None:
            self.replies.append(self.reply)
        self.reply = reply
        session.active_request_id = reply.request_id
        self._set(self.status, "value", "waiting for the first token…")
        last_draw = 0.0
        stop_ids = () if params.ignore_eos else getattr(self.tokenizer, "eos_token_ids", ())
        for reply in stream_reply(self.llm, prompt, params, reply, decode=self._decode,
                                  stop_token_ids=frozenset(stop_ids) | frozenset(params.stop_token_ids or ())):
            session.display[-1] = {"role": "assistant", "content": reply.text}
            self._set(self.chat, "value", chat_html(session.display, streaming=not reply.finished))
            self._set(self.status, "value", f"streaming… {len(reply.token_ids)} tokens")
            if time.monotonic() - last_draw >= self.refresh_interval and not reply.finished:
                self._render_panels(self.monitor.refresh(), reply)
                last_draw = time.monotonic()
        return reply

    def _finish_turn(self, user: dict, reply: Reply) -> None:
        """Keep the finished turn in the conversation (errors are shown, not kept)."""
        session = self.session
        if reply.error:
            session.display[-1] = {"role": "error", "content": reply.error}
            self._set(self.status, "value", f"<span style='color:#b91c1c'>engine error: {escape(reply.error)}</span>")
            return
        stopped = reply.finish_reason == "abort" or not reply.finished
        session.display[-1] = {"role": "assistant", "content": reply.text + (" (stopped)" if stopped else "")}
        session.messages += [user, {"role": "assistant", "content": reply.text}]
        session.last = reply
        session.record_turn(reply, str(len(session.turns) + 1))
        self._draw_provenance(reply)
        stats = [f"{len(reply.token_ids)} tokens ({reply.finish_reason})",
                 f"{reply.num_cached_tokens}/{reply.num_prompt_tokens} prompt tokens from the prefix cache"]
        if reply.ttft is not None:
            stats.append(f"TTFT {reply.ttft * 1000:.0f} ms")
        if reply.decode_tps is not None:
            stats.append(f"{reply.decode_tps:.1f} tok/s")
        self._set(self.status, "value", " · ".join(stats))

    # -- drawing (any thread) ------------------------------------------------------------------
    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)])

    def _set(self, widget: widgets.Widget, name: str, value: Any) -> None:
        with self._ui_lock:
            setattr(widget, name, value)

    def _render_panels(self, snap: dict, reply: Reply | None) -> None:
        turns = list(self.session.turns)
        if reply is not None and reply is not self.session.last and reply.num_prompt_tokens and not reply.error:
            turns.append({"label": str(len(turns) + 1), "num_prompt_tokens": reply.num_prompt_tokens,
                          "num_cached_tokens": reply.num_cached_tokens})
        stats = {"ttft": reply.ttft, "decode_tps": reply.decode_tps} if reply is not None else None
        self._set(self.block_map, "value", render.block_map_html(snap, labels=self.session.labels))
        self._set(self.prefix_panel, "value", render.prefix_cache_html(snap, turns))
        self._set(self.logprob_view, "value", _logprob_view(reply.records if reply is not None else [],
                                                            self.selected, branch=True))
        self._set(self.engine_panel, "value", render.engine_panel_html(snap, self.monitor.steps(120), stats))
        if self.inspected is not None:
            self.inspect_block(self.inspected)
