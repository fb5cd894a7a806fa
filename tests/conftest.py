"""Tests write only under their own temporary directory.

Under Bazel that is ``TEST_TMPDIR``; under plain pytest a fresh directory removed at exit. ``HOME`` and the XDG
base directories (so ``$XDG_CACHE_HOME/recipe-bundle/{kernels,cas}`` and every cache a run or a tool creates)
point there before any test runs, and ``KERNEL_CACHE`` is unset so runs take their default under it; under
Bazel pytest's ``tmp_path`` directories are there too (``--basetemp``, helpers.main). ``TMPDIR`` is left alone:
Bazel's ``TEST_TMPDIR`` is longer than a unix socket's path may be, and Ray puts sockets in the temp directory.
``TRAINER_ENV_ROOT`` names where the running launcher environment lives, so that ``bin/python-env`` called from a
test finds it instead of building another one under the new ``HOME``; ``PIP_CONFIG_FILE`` keeps the user's pip
configuration (package access) when ``HOME`` moves.
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

SUBDIRS = {
    "HOME": "home",
    "XDG_CACHE_HOME": "cache",
    "XDG_CONFIG_HOME": "config",
    "XDG_DATA_HOME": "data",
    "XDG_STATE_HOME": "state",
}


def _keep_pip_configuration() -> None:
    """Package access is not something tests write: a user's pip configuration (the indexes and wheel folders
    it names) stays in force after ``HOME`` moves, through ``PIP_CONFIG_FILE`` (read after pip's other
    files). Taken from the account's real home (``pwd``), since Bazel may already have replaced ``HOME``."""
    import pwd

    if os.environ.get("PIP_CONFIG_FILE"):
        return
    homes = {os.environ.get("HOME", ""), pwd.getpwuid(os.getuid()).pw_dir}
    for home in sorted(h for h in homes if h):
        for rel in (".config/pip/pip.conf", ".pip/pip.conf"):
            if (Path(home) / rel).is_file():
                os.environ["PIP_CONFIG_FILE"] = str(Path(home) / rel)
                return


def _confine() -> Path:
    given = os.environ.get("TEST_TMPDIR")
    if not given:
        given = tempfile.mkdtemp(prefix="recipe-bundle-tests-")
        atexit.register(shutil.rmtree, given, True)
    base = Path(given).absolute()
    if (Path(sys.prefix) / ".complete").is_file():  # a launcher environment made by bin/python-env
        os.environ["TRAINER_ENV_ROOT"] = str(Path(sys.prefix).parent)
    _keep_pip_configuration()
    for name, sub in SUBDIRS.items():
        (base / sub).mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(base / sub)
    os.environ.pop("KERNEL_CACHE", None)
    return base


TEST_ROOT = _confine()


@pytest.fixture
def hydra_calls(monkeypatch):
    """The override lists Hydra's own ``compose`` was called with (a cache hit makes no call)."""
    from trainer.compose import compose as compose_module

    calls = []
    real = compose_module.compose
    monkeypatch.setattr(compose_module, "compose", lambda *a, **k: calls.append(k.get("overrides")) or real(*a, **k))
    return calls


@pytest.fixture
def compose_cache(tmp_path, monkeypatch):
    """A composition-cache directory of the test's own, and a cache key of its own (``XDG_CONFIG_HOME`` under
    ``tmp_path``)."""
    from trainer.compose import cache as cache_module
    from trainer.image import stampkey

    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(cache_module, "_KEY", None)
    monkeypatch.setattr(stampkey, "_PROCESS_KEY", None)
    return tmp_path / "cache"


class Result:
    """What a command ended with: ``returncode``, ``stdout``, ``stderr`` (as ``subprocess.CompletedProcess``)."""

    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def refused_train(monkeypatch, capsys):
    """``train ARGS`` in this process for a command line that ends before a run starts (a refusal: fast)."""
    from trainer import train

    def call(args, cwd):
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", ["train", *args])
        with pytest.raises(SystemExit) as exit_info:
            train.main()
        out = capsys.readouterr()
        return Result(exit_info.value.code, out.out, out.err)

    return call


@pytest.fixture
def eight_ranks_at_a_time():
    """For a test that trains eight ranks at once (ask for it after the module's cluster and reference run, so
    that those start outside it): the test runs while it holds :func:`helpers.one_heavy_at_a_time`'s lock."""
    import helpers

    with helpers.one_heavy_at_a_time():
        yield
