"""bin/python-env: where the launcher's torch CPU build comes from (it is not on PyPI)."""

import os
import subprocess
import sys
from pathlib import Path

from packaging.tags import sys_tags

import helpers
from helpers import REPO_ROOT

TORCH_PIN = next(line.split()[0] for line in (REPO_ROOT / "lockfiles" / "launcher.lock").read_text().splitlines()
                 if line.startswith("torch=="))


def torch_source(**pip_env):
    """`bin/python-env --torch-source` with pip's configuration files ignored and no index: only ``pip_env``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", **pip_env)
    return subprocess.run([str(REPO_ROOT / "bin" / "python-env"), "--torch-source"], capture_output=True, text=True,
                          env=env, timeout=120)


def test_pytorchs_cpu_index_is_added_when_pip_does_not_find_the_wheel():
    out = torch_source()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]
    assert out.stderr.strip() == (f"bin/python-env: {TORCH_PIN} is not where pip is configured to look; adding "
                                  "PyTorch's CPU index https://download.pytorch.org/whl/cpu (the lock's sha256 is "
                                  "checked as for every file)")


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


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
