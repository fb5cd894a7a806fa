"""``launcher=slurm``: render ``sbatch.sh`` for a Slurm cluster (pyxis/enroot), optionally submit it.

The script (one per run directory, which must be on a file system every node sees) asks for
``cluster.nodes`` nodes x ``cluster.gpus_per_node`` GPUs (``--gpus-per-node`` or ``--gres=gpu:N``),
``launcher.time_limit``, ``cluster.partition`` and ``cluster.account``, and then, every step started with
``srun`` inside ``launcher.image`` pinned by digest (pyxis: ``--container-image=NAME@sha256:...``, one named
container per node shared by the steps; ``launcher.container=none`` runs the steps in the nodes' own
environment, for clusters without pyxis). ``launcher.image=/PATH.sqsh@sha256:...`` names a squashfs file that
``trainer image squashfs`` made from that digest (:mod:`trainer.image.squashfs`; for a cluster without a
registry): it must hash to its record at check time and again on the batch host before the first step, and
``--container-image`` is the file. The steps:

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

The script is ``templates/sbatch.sh.tmpl`` next to this module (:data:`SBATCH_TEMPLATE`), filled in by
:func:`render_sbatch` with the values of :func:`sbatch_values`.

``launcher.submit=true`` submits with ``sbatch`` and prints the job id; ``trainer status RUN_DIR`` follows it.
A submission Slurm refuses marks the run ``failed`` with sbatch's error line.
"""

from __future__ import annotations

import json
import re
import shlex
import string
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import REPO_ROOT
from trainer.compose.checks import Parallelism
from trainer.compose.render import argv_words, shell_word
from trainer.compose.schema import TrainConfig
from trainer.errors import CheckError, UserError
from trainer.image.squashfs import checked_squashfs
from trainer.launch.host import cluster
from trainer.record.rundir import FAILED, LOGS, RENDERED, SBATCH, SUBMITTED, RunDir
from trainer.redact import is_secret_name, redact_field

if TYPE_CHECKING:
    from trainer.compose.prepare import PreparedRun

CONTAINERS = ("pyxis", "none")
NODE_ADDRESSES = ("interface", "hostname")
GPUS_FLAGS = ("gpus-per-node", "gres", "none")
TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")
LAUNCHER_MOUNT = "/opt/recipe-bundle-launcher"  # where pyxis mounts this bundle's trainer package
IMAGE_WORKDIR = "/root/miles"  # where the recipe image has miles (lockfiles: sources miles.dest); the job starts there


SBATCH_VALUE_RE = re.compile(r"^[A-Za-z0-9_.,:=@/+-]+$")
# The batch script with ${name} for the values of sbatch_values and $$ for bash's own $ (string.Template).
SBATCH_TEMPLATE = Path(__file__).parent / "templates" / "sbatch.sh.tmpl"


def check(cfg: TrainConfig, par: Parallelism) -> None:
    """Refuse what cannot become a valid sbatch script (one line naming the field)."""
    lau = cfg.launcher
    if lau.container not in CONTAINERS:
        raise CheckError(f"launcher.container {lau.container!r}: expected one of {', '.join(CONTAINERS)}")
    if lau.node_address not in NODE_ADDRESSES:
        raise CheckError(f"launcher.node_address {lau.node_address!r}: expected one of {', '.join(NODE_ADDRESSES)}")
    cluster.check_payload(cfg)
    if lau.gpus_flag not in GPUS_FLAGS:
        raise CheckError(f"launcher.gpus_flag {lau.gpus_flag!r}: expected one of {', '.join(GPUS_FLAGS)}")
    if lau.container == "pyxis" or lau.image:
        cluster.parse_image(lau.image or "")
    if squashfs_of(cfg) is not None and lau.container != "pyxis":
        raise CheckError(
            f"launcher.image {lau.image!r}: a squashfs file is an image for pyxis; set launcher.container=pyxis"
        )
    checked_image(cfg)  # a squashfs file must be the bytes recorded when it was made, from the digest asked for
    if not TIME_RE.match(lau.time_limit):
        raise CheckError(
            f"launcher.time_limit {redact_field('time_limit', lau.time_limit)!r}: expected Slurm's time format, "
            "e.g. 04:00:00 or 1-00:00:00"
        )
    for mount in lau.container_mounts:
        if mount.count(":") not in (1, 2) or not mount.startswith("/"):
            raise CheckError(
                f"launcher.container_mounts {redact_field('container_mounts', mount)!r}: "
                "expected /SRC:/DST or /SRC:/DST:ro"
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
                f"{key} {redact_field(key, value)!r}: expected one word of letters, digits and _.,:=@/+- "
                "(it becomes an #SBATCH line)"
            )


def squashfs_of(cfg: TrainConfig) -> Path | None:
    """The squashfs file ``launcher.image`` names (``/PATH@sha256:...``: an absolute path, which pyxis takes as a
    file to unpack rather than a registry reference), else None."""
    name = cluster.parse_image(cfg.launcher.image)[0] if cfg.launcher.image else ""
    return Path(name) if name.startswith("/") else None


