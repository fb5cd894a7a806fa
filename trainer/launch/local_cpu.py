"""``launcher=local-cpu``: train the composed model on this machine's CPUs, data parallel over processes.

The parent (inside ``train``) refuses layouts that need model parallelism, prepares the rows, starts one
process per DP rank (``python -m trainer.launch.cpu_worker RUN_DIR RANK WORLD``; gloo over loopback, file
rendezvous in the run directory), streams rank 0's output, and finishes the run record:

``record.json`` is written with status ``running`` (and the parent's pid) before the first process starts and
rewritten at the end as ``complete``, ``failed`` (with the reason: which rank exited how, and the last line of
its log) or ``interrupted`` (SIGINT/SIGTERM). A record still saying ``running`` whose pid is gone was killed
(``trainer.record.effective_status``). ``env.json`` holds the workers' environment with secrets redacted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

from trainer import REPO_ROOT
from trainer.checks import Parallelism
from trainer.errors import CheckError, UserError
from trainer.record import redact_env, write_json
from trainer.schema import TrainConfig


def check(cfg: TrainConfig, par: Parallelism) -> None:
    """Refuse what a CPU run cannot do: TP/PP/CP/EP/ETP > 1 or more than one node (one line, the field)."""
    lay = cfg.layout
    needs = {
        "tensor_model_parallel_size": lay.tensor_model_parallel_size,
        "pipeline_model_parallel_size": lay.pipeline_model_parallel_size,
        "context_parallel_size": lay.context_parallel_size,
        "expert_model_parallel_size": lay.expert_model_parallel_size,
        "expert_tensor_parallel_size": lay.expert_tensor_parallel_size,
    }
    for key, value in needs.items():
        if value > 1:
            raise CheckError(
                f"layout.{key} {value}: launcher local-cpu runs data parallel only (TP, PP, CP, EP, ETP must be 1); "
                "use a GPU launcher for this layout"
            )
    if cfg.cluster.nodes != 1:
        raise CheckError(f"cluster.nodes {cfg.cluster.nodes}: launcher local-cpu runs on this machine only (1 node)")


def prepare_rows(cfg: TrainConfig, run_dir: Path) -> Path:
    """The rows directory the workers read: built here from generated conversations when
    ``data.synthetic_conversations`` is set (checked against ``data.rows_sha256`` when that is given), else
    ``paths.prompt_data`` (a ``trainer data build`` output). Raises :class:`UserError` with one line."""
    from trainer.data import Rows
    from trainer.data import synthetic
    from trainer.data.build import BuildConfig, build

    data = cfg.data
    if data.synthetic_conversations:
        source = run_dir / "data" / "conversations.jsonl"
        source.parent.mkdir(parents=True, exist_ok=True)
        synthetic.write(source, data.synthetic_conversations, data.synthetic_seed)
        out = run_dir / "data" / "rows"
        manifest = build(
            [str(source)], out,
            BuildConfig(row_tokens=data.build.row_tokens, seed=data.build.seed,
                        tokenizer_sha256=data.build.tokenizer_sha256, loss_mask=data.build.loss_mask, name=data.build.name),
        )
        if data.rows_sha256 and manifest["rows_sha256"] != data.rows_sha256:
            raise UserError(
                f"data.rows_sha256 {data.rows_sha256} != built {manifest['rows_sha256']} ({out}): "
                "the same inputs and config must give the same rows"
            )
        return out
    path = Path(os.path.expandvars(cfg.paths.prompt_data))
    if "$" in str(path) or not (path / "manifest.json").is_file():
        raise UserError(
            f"paths.prompt_data {cfg.paths.prompt_data}: expected a rows directory from `trainer data build` "
            "(rows.parquet + manifest.json)"
        )
    Rows(path)  # verify before spending time on processes
    return path


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def execute(cfg: TrainConfig, par: Parallelism, run_dir: Path, record: Dict[str, Any]) -> Dict[str, Any]:
    """Run the job; return ``record`` updated with ``status``, ``reason``, ``returncodes`` and ``probe``.

    ``record`` is the run record so far (written by the caller as ``running``); this function writes
    ``argv.json`` (rank 0's command) and ``env.json`` (redacted) first.
    """
    world = par.world_size
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update({k: str(v) for k, v in cfg.env.items()} if cfg.env else {})
    env.update(
        {
            "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
            "GLOO_SOCKET_IFNAME": "lo",  # gloo's connections stay on loopback
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world)),
            "PYTHONUNBUFFERED": "1",
        }
    )
    rows_dir = prepare_rows(cfg, run_dir)
    record["data"] = {"rows": str(rows_dir), "manifest": json.loads((rows_dir / "manifest.json").read_text())}
    commands: List[List[str]] = [
        [sys.executable, "-m", "trainer.launch.cpu_worker", str(run_dir), str(rank), str(world), str(rows_dir)]
        for rank in range(world)
    ]
    write_json(run_dir / "argv.json", commands[0])
    write_json(run_dir / "env.json", redact_env(env))
    procs = []
    status, reason = "complete", None
    previous = signal.getsignal(signal.SIGTERM)

    def _terminate(signum, frame):  # noqa: ARG001 - signal handler signature
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        for rank, command in enumerate(commands):
            log = (logs / f"rank-{rank}.log").open("w")
            procs.append(
                (subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent), log)
            )
        rank0_log = logs / "rank-0.log"
        position = 0
        while any(p.poll() is None for p, _ in procs):
            position = _echo(rank0_log, position)
            failed = [(r, p.returncode) for r, (p, _) in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                break
            try:
                procs[0][0].wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        _echo(rank0_log, position)
        for p, _ in procs:
            if p.poll() is None:
                p.terminate()
        for p, _ in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        codes = [p.returncode for p, _ in procs]
        bad = [(r, c) for r, c in enumerate(codes) if c != 0]
        if bad:
            rank, code = bad[0]
            status = "failed"
            reason = f"rank {rank} exited with code {code}: {_last_line(logs / f'rank-{rank}.log')}"
    except KeyboardInterrupt:
        status, reason = "interrupted", "interrupted by a signal"
        for p, _ in procs:
            if p.poll() is None:
                p.terminate()
        for p, _ in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    finally:
        signal.signal(signal.SIGTERM, previous)
        for _, log in procs:
            log.close()
        (run_dir / ".rendezvous").unlink(missing_ok=True)
    record.update(status=status, reason=reason, returncodes=[p.returncode for p, _ in procs])
    probes = []
    for rank in range(world):
        path = run_dir / f"probe-rank-{rank}.json"
        if path.is_file():
            probes.append(json.loads(path.read_text()))
    record["probe"] = {"ranks": probes} if probes else None
    return record


def _die_with_parent() -> None:
    """In a worker before exec: get SIGTERM when the launcher dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _echo(path: Path, position: int) -> int:
    """Print what rank 0 logged since ``position``; return the new position."""
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
