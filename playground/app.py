"""The Gradio page: layout and event wiring around one shared ``LLM``.

``build_app(llm)`` returns a ``gr.Blocks`` (queue configured); ``launch(demo)``
starts it with the playground's theme and CSS. Every tab gets its own
``ChatSession``; all tabs share one engine, whose background loop batches
their requests together, so the chat events run concurrently up to the
engine's ``max_num_seqs``.
"""

from __future__ import annotations

import functools
import inspect
import os
from html import escape
from typing import Any

import gradio as gr

from . import render
from .chat import ChatSession
from .api_names import name_api
from .chatview import META_CSS
from .handlers import Handlers, Limits
from .monitor import EngineMonitor
from .inspector import BLOCK_CLICK_JS, block_inspector_html
from .live_map import LIVE_MAP_JS, ROUTE_POLL_JS
from .live_panels import LIVE_PANELS_JS, wrap
from .minimap import MINIMAP_HTML, MINIMAP_JS
from .prompt_view import PROMPT_VIEW_EMPTY
from .inputs import sampling_note as _sampling_note
from .revise import ACT_JS, Revise
from .sidebar import Sidebar
from .edit_cost_view import EditCost
from .replay_view import Replay
from .lens_panel import LensPanel
from .inside_views import InsideViews
from .context_left import ContextLeft
from .serve_commands import serve_commands_html
from .handlers import timeline_plot
from .timeline import WINDOWS
from .timeline_chart import timeline_figure

__all__ = ["build_app", "launch", "DEFAULT_SYSTEM_PROMPT", "THEME", "CSS"]

DEFAULT_SYSTEM_PROMPT = "You are a concise, friendly assistant. Answer in a few sentences."

# Clicking a token of the logprob view fires the HTML component's click event
# with the token's index; Python then offers that token's alternatives.
TOKEN_CLICK_JS = """
element.addEventListener('click', (e) => {
  const tok = e.target.closest('.lp-tok');
  if (tok) trigger('click', {index: Number(tok.dataset.index)});
});
"""

# The ‹ › arrows under replies live inside the Chatbot's messages, which run no
# scripts; one document-level listener (installed once per page) sends their
# clicks through this hidden bridge component's click event.
NAV_JS = """
if (!window.__pgNav) {
  window.__pgNav = true;
  document.addEventListener('click', (e) => {
    const nav = e.target.closest('#chat .pg-nav');
    if (nav && !nav.classList.contains('off')) {
      const id = [...nav.classList].find((c) => c.startsWith('pg-node-'));
      trigger('click', {node: Number(id.slice(8)), step: nav.classList.contains('pg-prev') ? -1 : 1});
    }
  });
}
"""

SIDEBAR_OPEN_JS = """() => {
  if (window.innerWidth >= 1024) document.querySelector('#conv-sidebar:not(.open) .toggle-button')?.click();
}"""

THEME = gr.themes.Soft(primary_hue="indigo", neutral_hue="slate")
CSS = """
.pg-title h1{margin:0;font-size:22px;font-weight:700}.pg-title p{margin:2px 0 0;color:#64748b}
.pg-notice{margin:6px 0 0;padding:6px 10px;border-radius:6px;background:#fef3c7;color:#78350f}
.pg-badge{display:inline-block;background:#eef2ff;color:#3730a3;border-radius:999px;padding:1px 9px;
 margin-right:6px;font-size:12px;font-weight:600}
#kv-map, #prefix-panel, #engine-panel, #logprobs, #batch-view{padding:6px 4px}
#nav-bridge, #act-bridge{display:none}
#chat .bubble-wrap{padding-top:34px}
#chat .pg-meta .pg-nav{display:inline-flex;align-items:center;justify-content:center;min-width:28px;min-height:28px}
@media (max-width:640px){#kv-map .kv-grid{grid-template-columns:repeat(auto-fill,minmax(24px,1fr))!important}}
""" + META_CSS


