"""The names of a run directory's files: what ``train``, the launchers, the workers, the reports, the attestation
and ``trainer verify`` read and write, by one name each.

The bottom of :mod:`trainer.record`: it imports nothing of the project, so every module of the run directory
(:mod:`trainer.record.rundir`, which writes them, :mod:`trainer.record.attest`, which names them in the run's
attestation, :mod:`trainer.record.verify_cli`) imports the names from here. :mod:`trainer.record.rundir` re-exports
them, where the launchers and reports import them from.
"""

from __future__ import annotations

CONFIG, COMMAND, PLAN, ARGV, ENV, RECORD = (
    "config.yaml",
    "command.sh",
    "plan.json",
    "argv.json",
    "env.json",
    "record.json",
)
METRICS, SBATCH = "metrics.jsonl", "sbatch.sh"
RUNTIME_ENV, SUBMIT = "runtime_env.json", "submit.sh"  # a Ray job's runtime environment and its submit command
MEGATRON = "megatron.json"  # the megatron-core arguments a local-megatron worker chose
PROFILE = "profile-top-kernels.md"  # the GPU kernels of launcher.profile_step, by device time
SANDBOX = "sandbox.json"  # the bubblewrap command a local-image run ran its probe in
PROBES, PREFLIGHT, LOGS = "probes", "preflight.json", "logs"  # per-node probes/NODE.json, their comparison, job logs
JOB = (
    "job.json"  # the job a launcher runs or submits: {"argv", "env"} (a worker, torchrun, launcher.job, a cluster job)
)
CHECKPOINTS = "checkpoints"  # the CPU worker's checkpoints, Megatron's --save layout (trainer.launch.checkpoint)
ATTEMPTS = "attempts"  # attempts/N/: the record (and metrics) of each earlier attempt a --resume continued
ATTESTATION = "attestation.json"  # the run's attestation (trainer.record.attest), written last, when the run ends


def probe_rank(rank: int) -> str:
    """The file a local worker of rank ``rank`` writes its probe to (``probe-rank-RANK.json``)."""
    return f"probe-rank-{rank}.json"


def checkpoint_state(iteration: int) -> str:
    """The CPU worker's checkpoint file of ``iteration`` relative to the run directory (Megatron-LM's
    ``get_checkpoint_name``: ``iter_`` and 7 digits, model-parallel rank 0's ``model_optim_rng.pt``)."""
    return f"{CHECKPOINTS}/iter_{iteration:07d}/mp_rank_00/model_optim_rng.pt"


def checkpoint_state_sha256(iteration: int) -> str:
    """The file beside :func:`checkpoint_state` in which the worker that saved it wrote its sha256 as it saved it
    (``sha256sum``'s line: 64 hex digits, two spaces, ``model_optim_rng.pt``, a newline)."""
    return f"{checkpoint_state(iteration)}.sha256"
