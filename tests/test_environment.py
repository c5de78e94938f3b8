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


def test_readme_quick_start_is_two_commands_and_its_test_command_installs_no_torch():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [line for block in re.findall(r"```bash\n(.*?)```", quick, re.S)
                for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, commands
    assert "python -m playground" in commands[0]
    ci_command = readme.split("\n# Run the tests\n", 1)[1].splitlines()[0]   # what .ci/run runs
    assert ci_command == commands[1]
    assert '".[test]"' in ci_command and ci_command.endswith("python -m pytest -q")
    assert "reference" not in ci_command and "torch" not in ci_command
    for version in ("3.11", "venv", "chromium"):
        assert version in quick


def test_ci_runs_the_readme_command_then_the_live_comparisons_on_cpu_torch():
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    run = "\n".join(lines)
    readme_job = run.index("cmd=$(grep -m1 -A1 '^# Run the tests' README.md | tail -1)")
    live_job = run.index("HF_REFERENCE=live python -m pytest -q -m reference")
    assert readme_job < run.index('bash -c "$cmd"') < live_job
    assert "pip install '$torch' --index-url https://download.pytorch.org/whl/cpu" in run
    assert "pip install -e '.[reference]'" in run


def _requirements_of(requirements, extras=("",)) -> list[Requirement]:
    """Those of ``requirements`` (strings) that apply here with one of ``extras``."""
    out = []
    for text in requirements or ():
        r = Requirement(text)
        if r.marker is None or any(r.marker.evaluate({"extra": extra}) for extra in extras):
            out.append(r)
    return out


def test_the_test_extra_pulls_no_torch():
    """Neither the project nor its test extra requires torch, directly or through what they
    install (followed through the installed packages' metadata)."""
    from importlib.metadata import PackageNotFoundError, distribution

    project = _pyproject()
    todo = _requirements_of(project["dependencies"] + project["optional-dependencies"]["test"])
    seen, paths = set(), {canonicalize_name(r.name): "fleet-playground[test]" for r in todo}
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if (name, tuple(sorted(requirement.extras))) in seen:
            continue
        seen.add((name, tuple(sorted(requirement.extras))))
        try:
            requires = distribution(name).requires
        except PackageNotFoundError:
            continue
        for child in _requirements_of(requires, ("", *requirement.extras)):
            paths.setdefault(canonicalize_name(child.name), name)
            todo.append(child)
    pulled = {name for name, _ in seen}
    assert len(pulled) > 50, "the walk found too few packages to say anything"
    heavy = {"torch", "accelerate", "nvidia-cudnn-cu12", "triton"} & pulled
    assert not heavy, {name: f"required by {paths[name]}" for name in heavy}


def test_heavy_references_are_their_own_extra_and_markers_are_registered():
    project = _pyproject()
    extras = {name: {canonicalize_name(Requirement(r).name) for r in reqs}
              for name, reqs in project["optional-dependencies"].items()}
    assert {"torch", "transformers", "accelerate"} <= extras["reference"]
    assert not {"torch", "accelerate"} & extras["test"]
    assert "transformers" not in extras["test"]     # paddleformers brings it, without torch
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


def test_hf_recordings_match_their_manifest_and_stay_small():
    """tests/fixtures/hf holds what scripts/record_hf_references.py wrote, as its manifest lists
    it (a file changed by hand, or left over, shows here), with the versions that answered."""
    import hashlib
    import json

    fixtures = ROOT / "tests" / "fixtures" / "hf"
    manifest = json.loads((fixtures / "MANIFEST.json").read_text())
    assert {"transformers", "torch"} <= manifest["versions"].keys()
    on_disk = {p.relative_to(fixtures).as_posix(): p for p in fixtures.rglob("*")
               if p.is_file() and p.name != "MANIFEST.json" and "__pycache__" not in p.parts}
    assert on_disk.keys() == manifest["files"].keys()
    for name, path in on_disk.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == manifest["files"][name]["sha256"], name
    assert sum(f["bytes"] for f in manifest["files"].values()) < 5_000_000
    for name in on_disk:
        if name.endswith(".json") and "/" not in name:      # an answer (not a model directory's file)
            assert json.loads(on_disk[name].read_text()).keys() == {"inputs", "answer"}, name


def test_a_recording_answers_only_for_its_inputs_and_a_live_answer_must_equal_it(tmp_path, monkeypatch):
    import hf_recorded
    import numpy as np

    monkeypatch.setattr(hf_recorded, "FIXTURES", tmp_path)
    answer = {"logits": np.arange(6, dtype=np.float32).reshape(2, 3), "tokens": [3, 1]}
    monkeypatch.setenv("HF_REFERENCE", "record")
    hf_recorded.answer("case", {"ids": [1, 2]}, lambda: answer)
    monkeypatch.setenv("HF_REFERENCE", "recorded")
    read = hf_recorded.answer("case", {"ids": [1, 2]}, lambda: pytest.fail("computed without torch"))
    np.testing.assert_array_equal(read["logits"], answer["logits"])
    assert read["tokens"] == [3, 1]
    with pytest.raises(AssertionError, match="recorded for other inputs.*record_hf_references.py"):
        hf_recorded.answer("case", {"ids": [1, 3]}, lambda: answer)
    with pytest.raises(AssertionError, match="no recording"):
        hf_recorded.answer("other", {}, lambda: answer)
    monkeypatch.setenv("HF_REFERENCE", "live")
    close = {**answer, "logits": answer["logits"] + 1e-6}
    assert hf_recorded.answer("case", {"ids": [1, 2]}, lambda: close)["tokens"] == [3, 1]
    with pytest.raises(AssertionError, match=r"stale.*\['tokens'\]\[1\]"):
        hf_recorded.answer("case", {"ids": [1, 2]}, lambda: {**answer, "tokens": [3, 2]})
    with pytest.raises(AssertionError, match=r"stale.*\['logits'\]"):
        hf_recorded.answer("case", {"ids": [1, 2]}, lambda: {**answer, "logits": answer["logits"] + 0.01})
    monkeypatch.setenv("HF_REFERENCE", "sometimes")
    with pytest.raises(ValueError, match="HF_REFERENCE='sometimes': expected one of live, recorded, record"):
        hf_recorded.mode()
