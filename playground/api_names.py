"""The page's public Gradio API, named: what "Use via API" and ``gradio_client``'s ``view_api()`` show.

Gradio names an event's API parameters after its function's parameters. The page's handlers are
wrapped (``Tabs.wrap``: the tab's session, the request) and many take ``*sampling``, so Gradio
would call them ``param_0 ... param_N``. ``name_api(demo)`` names each input of each public event
after its component instead (``message``, ``temperature``, ``top_p``, ...: the label up to its
first parenthesis, as an identifier, or a name given here), and refuses a public event without an
``api_name`` (Gradio would publish it as ``/lambda_1`` or the function's name).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import gradio as gr

__all__ = ["name_api", "parameter_name"]


def _value_load(fn: Any) -> bool:
    """Whether ``fn`` is the page-load event Gradio adds for a component whose value is a function
    (``gr.State(lambda: ChatSession())``: ``Blocks.attach_load_events``), named after that function."""
    return (not fn.inputs and len(fn.outputs) == 1 and [t[1] for t in fn.targets] == ["load"]
            and getattr(fn.outputs[0], "load_event_to_attach", (None,))[0] is fn.fn)


def parameter_name(component: Any, names: Mapping[int, str] = {}) -> str:
    """The API name of an input ``component``: ``names[id(component)]``, else its label's (or
    elem_id's) words before any parenthesis, lower-case, joined by underscores."""
    if id(component) in names:
        return names[id(component)]
    if isinstance(component, gr.State):
        return "session"
    text = str(getattr(component, "label", None) or getattr(component, "elem_id", None) or "value")
    words = re.findall(r"[a-z0-9]+", text.split("(")[0].lower())
    return "_".join(words) or "value"


def name_api(demo: gr.Blocks, names: Mapping[int, str] = {}) -> list[str]:
    """Name the parameters of ``demo``'s public events; return their endpoints (``/chat``, ...).

    Raises ``ValueError`` naming a public event without an ``api_name`` (give it one, or make it
    ``api_visibility="private"``)."""
    endpoints = []
    for fn in demo.fns.values():
        if fn.api_visibility == "public" and _value_load(fn):
            fn.api_visibility = "private"       # Gradio's own: a component's initial value, computed per tab
        if fn.api_visibility != "public":
            continue
        if not fn.api_name or fn.api_name.startswith("lambda"):
            raise ValueError(f"the public event of {getattr(fn.fn, '__name__', fn.fn)!r} has no api_name of its own "
                             f"({fn.api_name!r}): name it, or make it api_visibility='private'")
        fn.input_parameter_names = [parameter_name(c, names) for c in fn.inputs]
        endpoints.append(f"/{fn.api_name}")
    return endpoints
