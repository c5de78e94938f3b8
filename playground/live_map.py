"""The live block map: every open tab polls a route of its own for it, not a Gradio event.

A Gradio timer makes each refresh of each tab a Gradio event (request parsing, session state,
pre- and postprocessing of the output), several times a second per tab, on the same cores the
engine decodes with. Here the page's load event draws the map once, with a token naming the
tab (``data-tab``); from then on the page's script asks ``GET <root>/playground/map?tab=T&since=K``
every ``refresh_every`` seconds and gets either 204 (nothing changed since the map with key K)
or the new map's HTML (key in the ``X-Map-Key`` header), which it swaps into the panel. The map
is still drawn from the monitor's latest snapshot by ``render.block_map_html``, whose grid of
cells is drawn once per snapshot for every tab; only the legend (this tab's names) is per tab.

The route is added to Gradio's app by ``playground.app.launch`` (``app_kwargs={"routes": ...}``),
and asks for the same login as Gradio's own routes when the app is launched with ``auth=``
(``gradio_login``).
"""

from __future__ import annotations

import weakref
import inspect
from collections.abc import Callable
from html import escape

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from .chat import ChatSession

__all__ = ["LiveMap", "LIVE_MAP_JS", "ROUTE", "ROUTE_POLL_JS", "gradio_login"]

ROUTE = "/playground/map"

# The page's pollers of the app's own routes (the map's, the other panels'), defined once per page
# before the scripts that use them. ``pollRoute(path, every, query, handle)`` asks
# ``GET <root>/<path>?<query()>`` every ``every()`` ms, round trip included, while the page is
# visible and ``query()`` is not null (the load event has not drawn the tab's token yet), and hands
# a 200 to ``handle``; a 404 (the server forgot this tab: restarted) waits 5 s, an unreachable
# server at least 2 s. It returns the poll, for the caller to start.
ROUTE_POLL_JS = """
const routeBase = () => {
  const root = String((window.gradio_config && window.gradio_config.root) || document.baseURI);
  return root.endsWith('/') ? root : root + '/';
};
const pollRoute = (path, every, query, handle) => {
  const poll = async () => {
    const started = performance.now();
    let wait = every();
    const params = query();
    if (params && !document.hidden) {
      const url = new URL(path, routeBase());
      for (const [name, value] of Object.entries(params)) url.searchParams.set(name, value);
      try {
        const r = await fetch(url, {cache: 'no-store'});
        if (r.status === 200) await handle(r);
        else if (r.status === 404) wait = 5000;
      } catch (e) { console.warn(`${path}: ${e}`); wait = Math.max(wait, 2000); }
    }
    setTimeout(poll, Math.max(0, wait - (performance.now() - started)));
  };
  return poll;
};
"""

# Runs once per page (the map panel's js_on_load, after ROUTE_POLL_JS). It polls only once the
# load event has drawn the map with the tab's token. Only the inside of the ``.kv-live`` wrapper is
# replaced: that wrapper is what Gradio itself rendered.
LIVE_MAP_JS = """
const liveMap = () => element.querySelector('.kv-live[data-tab]');
setTimeout(pollRoute('playground/map',
  () => { const live = liveMap(); return live ? 1000 * Number(live.dataset.every || 0.5) : 500; },
  () => { const live = liveMap(); return live && {tab: live.dataset.tab, since: live.dataset.key || ''}; },
  async r => {
    const live = liveMap(), key = r.headers.get('X-Map-Key');
    const next = document.createElement('template');
    next.innerHTML = await r.text();
    const old = live.querySelector('.kv-map'), map = next.content.querySelector('.kv-map');
    if (map) { if (old) old.replaceWith(map); else live.append(map); }
    if (key) live.dataset.key = key;
  }), 0);
"""

async def gradio_login(request: Request) -> str | None | bool:
    """Whether Gradio would let ``request`` through to its own routes: True when the app has no
    login, else the logged-in user's name, or None (log in first).

    Gradio 6.31 checks every route with ``login_check`` (``gradio/routes.py``, ``App.create_app``:
    ``get_current_user``): the user comes from ``app.auth_dependency(request)`` when the app has
    one, else from the access-token cookie that ``POST /login`` sets (``access-token-<cookie_id>``
    or its ``-unsecure-`` twin), looked up in ``app.tokens``; a request without one gets 401. An
    app object without those attributes (another server) is treated as having a login nobody has.
    """
    app = request.app
    auth, dependency = getattr(app, "auth", None), getattr(app, "auth_dependency", None)
    if auth is None and dependency is None and hasattr(app, "tokens"):
        return True
    if dependency is not None:
        user = dependency(request)
        return (await user) if inspect.isawaitable(user) else user
    cookie_id, tokens = getattr(app, "cookie_id", None), getattr(app, "tokens", None) or {}
    if cookie_id is None:
        return None
    token = (request.cookies.get(f"access-token-{cookie_id}")
             or request.cookies.get(f"access-token-unsecure-{cookie_id}"))
    return tokens.get(token)


class LiveMap:
    """The block map of every open tab, served from ``ROUTE``.

    ``draw(session, css)`` returns the current map of a tab (with the panels' ``<style>`` or
    without) and its key (a string that changes when the map would); ``key(session)``, when
    given, is that key alone, cheaper than a drawing: a poll whose map did not change (204) then
    draws nothing. ``html(session)`` is the panel's content for the page's load event.
    """

    def __init__(self, draw: Callable[[ChatSession, bool], tuple[str, str]], every: float,
                 key: Callable[[ChatSession], str] | None = None):
        self.draw, self.every, self.key = draw, every, key
        self._tabs: weakref.WeakValueDictionary[str, ChatSession] = weakref.WeakValueDictionary()

    def html(self, session: ChatSession) -> str:
        """The panel as the page's load event draws it: the map inside the tab's polling wrapper."""
        body, key = self.draw(session, True)
        self._tabs[session.map_token] = session
        return (f'<div class="kv-live" data-tab="{session.map_token}" data-every="{self.every:g}" '
                f'data-key="{escape(key)}">{body}</div>')

    def forget(self, session: ChatSession) -> None:
        self._tabs.pop(session.map_token, None)

    def session(self, token: str) -> ChatSession | None:
        """The open tab whose map was drawn with ``token`` (the other live panels' route asks)."""
        return self._tabs.get(token)

    def __len__(self) -> int:
        return len(self._tabs)

    async def respond(self, request: Request) -> Response:
        """``GET ROUTE?tab=T&since=K``: 204 if the map's key is still K, else the map (on the event
        loop: a cached lookup most of the time, a legend otherwise)."""
        if await gradio_login(request) is None:
            return JSONResponse({"error": "Not authenticated"}, status_code=401)
        session = self.session(request.query_params.get("tab", ""))
        if session is None:
            return JSONResponse({"error": "unknown tab: reload the page"}, status_code=404)
        since = request.query_params.get("since")
        if self.key is not None and (key := self.key(session)) == since:
            return Response(status_code=204, headers={"Cache-Control": "no-store", "X-Map-Key": key})
        body, key = self.draw(session, False)
        headers = {"Cache-Control": "no-store", "X-Map-Key": key}
        if key == since:
            return Response(status_code=204, headers=headers)
        return HTMLResponse(body, headers=headers)

    def route(self) -> Route:
        return Route(ROUTE, self.respond, methods=["GET"], name="playground_map")
