"""``ClickableHTML``: an HTML widget that tells the kernel what was clicked in it.

``ipywidgets.HTML`` only shows its value: a click on a block of the map or a token of the
logprob view never reaches Python. This widget (an ``anywidget.AnyWidget``: its front end is the
ES module below, which JupyterLab, Notebook 7, VS Code and Colab load the same way) shows
``value`` as HTML and, on a click on an element with ``data-block`` (a KV block cell) or a
``.lp-tok`` with ``data-index`` (a token of a logprob view) or a ``.lz-tok`` with ``data-pos`` (a
token of an attention lens), sets ``clicked`` to ``{"block": id}``, ``{"index": i}`` or
``{"position": p}``, with a count ``n`` so that clicking the same element
again is a change too. Python observes ``clicked``::

    view = ClickableHTML(value=render.block_map_html(snapshot))
    view.observe(lambda change: print(change["new"]), "clicked")
"""

from __future__ import annotations

import anywidget
import traitlets

__all__ = ["ClickableHTML", "CLICK_ESM"]

# anywidget's front-end module: render({model, el}) (https://anywidget.dev/en/afm/)
CLICK_ESM = """
function render({ model, el }) {
  const draw = () => { el.innerHTML = model.get("value"); };
  draw();
  model.on("change:value", draw);
  el.addEventListener("click", (event) => {
    const block = event.target.closest("[data-block]");
    const token = event.target.closest(".lp-tok[data-index]");
    const lensToken = event.target.closest(".lz-tok[data-pos]");
    let hit = null;
    if (token) hit = { index: Number(token.dataset.index) };
    else if (lensToken) hit = { position: Number(lensToken.dataset.pos) };
    else if (block) hit = { block: Number(block.dataset.block) };
    if (!hit) return;
    hit.n = (model.get("clicked").n || 0) + 1;
    model.set("clicked", hit);
    model.save_changes();
  });
}
export default { render };
"""


class ClickableHTML(anywidget.AnyWidget):
    """HTML whose block cells and logprob tokens report clicks (``clicked``) to the kernel."""

    _esm = CLICK_ESM
    value = traitlets.Unicode("").tag(sync=True)
    clicked = traitlets.Dict({}).tag(sync=True)
