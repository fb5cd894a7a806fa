"""`bin/train` behaves as a Hydra app: a minimal ``@hydra.main`` app on the same config tree and `bin/train` agree
on sweeps (``a,b``, ``glob()``, ``range()``, ``choice()``, ``hydra.mode=MULTIRUN``), shell completion, verbose
logging and help; and `train.log` holds what the run said and decided, redacted.
"""

import json
import os
import re
import subprocess
import sys

import pytest

import helpers
from helpers import REPO_ROOT

# A plain Hydra app on the bundle's config tree: each job prints its task overrides as JSON, logs one debug line.
MINIMAL_APP = f"""
import json, logging, sys
sys.path.insert(0, {str(REPO_ROOT)!r})
import hydra
from hydra.core.hydra_config import HydraConfig
from trainer.compose import schema

log = logging.getLogger("minimal")


@hydra.main(config_path={str(REPO_ROOT / "conf")!r}, config_name="train", version_base="1.3")
def main(cfg):
    log.debug("a debug line of the minimal app")
    print("JOB " + json.dumps(sorted(HydraConfig.get().overrides.task)))


if __name__ == "__main__":
    schema.register()
    main()
"""


@pytest.fixture(scope="module")
def minimal(tmp_path_factory):
    app = tmp_path_factory.mktemp("app") / "minimal_app.py"
    app.write_text(MINIMAL_APP)
    return app


def run(argv, cwd, **env):
    return subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "160", **env}
    )