def _header(snapshot: dict, limits: Limits, base_model: bool = False) -> str:
    notice = ('<p class="pg-notice" id="base-model-notice">This is a <b>base model</b>: it has no chat template, '
              "so it was not trained to hold a conversation. The page starts in <b>completion</b> mode: your "
              "text is continued as it is. Chat mode wraps turns in a generic format the model does not know."
              "</p>") if base_model else ""
    badges = "".join(
        f'<span class="pg-badge">{escape(str(v))}</span>'
        for v in render.engine_badges(snapshot)
    )
    return (
        '<div class="pg-title"><h1>Fleet Playground</h1>'
        f"<p>{badges} Chat, then watch the paged KV cache, the prefix cache and every token's "
        f"probability. Messages up to {limits.max_input_chars} characters.</p>{notice}</div>"
    )


def _html(value: str, elem_id: str, js: str | None = None) -> gr.HTML:
    """An HTML panel styled only by the renderers' own CSS."""
    return gr.HTML(value, js_on_load=js, apply_default_css=False, elem_id=elem_id)


def _serialized_chat(fn: Any, chatbot: gr.Chatbot) -> Any:
    """``fn`` (a handler returning or yielding the chat outputs) with the Chatbot's value already in
    the form the page takes, for events with ``postprocess=False``.

    Gradio 6.31 postprocesses each output of each update in a worker thread of its own
    (``Blocks.postprocess_data``: ``anyio.to_thread.run_sync(block.postprocess, ...)``), a thread
    hand-off per output and streamed update, on the cores the engine decodes with. The HTML panels'
    postprocess returns the string as it is; only the Chatbot's value needs converting, done here in
    the handler's own thread. Skips and component updates pass through (Gradio handles them alike).
    """
    def convert(values: Any) -> Any:
        if isinstance(values, tuple) and values and isinstance(values[0], list):
            return (chatbot.postprocess(values[0]).model_dump(), *values[1:])
        return values

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def stream(*args):
            updates = fn(*args)
            try:
                for values in updates:
                    yield convert(values)
            finally:
                updates.close()        # a cancelled event (Stop, closed tab) ends the reply at once
        return stream

    @functools.wraps(fn)
    def plain(*args):
        return convert(fn(*args))
    return plain


