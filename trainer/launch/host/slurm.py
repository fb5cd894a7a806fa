"""``launcher=slurm``: render ``sbatch.sh`` for a Slurm cluster (pyxis/enroot), optionally submit it.

The script (one per run directory, which must be on a file system every node sees) asks for
``cluster.nodes`` nodes x ``cluster.gpus_per_node`` GPUs (``--gpus-per-node`` or ``--gres=gpu:N``),
``launcher.time_limit``, ``cluster.partition`` and ``cluster.account``, and then, every step started with
``srun`` inside ``launcher.image`` pinned by digest (pyxis: ``--container-image=NAME@sha256:...``, one named
container per node shared by the steps; ``launcher.container=none`` runs the steps in the nodes' own
environment, for clusters without pyxis and for the tests here):

1. records the run as ``running`` (job id, nodes);
2. runs the version probe on every node (``probes/<node>.json``) and compares them
   (:mod:`trainer.launch.preflight`: image digest and stamp, NCCL and its net plugin, driver, GPU count);
   any difference stops the job before training with the table in ``logs/preflight.log``;
3. starts one Ray head on the first node and a Ray worker on each other node (``ray start --block``);
4. submits the job (``job.json``: the plan's miles launch, exactly ``argv.json``/``env.json`` = ``command.sh``, or
   ``launcher.job``) with ``ray job submit`` through :mod:`trainer.launch.ray_entry` (which waits for every
   node to join, probes them again through Ray and compares, then runs the job); its log is ``logs/job.log``;
5. gathers each node's Ray logs into ``logs/ray/<node>/``, stops Ray, and records ``complete`` or ``failed``
   with the cause in one line (``python -m trainer.launch.jobsteps mark``). A time limit or ``scancel``
   (SIGTERM to the batch script) is recorded as ``failed`` too.

``launcher.submit=true`` submits with ``sbatch`` and prints the job id; ``trainer status RUN_DIR`` follows it.
A submission Slurm refuses marks the run ``failed`` with sbatch's error line.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import REPO_ROOT
from trainer.compose.checks import Parallelism
from trainer.compose.schema import TrainConfig
from trainer.errors import CheckError, UserError
from trainer.launch.host import cluster
from trainer.record.rundir import FAILED, LOGS, RENDERED, SBATCH, SUBMITTED, RunDir
from trainer.redact import is_secret_name, redact_field

if TYPE_CHECKING:
    from trainer.compose.prepare import PreparedRun

CONTAINERS = ("pyxis", "none")
GPUS_FLAGS = ("gpus-per-node", "gres", "none")
TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")
LAUNCHER_MOUNT = "/opt/recipe-bundle-launcher"  # where pyxis mounts this bundle's trainer package
IMAGE_WORKDIR = "/root/miles"  # where the recipe image has miles (lockfiles: sources miles.dest); the job starts there


SBATCH_VALUE_RE = re.compile(r"^[A-Za-z0-9_.,:=@/+-]+$")


def check(cfg: TrainConfig, par: Parallelism) -> None:
    """Refuse what cannot become a valid sbatch script (one line naming the field)."""
    lau = cfg.launcher
    if lau.container not in CONTAINERS:
        raise CheckError(f"launcher.container {lau.container!r}: expected one of {', '.join(CONTAINERS)}")
    if lau.gpus_flag not in GPUS_FLAGS:
        raise CheckError(f"launcher.gpus_flag {lau.gpus_flag!r}: expected one of {', '.join(GPUS_FLAGS)}")
    if lau.container == "pyxis" or lau.image:
        cluster.parse_image(lau.image or "")
    if not TIME_RE.match(lau.time_limit):
        raise CheckError(
            f"launcher.time_limit {redact_field('time_limit', lau.time_limit)!r}: expected Slurm's time format, e.g. 04:00:00 or 1-00:00:00"
        )
    for mount in lau.container_mounts:
        if mount.count(":") not in (1, 2) or not mount.startswith("/"):
            raise CheckError(
                f"launcher.container_mounts {redact_field('container_mounts', mount)!r}: expected /SRC:/DST or /SRC:/DST:ro"
            )
    for port in ("ray_port", "dashboard_port"):
        if not 0 < getattr(lau, port) < 65536:
            raise CheckError(f"launcher.{port} {getattr(lau, port)}: expected a TCP port (1-65535)")
    # values that become #SBATCH lines or words of the script: one line each, no spaces where Slurm splits
    for key, value in (
        ("cluster.partition", cfg.cluster.partition),
        ("cluster.account", cfg.cluster.account),
        ("layout.name", cfg.layout.name),
        *((f"launcher.sbatch_args[{i}]", a) for i, a in enumerate(lau.sbatch_args)),
    ):
        if value is not None and (not SBATCH_VALUE_RE.match(str(value))):
            raise CheckError(
                f"{key} {redact_field(key, value)!r}: expected one word of letters, digits and _.,:=@/+- (it becomes an #SBATCH line)"
            )


def _q(word: str) -> str:
    return shlex.quote(str(word))


def _require_vars(env: dict[str, str], argv: list[str]) -> list[str]:
    """Script lines that stop the job with one clear line when a variable the env or argv refers to
    (``$KERNEL_CACHE``, ``$HF_CKPT`` from ``paths.*``) is not set where the batch script runs."""
    names = sorted(
        {
            m.group(1)
            for text in [*env.values(), *argv]
            for m in re.finditer(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", str(text))
        }
        - set(env)
    )
    if not names:
        return []
    return [
        "# variables the recipe's env and argv refer to (paths.*): set them before sbatch",
        f"for v in {' '.join(names)}; do",
        '  [ -n "${!v+x}" ] || { echo "sbatch.sh: $v is not set: export it before sbatch (paths.* refer to it)" >&2; exit 2; }',
        "done",
    ]


def render_sbatch(cfg: TrainConfig, run_dir: Path, argv: list[str], env: dict[str, str]) -> str:
    """The batch script for ``cfg`` writing into ``run_dir`` (absolute); see the module docstring."""
    from trainer.compose.render import argv_words, shell_word

    lau, clu = cfg.launcher, cfg.cluster
    run_dir = run_dir.absolute()
    if not SBATCH_VALUE_RE.match(str(run_dir)):
        raise UserError(
            f"run directory {run_dir}: expected a path without spaces or special characters (Slurm's --output)"
        )
    pyxis = lau.container == "pyxis"
    digest = cluster.parse_image(lau.image)[1] if lau.image else ""
    python = lau.python or ("python3" if pyxis else sys.executable)
    nodes, gpus = clu.nodes, clu.gpus_per_node
    head = [
        "#!/bin/bash",
        f"# recipe-bundle: {cfg.layout.label} on {nodes} x {gpus} {clu.gpu_type} ({clu.name}), written by "
        "`train launcher=slurm`.",
        f"# Run directory (shared by every node): {run_dir}",
        f"#SBATCH --job-name=recipe-{cfg.layout.name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if lau.gpus_flag == "gpus-per-node":
        head.append(f"#SBATCH --gpus-per-node={gpus}")
    elif lau.gpus_flag == "gres":
        head.append(f"#SBATCH --gres=gpu:{gpus}")
    head.append(f"#SBATCH --time={lau.time_limit}")
    if clu.partition:
        head.append(f"#SBATCH --partition={clu.partition}")
    if clu.account:
        head.append(f"#SBATCH --account={clu.account}")
    head += [
        f"#SBATCH --output={run_dir}/logs/slurm-%j.out",
        "#SBATCH --signal=B:TERM@120",
        *(f"#SBATCH {arg}" for arg in lau.sbatch_args),
        "set -uo pipefail",
        "",
        f"RUN_DIR={_q(run_dir)}",
        f"PY={_q(python)}",
        f"IMAGE={_q(lau.image or '')}",
        f"export RECIPE_BUNDLE_IMAGE_DIGEST={_q(digest)}",
    ]
    if pyxis:
        mounts = [f"{run_dir}:{run_dir}", f"{REPO_ROOT / 'trainer'}:{LAUNCHER_MOUNT}/trainer:ro", *lau.container_mounts]
        head += [
            f"export PYTHONPATH={LAUNCHER_MOUNT}${{PYTHONPATH:+:$PYTHONPATH}}",
            "# every step runs in the image by digest; the steps of one node share a named container",
            'CONTAINER=(--container-image="$IMAGE" --container-name="recipe-$SLURM_JOB_ID" '
            f"--container-mounts={_q(','.join(mounts))})",
        ]
    else:
        head += [
            f"export PYTHONPATH={_q(REPO_ROOT)}${{PYTHONPATH:+:$PYTHONPATH}}",
            f"export PATH={_q(Path(python).parent)}:$PATH",
            "# launcher.container=none: the steps run in the nodes' own environment",
            "CONTAINER=()",
        ]
    head += [
        "export RAY_USAGE_STATS_ENABLED=0 RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 PYTHONUNBUFFERED=1",
        "",
        *_require_vars(env, argv),
        "# the recipe's environment (env.json; as command.sh has it: a secret from the submitter's environment)",
        *(
            f'export {k}="${{{k}:?{k} is a secret: set it in the environment before sbatch}}"'
            if is_secret_name(k)
            else f"export {k}={shell_word(v)}"
            for k, v in env.items()
        ),
        "",
        "# the job (job.json; the same command as command.sh unless launcher.job names another)",
        "ARGV=(",
        *("  " + words for words in argv_words(argv)),
        ")",
        "",
    ]
    entry = ["--probe", "--expect-nodes", str(nodes)]
    if lau.expect_gpus:
        entry += ["--expect-gpus", str(gpus)]
    if digest:
        entry += ["--expect-digest", digest]
    workdir = lau.workdir or (IMAGE_WORKDIR if lau.container != "none" else None)
    if workdir:
        entry += ["--workdir", workdir]
    preflight_args = [f"--expect-gpus {gpus}" if lau.expect_gpus else "", f"--expect-digest {digest}" if digest else ""]
    head_ip = (
        _q(lau.head_ip) if lau.head_ip else "$(srun --overlap -N1 -n1 -w \"$HEAD\" hostname -I | awk '{print $1}')"
    )
    ray_args = "".join(" " + _q(a) for a in lau.ray_start_args)
    body = f"""\
