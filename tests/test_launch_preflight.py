"""The preflight comparison of per-node probes (trainer.launch.preflight): real probes of this machine, one node
changed per case, and the command line the generated sbatch.sh runs."""

import copy
import json
import subprocess
import sys

import pytest

import helpers
from helpers import REPO_ROOT
from trainer.launch import preflight
from trainer.probe import probe

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def base():
    info = probe()
    info["image"] = {"digest": DIGEST, "lock.json": {"sha256": "cd" * 32}}
    info["torch"] = dict(
        info["torch"] or {}, nccl="2.28.9", gpus=[{"name": "NVIDIA H200", "memory_bytes": 150_000_000_000}] * 8
    )
    info["driver"] = "580.95.05"
    info["nccl_net_plugin"] = {"env": None, "loaded": ["/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so"]}
    return info


def test_identical_nodes_agree(base):
    report = preflight.compare({f"node{i}": copy.deepcopy(base) for i in range(8)}, expect_gpus=8, expect_digest=DIGEST)
    assert report.ok and report.reason() == ""
    assert report.reference["NCCL"] == "2.28.9" and report.reference["GPUs"] == "8"
    assert report.reference["NCCL net plugin"] == "libnccl-net-ofi.so"


def test_one_node_with_another_nccl_is_named_with_the_field(base):
    probes = {f"node{i}": copy.deepcopy(base) for i in range(8)}
    probes["node5"]["torch"]["nccl"] = "2.27.3"
    probes["node2"]["nccl_net_plugin"]["loaded"] = []
    report = preflight.compare(probes, expect_gpus=8)
    assert not report.ok
    assert [(d.node, d.field, d.value, d.expected) for d in report.differences] == [
        ("node2", "NCCL net plugin", "-", "libnccl-net-ofi.so"),
        ("node5", "NCCL", "2.27.3", "2.28.9"),
    ]
    assert report.reason() == (
        "preflight: 2 of 8 node(s) differ: node2: NCCL net plugin - != libnccl-net-ofi.so | "
        "node5: NCCL 2.27.3 != 2.28.9"
    )
    table = report.table().splitlines()
    assert table[0].split() == [
        "node",
        "image",
        "digest",
        "image",
        "stamp",
        "python",
        "torch",
        "NCCL",
        "NCCL",
        "net",
        "plugin",
        "driver",
        "GPUs",
    ]
    node5 = next(line for line in table if line.startswith("node5"))
    assert "2.27.3 *" in node5 and node5.count("*") == 1


def test_fewer_nodes_than_the_cluster_has_is_one_line_naming_those_that_came(base):
    report = preflight.compare({n: copy.deepcopy(base) for n in ("n1", "n2", "n3")}, expect_gpus=8)
    assert report.ok
    report.waited_s = 10
    report.differences.append(preflight.Difference(preflight.CLUSTER, "nodes", "3", "4"))
    assert report.reason() == "preflight: 3 of 4 node(s) alive after 10 s (n1, n2, n3); cluster.nodes is 4"
    assert preflight.compare({}, expect_gpus=8).nodes == []


def test_missing_probe_gpu_count_and_digest(base):
    probes = {"a": copy.deepcopy(base), "b": None, "c": copy.deepcopy(base)}
    probes["c"]["torch"]["gpus"] = probes["c"]["torch"]["gpus"][:7]
    probes["c"]["image"]["digest"] = "sha256:" + "ef" * 32
    report = preflight.compare(probes, expect_gpus=8, expect_digest=DIGEST)
    fields = {(d.node, d.field) for d in report.differences}
    assert fields == {("b", "probe"), ("c", "GPUs"), ("c", "image digest")}
    assert "b: probe failed" in report.reason() and "c: image digest sha256:efef" in report.reason()


def test_command_line_exit_codes(base, tmp_path):
    for name in ("n1", "n2"):
        (tmp_path / f"{name}.json").write_text(json.dumps(base))

    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "trainer.launch.preflight", str(tmp_path), *a],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
        )

    ok = run("--nodes", "n1,n2", "--expect-gpus", "8", "--out", str(tmp_path / "pf.json"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads((tmp_path / "pf.json").read_text())["ok"] is True
    bad = run("--nodes", "n1,n2,n3", "--expect-gpus", "4")
    assert bad.returncode == 3
    assert bad.stdout.splitlines()[-1].startswith("preflight: 3 of 3 node(s) differ: n1: GPUs 8 != 4")


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
