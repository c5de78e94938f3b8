"""Tests run in the process beside the suite (tests/beside.py) keep their ids and outcomes:
a failure there fails here with its report, a skip skips with its reason, and the main
process runs its own tests first."""

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

CONFTEST = f"""
import sys
sys.path.insert(0, {HERE!r})
import beside
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    beside.collection_modifyitems(config, items)

def pytest_collection_finish(session):
    beside.collection_finish(session)

def pytest_runtest_logreport(report):
    beside.runtest_logreport(report)

def pytest_sessionfinish(session):
    beside.sessionfinish(session)
"""

BESIDE_TESTS = """
import os
import pytest

def test_passes_beside():
    assert os.environ["FLEET_TESTS_BESIDE_REPORT"]      # it did run in the other process

def test_fails_beside():
    assert 1 + 1 == 3, "arithmetic is off"

def test_skips_beside():
    pytest.skip("nothing to see")

@pytest.fixture
def broken():
    raise RuntimeError("setup broke")

def test_setup_fails_beside(broken):
    pass
"""


def test_outcomes_of_the_process_beside_are_the_suites(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(CONFTEST)
    (tests / "test_loader.py").write_text(BESIDE_TESTS)       # one of beside.BESIDE_FILES
    (tests / "test_a_first.py").write_text("def test_here():\n    import os\n"
                                           "    assert 'FLEET_TESTS_BESIDE_REPORT' not in os.environ\n")
    env = {k: v for k, v in os.environ.items() if k not in ("FLEET_TESTS_BESIDE_REPORT", "NUMBA_ENABLE_CUDASIM")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", str(tests)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "2 failed, 2 passed, 1 skipped" in out, out
    order = [line.split(" ")[0] for line in out.splitlines() if line.startswith("tests/") and "::" in line]
    assert order[0] == "tests/test_a_first.py::test_here", out            # its own tests first
    assert "[call in the process beside the suite]" in out and "arithmetic is off" in out
    assert "[setup in the process beside the suite]" in out and "setup broke" in out
    assert "test_loader.py:12: nothing to see" in out
    assert "PASSED" in textwrap.dedent(out.split("test_passes_beside", 1)[1].splitlines()[0])