mkdir -p "$RUN_DIR/logs" "$RUN_DIR/probes"
NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
HEAD=${{NODES[0]}}
NODELIST=$(IFS=,; echo "${{NODES[*]}}")
on_head() {{ srun --overlap -N1 -n1 -w "$HEAD" "${{CONTAINER[@]}}" "$@"; }}
mark() {{ on_head "$PY" -m trainer.launch.jobsteps mark "$RUN_DIR" "$@"; }}
RAY_PIDS=()
STAGE=start
stop_ray() {{
  [ ${{#RAY_PIDS[@]}} -gt 0 ] || return 0
  srun --overlap --ntasks-per-node=1 "${{CONTAINER[@]}}" bash -c \\
    'mkdir -p "$0/logs/ray/$SLURMD_NODENAME" && cp -r "$1"/session_latest/logs/. "$0/logs/ray/$SLURMD_NODENAME/"' \\
    "$RUN_DIR" "$RAY_TMP" >> "$RUN_DIR/logs/gather.log" 2>&1
  kill -TERM "${{RAY_PIDS[@]}}" 2>/dev/null; wait "${{RAY_PIDS[@]}}" 2>/dev/null; RAY_PIDS=()
}}
on_term() {{ stop_ray; mark failed --stage "$STAGE" --reason "Slurm job $SLURM_JOB_ID got SIGTERM during $STAGE (time limit or scancel)"; exit 143; }}
trap on_term TERM
mark running --job-id "$SLURM_JOB_ID" --nodes "$NODELIST"

# 1. the version probe on every node, inside the image; then every node must agree (preflight)
STAGE=preflight
srun --overlap --ntasks-per-node=1 "${{CONTAINER[@]}}" "$PY" -m trainer.probe --out "$RUN_DIR/probes/{{node}}.json" \\
  > "$RUN_DIR/logs/probe.log" 2>&1
on_head "$PY" -m trainer.launch.preflight "$RUN_DIR/probes" --nodes "$NODELIST" {" ".join(a for a in preflight_args if a)} \\
  --out "$RUN_DIR/preflight.json" > "$RUN_DIR/logs/preflight.log" 2>&1
rc=$?
cat "$RUN_DIR/logs/preflight.log"
if [ $rc -ne 0 ]; then mark failed --stage preflight --exit-code $rc; exit 1; fi

# 2. one Ray head on the first node, a Ray worker on every other node
STAGE=ray
HEAD_IP={head_ip}
RAY_TMP=/tmp/ray-recipe-$SLURM_JOB_ID
srun --overlap -N1 -n1 -w "$HEAD" "${{CONTAINER[@]}}" ray start --head --block --node-ip-address="$HEAD_IP" \\
  --port={lau.ray_port} --dashboard-host=127.0.0.1 --dashboard-port={lau.dashboard_port} --num-gpus={gpus} --temp-dir="$RAY_TMP"{ray_args} \\
  > "$RUN_DIR/logs/ray-head.log" 2>&1 &
RAY_PIDS+=($!)
if [ ${{#NODES[@]}} -gt 1 ]; then
  srun --overlap -N$((${{#NODES[@]}} - 1)) --ntasks-per-node=1 -x "$HEAD" "${{CONTAINER[@]}}" ray start --block \\
    --address="$HEAD_IP:{lau.ray_port}" --num-gpus={gpus}{ray_args} > "$RUN_DIR/logs/ray-workers.log" 2>&1 &
  RAY_PIDS+=($!)
fi
on_head "$PY" -m trainer.launch.jobsteps wait-dashboard http://127.0.0.1:{lau.dashboard_port} --timeout 300
rc=$?
if [ $rc -ne 0 ]; then stop_ray; mark failed --stage ray --exit-code $rc --reason "Ray head did not start: $(tail -n 1 "$RUN_DIR/logs/ray-head.log")"; exit 1; fi

# 3. the job, submitted to that Ray cluster (the entry waits for every node, probes them through Ray, runs ARGV)
STAGE=job
# (a fresh head answers before its job agent is up: retry while it says so, up to 60 s)
for attempt in $(seq 20); do
  on_head ray job submit --address http://127.0.0.1:{lau.dashboard_port} --submission-id "recipe-$SLURM_JOB_ID" -- \\
    "$PY" -m trainer.launch.ray_entry {" ".join(_q(e) for e in entry)} \\
    --argv-b64 "$(printf '%s\\0' "${{ARGV[@]}}" | base64 -w0)" > "$RUN_DIR/logs/job.log" 2>&1 &
  wait $!
  JOB_RC=$?
  grep -q "No available agent to submit job" "$RUN_DIR/logs/job.log" || break
  sleep 3
done

# 4. gather the logs, stop Ray, record the result
STAGE=gather
stop_ray
if [ $JOB_RC -eq 0 ]; then mark complete --stage job --exit-code 0; else mark failed --stage job --exit-code $JOB_RC; fi
exit $JOB_RC
"""
    return "\n".join(head) + "\n" + body


def _sbatch_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors[-1] if errors else (lines[-1] if lines else "no output")).replace("sbatch: error: ", "")


def execute(prepared: PreparedRun, rundir: RunDir, record: dict[str, Any]) -> dict[str, Any]:
    """Write ``sbatch.sh`` (and ``job.json``); with ``launcher.submit`` submit it.

    Returns the record ``rendered`` once the script is written, ``submitted`` (with ``slurm.job_id``) once Slurm
    accepts it (``train`` then exits 0: the run now belongs to Slurm; ``trainer status RUN_DIR`` follows it), or
    ``failed`` with sbatch's error line when Slurm refuses the job.
    """
    cfg = prepared.config
    run_dir = rundir.path.absolute()
    argv, env = cluster.job(prepared)
    rundir.write_job(argv, env)
    (run_dir / LOGS).mkdir(exist_ok=True)
    script = render_sbatch(cfg, run_dir, argv, env)
    rundir.write(SBATCH, script.encode(), mode=0o777)
    digest = cluster.parse_image(cfg.launcher.image)[1] if cfg.launcher.image else None
    record["image"] = {"reference": cfg.launcher.image, "digest": digest}
    record["slurm"] = {"script": SBATCH, "container": cfg.launcher.container, "job_id": None}
    record["probe"] = None
    if not cfg.launcher.submit:
        return rundir.hand_off(record, RENDERED, f"wrote {run_dir / SBATCH}; submit it with: sbatch {run_dir / SBATCH}")
    try:
        out = subprocess.run(
            ["sbatch", "--parsable", str(run_dir / SBATCH)], capture_output=True, text=True, timeout=120, cwd=run_dir
        )
    except FileNotFoundError:
        return rundir.end(record, FAILED, "sbatch not found on PATH: submit from a Slurm login node")
    if out.returncode != 0:
        return rundir.end(record, FAILED, f"sbatch refused the job: {_sbatch_error(out.stderr + out.stdout)}")
    job_id = out.stdout.strip().split(";")[0]
    record["slurm"]["job_id"] = job_id
    return rundir.hand_off(
        record, SUBMITTED, f"submitted Slurm job {job_id} ({run_dir}); follow it with: trainer status {run_dir}"
    )
