"""Build steps (trainer.image.native) in a build root of pinned Debian .debs (trainer.image.buildroot), and the
small Debian image whose sdist is built by one.

The build root is debian-smoke's (gcc, libc6-dev, make, python3; its .debs are downloaded from Debian's mirror
into this test's cache, hash-checked). The C project is made here. The debian-smoke image test also needs the
CPU torch wheel, which pip finds in this machine's configured wheel directory (`pip download`).
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT
from image_fixtures import local_registry, make_git_source, push_then_pull, sha256, small_lock
from trainer.errors import UserError
from trainer.image.build import build_image
from trainer.image.cas import Cache
from trainer.lock import imagelock

EPOCH = 1767225600
SMOKE = REPO_ROOT / "lockfiles" / "debian-smoke.lock.json"
HELLO_C = b'#include <stdio.h>\nint main(void) { printf("hello from a pinned build\\n"); return 0; }\n'
MAKEFILE = b"hello: hello.c\n\t$(CC) $(CFLAGS) -g -o hello hello.c\n"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (bin/setup installs it)")


def lock_for(tmp: Path, name: str, files, command, cache: Cache):
    """A scratch lock with debian-smoke's build root, one git source of ``files`` and one build step."""
    archive, commit, tree = make_git_source(tmp, "hello", files, EPOCH)
    cache.add_file(archive)
    source = {
        "name": "hello",
        "url": "https://example.invalid/hello.git",
        "commit": commit,
        "tree": tree,
        "dest": "/opt/src/hello",
        "archive": {"filename": archive.name, "sha256": sha256(archive)},
    }
    lock = small_lock(name, EPOCH, [], [source])
    lock["build_root"] = json.loads(SMOKE.read_text())["build_root"]
    lock["builds"] = [
        {
            "name": "hello",
            "input": {"source": "hello"},
            "wheels": [],
            "command": ["/bin/sh", "-euc", command],
            "env": {"CC": "gcc"},
            "install": {"type": "tree", "dest": "/opt/hello"},
        }
    ]
    path = tmp / f"{name}.lock.json"
    path.write_text(json.dumps(lock, indent=1))
    return path


