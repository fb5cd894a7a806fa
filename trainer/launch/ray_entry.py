"""The entrypoint of a Ray job submitted by ``launcher=ray`` or ``launcher=slurm``: preflight, then the job.

``ray job submit -- python3 -m trainer.launch.ray_entry [OPTIONS] --argv-b64 B64`` runs this on the cluster
as the job's driver. It

1. with ``--expand``, expands ``$VAR`` / ``${VAR}`` references in the job's argv and in the recipe's
   environment variables (the runtime env names them in ``RECIPE_BUNDLE_ENV_NAMES``) from the cluster's
   environment, as the recipe's ``command.sh`` has bash do it; a reference to an unset variable stops the job
   (exit 2, one line naming it), as ``set -u`` would;
2. with ``--probe``, waits for ``--expect-nodes`` nodes to be alive (``--probe-timeout``), runs the version probe
   on every alive Ray node (one task per node, pinned with
   ``NodeAffinitySchedulingStrategy``), prints each as a ``RECIPE_BUNDLE_PROBE <node> <json>`` line (the
   launcher collects them from the job's logs) and compares them (:mod:`trainer.launch.preflight`); any
   difference, or fewer nodes than ``--expect-nodes``, prints the table and exits 3 before training;
3. changes to ``--workdir`` and replaces itself with the job (``os.execvp``): the job's exit code is the
   Ray job's.

``--argv-b64``: the argv as NUL-terminated strings, base64 (``printf '%s\\0' "${ARGV[@]}" | base64 -w0``), so
that it reaches the driver byte for byte whatever shell and quoting lie between.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import sys
import time

from trainer.launch import preflight
from trainer.probe import probe

PROBE_MARK = "RECIPE_BUNDLE_PROBE"
PREFLIGHT_MARK = "RECIPE_BUNDLE_PREFLIGHT"
ENV_NAMES = "RECIPE_BUNDLE_ENV_NAMES"
_VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


class Unset(Exception):
    """A ``$VAR`` reference to a variable that is not set."""


def expand(text: str, env: dict[str, str]) -> str:
    """``text`` with ``$VAR`` and ``${VAR}`` replaced from ``env``; raises :class:`Unset` naming a missing one."""

    def sub(match: re.Match[str]) -> str:
        name = match.group("braced") or match.group("plain")
        if name not in env:
            raise Unset(name)
        return env[name]

    return _VAR.sub(sub, text)


def decode_argv(b64: str) -> list[str]:
    """The argv from ``--argv-b64`` (base64 of NUL-terminated strings)."""
    raw = base64.b64decode(b64.encode(), validate=True)
    return [part.decode() for part in raw.split(b"\0")[:-1]] if raw else []


def encode_argv(argv: list[str]) -> str:
    """Inverse of :func:`decode_argv`."""
    return base64.b64encode(b"".join(a.encode() + b"\0" for a in argv)).decode()


def probe_nodes(timeout_s: float, expect_nodes: int | None = None) -> dict[str, dict | None]:
    """Run the probe on every alive node of the Ray cluster this driver belongs to; node name -> probe (None
    where the task failed). With ``expect_nodes``, first wait up to ``timeout_s`` seconds until that many nodes are
    alive (workers started beside the head join seconds after it answers)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout_s
        while expect_nodes and time.monotonic() < deadline:
            if sum(1 for n in ray.nodes() if n.get("Alive")) >= expect_nodes:
                break
            time.sleep(0.5)
        nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n.get("NodeManagerAddress", ""))

        @ray.remote(num_cpus=0)
        def _probe(name: str) -> dict:
            info = probe()
            info["node"] = name
            return info

        names = []
        refs = []
        for i, node in enumerate(nodes):
            name = node.get("NodeName") or node.get("NodeManagerAddress") or f"node{i}"
            if name in names:
                name = f"{name}#{i}"
            names.append(name)
            strategy = NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
            refs.append(_probe.options(scheduling_strategy=strategy).remote(name))
        out: dict[str, dict | None] = {}
        for name, ref in zip(names, refs, strict=True):
            try:
                out[name] = ray.get(ref, timeout=timeout_s)
            except Exception as ex:  # noqa: BLE001 - a node whose probe failed is reported, not raised
                print(f"{PROBE_MARK}-ERROR {name} {type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}")
                out[name] = None
        return out
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring. Exit: the job's, or 2 (bad input / unset variable), 3 (preflight)."""
    parser = argparse.ArgumentParser(
        prog="python -m trainer.launch.ray_entry",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--argv-b64", required=True, help="the job's argv (NUL-terminated strings, base64)")
    parser.add_argument("--expand", action="store_true", help="expand $VARS in argv and the recipe's env")
    parser.add_argument("--probe", action="store_true", help="probe every node and compare before the job")
    parser.add_argument("--expect-nodes", type=int, help="nodes the cluster must have (with --probe)")
    parser.add_argument("--expect-gpus", type=int, help="GPUs every node must see (with --probe)")
    parser.add_argument("--expect-digest", help="image digest every node must report (with --probe)")
    parser.add_argument(
        "--probe-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for --expect-nodes nodes to be alive, and for each node's probe (launcher.node_wait_s)",
    )
    parser.add_argument("--workdir", help="directory to start the job in")
    args = parser.parse_args(argv)
    try:
        job = decode_argv(args.argv_b64)
    except ValueError as ex:
        print(f"ray_entry: error: --argv-b64: not base64 of NUL-terminated strings ({ex})", file=sys.stderr)
        return 2
    if not job:
        print("ray_entry: error: --argv-b64: the job's argv is empty", file=sys.stderr)
        return 2
    if args.expand:
        try:
            for name in [n for n in os.environ.get(ENV_NAMES, "").split(",") if n]:
                if name in os.environ:
                    os.environ[name] = expand(os.environ[name], dict(os.environ))
            job = [expand(token, dict(os.environ)) for token in job]
        except Unset as ex:
            print(
                f"ray_entry: error: ${ex.args[0]} is referenced by the job's argv or env but not set on the cluster",
                file=sys.stderr,
            )
            return 2
    if args.probe:
        probes = probe_nodes(args.probe_timeout, args.expect_nodes)
        for name, info in probes.items():
            if info is not None:
                print(f"{PROBE_MARK} {name} {json.dumps(info, sort_keys=True)}")
        report = preflight.compare(probes, args.expect_gpus, args.expect_digest)
        report.waited_s = args.probe_timeout
        if args.expect_nodes is not None and len(probes) != args.expect_nodes:
            report.differences.append(
                preflight.Difference(preflight.CLUSTER, "nodes", str(len(probes)), str(args.expect_nodes))
            )
        print(report.table())
        print(f"{PREFLIGHT_MARK} {json.dumps(report.as_dict(), sort_keys=True)}")
        if not report.ok:
            print(report.reason())
            sys.stdout.flush()
            return preflight.EXIT_DIFFERS
        print(f"preflight: {len(probes)} node(s) agree")
    if args.workdir:
        try:
            os.chdir(args.workdir)
        except OSError as ex:
            print(f"ray_entry: error: --workdir {args.workdir}: {ex.strerror}", file=sys.stderr)
            return 2
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(job[0], job)
    except OSError as ex:
        print(f"ray_entry: error: cannot run {job[0]!r}: {ex.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
