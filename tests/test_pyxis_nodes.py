"""Four Slurm nodes with pyxis and enroot (built from their pinned sources, lockfiles/slurm-node.lock.json), running
the bundle's own image by digest as a squashfs file (`trainer image squashfs`): every task of `srun
--container-image` runs in that image and says so from the image's own files; `train launcher=slurm
launcher.container=pyxis` probes every node inside it and the preflight agrees on the digest; a squashfs file
changed by one byte is refused before anything is submitted.

Needs root, Slurm, umoci and mksquashfs, and the enroot and pyxis sources: git archives of NVIDIA/enroot
bd51f53b (v4.1.2) and NVIDIA/pyxis 10751994 (v0.24.0) in ``$RECIPE_BUNDLE_SOURCES`` (any archive of those trees;
`git archive --format=tar.gz --prefix=enroot/ bd51f53b` from a clone). Without them the module is skipped with
that reason."""

import configparser
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT, run_train
from launch_fixtures import LocalSlurm, NetNamespace, missing_slurm

NODE_LOCK = REPO_ROOT / "lockfiles" / "slurm-node.lock.json"
IMAGE_LOCK = REPO_ROOT / "lockfiles" / "debian-cluster.lock.json"
NODES, TASKS_PER_NODE = 4, 2

pytestmark = [
    pytest.mark.skipif(
        bool(missing_slurm()),
        reason=f"Slurm is not installed (missing: {' '.join(missing_slurm())}; Debian slurm-wlm munge)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="the private Slurm cluster runs its daemons as root"),
    pytest.mark.skipif(
        shutil.which("umoci") is None or shutil.which("mksquashfs") is None,
        reason="umoci and mksquashfs (Debian umoci, squashfs-tools) are not installed",
    ),
]
trainer = helpers.run_trainer


def _seed_node_sources() -> list[str]:
    """Seed this run's cache with the archives in ``$RECIPE_BUNDLE_SOURCES`` whose files hash to a tree that
    slurm-node.lock.json pins (enroot with its stated submodules, pyxis); returns the names seeded."""
    from trainer.errors import UserError
    from trainer.image.cas import Cache
    from trainer.image.sources import add_archive, pins_for

    pins = pins_for([NODE_LOCK])
    seeded = []
    for archive in sorted(Path(os.environ.get(helpers.SOURCES_ENV) or "/nonexistent").glob("*.tar*")):
        try:
            seeded.append(add_archive(Cache(), archive, pins)["name"])
        except UserError:
            continue  # an archive of another source (Megatron-LM, miles)
    return seeded


def _seed_locked_wheels_from_pip_find_links(lock: Path) -> None:
    """Wheels the lock pins that the user's pip configuration already has on disk (its ``find-links``
    directories: torch's CPU build lies there on these machines) go into the cache by their pinned sha256."""
    dirs: list[Path] = []
    for conf in filter(None, [os.environ.get("PIP_CONFIG_FILE"), "/etc/pip.conf"]):
        parser = configparser.ConfigParser()
        try:
            parser.read(conf)
        except configparser.Error:
            continue
        dirs += [Path(d) for d in parser.get("global", "find-links", fallback="").split() if d.startswith("/")]
    for wheel in json.loads(lock.read_text())["wheels"]:
        for d in dirs:
            if (d / wheel["filename"]).is_file():
                trainer("cache", "add", d / wheel["filename"], "--sha256", wheel["sha256"])
                break


@pytest.fixture(scope="module")
def node_tools(tmp_path_factory):
    """slurm-node.lock.json built (enroot and pyxis from their pinned sources) and unpacked: its root file system."""
    seeded = _seed_node_sources()
    if not {"enroot", "pyxis"} <= set(seeded):
        pytest.skip(
            f"enroot and pyxis sources not in ${helpers.SOURCES_ENV} (git archives of NVIDIA/enroot bd51f53b and "
            f"NVIDIA/pyxis 10751994; found {seeded or 'none'})"
        )
    root = tmp_path_factory.mktemp("slurm-node")
    built = trainer("image", "build", "--lock", NODE_LOCK, "--out", root / "oci", "--json", timeout=1800)
    assert built.returncode == 0, built.stderr[-3000:]
    unpack = subprocess.run(
        ["umoci", "unpack", "--image", f"{root / 'oci'}:latest", str(root / "bundle")], capture_output=True, text=True
    )
    assert unpack.returncode == 0, unpack.stderr
    rootfs = root / "bundle" / "rootfs"
    assert (rootfs / "opt" / "pyxis" / "lib" / "slurm" / "spank_pyxis.so").is_file()
    assert os.access(rootfs / "opt" / "enroot" / "bin" / "enroot", os.X_OK)
    return rootfs


@pytest.fixture(scope="module")
def image(node_tools, tmp_path_factory):
    """debian-cluster.lock.json (torch CPU, Ray, the trainer) built and made into a squashfs file."""
    _seed_locked_wheels_from_pip_find_links(IMAGE_LOCK)
    root = tmp_path_factory.mktemp("image")
    built = trainer("image", "build", "--lock", IMAGE_LOCK, "--out", root / "oci", "--json", timeout=3000)
    assert built.returncode == 0, built.stderr[-3000:]
    digest = json.loads(built.stdout)["manifest_digest"]
    made = trainer("image", "squashfs", root / "oci", "--out", root / "image.sqsh", "--json", timeout=1800)
    assert made.returncode == 0, made.stderr[-3000:]
    record = json.loads(made.stdout)
    assert record["digest"] == digest
    return {"oci": root / "oci", "sqsh": root / "image.sqsh", "digest": digest, "record": record}


@pytest.fixture(scope="module")
def cluster(node_tools, tmp_path_factory):
    root = tmp_path_factory.mktemp("pyxis4")
    with (
        NetNamespace() as netns,
        LocalSlurm(
            root, gpus=0, cpus=TASKS_PER_NODE, nodes=NODES, netns=netns, tools=node_tools, lifetime_s=1500
        ) as slurm,
    ):
        yield slurm


def test_the_squashfs_is_reproducible_and_records_what_it_was_made_from(image, tmp_path):
    """Promise: the same image makes the same squashfs bytes (another directory, another umask); the record beside
    it names the digest and the file's sha256, and `checked_squashfs` refuses a changed byte or another digest."""
    from trainer.errors import UserError
    from trainer.image.squashfs import checked_squashfs

    old = os.umask(0o077)
    try:
        again = trainer("image", "squashfs", image["oci"], "--out", tmp_path / "x" / "again.sqsh", "--json")
    finally:
        os.umask(old)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["sha256"] == image["record"]["sha256"]
    assert checked_squashfs(tmp_path / "x" / "again.sqsh", image["digest"])["sha256"] == image["record"]["sha256"]
    with pytest.raises(UserError, match="the run asks for sha256:" + "0" * 64):
        checked_squashfs(tmp_path / "x" / "again.sqsh", "sha256:" + "0" * 64)
    with open(tmp_path / "x" / "again.sqsh", "r+b") as handle:
        handle.seek(image["record"]["bytes"] // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 1]))
    with pytest.raises(UserError, match="changed since made"):
        checked_squashfs(tmp_path / "x" / "again.sqsh", image["digest"])


def test_every_task_of_srun_container_image_runs_in_the_image_by_digest(cluster, image):
    """Promise: `srun -N4 --ntasks-per-node=2 --container-image=FILE.sqsh` starts each task inside the image on its
    own node (its own host name and address), and each reads the digest from the image's own stamp."""
    ran = cluster.client(
        [
            "srun",
            f"-N{NODES}",
            f"--ntasks-per-node={TASKS_PER_NODE}",
            "--time=00:05:00",
            f"--container-image={image['sqsh']}",
            "--container-name=digest-check",
            "bash",
            "-c",
            "echo \"$SLURMD_NODENAME $(hostname) $(python3 -c 'import json; "
            'print(json.load(open("/etc/recipe-bundle/image.json"))["digest"])\')"',
        ],
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    rows = sorted(line.split() for line in ran.stdout.splitlines())
    assert rows == sorted(
        [f"n{i}", f"127.0.0.{i + 1}", image["digest"]] for i in range(1, NODES + 1) for _ in range(TASKS_PER_NODE)
    )


def _train(cluster, run_dir: Path, image_ref: str, cwd: Path):
    env = {
        "SLURM_CONF": str(cluster.conf),
        "PATH": str(Path(sys.executable).parent) + os.pathsep + cluster.env()["PATH"],
    }
    return run_train(
        [
            "experiment=smoke-cluster",
            "launcher=slurm",
            "launcher.container=pyxis",
            f"launcher.image={image_ref}",
            "launcher.node_address=hostname",
            "launcher.gpus_flag=none",
            "launcher.submit=true",
            "launcher.time_limit=00:15:00",
            'launcher.ray_start_args=["--object-store-memory=200000000"]',
            "launcher.ray_join_wave=1",  # four nodes on this machine's few cores: one joins at a time
            f"hydra.run.dir={run_dir}",
        ],
        cwd=cwd,
        env=env,
        preexec_fn=cluster._preexec(),
    )


def test_train_on_pyxis_probes_every_node_inside_the_image_by_digest(cluster, image, eight_ranks_at_a_time, tmp_path):
    """Promise: `train launcher=slurm launcher.container=pyxis launcher.image=FILE.sqsh@DIGEST` checks the file
    against its record, submits, and the batch script checks it again, then probes the four nodes inside the
    image: the preflight agrees on the digest read from the image's stamp on every node, and the record carries
    the squashfs file's sha256 and the image's stamped lock. Ray then starts on the four nodes inside the image,
    the job trains as eight CPU workers, two per node, each rank's probe reads the digest from the image's
    stamp, and `trainer verify` passes, the image digest of every rank among its rows."""
    run_dir = tmp_path / "run"
    submitted = _train(cluster, run_dir, f"{image['sqsh']}@{image['digest']}", tmp_path)
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    record = json.loads((run_dir / "record.json").read_text())
    assert record["image"]["squashfs"]["sha256"] == image["record"]["sha256"]
    assert "sha256sum --check" in (run_dir / "sbatch.sh").read_text()
    deadline = time.monotonic() + 600
    while not (run_dir / "preflight.json").is_file() and time.monotonic() < deadline:
        time.sleep(2)
    time.sleep(2)
    preflight = json.loads((run_dir / "preflight.json").read_text())
    assert preflight["ok"] is True, preflight
    assert preflight["nodes"] == [f"n{i}" for i in range(1, NODES + 1)]
    for node in preflight["nodes"]:
        probe = json.loads((run_dir / "probes" / f"{node}.json").read_text())
        assert probe["image"]["digest"] == image["digest"]
        assert "image.json" in probe["image"]  # read from the image's own stamp, not the job's environment
    # then Ray on the four nodes, inside the image, and the eight CPU workers the job places there
    deadline = time.monotonic() + 900
    record = json.loads((run_dir / "record.json").read_text())
    while record["status"] not in ("complete", "failed") and time.monotonic() < deadline:
        time.sleep(3)
        record = json.loads((run_dir / "record.json").read_text())
    if record["status"] not in ("complete", "failed"):
        cluster.client(["scancel", "--user=root"], timeout=30)
    logs = "".join(p.read_text()[-1500:] for p in sorted((run_dir / "logs").glob("*.log")))
    assert record["status"] == "complete", f"{record['status']}: {record.get('reason')}\n{logs}"
    assert record["lock"]["kind"] == "image stamp" and (run_dir / "image" / "lock.json").is_file()
    ranks = record["probe"]["ranks"]
    assert sorted(p["node"] for p in ranks) == sorted(f"n{i}" for i in range(1, NODES + 1) for _ in range(2))
    assert {p["image"]["digest"] for p in ranks} == {image["digest"]}  # each rank read the image's own stamp
    assert all("image.json" in p["image"] for p in ranks)
    verified = trainer("verify", run_dir, "--json")
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-1000:]
    rows = {row["component"]: row for row in json.loads(verified.stdout)["rows"]}
    assert rows["image digest"] == {
        "component": "image digest",
        "locked": image["digest"],
        "recipe": None,
        "observed": image["digest"],
        "verdict": "ok",
    }
    stamped = json.loads((run_dir / "image" / "lock.json").read_text())
    assert rows["ray"]["verdict"] == "ok" and rows["ray"]["observed"] == "2.60.0"  # a wheel of the stamped lock
    assert sum(1 for row in rows.values() if row["verdict"] == "ok") >= len(stamped["distributions"])


def test_a_squashfs_changed_by_one_byte_is_refused_before_submission(cluster, image, tmp_path):
    """Tamper test: one flipped byte in the squashfs file and `train` refuses it in one line naming
    launcher.image, exit 2, and Slurm gets no job."""
    bad = tmp_path / "bad.sqsh"
    shutil.copy(image["sqsh"], bad)
    shutil.copy(image["sqsh"].with_name(image["sqsh"].name + ".json"), tmp_path / "bad.sqsh.json")
    with open(bad, "r+b") as handle:
        handle.seek(4096)
        byte = handle.read(1)
        handle.seek(4096)
        handle.write(bytes([byte[0] ^ 0x80]))
    before = cluster.client(["squeue", "-h", "-o", "%i"], timeout=30).stdout
    refused = _train(cluster, tmp_path / "run", f"{bad}@{image['digest']}", tmp_path)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert any("launcher.image" in line and "changed since made" in line for line in lines), refused.stderr
    assert "Traceback" not in refused.stderr
    assert cluster.client(["squeue", "-h", "-o", "%i"], timeout=30).stdout == before
    assert not (tmp_path / "run" / "sbatch.sh").exists()


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
