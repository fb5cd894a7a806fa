"""The steps ``sbatch.sh`` runs inside the Slurm job (on the head node): ``python -m trainer.launch.jobsteps
mark RUN_DIR STATUS ...`` updates the run record as the job moves on (running, then complete or failed with
the cause in one line); ``wait-dashboard ADDRESS [--nodes N]`` waits for the Ray head to answer (and for N
nodes alive: :func:`alive_nodes`); ``ray-ports [--head]`` prints ``ray start`` flags that give a Ray node free
ports of its own (:func:`ray_port_flags`). The batch script itself is rendered by :mod:`trainer.launch.host.slurm`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.launch.host.cluster import ANSI_RE, ERROR_LINE_RE
from trainer.launch.host.ray import reachable
from trainer.launch.ports import free_ports
from trainer.record import joblog
from trainer.record.attempts import vouch_for_resume
from trainer.record.rundir import (
    COMPLETE,
    FAILED,
    FINAL,
    LOGS,
    PREFLIGHT,
    PROBES,
    RUNNING,
    RunDir,
    utc_now,
)

IMAGE_STAMP = Path("/etc/recipe-bundle/lock.json")  # the lock a bundle image was built from, as stamped into it
IMAGE_DIR = "image"  # the run directory's copy of it (as trainer.launch.host.local_image.IMAGE_DIR)
RANK_PROBE_RE = re.compile(r"^probe-rank-(\d+)\.json$")  # the files of trainer.record.names.probe_rank


def _job_failure(run_dir: Path, exit_code: int | None) -> str:
    """One line for a Ray job that exited non-zero, from the end of ``logs/job.log``
    (:func:`trainer.record.joblog.tail`)."""
    text = joblog.tail(run_dir / LOGS / "job.log")
    status = [line for line in text.splitlines() if "Status message:" in line]
    if status:
        message = status[-1].split("Status message:", 1)[1].strip().split(", last available logs")[0]
    else:
        message = f"ray job submit exited with code {exit_code}"
    lines = [ANSI_RE.sub("", line).strip() for line in text.splitlines() if not line.startswith("srun:")]
    lines = [line for line in lines if line]
    own = [line for line in lines if ERROR_LINE_RE.match(line)]  # a program's own `NAME: error: ...` line
    errors = own or [
        line for line in lines if ("error:" in line.lower() or "Error" in line) and "ERR cli.py" not in line
    ]
    tail = errors[-1] if errors else (lines[-1] if lines and not status else "")
    return message + (f"; {tail}" if tail else "")


def mark(
    run_dir: Path,
    status: str,
    stage: str | None = None,
    exit_code: int | None = None,
    reason: str | None = None,
    job_id: str | None = None,
    nodes: str | None = None,
) -> dict[str, Any]:
    """Update ``RUN_DIR/record.json`` from inside the job: status, stage, the probes and the preflight report
    gathered so far, and for a failure the cause in one line. Nothing already in the record is dropped.
    Returns the record written; raises :class:`UserError` when the run directory has no record or its state
    cannot move to ``status`` (:data:`trainer.record.rundir.MOVES`)."""
    rundir = RunDir(run_dir)

    def change(record: dict[str, Any]) -> None:
        record.pop("pid", None)  # the run lives in the Slurm job, not in the `train` process that submitted it
        slurm = record.setdefault("slurm", {})
        if job_id:
            slurm["job_id"] = job_id
        if nodes:
            slurm["nodes"] = nodes.split(",")
        if stage:
            slurm["stage"] = stage
        if exit_code is not None:
            slurm.setdefault("exit_codes", {})[stage or "job"] = exit_code
        rundir.move(record, status)
        if status == RUNNING:
            record["started_utc"] = utc_now()  # the job left the queue
            if slurm.get("container") == "pyxis" and IMAGE_STAMP.is_file():
                # this step runs in the image: its stamped lock is what the run is verified against, as for
                # launcher=local-image (image/lock.json)
                stamp = IMAGE_STAMP.read_bytes()
                rundir.write(f"{IMAGE_DIR}/lock.json", stamp, mode=0o644, verbatim=True)
                record.setdefault("image", {})["stamp_sha256"] = hashlib.sha256(stamp).hexdigest()
                record["lock"] = {"path": str(run_dir.absolute() / IMAGE_DIR / "lock.json"), "kind": "image stamp"}
        probes = {}
        for node in slurm.get("nodes") or sorted(p.stem for p in (run_dir / PROBES).glob("*.json")):
            probe_path = run_dir / PROBES / f"{node}.json"
            if probe_path.is_file():
                probes[node] = json.loads(probe_path.read_text())
        ranks = sorted(
            (p for p in run_dir.glob("probe-rank-*.json") if RANK_PROBE_RE.match(p.name)),
            key=lambda p: int(p.stem.rsplit("-", 1)[1]),
        )  # a stray probe-rank-x.json is not a rank's
        if probes:
            record["probe"] = {"ranks": list(probes.values()), "nodes": list(probes)}
        if probes and ranks:  # launcher.payload=cpu: every rank wrote its own probe (naming its node)
            record["probe"]["ranks"] = [json.loads(p.read_text()) for p in ranks]
        if (run_dir / PREFLIGHT).is_file():
            record["preflight"] = json.loads((run_dir / PREFLIGHT).read_text())
        if status in FINAL:
            record["finished_utc"] = utc_now()
            record["logs"] = sorted(str(p.relative_to(run_dir)) for p in (run_dir / LOGS).rglob("*") if p.is_file())
            # what a --resume continues from, hashed as the job leaves it (`trainer attest` later re-derives every
            # hash); a file an earlier attempt vouched for with other bytes stays unvouched
            changed = vouch_for_resume(run_dir, record)
            if changed:
                slurm["unvouched"] = changed
        if status == FAILED:
            why = reason
            if why is None and stage == "preflight" and record.get("preflight"):
                why = record["preflight"].get("reason")
            if why is None and stage == "preflight":
                why = f"preflight could not compare the nodes (exit code {exit_code}); see logs/probe.log"
            if why is None and stage == "job":
                why = _job_failure(run_dir, exit_code)
            record["reason"] = why or f"failed during {stage} (exit code {exit_code})"
        elif status == COMPLETE:
            record["reason"] = None

    return rundir.update(change)


def alive_nodes(address: str, timeout_s: float = 5.0) -> int | str:
    """How many nodes the Ray cluster whose dashboard is at ``address`` has alive, from its state API
    (``GET /api/v0/nodes``, what ``ray list nodes`` reads: ``{"data": {"result": {"result": [{"state": ...}]}}}``);
    the cause in a few words (a ``str``) when it does not answer so."""
    try:
        with urllib.request.urlopen(address.rstrip("/") + "/api/v0/nodes?limit=10000", timeout=timeout_s) as reply:
            rows = json.loads(reply.read())["data"]["result"]["result"]
        return sum(1 for row in rows if isinstance(row, dict) and row.get("state") == "ALIVE")
    except urllib.error.HTTPError as ex:
        return f"HTTP {ex.code} from /api/v0/nodes"
    except urllib.error.URLError as ex:
        return str(getattr(ex.reason, "strerror", None) or ex.reason)
    except (OSError, ValueError, KeyError, TypeError) as ex:
        return f"{type(ex).__name__}: {ex}"


def wait_dashboard(address: str, timeout_s: float, nodes: int | None = None) -> int:
    """Wait until the Ray dashboard at ``address`` answers and, with ``nodes``, until at least that many nodes
    are alive (:func:`alive_nodes`); 0 when so, 1 after ``timeout_s`` seconds (the cause on stderr)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        cause = reachable(address, timeout_s=5)
        if cause is None and nodes is not None:
            alive = alive_nodes(address)
            cause = None if isinstance(alive, int) and alive >= nodes else f"{alive} of {nodes} nodes alive"
        if cause is None:
            return 0
        if time.monotonic() >= deadline:
            print(f"wait-dashboard: {address}: not ready in {timeout_s:.0f} s ({cause})", file=sys.stderr)
            return 1
        time.sleep(0.5)