def checked_image(cfg: TrainConfig) -> dict[str, Any] | None:
    """For a squashfs ``launcher.image``: its record after :func:`trainer.image.squashfs.checked_squashfs` (the
    file hashes to what ``trainer image squashfs`` recorded, made from the digest asked for), with ``path``;
    else None. Raises :class:`CheckError` (one line naming ``launcher.image``) otherwise."""
    path = squashfs_of(cfg)
    if path is None:
        return None
    try:
        record = checked_squashfs(path, cluster.parse_image(cfg.launcher.image or "")[1])
    except UserError as err:
        raise CheckError(str(err)) from None
    return {"path": str(path), "sha256": record["sha256"], "bytes": record["bytes"]}


def _image_check(cfg: TrainConfig, squashfs: dict[str, Any] | None) -> list[str]:
    """The lines that check a squashfs image on the batch host before any node unpacks it: its sha256 must be the
    one checked at submission; a changed file ends the job (``trainer status`` then records it failed)."""
    if squashfs is None:
        return []
    check = f"{squashfs['sha256']}  {squashfs['path']}"
    return [
        "# the squashfs image: the bytes checked at submission (trainer image squashfs recorded them), before use",
        f"if ! echo {_q(check)} | sha256sum --check --status; then",
        '  echo "launcher.image $IMAGE: its sha256 is no longer '
        + squashfs["sha256"]
        + ' (changed after submission; refused)" | tee "$RUN_DIR/logs/image-check.log" >&2',
        "  exit 1",
        "fi",
    ]


def _q(word: str | Path) -> str:
    return shlex.quote(str(word))


def _lines(lines: list[str]) -> str:
    """``lines`` as a block of the template: each line ending in a newline (nothing for no lines)."""
    return "".join(line + "\n" for line in lines)


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
        '  [ -n "${!v+x}" ] || { echo "sbatch.sh: $v is not set: export it before sbatch (paths.* refer to it)" >&2; '
        "exit 2; }",
        "done",
    ]


def _resources(cfg: TrainConfig) -> list[str]:
    """The ``#SBATCH`` lines of the allocation after ``--ntasks-per-node``: GPUs (``launcher.gpus_flag``), time
    limit, partition and account (the last two only when set)."""
    lau, clu = cfg.launcher, cfg.cluster
    lines = []
    if lau.gpus_flag == "gpus-per-node":
        lines.append(f"#SBATCH --gpus-per-node={clu.gpus_per_node}")
    elif lau.gpus_flag == "gres":
        lines.append(f"#SBATCH --gres=gpu:{clu.gpus_per_node}")
    lines.append(f"#SBATCH --time={lau.time_limit}")
    if clu.partition:
        lines.append(f"#SBATCH --partition={clu.partition}")
    if clu.account:
        lines.append(f"#SBATCH --account={clu.account}")
    return lines


def _container(cfg: TrainConfig, run_dir: Path, python: str) -> list[str]:
    """The lines that set ``PYTHONPATH`` and the ``CONTAINER`` array every ``srun`` step passes: pyxis flags that run
    the step in ``launcher.image`` with the run directory and this bundle's ``trainer`` mounted (read-only, at
    :data:`LAUNCHER_MOUNT`), or none (``launcher.container=none``: the nodes' own environment, ``python``'s
    directory first on ``PATH``)."""
    lau = cfg.launcher
    if lau.container == "pyxis":
        mounts = [f"{run_dir}:{run_dir}", f"{REPO_ROOT / 'trainer'}:{LAUNCHER_MOUNT}/trainer:ro", *lau.container_mounts]
        return [
            f"export PYTHONPATH={LAUNCHER_MOUNT}${{PYTHONPATH:+:$PYTHONPATH}}",
            "# every step runs in the image by digest; the steps of one node share a named container",
            'CONTAINER=(--container-image="$IMAGE" --container-name="recipe-$SLURM_JOB_ID" '
            f"--container-mounts={_q(','.join(mounts))})",
        ]
    return [
        f"export PYTHONPATH={_q(REPO_ROOT)}${{PYTHONPATH:+:$PYTHONPATH}}",
        *([f"export PATH={_q(Path(python).parent)}:$PATH"] if Path(python).parent != Path(".") else []),
        "# launcher.container=none: the steps run in the nodes' own environment",
        "CONTAINER=()",
    ]


def _entry(cfg: TrainConfig, digest: str) -> list[str]:
    """The arguments of :mod:`trainer.launch.ray_entry` before ``--argv-b64``: the nodes (and GPUs per node, image
    digest, working directory) the job must find before it runs."""
    lau, clu = cfg.launcher, cfg.cluster
    entry = ["--probe", "--expect-nodes", str(clu.nodes), "--probe-timeout", str(lau.node_wait_s)]
    if lau.expect_gpus:
        entry += ["--expect-gpus", str(clu.gpus_per_node)]
    if digest:
        entry += ["--expect-digest", digest]
    # the recipe's job starts in the image's miles checkout; the CPU worker (payload=cpu) needs none
    workdir = lau.workdir or (IMAGE_WORKDIR if lau.container != "none" and lau.payload == "miles" else None)
    if workdir:
        entry += ["--workdir", workdir]
    return entry


