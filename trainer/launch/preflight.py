"""Preflight of a multi-node job: every node must report the same image and the same probe before training.

Each node runs the version probe (``python -m trainer.probe``) inside the job's image; this module compares
the per-node probes on the fields a multi-node NCCL job depends on and stops the job when any node differs:

=================  ==========================================================================
field              taken from the probe (:func:`trainer.probe.probe`)
=================  ==========================================================================
image digest       ``image.digest`` (the digest the job was started with, ``RECIPE_BUNDLE_IMAGE_DIGEST``)
image stamp        ``image["lock.json"].sha256``: the lock stamped into the image's own files
python             ``python``
torch              ``torch.version``
NCCL               ``torch.nccl``: the NCCL library as loaded by torch
NCCL net plugin    ``nccl_net_plugin``: ``NCCL_NET_PLUGIN`` and the net plugin libraries mapped in
driver             ``driver`` (``nvidia-smi``)
GPUs               ``len(torch.gpus)``: GPUs visible to the process
=================  ==========================================================================

The reference value of a field is what most nodes report (ties: the first node in order), except that an
expected image digest or GPU count, when given, is the reference. A node whose probe is missing (the probe
failed or never ran) differs in every field. The module has no dependencies beyond the standard library and
the ``trainer`` package: it runs inside the job's image on a node.

Command line (what the generated ``sbatch.sh`` runs)::

    python -m trainer.launch.preflight PROBE_DIR --nodes n1,n2,... [--expect-gpus 8] [--expect-digest sha256:...]
                                       [--out preflight.json]

exits 0 when every node agrees, 3 with the table on stdout when any differs, 2 on bad input (one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MISSING_PROBE = "(no probe)"
FIELDS = ("image digest", "image stamp", "python", "torch", "NCCL", "NCCL net plugin", "driver", "GPUs")
EXIT_DIFFERS = 3


def _dig(data: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def summarize(probe: Mapping[str, Any]) -> dict[str, str]:
    """The compared fields of one node's probe as strings (``-`` where the probe saw nothing)."""
    torch = probe.get("torch") or {}
    plugin = probe.get("nccl_net_plugin") or {}
    loaded = plugin.get("loaded") or []
    plugin_text = ",".join(Path(p).name for p in loaded) if loaded else ""
    if plugin.get("env"):
        plugin_text = f"NCCL_NET_PLUGIN={plugin['env']}" + (f" {plugin_text}" if plugin_text else "")
    values = {
        "image digest": _dig(probe, "image", "digest"),
        "image stamp": _dig(probe, "image", "lock.json", "sha256"),
        "python": probe.get("python"),
        "torch": torch.get("version"),
        "NCCL": torch.get("nccl"),
        "NCCL net plugin": plugin_text or None,
        "driver": probe.get("driver"),
        "GPUs": len(torch.get("gpus") or []),
    }
    return {k: "-" if v is None else str(v) for k, v in values.items()}


CLUSTER = "(cluster)"  # the node name of a difference of the whole cluster (fewer nodes than cluster.nodes)


@dataclass
class Difference:
    """One node whose ``field`` is ``value`` where the reference (most nodes, or the expectation) is ``expected``."""

    node: str
    field: str
    value: str
    expected: str