def build_app(
    llm: Any,
    *,
    limits: Limits | None = None,
    queue_size: int = 32,
    concurrency: int | None = None,
    refresh_every: float = 0.2,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    allow_engine_admin: bool = False,
) -> gr.Blocks:
    """Build the playground page for ``llm``.

    Args:
        llm: an ``engine.LLM`` (anything with its public API).
        limits: per-visitor caps (message length, max tokens, batch size).
        queue_size: requests waiting beyond this are refused with "queue full".
        concurrency: chats streaming at once (default: the engine's
            ``max_num_seqs``, so they all batch together).
        refresh_every: seconds between block-map refreshes (each tab's script polls the
            map's own route, ``playground.live_map``; the other live panels are polled once
            a second from theirs, ``playground.live_panels``).
        system_prompt: the initial system prompt.
        allow_engine_admin: enable the actions that affect every visitor
            (resetting the prefix cache, loading a second backend for the
            consistency check); off by default, since anyone who can open the
            page could use them.
    """
    limits = limits or Limits()
    config = getattr(llm, "config", None)
    concurrency = concurrency or getattr(config, "max_num_seqs", None) or 8
    # Snapshots a little more often than the tabs poll the map, so a poll while the engine runs
    # finds a new one (the map then refreshes 1 / refresh_every times a second).
    monitor = EngineMonitor(llm, interval=0.75 * refresh_every)
    h = Handlers(llm, monitor, limits, allow_engine_admin=allow_engine_admin, map_every=refresh_every)
    snap = monitor.snapshot()
    base_model = h.default_mode == "completion"

    # Gradio sends usage analytics unless told not to: off unless GRADIO_ANALYTICS_ENABLED=True.
    analytics = os.environ.get("GRADIO_ANALYTICS_ENABLED", "False") == "True"
    with gr.Blocks(title="Fleet Playground", fill_width=True, analytics_enabled=analytics) as demo:
        # A plain function, not the bound method: Gradio deep-copies the page
        # config (which lists this callback) on every page load.
        session = gr.State(lambda: ChatSession(), delete_callback=lambda s: h.stop(s))
        # This browser's key to its conversations (kept by the server: playground.library says why).
        browser_key = gr.BrowserState(None, storage_key="fleet-playground-browser")
        S, R = Sidebar(h), Revise(h)
        with gr.Sidebar(label="Conversations", open=False, elem_id="conv-sidebar"):
            new_conv = gr.Button("+ New conversation", size="sm", variant="primary", elem_id="conv-new")
            conv_list = gr.Radio([], label="Conversations", elem_id="conv-list")
            with gr.Row():
                conv_name = gr.Textbox(placeholder="New name", show_label=False, scale=3,
                                       max_lines=1, elem_id="conv-name")
                rename_conv = gr.Button("Rename", size="sm", scale=1, min_width=60, elem_id="conv-rename")
            delete_conv = gr.Button("Delete the shown conversation", size="sm", variant="stop",
                                    elem_id="conv-delete")
            with gr.Row():
                export_conv = gr.Button("Export JSON", size="sm", elem_id="conv-export")
                import_conv = gr.UploadButton("Import JSON", size="sm", file_types=[".json"], type="filepath",
                                              elem_id="conv-import")
            export_file = gr.File(visible=False, show_label=False, elem_id="conv-file")
            conv_note = _html("", "conv-note")
        _html(_header(snap, limits, base_model), "header")
        _html(MINIMAP_HTML, "kv-mini", js=MINIMAP_JS)
        with gr.Row(equal_height=False):
            with gr.Column(scale=5, min_width=420):
                chatbot = gr.Chatbot(label="Chat", height=440, elem_id="chat", buttons=["copy"], editable="user")
                nav = _html("", "nav-bridge", js=NAV_JS)
                act = _html("", "act-bridge", js=ACT_JS)
                with gr.Row():
                    msg = gr.Textbox(placeholder="Type a message and press Enter", show_label=False,
                                     scale=8, max_lines=6, elem_id="msg")
                    send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="send")
                with gr.Row():
                    stop = gr.Button("Stop", size="sm", elem_id="stop")
                    regen = gr.Button("Regenerate (new branch)", size="sm", elem_id="regenerate")
                    clear = gr.Button("Clear", size="sm", elem_id="clear")
                cost = EditCost(h)         # what an edit or a branch will cost, before it is sent
                cost.build()
                with gr.Accordion("Mode, system prompt and sampling", open=base_model):
                    mode = gr.Radio(["chat", "completion"], value=h.default_mode, label="mode", elem_id="mode",
                                    info="chat: the model's chat template; completion: your text is continued "
                                         "as it is (base models)")
                    system = gr.Textbox(label="System prompt", value=system_prompt, lines=2, elem_id="system",
                                        info="chat mode only: completion mode continues your text as it is",
                                        interactive=not base_model)
                    with gr.Row():
                        temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="temperature")
                        top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="top-p")
                        top_k = gr.Slider(0, 200, value=0, step=1, label="top-k (0 = off)")
                    with gr.Row():
                        max_tokens = gr.Slider(1, limits.max_tokens, value=min(128, limits.max_tokens),
                                               step=1, label="max tokens", elem_id="max-tokens")
                        seed = gr.Number(value=-1, precision=0, label="seed (-1 = random)")
                        n_logprobs = gr.Slider(0, 20, value=5, step=1, label="logprobs (top-k alternatives)")
                    with gr.Row():
                        min_p = gr.Slider(0.0, 1.0, value=0.0, step=0.01, label="min-p (0 = off)")
                        repetition_penalty = gr.Slider(0.0, 2.0, value=1.0, step=0.05,
                                                       label="repetition penalty (1 = off)")
                        frequency_penalty = gr.Slider(-2.0, 2.0, value=0.0, step=0.1, label="frequency penalty")
                        presence_penalty = gr.Slider(-2.0, 2.0, value=0.0, step=0.1, label="presence penalty")
                    stop_seqs = gr.Textbox("", label="stop sequences", lines=1, max_lines=4, elem_id="stop-seqs",
                                           info="one per line; \\n is a newline")
                    sampling_note = _html("", "sampling-note")
                gr.Markdown("**Logprobs of the reply shown last** — hover a token for its alternatives, "
                            "click it to branch from there (the original reply is kept: ‹ › under it).")
                lp_metric = gr.Radio(["probability", "logprob", "rank"], value="probability", show_label=False,
                                     container=False, elem_id="lp-metric")
                lp_view = _html(render.logprob_html([]), "logprobs", js=TOKEN_CLICK_JS)
                with gr.Row(equal_height=False):
                    token_index = gr.Number(label="branch at token #", precision=0, minimum=0, scale=1)
                    alternative = gr.Dropdown(label="forcing the alternative (or type text)", choices=[],
                                              allow_custom_value=True, scale=2, elem_id="alternative")
                    branch = gr.Button("Branch ↳", scale=1, min_width=100, elem_id="branch")
                with gr.Accordion("Compare branches", open=False, elem_id="compare-box"):
                    compare_btn = gr.Button("Compare the shown reply with another branch", size="sm",
                                            elem_id="compare")
                    compare_view = _html("", "compare-view")
                with gr.Accordion("Prompt view: what surprised the model in the prompt", open=False,
                                  elem_id="prompt-box"):
                    prompt_btn = gr.Button("Score the shown reply's prompt", size="sm", elem_id="score-prompt")
                    prompt_view = _html(PROMPT_VIEW_EMPTY, "prompt-view", js=TOKEN_CLICK_JS)
                lens = LensPanel(h)       # click a token of the reply or the prompt: where its attention went
                lens.build()
                inside = InsideViews(h)   # a clicked token's sampler stages; where the reply's K/V came from
                inside.build()
            with gr.Column(scale=4, min_width=380):
                gr.Markdown("**KV cache blocks** — one cell per physical block, live; click one to inspect it, "
                            "hover a legend entry to find its blocks")
                block_map = _html(render.block_map_html(snap), "kv-map", js=BLOCK_CLICK_JS + ROUTE_POLL_JS + LIVE_MAP_JS + LIVE_PANELS_JS)
                inspector = _html(wrap("block-inspector", block_inspector_html(None, None)), "block-inspector")
                with gr.Tabs():
                    with gr.Tab("Prefix cache"):
                        prefix = _html(wrap("prefix-panel", render.prefix_cache_html(snap)), "prefix-panel")
                        reset = gr.Button("Reset prefix cache", size="sm", interactive=allow_engine_admin,
                                          elem_id="reset-prefix")
                    with gr.Tab("Engine"):
                        engine = _html(wrap("engine-panel", render.engine_panel_html(snap)), "engine-panel")
                        window = gr.Radio([f"{w} s" for w in WINDOWS], value="120 s", label="timeline window",
                                          elem_id="timeline-window")
                        timeline = gr.Plot(timeline_plot(timeline_figure(monitor.timeline.series(120))),
                                           show_label=False, elem_id="timeline")
                        align = gr.Button(f"Check backend consistency: {h.llm.model_impl} vs {h.aligner.impl}",
                                          size="sm", elem_id="align", interactive=allow_engine_admin)
                        if not allow_engine_admin:
                            gr.Markdown("Engine-wide actions (reset, consistency check) are off: start the app "
                                        "with `--allow-engine-admin` to enable them.")
                        align_view = _html(render.alignment_html(None), "align-view")
                        gr.Markdown("**Take it further** — the same model and settings on a serving stack:")
                        _html(serve_commands_html(llm), "serve-commands")
                    with gr.Tab("Batch demo"):
                        gr.Markdown("Fire N concurrent requests that share the system prompt: the block map "
                                    "shows their shared prefix blocks, the Engine tab their batched steps.")
                        with gr.Row(equal_height=True):
                            n_batch = gr.Slider(2, limits.max_batch, value=min(4, limits.max_batch), step=1,
                                                label="requests")
                            fire = gr.Button("Fire batch", variant="primary")
                        batch_view = _html(render.batch_table_html([]), "batch-view")
                    with gr.Tab("KV replay"):  # allocations, evictions, preemptions, with their causes
                        replay = Replay(llm)
                        replay.build()

        T = h.tabs.wrap
        # The chat events' values reach the page without Gradio's per-output postprocessing (see
        # _serialized_chat): C(h.send) is h.send with the Chatbot's value already serialized.
        C = functools.partial(_serialized_chat, chatbot=chatbot)
        sampling = [temperature, top_p, top_k, max_tokens, seed, n_logprobs,
                    min_p, repetition_penalty, frequency_penalty, presence_penalty, stop_seqs]
        chat_out = [chatbot, msg, lp_view, prefix, token_index, alternative]
        # preprocess=False: handlers check the raw values themselves (playground.inputs), so a bad
        # value from the HTTP API is a readable error, not a failure inside a component.
        engine_q = dict(concurrency_limit=concurrency, concurrency_id="engine", show_progress="hidden",
                        preprocess=False)
        posted = dict(postprocess=False)
        # A refused input is a toast; Gradio would also cover the event's outputs (the whole chat)
        # with an "Error" badge, so the event's status goes to the hidden bridge component instead.
        chat_q = dict(engine_q, show_progress_on=[nav], **posted)
        chat_events = [
            # trigger_mode="multiple": a message sent while a reply streams is queued by the handler
            # (Gradio's default, "once", would silently drop the second submission).
            send.click(T(C(h.send)), [msg, session, system, *sampling, mode], chat_out, api_name="chat",
                       trigger_mode="multiple", **chat_q),
            msg.submit(T(C(h.send)), [msg, session, system, *sampling, mode], chat_out, api_visibility="private",
                       trigger_mode="multiple", **chat_q),
            regen.click(T(C(h.regenerate)), [session, system, *sampling, mode], chat_out, api_name="regenerate",
                        **chat_q),
            branch.click(T(C(h.branch)), [token_index, alternative, session, *sampling], chat_out, api_name="branch",
                         **chat_q),
            act.click(T(C(R.continue_reply), event_data=True), [session, system, *sampling, mode], chat_out,
                      api_visibility="private", **chat_q),
            chatbot.edit(T(C(R.edit), event_data=True), [session, system, *sampling, mode], chat_out,
                         api_visibility="private", **chat_q),
            fire.click(T(h.batch_demo), [n_batch, session, system, *sampling], [batch_view], api_name="batch_demo",
                       concurrency_limit=1, concurrency_id="batch", preprocess=False),
        ]
        for event in chat_events[:2]:        # a first message names the conversation in the list
            event.then(T(S.conversations), [session], [conv_list], api_visibility="private", queue=False,
                       show_progress="hidden")
        # A sampling value the page or the engine refuses is named under the controls as it is set.
        for control in sampling:
            control.change(functools.partial(_sampling_note, max_tokens_cap=limits.max_tokens, vocab_size=h.vocab_size),
                           sampling, [sampling_note], api_visibility="private", queue=False,
                           show_progress="hidden", preprocess=False)
        switched = [*chat_out, conv_list, conv_note]
        side = dict(api_visibility="private", show_progress="hidden")
        shown = [*chat_events[:6], demo.load(T(S.restore), [browser_key, session], [browser_key, *switched], **side)]
        # The list is open beside the page on a wide screen; on a phone it would cover the chat: closed there.
        demo.load(None, js=SIDEBAR_OPEN_JS, api_visibility="private", queue=False)
        shown += [new_conv.click(T(S.new), [session], switched, **side),
                  conv_list.input(T(S.open), [session, conv_list], switched, **side)]
        rename_conv.click(T(S.rename), [session, conv_name], [conv_list, conv_note, conv_name], **side)
        conv_name.submit(T(S.rename), [session, conv_name], [conv_list, conv_note, conv_name], **side)
        shown.append(delete_conv.click(T(S.delete), [session], switched, **side))
        export_conv.click(T(S.export), [session, system], [export_file, conv_note], **side)
        shown.append(import_conv.upload(T(S.import_), [session, import_conv], switched, **side))
        # Stop skips the queue, so it works even when the queue is full.
        shown.append(stop.click(T(C(h.stop)), [session], chat_out, cancels=chat_events, api_name="stop", queue=False, **posted
                   ).then(T(C(h.settled)), [session], chat_out, api_visibility="private", queue=False, **posted))
        shown.append(clear.click(T(C(h.clear)), [session], chat_out, cancels=chat_events, api_name="clear", **posted))
        # The Chatbot's own trash icon clears the same way (not just the display).
        shown.append(chatbot.clear(T(C(h.clear)), [session], chat_out, cancels=chat_events, api_visibility="private", **posted))
        lp_view.click(T(h.pick_token, event_data=True), [session], [token_index, alternative, lp_view], api_visibility="private")
        shown.append(nav.click(T(C(h.navigate), event_data=True), [session], chat_out, api_visibility="private", **posted))
        # Max tokens up to the context left, after every event that changes the conversation shown.
        ContextLeft(h.max_model_len, limits.max_tokens).follow(shown, session, max_tokens, wrap=T)
        block_map.click(T(h.inspect_block, event_data=True), [session], [inspector], api_visibility="private")
        lens.wire(T, session, lp_view, prompt_view)
        inside.wire(T, session, lp_view)
        cost.wire(T, session, system, mode, token_index, alternative, chat_events[:6])
        replay.wire(T, session)
        compare_btn.click(T(h.compare), [session], [compare_view], api_name="compare")
        prompt_btn.click(T(h.prompt_view), [session], [prompt_view], api_name="prompt_view", **engine_q)
        # The system prompt is part of chat prompts only: editable in chat mode.
        mode.change(lambda m: gr.update(interactive=m == "chat"), [mode], [system], queue=False,
                    api_visibility="private", show_progress="hidden")
        lp_metric.change(T(h.set_metric), [session, lp_metric], [lp_view], api_name="logprob_metric",
                         preprocess=False)
        window.change(T(h.set_timeline_window), [session, window], [timeline], api_visibility="private",
                      queue=False, show_progress="hidden", preprocess=False)
        reset.click(T(h.reset_prefix_cache), [session], [prefix], api_name="reset_prefix_cache")
        align.click(T(h.align), [session, system], [align_view], api_name="align", concurrency_limit=1,
                    concurrency_id="align", preprocess=False)
        # Live views: the page's load event draws the block map with the tab's token and the other
        # panels once; then the page's script polls the map's route (live_map) and the panels' route
        # (live_panels) with that token: no Gradio event per tab and refresh.
        # The load events skip the queue (queue=False: a plain request, not a queued SSE event).
        # Their outputs are HTML strings, sent as they are (postprocess=False: no worker thread per
        # output); the panels' drawing runs on Gradio's event loop (on_loop: no hand-off either).
        live = dict(show_progress="hidden", concurrency_limit=None, api_visibility="private", queue=False, **posted)
        demo.load(T(h.map_panel), [session], [block_map], **live)
        demo.load(T(h.refresh_panels, on_loop=True), [session], [prefix, engine, timeline, inspector], **live)
        demo.unload(h.tabs.forget)
    # "Use via API": every public event's parameters named after its inputs (message, temperature, ...).
    name_api(demo, {id(msg): "message", id(token_index): "token_index", id(alternative): "alternative",
                    id(lp_metric): "metric"})
    # After every queued event Gradio recomputes the summary of its monitoring dashboard (a pandas
    # table of up to 10,000 past events) unless told to do it less often; the page never shows it.
    os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", "1000")
    demo.queue(max_size=queue_size, default_concurrency_limit=concurrency)
    _pace_queue(demo)
    demo.playground_monitor = monitor   # so callers can close it
    demo.playground_routes = [h.live_map.route(), h.live_panels.route()]    # added to Gradio's app by launch()
    return demo


