"""bin/python-env: where the launcher's torch CPU build comes from (it is not on PyPI)."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from packaging.tags import sys_tags

import helpers
from helpers import REPO_ROOT

TORCH_PIN = next(
    line.split()[0]
    for line in (REPO_ROOT / "lockfiles" / "launcher.lock").read_text().splitlines()
    if line.startswith("torch==")
)


def torch_source(**pip_env):
    """`bin/python-env --torch-source` with pip's configuration files ignored and no index: only ``pip_env``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", **pip_env)
    return subprocess.run(
        [str(REPO_ROOT / "bin" / "python-env"), "--torch-source"], capture_output=True, text=True, env=env, timeout=120
    )


def test_pytorchs_cpu_index_is_added_when_pip_does_not_find_the_wheel():
    out = torch_source()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]
    assert out.stderr.strip() == (
        f"bin/python-env: {TORCH_PIN} is not where pip is configured to look; adding "
        "PyTorch's CPU index https://download.pytorch.org/whl/cpu (the lock's sha256 is "
        "checked as for every file)"
    )


def test_nothing_is_added_when_a_configured_wheel_folder_has_it(tmp_path):
    version = TORCH_PIN.split("==")[1]
    (tmp_path / f"torch-{version}-{next(iter(sys_tags()))}.whl").write_bytes(b"")  # pip reads only the name here
    out = torch_source(PIP_FIND_LINKS=str(tmp_path))
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    other = tmp_path / "other"
    other.mkdir()
    (other / f"torch-{version}-cp30-cp30-manylinux_2_28_x86_64.whl").write_bytes(b"")  # for another Python
    assert torch_source(PIP_FIND_LINKS=str(other)).stdout.split()[0] == "--extra-index-url"


def test_the_environment_is_the_one_running_the_tests():
    out = subprocess.run([str(REPO_ROOT / "bin" / "python-env")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == ""
    assert Path(out.stdout.strip()).parent == Path(sys.executable).parent


def _fast_path_setup(tmp_path):
    """An environment root holding a complete environment for the lock, and TRAINER_PYTHON a wrapper that logs
    every start of the interpreter it wraps (the Python running the tests)."""
    key = hashlib.sha256((REPO_ROOT / "lockfiles" / "launcher.lock").read_bytes()).hexdigest()[:16]
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    env_dir = tmp_path / "envs" / f"{key}-py{version}"
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").symlink_to(sys.executable)
    (env_dir / ".complete").touch()
    log = tmp_path / "starts.log"
    wrapper = tmp_path / "bin" / "python-wrapped"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho start >> {log}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, TRAINER_ENV_ROOT=str(tmp_path / "envs"), TRAINER_PYTHON=str(wrapper))
    return env_dir, wrapper, log, work, env


def _python_env(env, cwd):
    return subprocess.run(
        [str(REPO_ROOT / "bin" / "python-env")], capture_output=True, text=True, env=env, cwd=cwd, timeout=60
    )


def _starts(log):
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_complete_environment_is_found_without_starting_python(tmp_path):
    env_dir, wrapper, log, work, env = _fast_path_setup(tmp_path)
    first = _python_env(env, work)
    assert (first.returncode, first.stdout.strip(), first.stderr) == (0, str(env_dir / "bin" / "python"), "")
    assert _starts(log) == 2  # the slow path: choose the interpreter, name its version
    for _ in range(3):
        again = _python_env(env, work)
        assert (again.returncode, again.stdout, again.stderr) == (0, first.stdout, "")
    assert _starts(log) == 2  # the fast path started no Python


def test_the_fast_path_follows_the_interpreter_its_version_files_and_the_environment(tmp_path):
    env_dir, wrapper, log, work, env = _fast_path_setup(tmp_path)
    assert _python_env(env, work).returncode == 0
    starts = _starts(log)
    wrapper.write_text(wrapper.read_text())  # the same interpreter name, replaced: its ctime changes
    assert _python_env(env, work).returncode == 0 and _starts(log) == starts + 2
    starts += 2
    (work / ".python-version").write_text("3.99\n")  # a version manager's shim would now choose another one
    assert _python_env(env, work).returncode == 0 and _starts(log) == starts + 2
    starts += 2
    assert _python_env(env, work).returncode == 0 and _starts(log) == starts  # that state is the stamp's now
    other = dict(env, PYENV_VERSION="3.98")
    assert _python_env(other, work).returncode == 0 and _starts(log) == starts + 2
    # an environment no longer complete is never answered from the stamp: the slow path runs, and here refuses
    (env_dir / ".complete").unlink()
    broken = dict(env, TRAINER_PYTHON=str(tmp_path / "no-such-python"))
    out = _python_env(broken, work)
    assert out.returncode == 2 and out.stdout == "" and "need Python >= 3.11" in out.stderr


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