def inputs_cache(main: Cache, path: Path) -> Cache:
    """A new cache holding only links to ``main``'s blobs: nothing built, no unpacked build root."""
    (path / "sha256").mkdir(parents=True)
    for blob in (main.root / "sha256").iterdir():
        os.link(blob, path / "sha256" / blob.name)
    return Cache(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("native")
    bundle = tmp / "bundle"
    (bundle / "conf").mkdir(parents=True)
    (bundle / "conf" / "x.yaml").write_text("a: 1\n")
    return {"tmp": tmp, "bundle": bundle, "cache": Cache(tmp / "cache")}


BUILD = 'make && install -D -m 0755 hello "$BUILD_OUT/bin/hello"'


def layer(result, name):
    return next(entry for entry in result.layers if entry[0] == name)


def test_build_step_reproduces_caches_and_rebuilds_only_what_changed(world):
    tmp, cache = world["tmp"], world["cache"]
    lock = lock_for(tmp / "a", "hello", {"hello.c": HELLO_C, "Makefile": MAKEFILE}, BUILD, cache)
    first = build_image(lock, tmp / "img1", cache, world["bundle"], offline=False, jobs=2)
    name, diff_id, size, status = layer(first, "build-hello")
    assert status == "built" and size > 10_000
    # the output: the compiled program, under install.dest, runnable on the build root's own libc
    with tarfile.open(cache.blob_path(diff_id[7:])) as tar:
        assert [m.name for m in tar if m.isreg()] == ["opt/hello/bin/hello"]
        data = tar.extractfile("opt/hello/bin/hello").read()
    assert data[:4] == b"\x7fELF" and b"hello from a pinned build" in data
    assert str(tmp).encode() not in data  # no host path (the sandbox's are fixed and prefix-mapped)

    # unchanged: never redone (no new log, layer from the cache)
    logs = sorted((cache.root / "logs").iterdir())
    started = time.monotonic()
    again = build_image(lock, tmp / "img1", cache, world["bundle"], offline=True)
    noop_seconds = time.monotonic() - started
    assert layer(again, "build-hello")[1:] == (diff_id, size, "cached")
    assert sorted((cache.root / "logs").iterdir()) == logs
    assert again.manifest_digest == first.manifest_digest
    print(f"no-op rebuild {noop_seconds:.2f} s")

    # from an empty build cache, another directory, TZ and umask, 1 job: the same bytes
    other = inputs_cache(cache, tmp / "cache-2")
    old_tz, old_umask = os.environ.get("TZ"), os.umask(0o077)
    os.environ["TZ"] = "Asia/Kolkata"
    time.tzset()
    try:
        second = build_image(lock, tmp / "img2", other, world["bundle"], offline=True, jobs=1)
    finally:
        os.umask(old_umask)
        os.environ.pop("TZ") if old_tz is None else os.environ.__setitem__("TZ", old_tz)
        time.tzset()
    assert layer(second, "build-hello")[1:3] == (diff_id, size) and layer(second, "build-hello")[3] == "built"
    assert second.manifest_digest == first.manifest_digest

    # `trainer image check` compares the build layer with the reproduced digest recorded for the step's inputs
    from trainer.image.native import step_keys

    key = step_keys(imagelock.load_lock(lock))["hello"]
    expected = tmp / "expected.json"
    for recorded, code, line in (
        (diff_id, 0, f"build hello: same {diff_id} as the reproduced build"),
        ("sha256:" + "0" * 64, 1, f"build hello: {diff_id}, the reproduced build gave sha256:000"),
    ):
        expected.write_text(
            json.dumps({"hello": {"builds": {"hello": {"key": key, "diff_id": recorded, "size": size}}}})
        )
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer",
                "image",
                "check",
                str(tmp / "img2"),
                "--lock",
                str(lock),
                "--expected",
                str(expected),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        assert proc.returncode == code, proc.stderr
        assert proc.stdout.splitlines()[0].startswith(line)

    # a changed input rebuilds that step (and the layers after it); the layers below stay cached
    changed = lock_for(
        tmp / "b", "hello", {"hello.c": HELLO_C.replace(b"pinned", b"changed"), "Makefile": MAKEFILE}, BUILD, cache
    )
    third = build_image(changed, tmp / "img3", cache, world["bundle"], offline=True)
    assert layer(third, "build-hello")[3] == "built" and layer(third, "build-hello")[1] != diff_id


def test_a_step_sees_the_same_modification_times_whenever_its_root_was_unpacked(world):
    """A compiler may record its sources' times (nvcc's -lineinfo line tables hold every header's mtime): the step's
    input (/build/src, files and folders), the Debian root (/usr/include/stdio.h, /usr/bin) and its wheels' tree
    hold 1980-01-01T00:00:00Z (buildroot.TREE_MTIME), not the time they were unpacked; two builds from empty caches
    unpacked at other times give the same layer. Tamper: a step that prints the time of a file it wrote itself
    (now) gives another layer from the same inputs."""
    from trainer.image.buildroot import TREE_MTIME

    tmp, cache = world["tmp"], world["cache"]
    stat = (
        "stat -c '%n %Y' /build/src /build/src/hello.c /build/src/sub /build/src/sub/b.h /usr/include/stdio.h /usr/bin"
    )
    command = f'{stat} > "$BUILD_OUT/times"'
    files = {"hello.c": HELLO_C, "sub/b.h": b"#define B 1\n"}
    lock = lock_for(tmp / "mtime", "hello", files, command, cache)
    first = build_image(lock, tmp / "img-mtime", cache, world["bundle"], offline=False)
    diff_id = layer(first, "build-hello")[1]
    with tarfile.open(cache.blob_path(diff_id[7:])) as tar:
        lines = tar.extractfile("opt/hello/times").read().decode().splitlines()
    assert lines == [
        f"{path} {TREE_MTIME}"
        for path in ("/build/src", "/build/src/hello.c", "/build/src/sub", "/build/src/sub/b.h")
        + ("/usr/include/stdio.h", "/usr/bin")
    ]
    time.sleep(1.1)  # the second root is unpacked at least a second later
    second = build_image(
        lock, tmp / "img-mtime-2", inputs_cache(cache, tmp / "cache-mtime"), world["bundle"], offline=True
    )
    assert layer(second, "build-hello")[1:3] == layer(first, "build-hello")[1:3]
    assert layer(second, "build-hello")[3] == "built"
    now = lock_for(tmp / "mtime-now", "hello", files, f'touch /tmp/x; {stat} /tmp/x > "$BUILD_OUT/times"', cache)
    layers = []
    for i in (1, 2):
        time.sleep(1.1)  # the file it writes gets another second
        made = build_image(
            now, tmp / f"img-now-{i}", inputs_cache(cache, tmp / f"cache-now-{i}"), world["bundle"], offline=True
        )
        layers.append(layer(made, "build-hello")[1])
    assert layers[0] != layers[1]


@pytest.mark.parametrize(
    "case, command, needle",
    [
        # the sandbox has its own network namespace with only loopback: nothing can leave it, a name cannot resolve
        (
            "network",
            "sed -n '3,$p' /proc/net/dev | cut -d: -f1 | tr -d ' '; exec python3 -c \"import urllib.request; "
            "urllib.request.urlopen('https://pypi.org/simple/', timeout=5)\"",
            "build step hello failed (exit 1",
        ),
        ("outside", 'echo x > /usr/escaped; echo ok > "$BUILD_OUT/ok"', "build step hello failed (exit"),
        ("fails", 'echo "compiler says no" >&2; exit 3', "build step hello failed (exit 3"),
    ],
)
def test_failing_step_is_one_line_keeps_a_log_and_caches_nothing(world, case, command, needle):
    tmp, cache = world["tmp"], world["cache"]
    lock = lock_for(tmp / case, "hello", {"hello.c": HELLO_C, "Makefile": MAKEFILE}, command, cache)
    records = set((cache.root / "layers").iterdir()) if (cache.root / "layers").is_dir() else set()
    out = tmp / f"img-{case}"
    with pytest.raises(UserError) as err:
        build_image(lock, out, cache, world["bundle"], offline=False)
    message = str(err.value)
    assert needle in message and "\n" not in message
    log = Path(message.rsplit("log: ", 1)[1])
    assert log.is_file()
    if case == "fails":
        assert "compiler says no" in log.read_text() and "compiler says no" in message
    if case == "network":
        text = log.read_text()
        assert text.splitlines()[0] == "lo" and "URLError" in text
        assert any(
            s in text
            for s in ("Temporary failure in name resolution", "Name or service not known", "Network is unreachable")
        )
    if case == "outside":
        assert "Read-only file system" in log.read_text()
    assert not out.exists()
    new = {p.name for p in (cache.root / "layers").iterdir()} - {p.name for p in records}
    built = [json.loads((cache.root / "layers" / n).read_text())["layer"] for n in new]
    assert "build-hello" not in built
    assert not any(p.name.startswith("build-hello") for p in cache.tmp_dir().iterdir())


def test_bad_build_lock_is_one_line(world):
    tmp = world["tmp"]
    lock = json.loads(lock_for(tmp / "bad", "hello", {"hello.c": HELLO_C}, "true", world["cache"]).read_text())
    lock["builds"][0]["input"] = {"source": "nope"}
    with pytest.raises(UserError, match=r"builds\[0\]\.input\.source: 'nope' is not a sources\[\] name"):
        imagelock.validate_lock(lock, "x.lock.json")
    lock["builds"][0]["input"] = {"source": "hello"}
    lock["builds"][0]["wheels"] = ["torch"]
    with pytest.raises(UserError, match=r"builds\[0\]\.wheels: wheel 'torch' is neither"):
        imagelock.validate_lock(lock, "x.lock.json")
    del lock["build_root"]
    lock["builds"][0]["wheels"] = []
    with pytest.raises(UserError, match=r"build_root: missing"):
        imagelock.validate_lock(lock, "x.lock.json")


def test_unbuilt_sdist_is_refused(world):
    tmp = world["tmp"]
    path = lock_for(tmp / "sd", "hello", {"hello.c": HELLO_C}, "true", world["cache"])
    lock = json.loads(path.read_text())
    lock["sdists"] = [
        {
            "name": "tiny",
            "version": "1.0",
            "filename": "tiny-1.0.tar.gz",
            "group": "rest",
            "sha256": "0" * 64,
            "url": "https://files.pythonhosted.org/packages/tiny-1.0.tar.gz",
        }
    ]
    path.write_text(json.dumps(lock))
    with pytest.raises(UserError, match="sdists tiny have no builds"):
        build_image(path, tmp / "img-sd", world["cache"], world["bundle"], offline=True)


def _torch_cpu_wheel(lock, cache: Cache, tmp: Path) -> None:
    item = next(w for w in lock["wheels"] if w["name"] == "torch")
    if cache.has(item["sha256"]):
        return
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-d",
            str(tmp),
            f"torch=={item['version']}",
            "--python-version",
            "3.11",
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    cache.add_file(tmp / item["filename"], item["sha256"])


@pytest.fixture(scope="module")
def debian_smoke(world):
    """lockfiles/debian-smoke.lock.json built once into the module's cache: (build result, OCI layout)."""
    cache = world["cache"]
    lock = json.loads(SMOKE.read_text())
    _torch_cpu_wheel(lock, cache, world["tmp"])
    out = world["tmp"] / "debian-smoke.oci"
    return build_image(SMOKE, out, cache, REPO_ROOT, offline=False, jobs=2), out


def test_debian_smoke_image_imports_hydra_torch_and_trainer(debian_smoke, tmp_path):
    """The sdist (antlr4-python3-runtime, hydra's parser) is built in the build root into a wheel and installed,
    so `import hydra` works in the image, and the bundle's own trainer package imports there too."""
    result, out = debian_smoke
    assert layer(result, "build-antlr4-python3-runtime")[2] > 100_000
    ref = json.loads((out / "index.json").read_text())["manifests"][0]["annotations"][
        "org.opencontainers.image.ref.name"
    ]
    bundle = tmp_path / "unpacked"
    subprocess.run(
        ["umoci", "unpack", "--image", f"{out}:{ref}", str(bundle)], check=True, capture_output=True, timeout=600
    )
    assert not list((bundle / "rootfs" / "opt" / "recipe-bundle").glob("sdists"))
    # every namespace but, as root, the user namespace: inside another sandbox (CI's fresh root) a nested
    # user namespace may not mount a new /proc (trainer.launch.host.local_image does the same)
    unshare = ["--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if os.geteuid() != 0:
        unshare.append("--unshare-user-try")
    proc = subprocess.run(
        [
            "bwrap",
            "--bind",
            str(bundle / "rootfs"),
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            "--tmpfs",
            "/tmp",
            *unshare,
            "--die-with-parent",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "PYTHONPATH",
            "/opt/recipe-bundle",
            "/usr/bin/python3",
            "-c",
            "import hydra, omegaconf, torch, trainer, antlr4; "
            "print(hydra.__version__, omegaconf.__version__, torch.__version__, "
            "int(torch.arange(4).sum()), trainer.__file__)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1.3.8", "2.3.0", "2.13.0+cpu", "6", "/opt/recipe-bundle/trainer/__init__.py"]


@pytest.mark.skipif(
    shutil.which("docker-registry") is None or shutil.which("skopeo") is None,
    reason="needs docker-registry and skopeo (bin/setup installs them)",
)
def test_debian_smoke_round_trips_through_a_registry_without_running_a_build_step(world, debian_smoke, tmp_path):
    """debian-smoke's layers, its build step's output among them, pushed to a registry on 127.0.0.1 and pulled
    into an empty cache: the rebuild there is offline, has no .deb, wheel or source to build from, runs no build
    step, and gives the same manifest digest."""
    result, _ = debian_smoke
    empty = tmp_path / "empty"
    with local_registry(tmp_path / "registry") as served:
        remote = f"docker://{served['host']}/debian-smoke-cache"
        pushed, pulled = push_then_pull(world["cache"].root, remote, SMOKE, tmp_path / "team", empty)
    assert "build-antlr4-python3-runtime" in {r["layer"] for r in pushed}
    assert {r["status"] for r in pulled} == {"pulled"}
    again = build_image(SMOKE, tmp_path / "again.oci", Cache(empty), REPO_ROOT, offline=True, jobs=2)
    assert again.manifest_digest == result.manifest_digest
    assert {name: status for name, _, _, status in again.layers} == {
        name: "built" if name == "bundle" else "cached" for name, _, _, _ in result.layers
    }
    assert not (empty / "roots").exists() and not (empty / "logs").exists()  # no build root made, no step run


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
