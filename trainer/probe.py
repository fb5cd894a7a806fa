"""The version probe: what the running environment actually is, read from inside the training process.

Nothing here is copied from a lock: versions come from the imported modules and installed distributions,
NCCL from ``torch.cuda.nccl.version()`` (the library as loaded), the NCCL net plugin from the shared objects
mapped into this process (``/proc/self/maps``) and ``NCCL_NET_PLUGIN``, GPUs from ``torch.cuda``, the driver
from ``nvidia-smi``, the image digest from the file the image builder stamps (``/etc/recipe-bundle/image.json``
or ``lock.json``). A component that is not installed is recorded as ``None`` (absent), never guessed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from trainer.image.gittree import directory_tree_id
from trainer.publish import atomic_write

# component -> distributions to try, in order
DISTRIBUTIONS = {
    "torch": ("torch",),
    "transformer_engine": ("transformer-engine", "transformer_engine"),
    "megatron_core": ("megatron-core", "megatron_core"),
    "miles": ("miles",),
    "deepep": ("deep-ep", "deep_ep"),
    "tilelang": ("tilelang",),
    "triton": ("triton",),
    "transformers": ("transformers",),
    "tokenizers": ("tokenizers",),
    "nvidia_nccl": ("nvidia-nccl-cu13", "nvidia-nccl-cu12"),
}
STAMP_DIR = Path("/etc/recipe-bundle")
# git sources the recipe runs from a checkout (no distribution metadata): component -> top-level package
SOURCE_MODULES = {"megatron_lm": "megatron", "miles": "miles"}


def _dist_version(names) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _megatron_version(checkout: str) -> str | None:
    """megatron-core's version from a Megatron-LM checkout, read (not imported) from
    ``megatron/core/package_info.py``: MAJOR.MINOR.PATCH + PRE_RELEASE, as its ``__version__`` forms it."""
    import ast

    try:
        tree = ast.parse((Path(checkout) / "megatron" / "core" / "package_info.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str | int):
                values[node.targets[0].id] = node.value.value
    if not all(k in values for k in ("MAJOR", "MINOR", "PATCH")):
        return None
    return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE', '')}"


def mapped_libraries() -> list:
    """Paths of the shared objects mapped into this process (``/proc/self/maps``), sorted; [] where unreadable."""
    return _mapped_libraries()


def _mapped_libraries() -> list:
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in text.splitlines() if ".so" in line.split()[-1]})


def _package_dir(module_name: str) -> Path | None:
    """The (first) directory of the importable package ``module_name``, resolved, found without importing it;
    None for a module that is not a package or not importable."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]).resolve() if locations else None


def _git_commit_of(module_name: str) -> str | None:
    """The commit of a package installed from its own git checkout, or None.

    A ``GIT_COMMIT`` file stamped in or beside the package wins; otherwise ``git rev-parse HEAD``, accepted only
    when the package directory sits at the top of that checkout (``<checkout>/<module_name>``), so a package
    inside another repository (or a namespace package without a file) is never given that repository's commit.
    """
    root = _package_dir(module_name)
    if root is None:
        return None
    for candidate in (root / "GIT_COMMIT", root.parent / "GIT_COMMIT"):
        if candidate.is_file():
            return candidate.read_text().strip() or None
    try:
        top = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=5
        )
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() / module_name != root:
            return None
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _pins() -> dict[str, dict[str, str]]:
    """Git sources this process could be running, by tree id -> {"name", "commit"}: the image's stamp
    (``/etc/recipe-bundle/lock.json`` ``sources``) and the bundle's ``lockfiles/stack.json``."""
    pins: dict[str, dict[str, str]] = {}
    candidates = [STAMP_DIR / "lock.json", Path(__file__).absolute().parent.parent / "lockfiles" / "stack.json"]
    for path in candidates:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        items = (data.get("sources") or data.get("components") or {}) if isinstance(data, dict) else {}
        for name, item in items.items() if isinstance(items, dict) else []:
            if isinstance(item, dict) and item.get("tree") and item.get("commit"):
                pins.setdefault(str(item["tree"]), {"name": name, "commit": str(item["commit"])})
    return pins


def source_of(module_name: str, pins: dict[str, dict[str, str]] | None = None) -> dict[str, str | None]:
    """Which commit of its repository the importable package ``module_name`` comes from, read from the files.

    The package's checkout root (the directory holding ``<module_name>/``) is hashed as git hashes a tree
    (:func:`trainer.image.gittree.directory_tree_id`; byte-code caches and ``.git`` left out). The commit is
    the one a pin with that tree names (the image's stamp or ``lockfiles/stack.json``: the files are exactly
    that commit's), else :func:`_git_commit_of` (a live checkout; its files may differ from the commit, which
    the tree then shows). A package installed from a wheel into a site directory has neither (its root is
    the site directory, never hashed). Hash at the start of a run: files a job later writes into the
    checkout change the tree. Returns {"commit", "tree", "path"}, each None when unknown.
    """
    out: dict[str, str | None] = {"commit": None, "tree": None, "path": None}
    package = _package_dir(module_name)
    if package is None:
        return out
    root = package.parent
    out["path"] = str(root)
    if root.name in ("site-packages", "dist-packages") or next(root.glob("*.dist-info"), None) is not None:
        return out  # installed from a wheel into a site directory: no checkout to hash, no commit to name
    try:
        out["tree"] = directory_tree_id(root)
    except OSError:
        pass
    pin = (pins if pins is not None else _pins()).get(out["tree"] or "")
    out["commit"] = pin["commit"] if pin else _git_commit_of(module_name)
    return out


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _image() -> dict[str, Any]:
    """The image this process runs in, from the builder's stamp; empty when not in a bundle image."""
    out: dict[str, Any] = {}
    for name in ("image.json", "lock.json"):
        path = STAMP_DIR / name
        if path.is_file():
            data = path.read_bytes()
            out[name] = {"sha256": hashlib.sha256(data).hexdigest()}
            try:
                parsed = json.loads(data)
                for key in ("digest", "image_digest", "lock_sha256"):
                    if key in parsed:
                        out[key] = parsed[key]
            except json.JSONDecodeError:
                pass
    digest = os.environ.get("RECIPE_BUNDLE_IMAGE_DIGEST")
    if digest:
        out.setdefault("digest", digest)
    return out


