"""Supervising the processes of a local run: start, stream rank 0, stop on failure or signal, collect probes.

Shared by the local launchers. Every process gets SIGTERM if the launcher dies (even by SIGKILL), so a killed
launcher leaves no orphaned workers; the launcher's own record then still says ``running`` with its pid, which
:func:`trainer.record.record.effective_status` reads as ``interrupted``.
"""

from __future__ import annotations

import json
import os
import signal
import string
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer import REPO_ROOT, runlog
from trainer.errors import UserError
from trainer.record.rundir import probe_rank
from trainer.redact import redact_field


def default_kernel_cache(run_dir: Path) -> str:
    """``$XDG_CACHE_HOME/recipe-bundle/kernels`` (``~/.cache`` without XDG_CACHE_HOME), created if missing, so the
    JIT kernel caches persist across runs; ``RUN_DIR/kernels`` when that cannot be created or written (a read-only
    home, as in a build sandbox), with one line on stderr saying so."""
    cache_root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    cache = Path(cache_root) / "recipe-bundle" / "kernels"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if not os.access(cache, os.W_OK):
            raise PermissionError(f"[Errno 13] Permission denied: '{cache}'")
    except OSError as err:
        fallback = Path(run_dir).absolute() / "kernels"
        print(
            f"kernel cache {cache} not writable ({err.strerror or err}); using {fallback} for this run", file=sys.stderr
        )
        return str(fallback)
    return str(cache)


def worker_env(recipe_env: Mapping[str, str], extra: Mapping[str, str], run_dir: Path) -> dict[str, str]:
    """The environment of a local run's processes: this process's, the recipe's ``env`` block, then ``extra``.

    The recipe's values may refer to variables (``$KERNEL_CACHE/triton``); here they are expanded as the
    recipe's shell would. ``KERNEL_CACHE``, unless set, is :func:`default_kernel_cache`. ``PYTHONPATH`` starts
    with the bundle's source tree.
    Raises :class:`UserError` naming the variable when a value still refers to an unset variable.
    """
    env = dict(os.environ)
    if not env.get("KERNEL_CACHE"):
        env["KERNEL_CACHE"] = default_kernel_cache(run_dir)
    for name, value in recipe_env.items():
        expanded = string.Template(str(value)).safe_substitute(env)
        if "$" in expanded:
            raise UserError(f"env.{name} {redact_field(name, value)}: refers to a variable that is not set here")
        env[name] = expanded
    env.update(extra)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def die_with_parent() -> None:
    """In a child before exec: SIGTERM when the parent dies, even by SIGKILL (Linux ``prctl(PR_SET_PDEATHSIG)``)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def last_line(path: Path) -> str:
    """The last non-empty line of a log file ('' when absent)."""
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def _echo(path: Path, position: int) -> int:
    try:
        with path.open("rb") as handle:
            handle.seek(position)
            chunk = handle.read()
    except OSError:
        return position
    if chunk:
        sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()
    return position + len(chunk)


def _stop(procs: Sequence[subprocess.Popen], grace_s: float = 30) -> set:
    """Terminate the processes still running (SIGTERM, then SIGKILL after ``grace_s``); return their pids."""
    stopped = set()
    for p in procs:
        if p.poll() is None:
            p.terminate()
            stopped.add(p.pid)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return stopped


def supervise(commands: Sequence[list[str]], env: Mapping[str, str], logs: Path) -> dict[str, Any]:
    """Run ``commands`` (one process each, logs in ``logs/rank-N.log``), echo rank 0's log, and wait.

    The first process to exit non-zero stops the others. SIGINT/SIGTERM to the launcher stops them all.
    Returns ``{"status": complete|failed|interrupted, "reason": str|None, "returncodes": [int|None, ...]}``;
    the reason of a failure names the rank, its exit code and the last line of its log.
    """
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    handles = []
    status, reason = "complete", None
    previous = signal.getsignal(signal.SIGTERM)

    def _terminate(signum, frame):  # noqa: ARG001 - signal handler signature
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    # from its first second: a worker prints nothing while it imports torch and builds its model
    print(f"starting {len(commands)} worker process(es); rank 0's output follows (logs in {logs})", flush=True)
    runlog.info(f"starting {len(commands)} worker process(es): {' '.join(commands[0][:4])} ...")
    try:
        try:
            for rank, command in enumerate(commands):
                handle = (logs / f"rank-{rank}.log").open("w")
                handles.append(handle)
                procs.append(
                    subprocess.Popen(
                        command, env=dict(env), stdout=handle, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
                    )
                )
                runlog.log.debug("rank %d: pid %d, log %s", rank, procs[-1].pid, logs / f"rank-{rank}.log")
        except OSError as err:
            _stop(procs)
            return {
                "status": "failed",
                "reason": f"cannot start rank {len(procs)}: {err}",
                "returncodes": [p.returncode for p in procs],
            }
        position = 0
        while any(p.poll() is None for p in procs):
            position = _echo(logs / "rank-0.log", position)
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
        _echo(logs / "rank-0.log", position)
        stopped = _stop(procs)
        bad = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode != 0]
        if bad:
            # the cause is a rank that exited by itself; the ones stopped here were stopped because of it
            causes = [rc for rc in bad if procs[rc[0]].pid not in stopped] or bad
            first = causes[0]
            status = "failed"
            reason = f"rank {first[0]} exited with code {first[1]}: {last_line(logs / f'rank-{first[0]}.log')}"
    except KeyboardInterrupt:
        status, reason = "interrupted", "interrupted by a signal"
        _stop(procs)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for handle in handles:
            handle.close()
    codes = [p.returncode for p in procs]
    runlog.info(f"workers ended {status}: exit codes {codes}" + (f"; {reason}" if reason else ""))
    return {"status": status, "reason": reason, "returncodes": [p.returncode for p in procs]}


def collect_probes(run_dir: Path, world: int) -> dict[str, Any] | None:
    """``{"ranks": [probe of rank 0, ...]}`` from ``probe-rank-N.json`` files (None when no rank wrote one)."""
    probes = []
    for rank in range(world):
        path = run_dir / probe_rank(rank)
        if path.is_file():
            probes.append(json.loads(path.read_text()))
    return {"ranks": probes} if probes else None
