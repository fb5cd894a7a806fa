"""Build steps: compiled parts of the image (sdists, C/C++/CUDA sources) built like Nix derivations.

A lock's ``builds`` list names each step's inputs, command and environment; the output directory becomes one
image layer (``build-<name>``, after ``sources``)::

    "builds": [{
      "name": "aws-ofi-nccl",
      "input": {"source": "aws-ofi-nccl"}          # a sources[] item (archive checked against its git tree)
             | {"sdist": "antlr4-python3-runtime"}, # or an sdists[] item (sha256)
      "wheels": ["nvidia-cuda-runtime", ...],      # installed into the build root (build_root.wheels or wheels)
      "command": ["/bin/sh", "-euc", "..."],       # run in /build/src; writes only /build/out
      "env": {"K": "V"},                           # on top of the fixed environment below
      "install": {"type": "tree", "dest": "/opt/aws-ofi-nccl"}   # /build/out's files under dest
               | {"type": "wheel"}                  # /build/out holds one wheel: installed as the image's wheels are
    }]

The step runs in bubblewrap (:func:`sandbox_argv`): the build root (:mod:`trainer.image.buildroot`) read-only
at ``/``, the step's wheels read-only at the build root's Python prefix, the unpacked input read-only at
``/build/input`` and copied in name order into a tmpfs at ``/build/src`` (writable scratch; a tmpfs lists
files in creation order, so sources found by walking a directory come in the same order everywhere: link
order), an empty ``/build/out``, a private ``/tmp``, ``/dev`` and ``/proc``; no network
(``--unshare-net``: not even loopback is up), new PID/IPC/UTS namespaces, every capability dropped, the
environment cleared and set to :data:`FIXED_ENV` + the lock's ``SOURCE_DATE_EPOCH`` + ``BUILD_JOBS`` + the
step's ``env``, umask 022. The sandbox path of everything is the same on every machine, and
``-ffile-prefix-map=/build/src=.`` is in ``CFLAGS``/``CXXFLAGS``, so no host path reaches the output. A write
outside ``/build/out``, ``/build/src`` and ``/tmp`` fails (read-only file system), and so does a connection.

The layer's cache key (:func:`trainer.image.layerplan.layer_key`) hashes the step (name, command, env, install),
the input's sha256 (and git tree), the build root's .debs and the step's wheels (name, version, sha256), the
lock's epoch and python block: an unchanged step is never rebuilt, a changed input rebuilds that step only.
``BUILD_JOBS`` (``--jobs``) is not part of the key: a build whose bytes depend on it is a bug that the
reproducibility bench finds. A failing command raises one line naming the step, its exit status and its log
(``CACHE/logs/build-<name>-<key>.log``, kept); nothing is cached and no image is written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.image import buildroot
from trainer.image.cas import Cache
from trainer.image.layer import Entry, entries_from_tree
from trainer.image.layerplan import LayerPlan, layer_key
from trainer.image.sources import cached_archive, source_entries
from trainer.image.tarread import entries_from_tar
from trainer.image.wheels import install_wheels
from trainer.lock.imagelock import canonical_name, wheel_items

FORMAT = 1  # bump when the same step would give other bytes (sandbox, fixed env, output handling)
INPUT, SRC, OUT = "/build/input", "/build/src", "/build/out"
PREFIX_MAP = f"-ffile-prefix-map={SRC}=. -fdebug-prefix-map={SRC}=."
FIXED_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TZ": "UTC",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PIP_NO_INDEX": "1",
    "PIP_NO_CACHE_DIR": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "CFLAGS": f"-O2 {PREFIX_MAP}",
    "CXXFLAGS": f"-O2 {PREFIX_MAP}",
    "BUILD_SRC": SRC,
    "BUILD_OUT": OUT,
}


def unbuilt_sdists(lock: dict[str, Any]) -> list[str]:
    """Names of the lock's sdists that no build step builds (an image must not ship them unbuilt)."""
    built = {canonical_name(s["input"]["sdist"]) for s in lock.get("builds", []) if "sdist" in s["input"]}
    return [s["name"] for s in lock.get("sdists", []) if canonical_name(s["name"]) not in built]


def _input_item(lock: dict[str, Any], step: dict[str, Any]) -> dict[str, Any]:
    spec = step["input"]
    if "source" in spec:
        return next(s for s in lock["sources"] if s["name"] == spec["source"])
    return next(s for s in lock["sdists"] if canonical_name(s["name"]) == canonical_name(spec["sdist"]))