# Gradio's queue looks for waiting events every millisecond and for progress to report every 10 ms
# (``gradio.queueing.Queue``: ``sleep_when_free``, ``progress_update_sleep_when_free``): the server
# wakes ~1,100 times a second whether anyone is on the page or not, on the cores the engine decodes
# with. A chat waits at most QUEUE_POLL_S more to start (beside a first token's hundreds of ms);
# the page reports no progress bars (its replies show their own state).
QUEUE_POLL_S = 0.02
PROGRESS_POLL_S = 0.25


def _pace_queue(demo: gr.Blocks) -> None:
    queue = getattr(demo, "_queue", None)
    if queue is None or not hasattr(queue, "sleep_when_free"):
        return                                   # another Gradio: its own pace
    queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
    if hasattr(queue, "progress_update_sleep_when_free"):
        queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, PROGRESS_POLL_S)


def launch(demo: gr.Blocks, **kwargs: Any):
    """``demo.launch`` with the playground's theme, CSS and routes (bound to 127.0.0.1 unless told)."""
    app_kwargs = dict(kwargs.pop("app_kwargs", None) or {})
    app_kwargs["routes"] = [*getattr(demo, "playground_routes", []), *app_kwargs.get("routes", [])]
    kwargs["app_kwargs"] = app_kwargs
    kwargs.setdefault("server_name", os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    kwargs.setdefault("theme", THEME)
    kwargs.setdefault("css", CSS)
    return demo.launch(**kwargs)