def minimal_jobs(minimal, args, tmp_path):
    r = run(
        [
            sys.executable,
            str(minimal),
            *args,
            f"hydra.sweep.dir={tmp_path / 'minimal'}",
            f"hydra.run.dir={tmp_path / 'minimal-run'}",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return sorted(json.loads(line[4:]) for line in r.stdout.splitlines() if line.startswith("JOB "))


def train_jobs(args, tmp_path):
    sweep = tmp_path / "train"
    r = run([str(REPO_ROOT / "bin" / "train"), *args, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = []
    for record in sorted(sweep.glob("*/record.json")):
        overrides = json.loads(record.read_text())["overrides"]
        jobs.append(sorted(o for o in overrides if not o.startswith("hydra.sweep.dir=")))
    return sorted(jobs)


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "layout=tp2pp4ep8,tp8pp8ep8"],
        ["-m", "layout=glob(tp*)"],
        ["-m", "layout=glob(tp*,exclude=tp8*)", "optim.lr=1e-5,2e-5"],
        ["-m", "optim.lr=choice(1e-5,2e-5)"],
        ["-m", "launcher.steps=range(2,5)"],
        ["hydra.mode=MULTIRUN", "layout=tp2pp4ep8,tp8pp8ep8"],
    ],
    ids=["list", "glob", "glob-exclude", "choice", "range", "hydra.mode"],
)
def test_a_sweep_runs_the_jobs_a_plain_hydra_app_runs(minimal, tmp_path, args):
    expected = minimal_jobs(minimal, args, tmp_path)
    assert len(expected) >= 2
    assert train_jobs(args, tmp_path) == expected


def test_a_sweep_without_multirun_is_refused_in_one_line_as_hydra_refuses_it(minimal, tmp_path):
    plain = run([sys.executable, str(minimal), "layout=tp2pp4ep8,tp8pp8ep8"], tmp_path)
    assert plain.returncode != 0 and "multirun" in plain.stderr.lower()
    ours = run([str(REPO_ROOT / "bin" / "train"), "layout=tp2pp4ep8,tp8pp8ep8"], tmp_path)
    assert ours.returncode == 2 and ours.stderr.splitlines() == [
        "train: error: layout=tp2pp4ep8,tp8pp8ep8: a sweep needs multirun (-m, or hydra.mode=MULTIRUN)"
    ]


def test_shell_completion_is_bound_to_the_command_as_typed(tmp_path):
    """The install line Hydra prints names `bin/train` as typed, binds completion to `train` (bash also uses it
    for `bin/train`), and the query completes the bundle's groups."""
    train = REPO_ROOT / "bin" / "train"
    helped = run([str(train), "--hydra-help"], tmp_path)
    assert f'eval "$({train} -sc install=bash)"' in helped.stdout
    install = run([str(train), "-sc", "install=bash"], tmp_path)
    assert install.returncode == 0 and install.stdout.rstrip().endswith("-F hydra_bash_completion train")
    bound = subprocess.run(
        ["bash", "-c", f'eval "$({train} -sc install=bash)" && complete -p train'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bound.stdout.strip() == "complete -o default -o nospace -F hydra_bash_completion train"
    query = run([str(train), "-sc", "query=bash"], tmp_path, COMP_LINE="bin/train lay", COMP_POINT="13")
    assert query.stdout.split() == ["layout.", "layout="]


def test_hydra_verbose_prints_debug_lines_as_a_plain_app_does(minimal, tmp_path):
    plain = run([sys.executable, str(minimal), "hydra.verbose=true", f"hydra.run.dir={tmp_path / 'm'}"], tmp_path)
    assert "[DEBUG] - a debug line of the minimal app" in plain.stdout
    quiet = run([str(REPO_ROOT / "bin" / "train"), f"hydra.run.dir={tmp_path / 'q'}"], tmp_path)
    verbose = run([str(REPO_ROOT / "bin" / "train"), "hydra.verbose=true", f"hydra.run.dir={tmp_path / 'v'}"], tmp_path)
    assert "[DEBUG]" not in quiet.stdout
    debug = [line for line in verbose.stdout.splitlines() if "[trainer][DEBUG] - " in line]
    assert any("with Hydra" in line or "from the cache" in line for line in debug), verbose.stdout


def test_every_group_the_help_lists_composes(tmp_path):
    helped = run([str(REPO_ROOT / "bin" / "train"), "--help"], tmp_path)
    groups = re.findall(r"^(\w+): ", helped.stdout.split("Config groups")[1].split("Every field")[0], re.M)
    assert "convergence" not in groups and {"layout", "model", "cluster", "launcher"} <= set(groups)
    for group in groups:
        options = sorted(p.stem for p in (REPO_ROOT / "conf" / group).glob("*.yaml"))
        r = run([str(REPO_ROOT / "bin" / "train"), f"{group}={options[0]}", "--cfg", "job"], tmp_path)
        assert r.returncode == 0, (group, r.stderr[-2000:])


def test_train_log_holds_what_a_plan_said_and_decided_redacted(tmp_path):
    secret = "tRaInLoGsEcReT99"
    out = tmp_path / "run"
    r = run([str(REPO_ROOT / "bin" / "train"), f"hydra.run.dir={out}", f"+env.HF_TOKEN={secret}"], tmp_path)
    assert r.returncode == 0, r.stderr
    log = (out / "train.log").read_text()
    assert secret not in log and "+env.HF_TOKEN=<redacted>" in log
    lines = log.splitlines()
    assert all(
        re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]\[[\w.]+\]\[(INFO|DEBUG|WARNING|ERROR)\] - ", line)
        for line in lines
    )
    said = [line.split("] - ", 1)[1] for line in lines]
    assert any(s.startswith("checked ") and "stack pins against lockfiles/stack.json" in s for s in said)
    assert any(s.startswith("numerics against layout tp8pp8ep8: ") for s in said)
    for printed in r.stdout.splitlines():  # what the summary says, line by line
        assert printed.rstrip() in said, printed


def test_train_log_of_a_cpu_run_holds_its_launcher_steps(tmp_path):
    out = tmp_path / "run"
    r = run(
        [str(REPO_ROOT / "bin" / "train"), "experiment=smoke", "launcher.steps=2", f"hydra.run.dir={out}"], tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[0].startswith("starting ")  # said from the first second, before torch loads
    said = [line.split("] - ", 1)[1] for line in (out / "train.log").read_text().splitlines()]
    assert any(s.startswith("starting ") and "worker process" in s for s in said)
    assert any(s.startswith("workers ended complete: exit codes [0") for s in said)
    assert said[-1].startswith("run complete")


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