def python_of(cfg: TrainConfig) -> str:
    """The interpreter on the nodes: ``launcher.python``, else ``python3`` in the image (pyxis), else this one."""
    return cfg.launcher.python or ("python3" if cfg.launcher.container == "pyxis" else sys.executable)


def sbatch_values(cfg: TrainConfig, run_dir: Path, argv: list[str], env: dict[str, str]) -> dict[str, str]:
    """The values of :data:`SBATCH_TEMPLATE`'s placeholders for ``cfg`` writing into ``run_dir`` (absolute, one
    word: checked by :func:`render_sbatch`), the job's ``argv`` and ``env`` (:func:`cluster.job`). A value named
    in the plural (``resources``, ``container``, ``exports``, ...) is a block of whole lines, each ending in a
    newline; a ``_word`` is quoted for bash."""
    lau, clu = cfg.launcher, cfg.cluster
    digest = cluster.parse_image(lau.image)[1] if lau.image else ""
    squashfs = checked_image(cfg)
    python = python_of(cfg)
    preflight = [
        f"--expect-gpus {clu.gpus_per_node}" if lau.expect_gpus else "",
        f"--expect-digest {digest}" if digest else "",
    ]
    return {
        "label": cfg.layout.label,
        "nodes": str(clu.nodes),
        "gpus": str(clu.gpus_per_node),
        "gpu_type": clu.gpu_type,
        "cluster_name": clu.name,
        "run_dir": str(run_dir),
        "layout_name": cfg.layout.name,
        "resources": _lines(_resources(cfg)),
        "sbatch_args": _lines([f"#SBATCH {arg}" for arg in lau.sbatch_args]),
        "run_dir_word": _q(run_dir),
        "python_word": _q(python),
        "image_word": _q(squashfs["path"] if squashfs else lau.image or ""),
        "image_check": _lines(_image_check(cfg, squashfs)),
        "digest_word": _q(digest),
        "container": _lines(_container(cfg, run_dir, python)),
        "require_vars": _lines(_require_vars(env, argv)),
        "exports": _lines(
            [
                f'export {k}="${{{k}:?{k} is a secret: set it in the environment before sbatch}}"'
                if is_secret_name(k)
                else f"export {k}={shell_word(v)}"
                for k, v in env.items()
            ]
        ),
        "argv": _lines(["  " + words for words in argv_words(argv)]),
        "preflight_args": " ".join(a for a in preflight if a),
        "head_ip": _q(lau.head_ip)
        if lau.head_ip
        else '$(srun --overlap -N1 -n1 -w "$HEAD" hostname -i | cut -d" " -f1)'
        if lau.node_address == "hostname"
        else "$(srun --overlap -N1 -n1 -w \"$HEAD\" hostname -I | awk '{print $1}')",
        "worker_ip": ' --node-ip-address="$(hostname -i | cut -d" " -f1)"' if lau.node_address == "hostname" else "",
        "ray_port": str(lau.ray_port),
        "dashboard_port": str(lau.dashboard_port),
        "ray_join_wave": str(lau.ray_join_wave),
        "node_wait_s": str(lau.node_wait_s),
        "ray_args": "".join(" " + _q(a) for a in lau.ray_start_args),
        "entry": " ".join(_q(e) for e in _entry(cfg, digest)),
    }


def render_sbatch(cfg: TrainConfig, run_dir: Path, argv: list[str], env: dict[str, str]) -> str:
    """The batch script for ``cfg`` writing into ``run_dir`` (made absolute); see the module docstring.

    :data:`SBATCH_TEMPLATE` (a :class:`string.Template`: ``${name}`` a value of :func:`sbatch_values`, ``$$``
    bash's own ``$``) filled in. Raises :class:`UserError` for a run directory that is not one word of
    :data:`SBATCH_VALUE_RE` (it becomes Slurm's ``--output``).
    """
    run_dir = run_dir.absolute()
    if not SBATCH_VALUE_RE.match(str(run_dir)):
        raise UserError(
            f"run directory {run_dir}: expected a path without spaces or special characters (Slurm's --output)"
        )
    template = string.Template(SBATCH_TEMPLATE.read_text(encoding="utf-8"))
    return template.substitute(sbatch_values(cfg, run_dir, argv, env))


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
    if cfg.launcher.payload == "cpu":
        argv, env, rows = cluster.cpu_job(prepared, run_dir, python_of(cfg), env)
        record["data"] = {"rows": str(rows), "manifest": json.loads((rows / "manifest.json").read_text())}
    rundir.write_job(argv, env)
    (run_dir / LOGS).mkdir(exist_ok=True)
    script = render_sbatch(cfg, run_dir, argv, env)
    rundir.write(SBATCH, script.encode(), mode=0o777)
    digest = cluster.parse_image(cfg.launcher.image)[1] if cfg.launcher.image else None
    record["image"] = {"reference": cfg.launcher.image, "digest": digest}
    squashfs = checked_image(cfg)
    if squashfs is not None:
        record["image"]["squashfs"] = squashfs
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
