"""The panels beside the block map (prefix cache, engine, timeline, block inspector), refreshed by
the page's script from a route of their own, not a Gradio timer.

A Gradio timer made each refresh of each tab a request through Gradio's ``/run/predict`` (FastAPI
dependencies, the event's session state and config, the JSON of every output): ~4 ms of the
server per tab and tick on a 2-core machine, on the cores the engine decodes with. Here the page's
load event draws the panels once (a Gradio event, as before); from then on the page's script asks
``GET <root>/playground/panels?tab=T`` once a second (the tab's token is the block map's) and gets
the panels' contents as JSON, ``{elem_id: html}``, drawn by ``Handlers.panels`` (cached per
snapshot and tab). The script swaps each one that changed into its panel. The timeline is a
``gr.Plot``: its entry is ``{"plotly": figure}``, which the script hands to ``Plotly.react`` on
the figure gr.Plot drew (``playground.timeline_chart``); a hidden chart (another tab of the
panel shown) is not redrawn. The route also says whether the tab has anything for Stop to stop:
the script disables Stop when it has not (and enables it at once on Send, Enter, Regenerate, Branch).

Each panel's value as Gradio renders it is wrapped (``wrap``) in a ``div.live-panel``; the script
replaces only the inside of that wrapper, which is what Gradio itself rendered, so a later Gradio
update of the panel (a chat stream's prefix panel, a click on the map's inspector) replaces the
wrapper and its contents cleanly. The route asks for Gradio's login, as the map's does.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .chat import ChatSession
from .live_map import gradio_login

__all__ = ["LivePanels", "LIVE_PANELS_JS", "PANEL_IDS", "ROUTE", "wrap"]

ROUTE = "/playground/panels"
PANEL_IDS = ("prefix-panel", "engine-panel", "timeline", "block-inspector")   # the panels' elem_ids
EVERY_S = 1.0

# Runs once per page (the map panel's js_on_load, after ``live_map.ROUTE_POLL_JS``). It polls only
# once the load event has drawn the map with the tab's token. A panel whose wrapper Gradio has
# redrawn since (a new element) is filled again even if its HTML is the same as last time.
LIVE_PANELS_JS = """
setTimeout(pollRoute('playground/panels', () => %d,
  () => { const live = document.querySelector('.kv-live[data-tab]'); return live && {tab: live.dataset.tab}; },
  async r => {
    for (const [id, html] of Object.entries(await r.json())) {
      if (html && typeof html === 'object') {
        if (html.plotly) drawPlot(id, html.plotly);
        else if ('disabled' in html) stopState(html.disabled);
        continue;
      }
      const box = document.querySelector(`#${id} .live-panel`);
      if (box && box.__shown !== html) { box.innerHTML = html; box.__shown = html; }
    }
  }), %d);
// Stop: off while the tab has nothing running (the route says so); on at once when a reply is asked
// for (Send, Enter, Regenerate, Branch), and kept on until the route has seen that request running
// (a loaded server can take seconds to start it) or ASK_GRACE_MS have passed.
const ASK_GRACE_MS = 10000;
let askedAt = 0, seenSinceAsked = true;
function stopState(disabled) {
  const stop = document.querySelector('#stop');
  if (!disabled) seenSinceAsked = true;
  if (stop && !(disabled && !seenSinceAsked && Date.now() - askedAt < ASK_GRACE_MS)) stop.disabled = disabled;
}
function asked() {
  askedAt = Date.now(); seenSinceAsked = false;
  const stop = document.querySelector('#stop');
  if (stop) stop.disabled = false;
}
stopState(true);                      // a page just opened has nothing running (a reload mid-reply: the route says)
document.addEventListener('click', (e) => {
  if (e.target.closest('#send, #regenerate, #branch')) asked();
  if (e.target.closest('#branch')) scrollToBranch();
}, true);
// After Branch the new branch streams in the chat, above the logprob view the click came from (on a
// phone a screen or more away): once the chat shows it (its ‹ n/m › changed), it is scrolled into view.
function scrollToBranch() {
  const last = () => [...document.querySelectorAll('#chat [data-testid="bot"]')].pop();
  const pos = () => { const p = last() && last().querySelector('.pg-pos'); return p ? p.textContent : ''; };
  const before = pos(), started = Date.now();
  const wait = setInterval(() => {
    if (pos() !== before) { clearInterval(wait); last().scrollIntoView({block: 'center'}); }
    else if (Date.now() - started > 20000) clearInterval(wait);
  }, 200);
}
document.addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && !e.shiftKey && e.target.closest('#msg')) asked();
}, true);
// A chart (the timeline): redrawn by the Plotly.js that Gradio's gr.Plot loaded, into the div that
// gr.Plot drew the figure in (until it has, on a tab not shown yet, there is nothing to redraw).
function drawPlot(id, fig) {
  const div = document.querySelector(`#${id} .js-plotly-plot`);
  if (!div || !window.Plotly || div.offsetParent === null) return;
  window.Plotly.react(div, fig.data, Object.assign(fig.layout, {autosize: true}), fig.config);
}
""" % (round(EVERY_S * 1000), round(EVERY_S * 1000))


def wrap(elem_id: str, body: str) -> str:
    """A panel's value as Gradio renders it: ``body`` inside the wrapper the script fills."""
    return f'<div class="live-panel" data-panel="{elem_id}">{body}</div>'


class LivePanels:
    """The live panels of every open tab, served from ``ROUTE``.

    ``session(token)`` finds a tab by the token its block map was drawn with (``LiveMap``);
    ``draw(session)`` returns its panels' contents, ``{elem_id: html}`` (unwrapped).
    """

    def __init__(self, session: Callable[[str], ChatSession | None],
                 draw: Callable[[ChatSession], dict[str, str]]):
        self.session, self.draw = session, draw

    async def respond(self, request: Request) -> Response:
        """``GET ROUTE?tab=T``: the tab's panels as JSON (on the event loop: cached drawings most of
        the time), 404 for a token the map never gave out, 401 without Gradio's login."""
        if await gradio_login(request) is None:
            return JSONResponse({"error": "Not authenticated"}, status_code=401)
        session = self.session(request.query_params.get("tab", ""))
        if session is None:
            return JSONResponse({"error": "unknown tab: reload the page"}, status_code=404)
        return JSONResponse(self.draw(session), headers={"Cache-Control": "no-store"})

    def route(self) -> Route:
        return Route(ROUTE, self.respond, methods=["GET"], name="playground_panels")
