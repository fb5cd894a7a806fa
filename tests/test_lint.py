"""The code's own checks, with zero findings allowed: ruff (lint and format), mypy (types), import-linter (the
import contract between the phases). Their configuration is pyproject.toml's ``[tool.ruff]``, ``[tool.mypy]`` and
``[tool.importlinter]``; the tools are pinned by lockfiles/launcher.lock and run from this interpreter's
environment. Each check is also run on a file with one planted finding, which it must report (the check is live)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT

BIN = Path(sys.executable).parent
PATHS = ["trainer", "tests", "bench"]


def tool(name: str, *args: str, cwd: Path = REPO_ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run one of the environment's tools (``BIN/name ARGS``) in ``cwd``; capture its output (text)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [str(BIN / name), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def cache_dir(name: str) -> str:
    """A cache directory for one tool, inside the test's own temporary directory when Bazel gives one."""
    root = Path(os.environ.get("TEST_TMPDIR") or "/tmp") / f"lint-cache-{os.getuid()}"
    return str(root / name)


def test_ruff_finds_nothing():
    result = tool("ruff", "check", "--no-cache", *PATHS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_changes_nothing():
    result = tool("ruff", "format", "--check", "--no-cache", *PATHS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_nothing():
    result = tool("mypy", "--cache-dir", cache_dir("mypy"))
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr
    assert result.stdout.splitlines()[-1].startswith("Success: no issues found in ")


def test_import_contract_is_kept():
    result = tool("lint-imports", "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    "source, rule",
    [
        ("import os\n", "F401"),  # pyflakes: unused import
        ("def f(x=[]):\n    return x\n", "B006"),  # bugbear: mutable default
        ("import sys\nimport os\n\nprint(os, sys)\n", "I001"),  # import order
        ("from typing import List\n\nx: List[int] = []\n", "UP006"),  # pyupgrade
        ("x = 1  # " + "long " * 30 + "\n", "E501"),  # line length 120
    ],
)
def test_ruff_reports_a_planted_finding(tmp_path, source, rule):
    (tmp_path / "pyproject.toml").write_text((REPO_ROOT / "pyproject.toml").read_text())
    (tmp_path / "planted.py").write_text(source)
    result = tool("ruff", "check", "--no-cache", "planted.py", cwd=tmp_path)
    assert result.returncode == 1
    assert rule in result.stdout


def test_ruff_format_reports_a_planted_finding(tmp_path):
    (tmp_path / "pyproject.toml").write_text((REPO_ROOT / "pyproject.toml").read_text())
    (tmp_path / "planted.py").write_text("x = {  'a':1 }\n")
    result = tool("ruff", "format", "--check", "--no-cache", "planted.py", cwd=tmp_path)
    assert result.returncode == 1
    assert "planted.py" in result.stdout


def test_mypy_reports_a_planted_finding(tmp_path):
    (tmp_path / "planted.py").write_text("def f(x: int) -> str:\n    return x\n")
    result = tool(
        "mypy", "--no-incremental", "--config-file", str(REPO_ROOT / "pyproject.toml"), "planted.py", cwd=tmp_path
    )
    assert result.returncode == 1
    assert 'planted.py:2: error: Incompatible return value type (got "int", expected "str")' in result.stdout


ENTRY = 'if __name__ == "__main__":\n    raise SystemExit(helpers.main(__file__))\n'


def has_entry_point(source: str) -> bool:
    """Whether the module ``source`` imports ``helpers`` at top level and its last top-level statement is
    :data:`ENTRY` (compared as syntax trees, so a commented-out copy does not count)."""
    body = ast.parse(source).body
    imports = any(isinstance(s, ast.Import) and any(a.name == "helpers" for a in s.names) for s in body)
    return bool(body) and imports and ast.dump(body[-1]) == ast.dump(ast.parse(ENTRY).body[0])


def missing_entry_points(test_dir: Path) -> list[str]:
    """The ``test_*.py`` modules of ``test_dir`` that do not end with the py_test entry point (:data:`ENTRY`):
    Bazel runs each module as a script, so one without it passes having run no test."""
    return sorted(p.name for p in test_dir.glob("test_*.py") if not has_entry_point(p.read_text()))


def test_every_test_module_runs_its_tests_under_bazel(tmp_path):
    assert missing_entry_points(REPO_ROOT / "tests") == []
    cases = {
        "test_none.py": "def test_x():\n    assert False\n",
        "test_commented.py": "import helpers\n\n\ndef _f():\n    pass\n#" + ENTRY,
        "test_mid_file.py": "import helpers\n\n" + ENTRY + "\n\ndef test_x():\n    assert False\n",
        "test_no_import.py": "from helpers import REPO_ROOT\n\n\n" + ENTRY,
        "test_ok.py": "import helpers\n\n\n" + ENTRY,
    }
    for name, source in cases.items():
        (tmp_path / name).write_text(source)
    assert missing_entry_points(tmp_path) == sorted(set(cases) - {"test_ok.py"})


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
