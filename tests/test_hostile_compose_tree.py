"""A hostile config tree under the composition cache (trainer/compose/cache.py): FIFOs and link loops in conf/
never hang the key's walk nor Hydra, and a composition holding a secret (in a job list too) is never stored."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import helpers
from helpers import REPO_ROOT
from trainer.compose import cache as cache_module
from trainer.compose.compose import session

SCHEMA = REPO_ROOT / "trainer" / "compose" / "schema.py"


@pytest.fixture
def root(compose_cache):
    return compose_cache


def entries(root):
    return sorted(root.glob("*" + cache_module.SUFFIX))


def copy_bundle(tmp_path):
    """What `train` needs of the repository, copied (trainer/, conf/, lockfiles/), so that its conf/ can be made
    hostile."""
    bundle = tmp_path / "bundle"
    for name in ("trainer", "conf", "lockfiles"):
        shutil.copytree(REPO_ROOT / name, bundle / name, ignore=shutil.ignore_patterns("__pycache__"))
    return bundle


def train_in(bundle, args, cwd, env):
    """`python -m trainer.train ARGS` of the copied bundle, killed after 20 s."""
    env = {**os.environ, **env, "PYTHONPATH": str(bundle), "COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-m", "trainer.train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=20
    )


def test_a_fifo_in_conf_neither_hangs_the_cache_nor_hydra(tmp_path, root, hydra_calls):
    """Promise: a FIFO in the config tree (a group option `model/evil.yaml`, and one at the top) is recorded in
    the key by its name and kind and never opened: with the cache on, compositions are cached and correct, and
    `train` plans (exit 0) in bounded time; choosing the FIFO is Hydra's one-line "Could not find" (Hydra lists
    only regular files); replacing the FIFO by a file changes the key."""
    bundle = copy_bundle(tmp_path)
    conf = bundle / "conf"
    os.mkfifo(conf / "model" / "evil.yaml")
    os.mkfifo(conf / "notes")
    with helpers.bounded(20):
        for _ in range(2):
            with session(conf) as composer:
                assert composer.compose(["layout=tp8pp8ep8"]).layout.tensor_model_parallel_size == 8
        assert len(hydra_calls) == 1
        key = cache_module.tree_digest(conf, SCHEMA)
    env = {"TRAINER_COMPOSE_CACHE": str(root), "XDG_CONFIG_HOME": os.environ["XDG_CONFIG_HOME"]}
    proc = train_in(bundle, ["layout=tp2pp4ep8", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["parallelism"]["world_size"] == 64
    assert entries(root)  # cached with the FIFO there
    proc = train_in(bundle, ["model=evil", f"hydra.run.dir={tmp_path / 'evil'}"], tmp_path, env)
    assert proc.returncode == 2 and "Could not find 'model/evil'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    (conf / "notes").unlink()
    (conf / "notes").write_text("")
    assert cache_module.tree_digest(conf, SCHEMA) != key


def test_link_loops_in_conf_are_walked_once(tmp_path, root, hydra_calls):
    """Promise: three `ln -s .. conf/model/loopN` links (each a loop to the whole tree) cost the key one walk of
    the tree: the key is computed in well under a second, `train` plans the recipe from the cache in bounded
    time (20 s), and re-pointing a loop elsewhere changes the key."""
    bundle = copy_bundle(tmp_path)
    conf = bundle / "conf"
    for n in (1, 2, 3):
        (conf / "model" / f"loop{n}").symlink_to("..")
    schema_file = SCHEMA
    start = time.perf_counter()
    with helpers.bounded(20):
        key = cache_module.tree_digest(conf, schema_file)
    assert time.perf_counter() - start < 2
    env = {"TRAINER_COMPOSE_CACHE": str(root), "XDG_CONFIG_HOME": os.environ["XDG_CONFIG_HOME"]}
    plans, stored = [], []
    for _ in range(2):  # cold, then from the cache (the same command line: --overwrite the same directory)
        proc = train_in(bundle, ["layout=tp2pp4ep8", f"hydra.run.dir={tmp_path / 'run'}", "--overwrite"], tmp_path, env)
        assert proc.returncode == 0, proc.stderr
        plans.append((tmp_path / "run" / "plan.json").read_bytes())
        assert json.loads(plans[-1])["parallelism"]["world_size"] == 64
        assert len(entries(root)) == 2  # the job and the reference layout: stored once, read the second time
        stored.append({e.name: e.stat().st_mtime_ns for e in entries(root)})
    assert plans[0] == plans[1]
    assert stored[0] == stored[1]  # read, not written again: the same entries, their mtime_ns unchanged
    (conf / "model" / "loop3").unlink()
    (conf / "model" / "loop3").symlink_to("../layout")
    assert cache_module.tree_digest(conf, schema_file) != key
    for n in (1, 2, 3):  # no loop is left behind for a tool that walks the test's directory (a recursive glob)
        (conf / "model" / f"loop{n}").unlink()


def test_a_composition_with_a_secret_in_a_job_list_is_never_stored(root, hydra_calls, tmp_path):
    """Promise: a secret in a list element (a CLI flag `--hf-token=V`, a flag and its value as two elements,
    `HF_TOKEN=V`, an `Authorization: Bearer V` header) makes a composition uncacheable: no entry file holds the
    canary, and the next run composes it again. A secret a config file of the tree puts in a long list element
    (where YAML would fold the line) is found too: each value is scrubbed on its own."""
    canary = "abcdefgh12"
    jobs = [
        f"launcher.job=[x,'--hf-token={canary}']",
        f"launcher.job=[x,--hf-token,{canary}]",
        f"launcher.job=[x,HF_TOKEN\\={canary}]",
        f"launcher.job=[x,'Authorization: Bearer {canary}']",
    ]
    for _ in range(2):
        with session() as composer:
            for job in jobs:
                assert canary in " ".join(composer.compose([job]).launcher.job)
                composer.compose([job, "hydra.mode=RUN"], hydra_node=True)
    assert len(hydra_calls) == 4 * len(jobs)
    assert not any(canary.encode() in p.read_bytes() for p in root.rglob("*") if p.is_file())
    conf = tmp_path / "conf"
    shutil.copytree(REPO_ROOT / "conf", conf)
    plan = conf / "launcher" / "plan.yaml"
    words = " ".join(["word"] * 30)
    plan.write_text(plan.read_text() + f"job: [x, '{words} Authorization: Bearer {canary}xyz']\n")
    for _ in range(2):
        with session(conf) as composer:
            assert canary in composer.compose([]).launcher.job[1]
    assert len(hydra_calls) == 4 * len(jobs) + 2
    assert not any(canary.encode() in p.read_bytes() for p in root.rglob("*") if p.is_file())


def test_a_config_under_pycache_is_in_the_key(tmp_path, root, hydra_calls):
    """Promise: a config Hydra composes from a __pycache__ directory (optim=__pycache__/x) is in the key: editing
    it (lr 1e-3, then 9e-3) gives the new value, never the cached old one."""
    conf = tmp_path / "conf"
    shutil.copytree(REPO_ROOT / "conf", conf)
    (conf / "optim" / "__pycache__").mkdir()
    source = (conf / "optim" / "recipe-sft.yaml").read_text()
    for lr in ("1.0e-3", "9.0e-3"):
        (conf / "optim" / "__pycache__" / "x.yaml").write_text(source.replace("lr: 1.0e-5", f"lr: {lr}"))
        with session(conf) as composer:
            assert composer.compose(["optim=__pycache__/x"]).optim.lr == float(lr)
    assert len(hydra_calls) == 2 and len(entries(root)) == 2


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
