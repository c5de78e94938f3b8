"""The conda environment (environment.yml) matches pyproject.toml, the README
says how to start Jupyter with it, and the "python3" Jupyter kernel runs this
interpreter (so the notebooks see the installed project)."""

import os
import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _normalized(requirement: str) -> str:
    """One spelling per requirement: canonical name, sorted extras, specifier, marker."""
    r = Requirement(requirement)
    extras = f"[{','.join(sorted(r.extras))}]" if r.extras else ""
    marker = f"; {r.marker}" if r.marker else ""
    return f"{canonicalize_name(r.name)}{extras}{r.specifier}{marker}"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _environment() -> dict:
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def _conda_and_pip(env: dict) -> tuple[list[str], list[str]]:
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pips = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pips) == 1, "environment.yml must have exactly one pip section"
    return conda, pips[0]


def test_environment_lists_the_same_dependencies_as_pyproject():
    project = _pyproject()
    declared = {_normalized(r) for r in project["dependencies"]}
    for name, extra in project["optional-dependencies"].items():
        # the environment is the CPU one for notebooks: GPU users add the cuda extra themselves, and
        # the bench extra (the llama.cpp peer, built from source) is installed for benchmarking only
        if name not in ("cuda", "bench"):
            declared |= {_normalized(r) for r in extra}
    _, pip = _conda_and_pip(_environment())
    listed = [_normalized(r) for r in pip if not r.startswith("-")]
    assert len(listed) == len(set(listed)), "a requirement is listed twice in environment.yml"
    assert set(listed) == declared, (
        f"only in environment.yml: {sorted(set(listed) - declared)}; "
        f"only in pyproject.toml: {sorted(declared - set(listed))}")


def test_environment_installs_the_project_and_a_supported_python():
    env = _environment()
    conda, pip = _conda_and_pip(env)
    assert env["name"] == "fleet-playground"
    assert "-e ." in pip, "the environment must install this project (editable) so notebooks can import it"
    assert "pip" in conda
    pythons = [d.split("=", 1)[1] for d in conda if d.startswith("python=")]
    assert pythons == ["3.11"]
    assert SpecifierSet(_pyproject()["requires-python"]).contains("3.11")


def test_notebook_extra_has_the_widgets_and_jupyter():
    extra = {canonicalize_name(Requirement(r).name) for r in _pyproject()["optional-dependencies"]["notebook"]}
    assert {"ipywidgets", "jupyterlab", "matplotlib"} <= extra


def test_readme_shows_how_to_start_jupyter_with_the_environment():
    readme = (ROOT / "README.md").read_text()
    for command in ("conda env create -f environment.yml", "conda activate fleet-playground", "jupyter lab"):
        assert command in readme, f"README.md should show `{command}`"


def test_python3_kernel_runs_this_interpreter_and_imports_the_project():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT / "notebooks"),
                              env=_kernel_env())
    try:
        out: list[str] = []

        def collect(msg):
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])

        code = "import sys, engine, playground.notebook; print(sys.executable)"
        reply = kc.execute_interactive(code, output_hook=collect, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert Path("".join(out).strip()).resolve() == Path(sys.executable).resolve()
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _kernel_env() -> dict:
    """This process's environment, with the repository importable (also without ``pip install -e``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def test_readme_quick_start_is_two_commands_and_ci_runs_the_reference_comparisons():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [line for block in re.findall(r"```bash\n(.*?)```", quick, re.S)
                for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, commands
    assert "python -m playground" in commands[0]
    ci_command = readme.split("\n# Run the tests\n", 1)[1].splitlines()[0]   # what .ci/run runs
    assert ci_command == commands[1]
    assert '".[test,reference]"' in ci_command and ci_command.endswith("python -m pytest -q")
    for version in ("3.11", "venv", "chromium"):
        assert version in quick


def test_heavy_references_are_their_own_extra_and_markers_are_registered():
    project = _pyproject()
    extras = {name: {canonicalize_name(Requirement(r).name) for r in reqs}
              for name, reqs in project["optional-dependencies"].items()}
    assert {"torch", "transformers", "accelerate"} <= extras["reference"]
    assert not {"torch", "accelerate"} & extras["test"]
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert {m.split(":")[0] for m in ini["markers"]} >= {"slow", "browser", "gpu", "paddlefleet"}


def test_a_missing_requirement_skips_outside_ci_and_fails_in_ci(monkeypatch):
    import conftest

    monkeypatch.setattr(conftest, "IN_CI", False)
    with pytest.raises(pytest.skip.Exception, match="no chromium"):
        conftest.unavailable("no chromium")
    monkeypatch.setattr(conftest, "IN_CI", True)
    with pytest.raises(pytest.fail.Exception, match="no chromium .*CI must run this test"):
        conftest.unavailable("no chromium")
    assert "export CI=true" in (ROOT / ".ci" / "run").read_text()
