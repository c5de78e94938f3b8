"""Every notebook in notebooks/ runs headless, top to bottom, in a fresh "python3"
Jupyter kernel on the CPU. Each ends with assertions about what it showed, so
running it is a test; the executed copy is written to pytest's tmp_path."""

import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# One cell, against a hang (not a speed goal: a cold Numba cache compiles the kernels in the first cell
# that calls them, and a loaded 2-core machine runs a notebook several times slower than a quiet one).
CELL_TIMEOUT_S = 600

# What each notebook must have displayed: the playground's views (HTML), the
# Playground widget, the kernel lab's timing plot.
SHOWS = {
    "01_quickstart": ["text/html", "application/vnd.jupyter.widget-view+json"],
    "02_kv_cache_and_prefix_caching": ["text/html", "image/png"],
    "03_model_impl_fallback": ["text/html"],
    "04_kernel_lab": ["image/png"],
}


def _kernel_env() -> dict:
    """This process's environment, with the repository importable (also without ``pip install -e``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _outputs(nb, kind: str) -> list:
    """Every output of the executed notebook's code cells that carries ``kind`` (a MIME type or "stdout")."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if kind == "stdout" and out.get("name") == "stdout":
                found.append(out["text"])
            elif kind in out.get("data", {}):
                found.append(out["data"][kind])
    return found


