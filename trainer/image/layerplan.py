"""A layer to build and its cache key: :class:`LayerPlan` (what :func:`trainer.image.build.plan_layers` and the
build steps of :mod:`trainer.image.native` plan) and :func:`layer_key`, the hash of everything that determines the
layer's bytes (:data:`LAYER_FORMAT` among it, which the provenance records)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.image.layer import Entry
from trainer.image.oci import compact_json

LAYER_FORMAT = 1  # bump when layer bytes for the same inputs would change (writer or installer behaviour)


@dataclass
class LayerPlan:
    """One layer to build: ``name`` (group), ``inputs`` (what its key hashes), ``comment`` for the history,
    ``make(spool, handles)`` returning its entries (called only on a cache miss; open files the entries
    read from are appended to ``handles`` and closed after the layer is written), or None for a plan made only
    for its key (:func:`layer_key`)."""

    name: str
    inputs: Any
    comment: str
    make: Callable[[Path, list[Any]], list[Entry]] | None
    cacheable: bool = True
    allow_absolute_symlinks: bool = False


def layer_key(lock: dict[str, Any], plan: LayerPlan) -> str:
    """sha256 hex of the canonical JSON (:func:`trainer.image.oci.compact_json`) of everything that determines
    ``plan``'s bytes."""
    basis = {
        "format": LAYER_FORMAT,
        "epoch": lock["epoch"],
        "python": lock["python"],
        "layer": plan.name,
        "inputs": plan.inputs,
    }
    return hashlib.sha256(compact_json(basis)).hexdigest()
