"""The phone's mini-map: the KV block map in miniature, kept at the top of a narrow screen.

On a narrow screen the page's two columns stack and the block map ends up below the whole chat.
The mini-map is drawn in the browser from the block map already on the page (no second
rendering on the server): every 250 ms, if the map changed, its cells are copied into a
dense grid of a few rows. It sticks to the top of the screen while the chat scrolls; a tap on it
scrolls to the full map. Wide screens never show it (CSS).
"""

from __future__ import annotations

__all__ = ["MINIMAP_HTML", "MINIMAP_JS", "NARROW"]

NARROW = "(max-width: 840px)"    # below this the page's columns (min widths 420 + 380 px) stack

MINIMAP_CSS = f"""
#kv-mini{{display:none}}
@media {NARROW}{{
 .gradio-container{{overflow:clip!important}}  /* hidden made it a scroll container: no sticking */
 #kv-mini{{display:block;position:sticky;top:0;z-index:30;background:#fff;padding:4px 6px 6px;
  border-bottom:1px solid #e2e8f0;box-shadow:0 2px 6px rgba(15,23,42,.12);cursor:pointer}}
 #kv-map{{scroll-margin-top:110px}}            /* the full map lands below the mini-map */
}}
.kv-mini .mini-head{{display:flex;gap:8px;align-items:baseline;font:12px ui-sans-serif,system-ui,sans-serif;
 color:#334155;margin-bottom:3px;white-space:nowrap;overflow:hidden}}
.kv-mini .mini-go{{margin-left:auto;color:#4f46e5}}
.kv-mini .mini-grid{{display:grid;gap:1px}}
.kv-mini .kv-cell{{aspect-ratio:1;border-radius:1px;outline:none!important}}
"""

# The CSS travels in the panel (a <style> in an HTML component is not rewritten; Gradio prefixes every
# selector of launch(css=...) with its container class, so that could not reach the container itself).
MINIMAP_HTML = (f"<style>{MINIMAP_CSS}</style>"
                '<div class="kv-mini" role="button" aria-label="KV cache blocks: tap for the full map">'
                '<div class="mini-head"><b>KV blocks</b> <span class="mini-usage"></span>'
                '<span class="mini-go">map ↓</span></div><div class="mini-grid"></div></div>')

MINIMAP_JS = """
let watched = null, dirty = true;
const seen = new MutationObserver(() => { dirty = true; });
const draw = () => {
  const full = document.querySelector('#kv-map');
  if (full && full !== watched) {                      // the map's redraws patch this element
    watched = full; dirty = true;
    seen.disconnect();
    seen.observe(full, {childList: true, subtree: true, attributes: true, characterData: true});
  }
  if (!dirty || !element.offsetParent) return;         // unchanged, or hidden (a wide screen)
  const map = full && full.querySelector('.kv-map');
  if (!map) return;
  dirty = false;
  const cells = map.querySelectorAll('.kv-grid .kv-cell');
  const grid = element.querySelector('.mini-grid');
  grid.style.gridTemplateColumns = `repeat(${Math.max(64, Math.ceil(cells.length / 8))}, minmax(0, 1fr))`;
  const source = map.querySelector('.kv-grid');          // none: a server whose blocks are not exposed
  grid.innerHTML = source ? source.innerHTML : '';
  const usage = map.querySelector('.pg-head span');
  element.querySelector('.mini-usage').textContent = usage ? usage.textContent.replace(' blocks', '') : '';
};
setInterval(draw, 250);
element.addEventListener('click', () => {
  const full = document.querySelector('#kv-map');
  if (full) full.scrollIntoView({behavior: 'smooth', block: 'start'});
});
"""