def test_the_guided_notebooks_are_there():
    assert [p.stem for p in NOTEBOOKS] == sorted(SHOWS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} has outputs: clear them before committing")
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_its_checks_pass(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    try:
        client.execute(env=_kernel_env())     # raises CellExecutionError with the cell's traceback
    finally:
        nbformat.write(nb, tmp_path / path.name)

    last = nb.cells[-1]
    assert last.cell_type == "code" and "assert " in last.source, "a notebook must end with its checks"
    assert "all checks passed" in "".join(_outputs(nb, "stdout"))
    for kind in SHOWS[path.stem]:
        assert _outputs(nb, kind), f"{path.name} should display {kind}"
    assert _noise(nb) == [], f"{path.name} leaves stderr or empty outputs in its cells"
    # The saved file as nbconvert --execute writes it (nbclient is its executor): every widget view
    # stands beside a picture (text/html) for where no kernel runs, none beside a bare repr.
    saved = json.loads((tmp_path / path.name).read_text())
    for cell in saved["cells"]:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "application/vnd.jupyter.widget-view+json" in data and path.stem == "01_quickstart":
                assert "VBox(" not in "".join(data["text/plain"])
                picture = "".join(data["text/html"])
                assert 'class="pg-panel kv-map"' in picture and "cached, reusable" in picture
                # its last state: the second turn and the branch taken in later cells
                assert "Which of them is the colour of the sky?" in picture
                assert 'data-index="2"' in picture and "lp-forced" in picture
    if path.stem == "01_quickstart":
        # and the widgets' state, from which JupyterLab draws them again when it reopens the file
        state = saved["metadata"]["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
        assert any('class="pg-panel kv-map"' in str(m["state"].get("value", "")) for m in state.values())


def _noise(nb) -> list[str]:
    """Outputs a reader should not find in a saved notebook: stderr, and outputs that show nothing."""
    found = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("name") == "stderr":
                found.append(f"cell {i} stderr: {out['text'][:200]}")
            elif out.get("output_type") == "display_data" and not "".join(
                    str(v) for v in out.get("data", {}).values()).strip():
                found.append(f"cell {i}: an empty display_data")
    return found


def _run_cells(sources: list[str], tmp_path) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute(env=_kernel_env())
    return nb


def test_loading_weights_leaves_no_view_of_a_closed_widget(tmp_path):
    """The loader's progress bar is an ipywidgets bar in a kernel. JupyterLab drops a closed
    widget's model, so a saved output that still shows it reopens as "Error displaying widget:
    model not found": every widget view left in the outputs must belong to a live widget."""
    model_dir = tmp_path / "tiny"
    nb = _run_cells([
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from tiny_models import make_tiny_model\n"
        "from engine.loader.hf import iter_safetensors, safetensors_files\n"
        f"d = make_tiny_model({str(model_dir)!r})\n"
        "config = json.load(open(d + '/config.json'))\n"
        "print(len(list(iter_safetensors(safetensors_files(d), config))), 'tensors')",
        "from ipywidgets.widgets.widget import _instances\n"
        "print('live:', ' '.join(sorted(_instances)))",
    ], tmp_path)
    assert "tensors" in "".join(_outputs(nb, "stdout"))
    live = "".join(_outputs(nb, "stdout")).split("live:")[1].split()
    views = [v["model_id"] for v in _outputs(nb, "application/vnd.jupyter.widget-view+json")]
    assert [m for m in views if m not in live] == [], "an output shows a widget that was closed"


@pytest.mark.parametrize("first", ["engine", "paddle"])
def test_a_notebook_shows_the_engines_warnings_but_not_its_info(first, tmp_path):
    """Importing Paddle gives the root logger a stderr handler at INFO, so every library's INFO
    record printed as red stderr in a notebook's first cell. The engine's logger behaves as a
    library's: its warnings show, its INFO records only where the application asks for them."""
    nb = _run_cells([
        f"import {first}\nimport engine, logging\n"
        "logging.getLogger('engine').info('an info record')\n"
        "logging.getLogger('engine').warning('a warning record')",
        "logging.basicConfig(level=logging.INFO, format='app: %(message)s')\n"
        "logging.getLogger('engine').info('asked for')",
    ], tmp_path)
    stderr = ["".join(o.text for o in cell.outputs if o.get("name") == "stderr") for cell in nb.cells]
    assert "a warning record" in stderr[0]
    assert "an info record" not in stderr[0]
    assert "app: asked for" in stderr[1]


def test_the_readme_notebook_install_brings_every_model_the_notebooks_load():
    """Notebook 03 once failed with "zoo model 'gemma3-270m' is not installed" under the README's
    notebook install: each route of the README's Jupyter section (conda, pip) must install the
    weights of every zoo model a notebook loads."""
    import tomllib

    import yaml

    from engine.loader.zoo import ZOO

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Jupyter"):]
    section = section[:section.index("\n## ", 1)]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pip_env = next(d["pip"] for d in yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
                   if isinstance(d, dict))
    conda_route = section[:section.index("Without conda")] + "\n".join(pip_env)
    pip_line = next(line for line in section.splitlines() if line.startswith("Without conda"))
    pip_route = pip_line + ("\n".join(extras["notebook"]) if '".[notebook]"' in pip_line else "")
    for path in NOTEBOOKS:
        for name in set(re.findall(r'LLM\(model=\\?"([\w.-]+)', path.read_text())):
            package = ZOO[name].pip_install.split()[-1].split("==")[0]
            assert package in conda_route, f"{path.name} loads {name}; the conda route does not install {package}"
            assert package in pip_route, f"{path.name} loads {name}; the pip route does not install {package}"


def test_rich_displays_in_a_kernel(tmp_path):
    """An LLM, a snapshot and an output display as pictures (the block map, the logprob strip), the
    snapshot's text repr is one line, and loading the model leaves no noise in the cell."""
    nb = _run_cells([
        "from engine import LLM, SamplingParams\nllm = LLM(model='smollm2-135m-instruct')\nllm",
        "out = llm.generate('The capital of France is', SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]\n"
        "out",
        "llm.snapshot()",
    ], tmp_path)
    assert _noise(nb) == []
    results = [next(o for o in cell.outputs if o.output_type == "execute_result") for cell in nb.cells]
    llm_html, out_html, snap_html = (r.data["text/html"] for r in results)
    assert "smollm2-135m-instruct" in llm_html and "native" in llm_html and 'data-field="KV blocks"' in llm_html
    assert out_html.count('class="lp-tok') == 4 and "Paris" in out_html
    assert 'class="pg-panel kv-map"' in snap_html and snap_html.count('class="kv-cell') >= 64
    assert len(results[2].data["text/plain"]) < 300 and "BlockInfo" not in results[2].data["text/plain"]
    assert results[0].data["text/plain"].startswith("LLM(model='smollm2-135m-instruct'")


def test_paddleformers_prints_nothing_when_the_engine_imports_it(tmp_path):
    """PaddleFormers 1.2.0's import printed "PyTorch was not found...", a WARNING about torch and a
    distutils warning as red stderr in the cell that built a fallback model."""
    nb = _run_cells([
        "import warnings, logging\nfrom engine.fallback.quiet import quiet_paddleformers\n"
        "with quiet_paddleformers():\n    import paddleformers.transformers\n"
        "logging.getLogger('PaddleFormers').warning('a later warning still shows')",
    ], tmp_path)
    stderr = "".join(o.text for o in nb.cells[0].outputs if o.get("name") == "stderr")
    assert "PyTorch was not found" not in stderr and "compatibility issues" not in stderr
    assert "distutils" not in stderr
    assert "a later warning still shows" in stderr


def test_a_kernel_restart_leaves_the_playgrounds_picture(tmp_path):
    """JupyterLab draws an output carrying a widget view with its widget renderer whatever other types
    it has (@jupyter-widgets/jupyterlab-manager's WidgetRenderer), so a notebook saved after a restart
    reopened on "Error displaying widget: model not found". At its exit the kernel turns each displayed
    Playground into its picture alone (an update of its display); JupyterLab 4.6 applies it, and the
    saved notebook reopens on the picture."""
    from queue import Empty

    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=_kernel_env(), cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        shown = []
        reply = kc.execute_interactive(
            "from engine import LLM\nfrom playground.notebook import Playground\n"
            "pg = Playground(LLM(model='smollm2-135m-instruct', kv_cache_memory=16 * 1024**2))\npg",
            timeout=CELL_TIMEOUT_S, output_hook=lambda msg: shown.append(msg))
        assert reply["content"]["status"] == "ok"
        view = next(m["content"] for m in shown if m["msg_type"] == "display_data"   # not the loader's bar
                    and "pg-picture" in m["content"]["data"].get("text/html", ""))
        assert "application/vnd.jupyter.widget-view+json" in view["data"]
        display_id = view["transient"]["display_id"]
        km.shutdown_kernel(restart=True)            # what a restart asks of the kernel
        updates = []
        while True:
            try:
                msg = kc.get_iopub_msg(timeout=5)
            except Empty:
                break
            if msg["msg_type"] == "update_display_data" and msg["content"]["transient"]["display_id"] == display_id:
                updates.append(msg["content"]["data"])
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
    assert updates, "the kernel exited without leaving the picture"
    assert "application/vnd.jupyter.widget-view+json" not in updates[-1]
    assert 'class="pg-panel kv-map"' in updates[-1]["text/html"]
