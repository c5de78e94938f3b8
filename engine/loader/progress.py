"""The loaders' progress bar: tqdm's, which in a Jupyter kernel is an ipywidgets bar.

A bar that closes without being left (``leave=False``) closes its widget, and JupyterLab then
drops the widget's model; an output still showing it reads "Error displaying widget: model not
found" once the notebook is saved and reopened. In a kernel the bar is therefore shown under a
display id, and when it closes that output is replaced by the bar's last line as text (what tqdm
leaves in a terminal: what was loaded, how fast) and its widgets are closed. An output emptied
instead would stay in the saved notebook as an empty ``display_data``.
"""

from __future__ import annotations

from tqdm.auto import tqdm as auto_tqdm
from tqdm.notebook import tqdm_notebook


def load_progress(iterable=None, **kwargs):
    """``tqdm.auto.tqdm(iterable, **kwargs)``, leaving no widget behind in a notebook."""
    if issubclass(auto_tqdm, tqdm_notebook):
        return NotebookBar(iterable, **kwargs)
    return auto_tqdm(iterable, **kwargs)


class NotebookBar(tqdm_notebook):
    """tqdm's notebook bar, shown under a display id whose output its close turns into text."""

    def __init__(self, *args, **kwargs):
        self._handle = None
        super().__init__(*args, display=False, **kwargs)
        if not self.disable:
            from IPython.display import display
            self._handle = display(self.container, display_id=True)

    def close(self):
        super().close()
        handle, self._handle = self._handle, None
        if handle is None or self.leave:
            return
        handle.update({"text/plain": str(self)}, raw=True)
        for widget in (self.container, *self.container.children):
            widget.close()
