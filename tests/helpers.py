"""Shared test helpers: the repository root, golden files, composing configs, running the CLI."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from trainer.compose import compose_run

REPO_ROOT = Path(__file__).absolute().parent.parent
GOLDEN = Path(__file__).absolute().parent / "golden"


def compose(*overrides: str):
    """Compose ``conf/train.yaml`` with ``overrides`` (schema-validated DictConfig)."""
    return compose_run(list(overrides))


def reference_model_args(variant: str = "deepseek-v4-flash") -> List[str]:
    """miles 78527b91's model-args snapshot for ``variant``: one quoted token per line."""
    path = GOLDEN / f"miles-78527b91.model-args.{variant}.txt"
    return [shlex.split(line)[0] for line in path.read_text().splitlines() if line.strip()]


def seed_command() -> Tuple[List[str], Dict[str, str]]:
    """The seed's launch (``attune-tp2-pp4-ep8.command.sh``) as (argv, env).

    ``export`` lines give the env (values unquoted, ``$VARS`` kept); the ``python3 train.py`` command
    is joined across line continuations and split like a shell would, with ``"${MODEL_ARGS[@]}"``
    expanded from the model-args snapshot, as the script's ``read -ra MODEL_ARGS`` does.
    """
    text = (GOLDEN / "attune-tp2-pp4-ep8.command.sh").read_text()
    env: Dict[str, str] = {}
    command: List[str] = []
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("export "):
            name, _, value = line[len("export "):].partition("=")
            env[name] = shlex.split(value)[0]
        elif line.startswith("python3 "):
            command = shlex.split(line)
    argv: List[str] = []
    for token in command:
        argv += reference_model_args() if token == "${MODEL_ARGS[@]}" else [token]
    return argv, env


def same_token(a: str, b: str) -> bool:
    """Two argv tokens mean the same to argparse: equal strings, or equal numbers (``16`` vs ``16.0``)."""
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def run_train(args: Sequence[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m trainer.train ARGS`` in ``cwd`` with the current interpreter; capture output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "160"
    return subprocess.run(
        [sys.executable, "-m", "trainer.train", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


def main(test_file: str) -> int:
    """Run pytest on one test module (the py_test entry point); JUnit XML goes where Bazel asks for it."""
    import pytest

    args = [test_file, "-q", "-p", "no:cacheprovider"]
    if os.environ.get("XML_OUTPUT_FILE"):
        args.append(f"--junitxml={os.environ['XML_OUTPUT_FILE']}")
    return pytest.main(args)