def probe() -> dict[str, Any]:
    """Probe this process's environment. Returns a JSON-ready dict (see the module docstring).

    Keys: ``python``, ``host``, ``cpu``, ``components`` (name -> version or None), ``torch`` (version, CUDA,
    cuDNN, NCCL as loaded, GPUs), ``nccl_net_plugin``, ``sources`` (megatron_lm, miles: commit, tree, path;
    :func:`source_of`), ``megatron_lm_commit``/``_tree``, ``miles_commit``/``_tree``, ``driver``, ``image``. Imports
    torch if installed (seconds).
    """
    components = {name: _dist_version(dists) for name, dists in DISTRIBUTIONS.items()}
    pins = _pins()
    sources = {name: source_of(module, pins) for name, module in SOURCE_MODULES.items()}
    if components["megatron_core"] is None and sources["megatron_lm"]["path"]:
        components["megatron_core"] = _megatron_version(sources["megatron_lm"]["path"])
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "cpu": {"model": _cpu_model(), "count": os.cpu_count()},
        "components": components,
        "torch": None,
        "nccl_net_plugin": None,
        "sources": sources,
        "megatron_lm_commit": sources["megatron_lm"]["commit"],
        "megatron_lm_tree": sources["megatron_lm"]["tree"],
        "miles_commit": sources["miles"]["commit"],
        "miles_tree": sources["miles"]["tree"],
        "driver": None,
        "image": _image(),
    }
    try:
        import torch
    except ImportError:
        return info
    cuda = torch.cuda.is_available()
    gpus = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"name": props.name, "memory_bytes": int(props.total_memory)})
    nccl = None
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            version = torch.cuda.nccl.version()
            nccl = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
        except Exception:  # noqa: BLE001 - NCCL not loadable: absent
            nccl = None
    cudnn = None
    if cuda and torch.backends.cudnn.is_available():
        try:
            cudnn = str(torch.backends.cudnn.version())
        except RuntimeError as ex:  # torch refuses a cuDNN other than its own: record what it says
            cudnn = f"refused: {str(ex).split('.')[0]}"
    info["torch"] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "nccl": nccl,
        "gpus": gpus,
        "threads": torch.get_num_threads(),
    }
    plugins = [lib for lib in _mapped_libraries() if "nccl-net" in Path(lib).name or "nccl_net" in Path(lib).name]
    info["nccl_net_plugin"] = {"env": os.environ.get("NCCL_NET_PLUGIN"), "loaded": plugins}
    info["torch"]["cudnn_libraries"] = [lib for lib in _mapped_libraries() if Path(lib).name.startswith("libcudnn")]
    if cuda:
        info["driver"] = _driver_version()
    return info


def distributions() -> dict[str, str]:
    """Every distribution importable from ``sys.path`` (name -> version, names lower-case with ``-``), for
    comparing an image's site-packages with the lock stamped into it. A probe stores them as
    :func:`distribution_pairs`."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = (dist.name or "").lower().replace("_", "-")  # the metadata's Name (None when it has none)
        if name:
            out.setdefault(name, dist.version)
    return dict(sorted(out.items()))


def distribution_pairs() -> list[list[str]]:
    """:func:`distributions` as ``[[name, version], ...]`` (sorted by name), the form a probe stores them in: a
    record's redaction reads a JSON key that looks like a secret's name as one (``"google-auth": "2.63.0"`` would
    lose its version), a pair has no key (:mod:`trainer.redact`)."""
    return [[name, version] for name, version in distributions().items()]


def main(argv: list | None = None) -> int:
    """``python -m trainer.probe [--out PATH] [--distributions] [--node NAME]``: print the probe as JSON.

    ``--out`` writes it (atomically) instead; ``{node}`` in PATH becomes the node name (``--node``, else
    ``SLURMD_NODENAME``, else the host name), so one command serves every node of a Slurm step.
    ``--distributions`` adds every importable distribution. Exit 0, or 2 on an unwritable PATH (one line).
    """
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m trainer.probe", description=main.__doc__)
    parser.add_argument("--out", help="write the JSON here ({node} = node name) instead of stdout")
    parser.add_argument("--node", help="node name for {node} (default: $SLURMD_NODENAME or the host name)")
    parser.add_argument("--distributions", action="store_true", help="add every importable distribution")
    args = parser.parse_args(argv)
    info = probe()
    node = args.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    info["node"] = node
    if args.distributions:
        info["distributions"] = distribution_pairs()
    text = json.dumps(info, indent=2, sort_keys=True) + "\n"
    if not args.out:
        sys.stdout.write(text)
        return 0
    path = Path(args.out.replace("{node}", node))
    try:
        atomic_write(path, text.encode())
    except OSError as ex:
        print(f"trainer.probe: error: --out {path}: {ex.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
