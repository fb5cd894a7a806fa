"""Pack the debian-full image's build outputs, with what they need to load, for a check on the lent H200.

    python bench/native_h200_kit.py --out DIR [--lock lockfiles/debian-full.lock.json] [--parts 61]

The H200 machine has Python 3.12.3 with torch 2.11.0+cu130; the image's extensions are built for the image's
Python (Debian 12's CPython 3.11), so the kit brings that interpreter along, from the lock's own .debs
(python3.11-minimal, libpython3.11-minimal, libpython3.11-stdlib, and the libraries the aws-ofi-nccl plugin
links: libfabric1, libhwloc15, ...), and torch's two Python-ABI files of the locked cp311 wheel
(``torch/_C.cpython-311-x86_64-linux-gnu.so``, ``torch/lib/libtorch_python.so``); everything else of torch (the
same 2.11.0+cu130 native libraries) is the machine's. The build outputs are taken from their cached layers
(keyed by the lock: what `trainer image build` put into the image), and the cp311 wheels TE imports
(numpy, onnx, pydantic-core, ...) from the lock. Everything comes out of the content-addressed cache, hash-checked;
nothing is downloaded. The result: ``kit.tar.xz`` and (with TE) the TE core wheel ``te-core.whl``, in chunks
``NAME.NN`` of at most ``--parts`` MB packed into folders ``DIR/part-NN`` (one carried folder per device call),
and ``DIR/kit.sha256`` (both files' sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer import REPO_ROOT  # noqa: E402
from trainer.image.cas import Cache  # noqa: E402
from trainer.image.native import step_keys  # noqa: E402
from trainer.lock import imagelock as lockfile  # noqa: E402

DEBS = [
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "libffi8",
    "libexpat1",
    "libfabric1",
    "libhwloc15",
    "libpsm-infinipath1",
    "libpsm2-2",
    "libibverbs1",
    "ibverbs-providers",
    "librdmacm1",
    "libnl-3-200",
    "libnl-route-3-200",
    "libnuma1",
]
WHEELS_TE = [
    "numpy",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "nvdlfw-inspect",
    "onnx",
    "onnx-ir",
    "onnxscript",
    "ml-dtypes",
    "protobuf",
    "einops",
    "packaging",
    "pyyaml",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "filelock",
    "fsspec",
    "importlib-metadata",
    "zipp",
    "transformer-engine",
    "transformer-engine-cu13",
]
TORCH_ABI = ["torch/_C.cpython-311-x86_64-linux-gnu.so", "torch/lib/libtorch_python.so"]


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lock", default=str(REPO_ROOT / "lockfiles" / "debian-full.lock.json"))
    p.add_argument("--out", required=True)
    p.add_argument("--parts", type=int, default=61, help="part size in MB (one device call each)")
    p.add_argument("--steps", default="aws-ofi-nccl,deepep,transformer-engine-torch")
    p.add_argument("--no-te-core", action="store_true", help="leave out the transformer-engine-cu13 wheel (245 MB)")
    args = p.parse_args(argv)
    lock = lockfile.load_lock(Path(args.lock))
    cache = Cache()
    out = Path(args.out)
    stage = out / "stage"
    shutil.rmtree(out, ignore_errors=True)
    (stage / "root").mkdir(parents=True)
    (stage / "site").mkdir()
    debs = {d["name"]: d for d in lock["base"]["debs"]}
    for name in DEBS:
        d = debs[name]
        path = cache.ensure(d["sha256"], f"deb {name}")
        subprocess.run(["dpkg-deb", "-x", str(path), str(stage / "root")], check=True)
    wheels = {lockfile.canonical_name(w["name"]): w for w in lock["wheels"]}
    torch = cache.ensure(wheels["torch"]["sha256"], "wheel torch")
    with zipfile.ZipFile(torch) as zf:
        for member in TORCH_ABI:
            target = stage / "torch311" / member
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(member))
    te = "transformer-engine-torch" in args.steps.split(",")
    for name in WHEELS_TE if te else []:  # what TE imports (cp311 builds where compiled), from the lock
        if name == "transformer-engine-cu13":
            continue  # travels as the wheel file itself (already compressed), unpacked there
        w = wheels[name]
        with zipfile.ZipFile(cache.ensure(w["sha256"], f"wheel {w['filename']}")) as zf:
            for info in zf.infolist():
                if ".data/" in info.filename.split("/", 1)[0] + "/":
                    continue
                zf.extract(info, stage / "site")
    keys = step_keys(lock)
    built = {}
    for step in args.steps.split(","):
        record = cache.layer_record(keys[step])
        if record is None:
            print(f"step {step}: not built (no cached layer for key {keys[step][:16]}); left out", file=sys.stderr)
            continue
        blob = cache.get(record["diff_id"][7:], f"layer build-{step}")
        built[step] = record["diff_id"]
        with tarfile.open(blob) as tar:
            for m in tar:
                name = m.name
                prefix = lock["python"]["site_packages"].strip("/") + "/"
                dest = stage / "site" / name[len(prefix) :] if name.startswith(prefix) else stage / "image" / name
                if m.isdir():
                    dest.mkdir(parents=True, exist_ok=True)
                elif m.issym():
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.symlink_to(m.linkname)
                elif m.isreg():
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    stream = tar.extractfile(m)
                    assert stream is not None  # a regular file has a stream
                    dest.write_bytes(stream.read())
                    dest.chmod(m.mode)
    (stage / "built.json").write_text(json.dumps(built, indent=1) + "\n")
    kit = out / "kit.tar"
    subprocess.run(["tar", "-C", str(stage), "--sort=name", "-cf", str(kit), "."], check=True)
    subprocess.run(["xz", "-6", "-T2", "-f", str(kit)], check=True)
    kit = out / "kit.tar.xz"
    shutil.rmtree(stage)
    files = [kit]
    if te and not args.no_te_core:
        core = wheels["transformer-engine-cu13"]
        shutil.copyfile(cache.ensure(core["sha256"], f"wheel {core['filename']}"), out / "te-core.whl")
        files.append(out / "te-core.whl")
    sums = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    (out / "kit.sha256").write_text("".join(f"{h}  {n}\n" for n, h in sums.items()))
    # chunks of at most --parts MB, packed into as few parts (device calls) as fit
    size = args.parts * 1000 * 1000
    chunks = []
    for f in files:
        with open(f, "rb") as handle:
            i = 0
            while chunk := handle.read(size):
                chunks.append((f"{f.name}.{i:02d}", chunk))
                i += 1
        f.unlink()
    parts: list = []
    for name, chunk in sorted(chunks, key=lambda c: -len(c[1])):
        for part in parts:
            if sum(len(c) for _, c in part) + len(chunk) <= size:
                part.append((name, chunk))
                break
        else:
            parts.append([(name, chunk)])
    for i, part in enumerate(parts):
        folder = out / f"part-{i:02d}"
        folder.mkdir()
        for name, chunk in part:
            (folder / name).write_bytes(chunk)
    print(json.dumps({"files": {n: sums[n] for n in sums}, "parts": len(parts), "built": built}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