def step_inputs(lock: dict[str, Any], step: dict[str, Any]) -> dict[str, Any]:
    """Everything a step's output depends on (its layer key hashes this; see the module docstring)."""
    item = _input_item(lock, step)
    if "source" in step["input"]:
        source = {
            "source": item["name"],
            "commit": item["commit"],
            "tree": item["tree"],
            "sha256": item.get("archive", {}).get("sha256"),
        }
    else:
        source = {"sdist": item["filename"], "sha256": item["sha256"]}
    root = lock["build_root"]
    wheels = wheel_items(lock, step.get("wheels", []), step["name"])
    return {
        "format": FORMAT,
        "step": {k: step.get(k) for k in ("name", "command", "env", "install")},
        "input": source,
        "fixed_env": FIXED_ENV,
        "root": buildroot.deb_key(root),
        "wheels": buildroot.wheels_key(root, wheels) if wheels else None,
    }


def sandbox_argv(
    root: Path, local: Path | None, prefix: str, src: Path, out: Path, env: dict[str, str], command: list[str]
) -> list[str]:
    """The bubblewrap command line running ``command`` in the build root (see the module docstring)."""
    argv = ["bwrap", "--ro-bind", str(root), "/"]
    if local is not None:
        argv += ["--ro-bind", str(local), prefix]
    argv += [
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "--ro-bind",
        str(src),
        INPUT,
        "--tmpfs",
        SRC,
        "--bind",
        str(out),
        OUT,
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--hostname",
        "build",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--chdir",
        SRC,
        "--clearenv",
    ]
    for key in sorted(env):
        argv += ["--setenv", key, env[key]]
    # the input is copied into the tmpfs in name order: tmpfs lists a directory in creation order, so a build
    # that globs or walks its sources (link order!) sees the same order on every machine and file system
    copy = f'tar -C {INPUT} -c --sort=name . | tar -C {SRC} -x --no-same-owner && exec "$@"'
    return argv + ["--", "/bin/sh", "-ec", copy, "sh"] + command


def _unpack_input(lock: dict[str, Any], step: dict[str, Any], cache: Cache, offline: bool, dest: Path) -> None:
    item = _input_item(lock, step)
    if "source" in step["input"]:
        entries = source_entries(cached_archive(cache, item), {**item, "dest": "/"})  # checked against its tree
    else:
        path = cache.ensure(item["sha256"], f"sdist {item['filename']}", item["url"], offline)
        with open(path, "rb") as handle:
            entries = entries_from_tar(handle, "", strip_components=1)
    buildroot.materialize(entries, dest)


class WorkDir:
    """A step's scratch directory in the cache's ``tmp/``; :meth:`close` removes it (after the layer is written)."""

    def __init__(self, cache: Cache, name: str) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"build-{name}-", dir=cache.tmp_dir()))

    def close(self) -> None:
        """Remove the directory and everything under it."""
        buildroot.remove_tree(self.path)


def run_step(
    lock: dict[str, Any],
    step: dict[str, Any],
    cache: Cache,
    key: str,
    work: Path,
    offline: bool = False,
    jobs: int = 1,
    console=None,
) -> Path:
    """Run ``step`` in its sandbox with scratch under ``work``; return its (non-empty) output directory.

    Raises :class:`UserError` with one line naming the step when an input is missing or corrupt, bubblewrap is
    absent, the command exits non-zero (its log is kept under ``CACHE/logs/``) or it wrote nothing.
    """
    if shutil.which("bwrap") is None:
        raise UserError(f"build step {step['name']}: needs bubblewrap (`bwrap`, Debian package bubblewrap)")
    block = lock["build_root"]
    root = buildroot.debian_tree(cache, block, offline, console)
    wheels = wheel_items(lock, step.get("wheels", []), step["name"])
    local = buildroot.wheel_tree(cache, block, wheels, offline, console)
    src, out = work / "src", work / "out"
    src.mkdir()
    out.mkdir()
    _unpack_input(lock, step, cache, offline, src)
    env = {
        **FIXED_ENV,
        "SOURCE_DATE_EPOCH": str(lock["epoch"]),
        "BUILD_JOBS": str(max(1, int(jobs))),
        **step.get("env", {}),
    }
    argv = sandbox_argv(root, local, block["python"]["prefix"], src, out, env, step["command"])
    logs = cache.root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"build-{step['name']}-{key[:16]}.log"
    if console is not None:
        console.print(f"build {step['name']}: running (log {log})", soft_wrap=True)
    started = time.monotonic()
    with open(log, "wb") as handle:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT, preexec_fn=lambda: os.umask(0o022)
        )
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["(no output)"]
        raise UserError(
            f"build step {step['name']} failed (exit {proc.returncode} after {seconds:.0f} s): "
            f"{tail[0].strip()[:200]}; log: {log}"
        )
    if not any(out.iterdir()):
        raise UserError(f"build step {step['name']}: wrote nothing to {OUT}; log: {log}")
    if console is not None:
        console.print(f"build {step['name']}: done in {seconds:.1f} s", soft_wrap=True)
    return out


