"""What the cluster launchers (``slurm``, ``ray``, ``local-image``) share: the image reference, the job's argv and
environment.

The job (``job.json``) is the plan's miles launch (:func:`trainer.compose.render.render`: ``argv.json`` and
``env.json``, the same as ``command.sh``) unless ``launcher.job`` names another command (a probe-only or smoke
job). ``$VAR`` references in argv and env stay symbolic here and are expanded on the cluster (by
``trainer.launch.ray_entry``), as the recipe's ``command.sh`` has bash do it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from trainer.errors import CheckError
from trainer.redact import redact_field

if TYPE_CHECKING:
    from trainer.compose.prepare import PreparedRun

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
REFERENCE_RE = re.compile(r"^(?P<name>[^@\s]+)@(?P<digest>sha256:[0-9a-f]{64})$")
ENV_NAMES = "RECIPE_BUNDLE_ENV_NAMES"  # the runtime env lists the recipe's variables here (comma-separated)
DIGEST_ENV = "RECIPE_BUNDLE_IMAGE_DIGEST"  # the image digest the job was started with (read by the probe)


def parse_image(reference: str, field: str = "launcher.image") -> tuple[str, str]:
    """Split ``NAME@sha256:<64 hex>`` into (name, digest); raises :class:`CheckError` naming ``field`` when the
    reference is not pinned by digest (a tag alone can move)."""
    match = REFERENCE_RE.match(reference or "")
    if not match:
        raise CheckError(
            f"{field} {redact_field(field, reference)!r}: expected an image pinned by digest, NAME@sha256:<64 hex>"
        )
    return match.group("name"), match.group("digest")


def job(prepared: PreparedRun) -> tuple[list[str], dict[str, str]]:
    """The job's (argv, env): ``launcher.job`` or the prepared run's miles launch, and the recipe's environment.

    Both are exactly what ``command.sh`` runs (values keep their ``$VAR`` references).
    """
    launch = prepared.launch
    job_argv = prepared.config.launcher.job
    argv = [str(t) for t in job_argv] if job_argv else list(launch.argv)
    return argv, dict(launch.env)


def last_line(text: str) -> str:
    """The last non-empty line of ``text`` (stripped), or ``""``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
