"""``launcher=ray``: submit the run to an existing Ray cluster with ``ray job submit``, wait, collect.

``launcher.address`` is the cluster's job submission address (the dashboard, ``http://HEAD:8265``). The job
(``job.json``) is the plan's miles launch (``argv.json``/``env.json``, as ``command.sh``) or ``launcher.job``; its
runtime env (``runtime_env.json`` in the run directory) carries

* ``env_vars``: the recipe's environment (NCCL/EFA variables, ``CUDA_DEVICE_MAX_CONNECTIONS``, kernel
  caches; ``$VAR`` references expanded on the cluster), ``RECIPE_BUNDLE_ENV_NAMES`` (their names) and
  ``RECIPE_BUNDLE_IMAGE_DIGEST`` (the digest of ``launcher.image``, which the probe reports);
* ``py_modules``: this bundle's ``trainer`` package, for the entrypoint (:mod:`trainer.launch.ray_entry`),
  which probes every node, compares them (the preflight) and then runs the job.

``launcher.payload=cpu`` makes the job the tiny model's CPU training instead (for clusters without GPUs, such as
the four-node test clusters of ``tests/launch_fixtures.py``): the rows are built here into the run directory
(which the nodes must share), the job is :mod:`trainer.launch.ray_workers` (one CPU worker per slot, placed as
miles places its actors), and the record's probe is every rank's (``probe-rank-N.json``, each naming its node).

The launcher waits for the job (``launcher.wait_s`` at most), then writes ``logs/job.log`` (the driver's
log), ``probes/<node>.json``, ``preflight.json`` and the record: ``complete``, or ``failed`` with the cause
in one line (cluster unreachable, submission refused, a node that failed the preflight, the job's exit code
and last log line), or ``interrupted`` (the job is stopped). ``submit.sh`` is the same submission as a
command a user can type.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import REPO_ROOT
from trainer.compose.checks import Parallelism
from trainer.compose.schema import TrainConfig
from trainer.errors import CheckError
from trainer.launch.host import cluster
from trainer.launch.host.processes import collect_probes
from trainer.launch.ray_entry import PREFLIGHT_MARK, PROBE_MARK, encode_argv
from trainer.record.rundir import COMPLETE, FAILED, INTERRUPTED, LOGS, PREFLIGHT, PROBES, RUNTIME_ENV, SUBMIT, RunDir
from trainer.redact import redact_field

if TYPE_CHECKING:
    from trainer.compose.prepare import PreparedRun

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def check(cfg: TrainConfig, par: Parallelism) -> None:
    """``launcher.address`` must be an http(s) URL; ``launcher.image``, when given, pinned by digest."""
    address = cfg.launcher.address or ""
    if not address.startswith(("http://", "https://")):
        raise CheckError(
            f"launcher.address {redact_field('address', address)!r}: expected the Ray job submission address, http://HOST:8265"
        )
    if cfg.launcher.image:
        cluster.parse_image(cfg.launcher.image)
    cluster.check_payload(cfg)


def ray_cli() -> str:
    """The ``ray`` command of this Python environment (beside the interpreter), else ``ray`` on PATH."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.is_file() else "ray"


def reachable(address: str, timeout_s: float = 10.0) -> str | None:
    """None when the Ray dashboard at ``address`` answers ``/api/version``; else the cause in a few words."""
    try:
        with urllib.request.urlopen(address.rstrip("/") + "/api/version", timeout=timeout_s) as response:
            json.loads(response.read())
        return None
    except urllib.error.HTTPError as ex:
        return f"HTTP {ex.code} from /api/version"
    except urllib.error.URLError as ex:
        return str(getattr(ex.reason, "strerror", None) or ex.reason)
    except (OSError, ValueError) as ex:
        return str(ex) or type(ex).__name__


def entrypoint(cfg: TrainConfig, argv: list[str], python: str, probe: bool = True) -> list[str]:
    """The job's entrypoint: :mod:`trainer.launch.ray_entry` with the preflight expectations and the argv."""
    out = [python, "-m", "trainer.launch.ray_entry", "--expand"]
    if probe:
        out += ["--probe", "--expect-nodes", str(cfg.cluster.nodes), "--probe-timeout", str(cfg.launcher.node_wait_s)]
        if cfg.launcher.expect_gpus:
            out += ["--expect-gpus", str(cfg.cluster.gpus_per_node)]
        if cfg.launcher.image:
            out += ["--expect-digest", cluster.parse_image(cfg.launcher.image)[1]]
    if cfg.launcher.workdir:
        out += ["--workdir", cfg.launcher.workdir]
    return out + ["--argv-b64", encode_argv(argv)]


def collect(rundir: RunDir, log: str) -> dict[str, Any]:
    """Write ``probes/<node>.json`` and ``preflight.json`` from the marker lines of the driver's log; return
    ``{"probe": {"ranks": [...], "nodes": [...]}|None, "preflight": report dict|None}``."""
    probes: dict[str, Any] = {}
    report = None
    for line in log.splitlines():
        if line.startswith(PROBE_MARK + " "):
            _, node, payload = line.split(" ", 2)
            probes[node] = json.loads(payload)
        elif line.startswith(PREFLIGHT_MARK + " "):
            report = json.loads(line.split(" ", 1)[1])
    for node, info in probes.items():
        rundir.write_json(f"{PROBES}/{node}.json", info)
    if report is not None:
        rundir.write_json(PREFLIGHT, report)
    return {"probe": {"ranks": list(probes.values()), "nodes": list(probes)} if probes else None, "preflight": report}


