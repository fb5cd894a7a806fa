"""Shared test helpers: the repository root, golden files, composing configs, running the CLI."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from trainer.compose.compose import compose_run

REPO_ROOT = Path(__file__).absolute().parent.parent
GOLDEN = Path(__file__).absolute().parent / "golden"


def compose(*overrides: str):
    """Compose ``conf/train.yaml`` with ``overrides`` (schema-validated DictConfig)."""
    return compose_run(list(overrides))


def reference_model_args(variant: str = "deepseek-v4-flash") -> list[str]:
    """miles 78527b91's model-args snapshot for ``variant``: one quoted token per line."""
    path = GOLDEN / f"miles-78527b91.model-args.{variant}.txt"
    return [shlex.split(line)[0] for line in path.read_text().splitlines() if line.strip()]


def seed_command() -> tuple[list[str], dict[str, str]]:
    """The seed's launch (``attune-tp2-pp4-ep8.command.sh``) as (argv, env).

    ``export`` lines give the env (values unquoted, ``$VARS`` kept); the ``python3 train.py`` command
    is joined across line continuations and split like a shell would, with ``"${MODEL_ARGS[@]}"``
    expanded from the model-args snapshot, as the script's ``read -ra MODEL_ARGS`` does.
    """
    text = (GOLDEN / "attune-tp2-pp4-ep8.command.sh").read_text()
    env: dict[str, str] = {}
    command: list[str] = []
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("export "):
            name, _, value = line[len("export ") :].partition("=")
            env[name] = shlex.split(value)[0]
        elif line.startswith("python3 "):
            command = shlex.split(line)
    argv: list[str] = []
    for token in command:
        argv += reference_model_args() if token == "${MODEL_ARGS[@]}" else [token]
    return argv, env


def pids_running(*argv: str) -> list[int]:
    """PIDs of this machine's processes whose command line contains ``argv`` as consecutive arguments (read from
    ``/proc/PID/cmdline``, so nothing outside the standard library is needed)."""
    want = [a.encode() for a in argv]
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        if any(args[i : i + len(want)] == want for i in range(len(args))):
            pids.append(int(entry.name))
    return pids