# ray start flags whose components otherwise take a fixed default port (the dashboard agent's HTTP server 52365,
# Ray Client 10001, ...) or one chosen when Ray starts: two Ray nodes on one host (two jobs sharing a node, or the
# test cluster's nodes in one network namespace) then collide, and the node whose agent lost dies (ray 2.60:
# dashboard/http_server_agent.py retries six times, then the raylet, fate-shared with it, exits)
RAY_NODE_PORT_FLAGS = (
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
)
RAY_HEAD_PORT_FLAGS = ("--ray-client-server-port",)  # ray start takes it on the head only
# each worker process's port from the kernel, not from Ray's default range 10002-19999, which every node on one
# host would otherwise draw from alike
RAY_WORKER_PORT_FLAGS = ("--min-worker-port=0", "--max-worker-port=0")


def ray_port_flags(head: bool = False) -> list[str]:
    """``--FLAG=PORT`` for each of :data:`RAY_NODE_PORT_FLAGS` (and :data:`RAY_HEAD_PORT_FLAGS` with ``head``):
    distinct ports free on every address of this host, below the kernel's ephemeral range
    (:func:`trainer.launch.ports.free_ports`), released for Ray to bind; then :data:`RAY_WORKER_PORT_FLAGS`.
    Raises OSError when no port can be had."""
    flags = [*RAY_NODE_PORT_FLAGS, *(RAY_HEAD_PORT_FLAGS if head else ())]
    ports = free_ports(len(flags))
    return [*(f"{flag}={port}" for flag, port in zip(flags, ports, strict=True)), *RAY_WORKER_PORT_FLAGS]


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.launch.jobsteps mark|wait-dashboard|ray-ports ...``: the steps ``sbatch.sh`` runs."""
    parser = argparse.ArgumentParser(prog="python -m trainer.launch.jobsteps", description="steps of sbatch.sh")
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mark", help="update the run record from inside the job")
    m.add_argument("run_dir", type=Path)
    m.add_argument("status", choices=("running", *FINAL))
    m.add_argument("--stage")
    m.add_argument("--exit-code", type=int)
    m.add_argument("--reason")
    m.add_argument("--job-id")
    m.add_argument("--nodes")
    w = sub.add_parser("wait-dashboard", help="wait for the Ray dashboard to answer")
    w.add_argument("address")
    w.add_argument("--timeout", type=float, default=300.0)
    w.add_argument("--nodes", type=int, help="also wait until this many Ray nodes are alive")
    r = sub.add_parser("ray-ports", help="print ray start flags giving this node free ports of its own")
    r.add_argument("--head", action="store_true", help="the head node's as well (Ray Client)")
    args = parser.parse_args(argv)
    if args.cmd == "ray-ports":
        print(" ".join(ray_port_flags(args.head)))
        return 0
    if args.cmd == "wait-dashboard":
        return wait_dashboard(args.address, args.timeout, args.nodes)
    try:
        record = mark(args.run_dir, args.status, args.stage, args.exit_code, args.reason, args.job_id, args.nodes)
    except UserError as err:
        print(f"slurm mark: error: {err}", file=sys.stderr)
        return 2
    print(f"run {record['status']}" + (f": {record['reason']}" if record.get("reason") else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
