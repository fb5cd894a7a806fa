"""What a run record says about the image it ran in, read without loading the image tools (``train`` seals every
run with it: :mod:`trainer.record.attest`; ``trainer image diff --run`` compares it: :mod:`trainer.image.diff`)."""

from __future__ import annotations

from typing import Any


def record_image(record: dict[str, Any]) -> dict[str, Any]:
    """What a run record says about the image it ran in: ``{"digest", "lock"}`` (either may be None).

    Read from ``record["image"]`` (``{"digest": "sha256:...", "lock": "<lock sha256>"}``, or a bare digest
    string) and, failing that, from the first rank's probe (``record["probe"]["ranks"][0]["image"]``, same
    shape). ``lock`` may also be a path to a lock file; then its sha256 is used."""
    found: dict[str, Any] = {"digest": None, "lock": None}
    candidates = [record.get("image")]
    probe = record.get("probe")
    ranks = probe.get("ranks") if isinstance(probe, dict) else probe if isinstance(probe, list) else None
    if isinstance(ranks, list) and ranks and isinstance(ranks[0], dict):
        candidates.append(ranks[0].get("image"))
    for item in candidates:
        if isinstance(item, str):
            item = {"digest": item}
        if isinstance(item, dict):
            found["digest"] = found["digest"] or item.get("digest")
            found["lock"] = found["lock"] or item.get("lock") or item.get("lock_sha256")
    return found
