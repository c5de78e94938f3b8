"""The panels beside the block map (prefix cache, engine, timeline, block inspector), refreshed by
the page's script from a route of their own, not a Gradio timer.

A Gradio timer made each refresh of each tab a request through Gradio's ``/run/predict`` (FastAPI
dependencies, the event's session state and config, the JSON of every output): ~4 ms of the
server per tab and tick on a 2-core machine, on the cores the engine decodes with. Here the page's
load event draws the panels once (a Gradio event, as before); from then on the page's script asks
``GET <root>/playground/panels?tab=T`` once a second (the tab's token is the block map's) and gets
the panels' contents as JSON, ``{elem_id: html}``, drawn by ``Handlers.panels`` (cached per
snapshot and tab). The script swaps each one that changed into its panel.

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
      const box = document.querySelector(`#${id} .live-panel`);
      if (box && box.__shown !== html) { box.innerHTML = html; box.__shown = html; }
    }
  }), %d);
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