def output_entries(
    lock: dict[str, Any], step: dict[str, Any], out: Path, cache: Cache, spool: Path, handles: list[Any]
) -> list[Entry]:
    """The layer entries of a step's output: its files under ``install.dest``, or its one wheel installed under
    the lock's ``python`` (the wheel is also added to the cache). Raises :class:`UserError` otherwise."""
    install = step["install"]
    if install["type"] == "tree":
        return entries_from_tree(out, install["dest"])
    wheels = sorted(p for p in out.iterdir() if p.name.endswith(".whl"))
    others = [p.name for p in out.iterdir() if not p.name.endswith(".whl")]
    if len(wheels) != 1 or others:
        raise UserError(
            f"build step {step['name']}: expected one wheel in {OUT}, found {[p.name for p in wheels] + others}"
        )
    cache.add_file(wheels[0])
    return install_wheels(
        [(wheels[0], wheels[0].name, f"built wheel {wheels[0].name}")], lock["python"], spool, handles
    )


def build_plans(lock: dict[str, Any], cache: Cache, offline: bool, jobs: int = 1, console=None) -> list:
    """One :class:`trainer.image.layerplan.LayerPlan` per build step (layer ``build-<name>``), in the lock's order."""
    plans = []
    for step in lock.get("builds", []):

        def make(spool: Path, handles: list[Any], step=step) -> list[Entry]:
            work = WorkDir(cache, step["name"])
            try:
                key = layer_key(lock, plans_by_name[step["name"]])
                out = run_step(lock, step, cache, key, work.path, offline, jobs, console)
                entries = output_entries(lock, step, out, cache, spool, handles)
            except BaseException:
                work.close()
                raise
            handles.append(work)
            return entries

        item = _input_item(lock, step)
        label = item["name"] + (f"@{item['commit'][:12]}" if "commit" in item else f" {item['version']} sdist")
        plan = LayerPlan(
            f"build-{step['name']}",
            step_inputs(lock, step),
            f"build {step['name']} from {label}: {' '.join(step['command'])}"[:1000],
            make,
        )
        plans.append(plan)
    plans_by_name = {p.name[len("build-") :]: p for p in plans}
    return plans


def step_keys(lock: dict[str, Any]) -> dict[str, str]:
    """step name -> the cache key of its layer (:func:`trainer.image.layerplan.layer_key` of its inputs)."""
    return {
        step["name"]: layer_key(lock, LayerPlan(f"build-{step['name']}", step_inputs(lock, step), "", None))
        for step in lock.get("builds", [])
    }


def check_builds(lock: dict[str, Any], layers: list[dict[str, Any]], expected: dict[str, Any]):
    """Compare an image's ``build-<name>`` layers ([{"name", "diff_id", "size"}]) with the reproduced outputs
    recorded in ``lockfiles/expected-digests.json`` (``<lock>.builds.<step>``: {"key", "diff_id", "size"}, written
    by ``bench/native_builds.py --record``). Only records whose key equals the step's current key count (an
    input changed otherwise). Returns (one line per step, whether none differs)."""
    keys = step_keys(lock)
    have = {layer["name"][len("build-") :]: layer for layer in layers if layer["name"].startswith("build-")}
    lines, ok = [], True
    for name, key in keys.items():
        want = expected.get(name)
        got = have.get(name)
        if got is None:
            lines.append(f"build {name}: not in the image")
            ok = False
        elif want is None or want.get("key") != key:
            lines.append(f"build {name}: {got['diff_id']} (no reproduced digest recorded for its inputs {key[:16]})")
        elif want["diff_id"] == got["diff_id"]:
            lines.append(f"build {name}: same {got['diff_id']} as the reproduced build")
        else:
            lines.append(
                f"build {name}: {got['diff_id']}, the reproduced build gave {want['diff_id']} "
                f"(same inputs: a nondeterministic build or a tampered cache; `trainer image diff` names the files)"
            )
            ok = False
    return lines, ok