@dataclass
class Report:
    """The comparison of ``nodes`` (in order): per-node summaries and the differences (empty when all agree)."""

    nodes: list[str]
    summaries: dict[str, dict[str, str] | None]
    reference: dict[str, str]
    differences: list[Difference] = field(default_factory=list)
    waited_s: float = 0.0  # seconds the job waited for the nodes to join (a short cluster's reason says it)

    @property
    def ok(self) -> bool:
        """True when no node differs (``differences`` is empty)."""
        return not self.differences

    def reason(self) -> str:
        """One line: which nodes differ in what (empty when ok)."""
        if self.ok:
            return ""
        short = next((d for d in self.differences if d.node == CLUSTER and d.field == "nodes"), None)
        if short is not None:  # nodes that never joined: the rest of the comparison is moot
            return (
                f"preflight: {short.value} of {short.expected} node(s) alive after {self.waited_s:.0f} s"
                f" ({', '.join(self.nodes) or 'none'}); cluster.nodes is {short.expected}"
            )
        by_node: dict[str, list[str]] = {}
        for d in self.differences:
            if d.value == MISSING_PROBE:
                by_node.setdefault(d.node, ["probe failed"])
            else:
                by_node.setdefault(d.node, []).append(f"{d.field} {d.value} != {d.expected}")
        parts = [f"{node}: {'; '.join(items)}" for node, items in by_node.items()]
        return f"preflight: {len(by_node)} of {len(self.nodes)} node(s) differ: " + " | ".join(parts)

    def table(self) -> str:
        """A plain-text table, one row per node and a column per field; differing cells are marked ``*``."""
        differing = {(d.node, d.field) for d in self.differences}
        header = ["node", *FIELDS]
        rows = [["(reference)", *(self.reference.get(f, "-") for f in FIELDS)]]
        for node in self.nodes:
            summary = self.summaries.get(node)
            if summary is None:
                rows.append([node, *([MISSING_PROBE + " *"] + ["*"] * (len(FIELDS) - 1))])
                continue
            rows.append([node, *(summary[f] + (" *" if (node, f) in differing else "") for f in FIELDS)])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-able data: ``ok``, ``nodes``, ``reference``, ``summaries``, ``differences`` (dicts)
        and ``reason`` (None when ok).
        """
        return {
            "ok": self.ok,
            "nodes": self.nodes,
            "reference": self.reference,
            "summaries": self.summaries,
            "differences": [d.__dict__ for d in self.differences],
            "reason": self.reason() or None,
        }


def compare(
    probes: Mapping[str, Mapping[str, Any] | None],
    expect_gpus: int | None = None,
    expect_digest: str | None = None,
) -> Report:
    """Compare per-node probes (node name -> probe dict, or None where the node's probe failed).

    ``expect_gpus``: GPUs every node must see (the job's GPUs per node); ``expect_digest``: the image digest
    (``sha256:<64 hex>``) every node must report. Returns a :class:`Report` (``ok`` false on any difference).
    """
    nodes = list(probes)
    summaries = {n: (summarize(p) if p is not None else None) for n, p in probes.items()}
    present = [s for s in summaries.values() if s is not None]
    reference: dict[str, str] = {}
    for name in FIELDS:
        counts = Counter(s[name] for s in present)
        reference[name] = max(counts, key=lambda v: counts[v]) if counts else "-"
    if expect_gpus is not None:
        reference["GPUs"] = str(expect_gpus)
    if expect_digest:
        reference["image digest"] = expect_digest
    differences: list[Difference] = []
    for node in nodes:
        summary = summaries[node]
        if summary is None:
            differences.append(Difference(node, "probe", MISSING_PROBE, "a probe"))
            continue
        for name in FIELDS:
            if summary[name] != reference[name]:
                differences.append(Difference(node, name, summary[name], reference[name]))
    return Report(nodes=nodes, summaries=summaries, reference=reference, differences=differences)


def read_probes(directory: Path, nodes: Sequence[str]) -> dict[str, dict[str, Any] | None]:
    """``DIR/<node>.json`` for each node (None where missing or unreadable: that node's probe failed)."""
    out: dict[str, dict[str, Any] | None] = {}
    for node in nodes:
        try:
            data = json.loads((directory / f"{node}.json").read_text())
            out[node] = data if isinstance(data, dict) else None
        except (OSError, json.JSONDecodeError):
            out[node] = None
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring. Exit 0 all agree, 3 a node differs, 2 bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m trainer.launch.preflight", description="compare the version probes of every node of a job"
    )
    parser.add_argument("probe_dir", type=Path, help="directory of <node>.json probes")
    parser.add_argument("--nodes", required=True, help="comma-separated node names (every node of the job)")
    parser.add_argument("--expect-gpus", type=int, help="GPUs every node must see")
    parser.add_argument("--expect-digest", help="image digest every node must report (sha256:...)")
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args(argv)
    nodes = [n for n in args.nodes.split(",") if n]
    if not nodes:
        print("preflight: error: --nodes: expected at least one node name", file=sys.stderr)
        return 2
    report = compare(read_probes(args.probe_dir, nodes), args.expect_gpus, args.expect_digest)
    if args.out:
        tmp = args.out.with_name(f".{args.out.name}.tmp")
        tmp.write_text(json.dumps(report.as_dict(), indent=2, sort_keys=True) + "\n")
        tmp.replace(args.out)
    print(report.table())
    if report.ok:
        print(f"preflight: {len(nodes)} node(s) agree")
        return 0
    print(report.reason())
    return EXIT_DIFFERS


if __name__ == "__main__":
    raise SystemExit(main())