def execute(prepared: PreparedRun, rundir: RunDir, record: dict[str, Any]) -> dict[str, Any]:
    """Submit, wait and collect; returns ``record`` with ``status``, ``reason``, ``ray``, ``probe``, ``preflight``."""
    cfg = prepared.config
    run_dir = rundir.path
    from ray.job_submission import JobSubmissionClient

    address = (cfg.launcher.address or "").rstrip("/")  # check() refused a missing one
    argv, env = cluster.job(prepared)
    rows = None
    if cfg.launcher.payload == "cpu":
        argv, env, rows = cluster.cpu_job(prepared, run_dir.absolute(), cfg.launcher.python or "python3", env)
        record["data"] = {"rows": str(rows), "manifest": json.loads((rows / "manifest.json").read_text())}
    rundir.write_job(argv, env)
    digest = cluster.parse_image(cfg.launcher.image)[1] if cfg.launcher.image else None
    env_vars = dict(env)
    env_vars[cluster.ENV_NAMES] = ",".join(env)
    env_vars["PYTHONUNBUFFERED"] = "1"
    if digest:
        env_vars[cluster.DIGEST_ENV] = digest
    runtime_env = {"env_vars": env_vars, "py_modules": [str(REPO_ROOT / "trainer")]}
    rundir.write_json(RUNTIME_ENV, runtime_env)
    submission_id = f"recipe-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    entry = entrypoint(cfg, argv, cfg.launcher.python or "python3")
    command = [
        ray_cli(),
        "job",
        "submit",
        "--address",
        address,
        "--submission-id",
        submission_id,
        "--runtime-env",
        str(run_dir / RUNTIME_ENV),
        "--no-wait",
        "--",
        *entry,
    ]
    rundir.write(SUBMIT, ("#!/usr/bin/env bash\n" + shlex.join(["ray", *command[1:]]) + "\n").encode(), mode=0o777)
    record["ray"] = {"address": address, "submission_id": submission_id, "image": cfg.launcher.image}
    record["image"] = {"reference": cfg.launcher.image, "digest": digest}
    record["probe"] = None
    (run_dir / LOGS).mkdir(exist_ok=True)

    cause = reachable(address)
    if cause:
        return rundir.end(record, FAILED, f"launcher.address {address}: Ray cluster unreachable ({cause})")
    for _ in range(20):  # a fresh head answers before its job agent is up: retry while it says so (60 s)
        submit = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if submit.returncode == 0 or "No available agent to submit job" not in submit.stdout + submit.stderr:
            break
        time.sleep(3)
    rundir.write(f"{LOGS}/submit.log", (submit.stdout + submit.stderr).encode())
    if submit.returncode != 0:
        return rundir.end(
            record, FAILED, f"ray job submit refused the job: {cluster.last_line(submit.stderr or submit.stdout)}"
        )
    print(f"submitted Ray job {submission_id} to {address}")
    client = JobSubmissionClient(address)
    deadline = None if cfg.launcher.wait_s is None else time.monotonic() + cfg.launcher.wait_s
    shown = 0
    status, stopped = "PENDING", None
    try:
        while True:
            status = str(client.get_job_status(submission_id)).split(".")[-1]
            text = client.get_job_logs(submission_id)
            if len(text) > shown:
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
            if status in TERMINAL:
                break
            if deadline is not None and time.monotonic() > deadline:
                client.stop_job(submission_id)
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        client.stop_job(submission_id)
        status, stopped = "STOPPED", f"interrupted; Ray job {submission_id} stopped"
    log = client.get_job_logs(submission_id)
    rundir.write(f"{LOGS}/job.log", log.encode())
    info = client.get_job_info(submission_id)
    record["ray"].update(
        status=str(info.status).split(".")[-1],
        message=info.message,
        driver_exit_code=getattr(info, "driver_exit_code", None),
    )
    collected = collect(rundir, log)
    if rows is not None and collected["probe"] is not None:  # payload cpu: the probe of every rank, with its node
        collected["probe"]["ranks"] = (collect_probes(run_dir, prepared.par.world_size) or {}).get("ranks", [])
    record.update(collected)
    if stopped:
        rundir.end(record, INTERRUPTED, stopped)
    elif status == "SUCCEEDED":
        rundir.end(record, COMPLETE)
    elif collected["preflight"] and not collected["preflight"].get("ok"):
        rundir.end(record, FAILED, collected["preflight"]["reason"])
    elif status not in TERMINAL:
        rundir.end(
            record,
            FAILED,
            f"Ray job {submission_id} still {status} after launcher.wait_s {cfg.launcher.wait_s} s; stopped",
        )
    else:
        detail = cluster.last_line(log)
        message = (
            cluster.last_line(info.message or "")
            if not (info.message or "").startswith("Job entrypoint")
            else (info.message or "").splitlines()[0].split(",")[0]
        )
        rundir.end(
            record,
            FAILED,
            f"Ray job {submission_id} {status.lower()}: {message}" + (f"; last log line: {detail}" if detail else ""),
        )
    return record