def run_train(
    args: Sequence[str],
    cwd: Path,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python -m trainer.train ARGS`` in ``cwd`` with the current interpreter (``env``: variables set on top
    of this process's environment; ``preexec_fn``: run in the child before exec, e.g. to join a network
    namespace); capture output."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "160"
    return subprocess.run(
        [sys.executable, "-m", "trainer.train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


HEAVY_LOCK = Path("/tmp/recipe-bundle-eight-ranks.lock")  # fixed: Bazel gives each test its own TMPDIR


@contextlib.contextmanager
def one_heavy_at_a_time():
    """Hold an exclusive lock (``flock`` on :data:`HEAVY_LOCK`) while a test trains eight ranks at once (about
    11 GB of memory): two such tests that Bazel runs side by side take turns instead of exhausting the machine's
    memory together. Only the training holds it: the clusters' start-up, the one-process reference runs, the
    checks and the other tests run on beside it."""
    import fcntl

    with open(HEAVY_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def bounded(seconds: int):
    """Fail (instead of hanging the test run) when the block takes more than ``seconds``."""
    import signal

    def expired(*_):
        raise TimeoutError(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


_NAMESPACE: list[list[str]] = []


def tmpfs_namespace() -> list[str]:
    """The command prefix that makes a mount namespace in which a test may mount a small tmpfs (a real full disk):
    ``unshare --user --map-root-user --mount``, or as root ``unshare --mount``; [] when neither works here."""
    import tempfile

    if not _NAMESPACE:
        target = tempfile.mkdtemp(prefix="ns-probe-")
        found: list[str] = []
        try:
            candidates = [["unshare", "--user", "--map-root-user", "--mount"]]
            if os.geteuid() == 0:
                candidates.append(["unshare", "--mount"])
            for prefix in candidates:
                try:
                    probe = subprocess.run(
                        [*prefix, "sh", "-c", f"mount -t tmpfs -o size=16k tmpfs {target} && umount {target}"],
                        capture_output=True,
                        timeout=30,
                    )
                except (OSError, subprocess.SubprocessError):
                    continue
                if probe.returncode == 0:
                    found = prefix
                    break
        finally:
            os.rmdir(target)
        _NAMESPACE.append(found)
    return _NAMESPACE[0]


def needs_tmpfs(test):
    """Skip ``test`` (naming why) where no mount namespace with a tmpfs can be made (:func:`tmpfs_namespace`)."""
    import pytest

    return pytest.mark.skipif(
        not tmpfs_namespace(),
        reason="no mount namespace can be made here (unshare --user "
        "--map-root-user --mount and, as root, unshare --mount both refused): no tmpfs to "
        "fill",
    )(test)


def assert_one_line(stderr: str, *expected: str, prefix: str = "train: error: ") -> str:
    """The one line of ``stderr``, asserted: no traceback, exactly one line, starting with ``prefix`` and holding
    each of ``expected`` (case-insensitive)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), stderr[-3000:]
    for text in expected:
        assert text.lower() in lines[0].lower(), (text, lines[0])
    return lines[0]


def tree_hash(path: Path) -> str:
    """sha256 over every path, mode and content under ``path`` (or of its absence)."""
    digest = hashlib.sha256()
    if not os.path.lexists(path):
        return "absent"
    for item in sorted([path, *path.rglob("*")]) if path.is_dir() else [path]:
        st = item.lstat()
        digest.update(f"{item.relative_to(path.parent)}\0{st.st_mode}\0".encode())
        if item.is_file() and not item.is_symlink():
            digest.update(item.read_bytes())
    return digest.hexdigest()


# The recipe's run (seed YAML): 20 steps of 128 rows x 8,192 tokens on 64 GPUs, 808.22 tokens/s/GPU in steps 5..19.
ROW_TOKENS, GLOBAL_BATCH, GPUS = 8192, 128, 64
RECIPE_TPS = 808.22


def recipe_rows(tps=RECIPE_TPS, cv=3.25, steps=20, window=(5, 19)):
    """20 steps whose window [5, 19] has the recipe's throughput and step-time CV (population)."""
    n = window[1] - window[0] + 1
    mean = n * GLOBAL_BATCH * ROW_TOKENS / GPUS / tps / n
    z = [i - (n - 1) / 2 for i in range(n)]
    sd = statistics.pstdev(z)
    rows = []
    for s in range(1, steps + 1):
        t = mean * (1 + cv / 100 * z[s - window[0]] / sd) if window[0] <= s <= window[1] else mean * 1.5
        rows.append(
            {
                "step": s,
                "lm_loss": 2.0 - 0.01 * s,
                "grad_norm": 1.0,
                "lr": 1e-5,
                "tokens": GLOBAL_BATCH * ROW_TOKENS,
                "supervised_tokens": 700_000,
                "step_time_s": t,
                "max_memory_bytes": 120_000_000_000,
            }
        )
    return rows


def write_rows(path, rows):
    """Write metrics rows as metrics.jsonl."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_trainer(
    *args, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``python -m trainer ARGS`` (each argument str()-ed) in ``cwd`` (default: the repository) with this
    checkout on PYTHONPATH and ``env`` added to the environment; capture output (text)."""
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "trainer", *map(str, args)],
        cwd=cwd or REPO_ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def same_training(reference: Path, run: Path, steps: int, loss_rel: float = 1e-4, grad_rel: float = 1e-3) -> None:
    """Assert that ``run``'s per-step metrics are ``reference``'s: ``steps`` rows each, tokens and supervised tokens
    exactly, ``lm_loss`` to ``loss_rel`` and ``grad_norm`` to ``grad_rel`` (relative), and that ``trainer
    converge`` of the two passes."""
    import pytest

    a, b = ([json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (reference, run))
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    for x, y in zip(a, b, strict=True):
        assert (y["tokens"], y["supervised_tokens"]) == (x["tokens"], x["supervised_tokens"])
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=loss_rel)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=grad_rel)
    verdict = run_trainer("converge", run / "metrics.jsonl", reference / "metrics.jsonl", "--json")
    assert verdict.returncode == 0 and json.loads(verdict.stdout)["passed"] is True, verdict.stdout[-2000:]


def one_process_run(tmp: Path, steps: int) -> Path:
    """``train experiment=smoke`` for ``steps`` steps as one local process on a global batch of 8 rows (8
    microbatches of one): the reference the multi-node runs of the same batch must match. Returns ``tmp/run``.
    Bounded by 600 s, a guard against a hang, not a speed goal: alone it takes about 25 s, but in CI it shares
    two cores with eight-rank trainings (more than 120 s once)."""
    batch = ["optim.global_batch_size=8", "optim.rollout_batch_size=8", "layout.micro_batch_size=1"]
    argv = ["experiment=smoke", f"launcher.steps={steps}", *batch, f"hydra.run.dir={tmp}/run"]
    result = run_train(argv, cwd=tmp, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return tmp / "run"


def planned_run(tmp: Path) -> Path:
    """A plan run written by `train` under ``tmp``, with the recipe's 20 steps of metrics beside it (as a run that
    executed would have): ``tmp/run``."""
    run_dir = tmp / "run"
    result = run_train([f"hydra.run.dir={run_dir}"], cwd=tmp)
    assert result.returncode == 0, result.stderr
    write_rows(run_dir / "metrics.jsonl", recipe_rows())
    return run_dir


def main(test_file: str) -> int:
    """Run pytest on one test module (the py_test entry point); JUnit XML goes where Bazel asks for it."""
    import pytest

    args = [test_file, "-q", "-p", "no:cacheprovider"]
    if os.environ.get("TEST_TMPDIR"):  # pytest's tmp_path directories inside the test's own (see conftest.py)
        args.append(f"--basetemp={os.environ['TEST_TMPDIR']}/pytest")
    if os.environ.get("XML_OUTPUT_FILE"):
        args.append(f"--junitxml={os.environ['XML_OUTPUT_FILE']}")
    return pytest.main(args)


SOURCES_ENV = "RECIPE_BUNDLE_SOURCES"
_SEEDED: list[str] = []


def seed_sources() -> list[str]:
    """Seed this test run's cache (the confined ``$XDG_CACHE_HOME``) with every archive in the directory
    ``$RECIPE_BUNDLE_SOURCES`` names (``git archive`` tarballs of the locked Megatron-LM and miles commits; CI sets
    it), each checked by the git tree id ``lockfiles/stack.json`` pins (``trainer cache add-archive``); once per
    process. Returns the names of the sources seeded ([] when the variable is unset)."""
    if _SEEDED or not os.environ.get(SOURCES_ENV):
        return list(_SEEDED)
    from trainer.image.cas import Cache
    from trainer.image.sources import add_archive, pins_for

    pins = pins_for([REPO_ROOT / "lockfiles" / "stack.json"])
    for archive in sorted(Path(os.environ[SOURCES_ENV]).glob("*.tar*")):
        _SEEDED.append(add_archive(Cache(), archive, pins)["name"])
    return list(_SEEDED)
