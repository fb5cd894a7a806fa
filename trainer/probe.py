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
from typing import Any, Dict, Optional

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


def _dist_version(names) -> Optional[str]:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _mapped_libraries() -> list:
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in text.splitlines() if ".so" in line.split()[-1]})


def _git_commit_of(module_name: str) -> Optional[str]:
    """The commit of a package installed from its own git checkout, or None.

    A ``GIT_COMMIT`` file stamped in or beside the package wins; otherwise ``git rev-parse HEAD``, accepted only
    when the package directory sits at the top of that checkout (``<checkout>/<module_name>``), so a package
    inside another repository (or a namespace package without a file) is never given that repository's commit.
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        return None
    root = Path(locations[0]).resolve()
    for candidate in (root / "GIT_COMMIT", root.parent / "GIT_COMMIT"):
        if candidate.is_file():
            return candidate.read_text().strip() or None
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=5)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() / module_name != root:
            return None
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _driver_version() -> Optional[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _cpu_model() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _image() -> Dict[str, Any]:
    """The image this process runs in, from the builder's stamp; empty when not in a bundle image."""
    out: Dict[str, Any] = {}
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


def probe() -> Dict[str, Any]:
    """Probe this process's environment. Returns a JSON-ready dict (see the module docstring).

    Keys: ``python``, ``host``, ``cpu``, ``components`` (name -> version or None), ``torch`` (version, CUDA,
    cuDNN, NCCL as loaded, GPUs), ``nccl_net_plugin``, ``megatron_lm_commit``, ``miles_commit``, ``driver``,
    ``image``. Imports torch if installed (seconds).
    """
    components = {name: _dist_version(dists) for name, dists in DISTRIBUTIONS.items()}
    info: Dict[str, Any] = {
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "cpu": {"model": _cpu_model(), "count": os.cpu_count()},
        "components": components,
        "torch": None,
        "nccl_net_plugin": None,
        "megatron_lm_commit": _git_commit_of("megatron") if components["megatron_core"] else None,
        "miles_commit": _git_commit_of("miles") if components["miles"] else None,
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
    info["torch"] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": (str(torch.backends.cudnn.version()) if cuda and torch.backends.cudnn.is_available() else None),
        "nccl": nccl,
        "gpus": gpus,
        "threads": torch.get_num_threads(),
    }
    plugins = [lib for lib in _mapped_libraries() if "nccl-net" in Path(lib).name or "nccl_net" in Path(lib).name]
    info["nccl_net_plugin"] = {"env": os.environ.get("NCCL_NET_PLUGIN"), "loaded": plugins}
    if cuda:
        info["driver"] = _driver_version()
    return info


def distributions() -> Dict[str, str]:
    """Every distribution importable from ``sys.path`` (name -> version, names lower-case with ``-``), for
    comparing an image's site-packages with the lock stamped into it."""
    out: Dict[str, str] = {}
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        if name:
            out.setdefault(name, dist.version)
    return dict(sorted(out.items()))


def main(argv: Optional[list] = None) -> int:
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
        info["distributions"] = distributions()
    text = json.dumps(info, indent=2, sort_keys=True) + "\n"
    if not args.out:
        sys.stdout.write(text)
        return 0
    path = Path(args.out.replace("{node}", node))
    from trainer.record import atomic_write

    try:
        atomic_write(path, text.encode())
    except OSError as ex:
        print(f"trainer.probe: error: --out {path}: {ex.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
