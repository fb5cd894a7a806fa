"""One bounded reader for every file (trainer/inputs.py): a FIFO, a directory, a device or an 8 GiB sparse file where a
file is expected is one line naming the file (exit 2), never a hang, a traceback or exhausted memory.

Every case of the parametrised test runs in ONE child process (``DRIVER``: the CLI's ``main`` in-process, one case
after another, each under an alarm), started with ``timeout=``: a reader that blocks on a FIFO fails the test by
timeout instead of hanging it. Sparse files are made with ``truncate`` (8 GiB that cost no disk). Also here:
`trainer logs` streams (memory bounded by the line cap, values report/converge would refuse refused, a round trip
logs -> report/converge), `trainer data build` caps (lines, messages), keys (size, mode 0600).
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helpers
from helpers import REPO_ROOT, planned_run
from trainer import cli
from trainer.errors import UserError

SPARSE = 8 << 30  # bytes of every oversized file: sparse, no disk


def _sparse(path: Path) -> None:
    with open(path, "wb") as handle:
        handle.truncate(SPARSE)


KINDS = {  # how each hostile file is made, and a phrase its one line must hold
    "fifo": (lambda p: os.mkfifo(p), "a FIFO, not a regular file"),
    "directory": (lambda p: p.mkdir(), "directory"),
    "/dev/zero": (lambda p: p.symlink_to("/dev/zero"), "a character device, not a regular file"),
    "sparse 8 GiB": (_sparse, None),
}
SPARSE_WORDS = (
    "8,589,934,592 bytes, more than",
    "longer than",
    "no PAR1 magic",
    "skipped",
    "line 1 does not say what the lock was resolved from",
)

MEGATRON_LINE = (
    " [2026-10-13 10:01:00] iteration {step:>8}/      20 | consumed samples: {samples:12d} | elapsed time per "
    "iteration (ms): {ms} | learning rate: 1.000000E-05 | global batch size:   128 | lm loss: {loss} | "
    "loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)


def megatron_log(steps=20, over=None):
    """A Megatron log of ``steps`` steps (``over``: {step: {field: text}} replacing fields of one step's line)."""
    lines = ["startup"]
    for s in range(1, steps + 1):
        fields = {
            "step": s,
            "samples": 128 * s,
            "ms": "20270.0",
            "loss": f"{2.0 - 0.01 * s:.6E}",
            **(over or {}).get(s, {}),
        }
        lines.append(MEGATRON_LINE.format(**fields))
    return "\n".join(lines) + "\n"


def good_jsonl(path):
    row = {"id": "a", "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    path.write_text(json.dumps(row) + "\n")
    return path


# reader: (the file made hostile, relative to the case directory; argv from (case dir, out dir); kinds it is tried with)
ALL = tuple(KINDS)
READERS = {
    "report record.json": ("run/record.json", lambda d, o: ["report", d / "run", "--no-plot", "--out", o], ALL),
    "report config.yaml": ("run/config.yaml", lambda d, o: ["report", d / "run", "--no-plot", "--out", o], ALL),
    "report metrics.jsonl": ("run/metrics.jsonl", lambda d, o: ["report", d / "run", "--no-plot", "--out", o], ALL),
    "recipe config.yaml": ("run/config.yaml", lambda d, o: ["recipe", d / "run", "-o", o / "recipe.yaml"], ALL),
    "status record.json": ("run/record.json", lambda d, o: ["status", d / "run"], ALL),
    "verify record.json": ("run/record.json", lambda d, o: ["verify", d / "run"], ALL),
    "verify --lock": ("lock.txt", lambda d, o: ["verify", d / "run", "--lock", d / "lock.txt"], ALL),
    "verify --key": ("key.pub", lambda d, o: ["verify", d / "run", "--key", d / "key.pub"], ALL),
    "verify attestation.json": (
        "run/attestation.json",
        lambda d, o: ["verify", d / "run", "--key", d / "good.pub"],
        ALL,
    ),
    "verify image index.json": ("image/index.json", lambda d, o: ["verify", d / "image", "--key", d / "good.pub"], ALL),
    "lock verify (image lock)": ("image.lock.json", lambda d, o: ["lock", "verify", d / "image.lock.json"], ALL),
    "lock verify (requirements)": ("launcher.lock", lambda d, o: ["lock", "verify", d / "launcher.lock"], ALL),
    "attest --sign-key": ("key", lambda d, o: ["attest", d / "run", "--sign-key", d / "key"], ALL),
    "logs": ("train.log", lambda d, o: ["logs", d / "train.log", "-o", o], ALL),
    "converge": ("a.jsonl", lambda d, o: ["converge", d / "a.jsonl", d / "run", "--no-plot", "--out", o], ALL),
    "data build jsonl": (
        "in.jsonl",
        lambda d, o: ["data", "build", "--input", d / "in.jsonl", "--out", o / "rows"],
        ("fifo", "/dev/zero", "sparse 8 GiB"),
    ),
    "data build parquet": (
        "in.parquet",
        lambda d, o: ["data", "build", "--input", d / "in.parquet", "--out", o / "rows"],
        ("fifo", "sparse 8 GiB"),
    ),
    "data build --tokenizer": (
        "tok.json",
        lambda d, o: ["data", "build", "--input", d / "good.jsonl", "--out", o / "rows", "--tokenizer", d / "tok.json"],
        ("fifo", "sparse 8 GiB"),
    ),
    "cas tree record": ("cas/trees/" + "a" * 40 + ".json", None, ALL),
}
CASES = [(reader, kind) for reader, (_, _, kinds) in READERS.items() for kind in kinds]

DRIVER = r"""
import contextlib, io, json, os, resource, signal, sys, time
from pathlib import Path
from trainer import cli
from trainer.errors import UserError

class Hung(Exception):
    pass

def alarm(*_):
    raise Hung()

signal.signal(signal.SIGALRM, alarm)
results = {}
for case in json.load(open(sys.argv[1])):
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    signal.alarm(15)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if case["argv"] is None:  # the cache's tree record, as `cache fetch` and a source build read it
                from trainer.image.cas import Cache
                try:
                    Cache(Path(case["root"])).tree_record("a" * 40)
                    code = 0
                except UserError as ex:
                    print(f"trainer cache: error: {ex}", file=sys.stderr)
                    code = 2
            elif case["argv"] == "oldest_live":  # a build's scan of the live markers in the cache's tmp/
                from trainer.image.cas import Cache
                code = 0 if Cache(Path(case["root"]))._oldest_live(Path(case["root"]) / "tmp") is None else 1
            else:
                code = cli.main(case["argv"])
    except Hung:
        code = "hung"
    except BaseException as ex:
        code = f"raised {type(ex).__name__}: {ex}"
    signal.alarm(0)
    results[case["id"]] = {"code": code, "out": out.getvalue(), "err": err.getvalue(),
                           "seconds": time.monotonic() - start}
results["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(results))
"""


def snapshot(root: Path) -> list:
    """Every entry under ``root``: path, mode, size, mtime, and the content of small regular files (never read
    through a FIFO or a device, never the 8 GiB of a sparse file)."""
    items = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            st = path.lstat()
            content = path.read_bytes() if path.is_file() and not path.is_symlink() and st.st_size < (4 << 20) else None
            items.append((str(path.relative_to(root)), st.st_mode, st.st_size, st.st_mtime_ns, content))
    return sorted(items, key=lambda item: item[0])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A plan run with metrics, a key pair, an OCI layout shell, inputs: shared by every case (copied per case)."""
    from trainer import signing

    base = tmp_path_factory.mktemp("bounded")
    (base / "src").mkdir()
    run = planned_run(base / "src")
    _, pub, _ = signing.keygen(base / "good", "ed25519")
    return {"base": base, "run": run, "pub": pub}


def _prepare(world, root: Path, reader: str, kind: str) -> dict:
    case_dir = root / f"{reader}-{kind}".replace(" ", "_").replace("/", "_")
    out = case_dir / "out"
    out.mkdir(parents=True)
    shutil.copytree(world["run"], case_dir / "run", symlinks=True)
    shutil.copy(world["pub"], case_dir / "good.pub")
    (case_dir / "image").mkdir()
    (case_dir / "image" / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    good_jsonl(case_dir / "good.jsonl")
    target_rel, argv, _ = READERS[reader]
    target = case_dir / target_rel
    if target.exists() or target.is_symlink():
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    KINDS[kind][0](target)
    return {
        "id": f"{reader} / {kind}",
        "argv": None if argv is None else [str(a) for a in argv(case_dir, out)],
        "root": str(case_dir / "cas"),
        "target": str(target),
        "out": str(out),
        "dir": str(case_dir),
    }


@pytest.fixture(scope="module")
def results(world):
    """Run every case in one child process with a timeout; returns (cases, results, seconds)."""
    root = world["base"] / "cases"
    cases = [_prepare(world, root, reader, kind) for reader, kind in CASES]
    from trainer.image.cas import LIVE_PREFIX

    (root / "live" / "cas" / "tmp").mkdir(parents=True)
    os.mkfifo(root / "live" / "cas" / "tmp" / f"{LIVE_PREFIX}4242")
    cases.append(
        {
            "id": "live marker / fifo",
            "argv": "oldest_live",
            "root": str(root / "live" / "cas"),
            "dir": str(root / "live"),
        }
    )
    before = {c["id"]: snapshot(Path(c["dir"])) for c in cases}
    (root / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "200"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(root / "cases.json")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=root,
    )  # a hang fails here, by timeout, never forever
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return {c["id"]: c for c in cases}, before, found, seconds


def test_a_fifo_live_marker_in_the_cache_does_not_block_a_build(results):
    """Promise: a FIFO named like a live build's marker in the shared cache's tmp/ is opened non-blocking: a build's
    scan for live builds returns at once and takes it for debris (no lock held), instead of hanging every build."""
    _, _, found, _ = results
    got = found["live marker / fifo"]
    assert (got["code"], got["err"]) == (0, "") and got["seconds"] < 5, got


@pytest.mark.parametrize("reader,kind", CASES)
def test_a_special_or_huge_file_is_one_line_for_every_reader(results, reader, kind):
    """Promise: a FIFO, a directory, a symlink to /dev/zero or an 8 GiB sparse file where a reader expects a file is
    refused at once (opened non-blocking, fstat-ed, size-capped before any byte is read): exit 2, one line naming the
    file and what was expected, no traceback, nothing written (the out directory stays empty, the run unchanged)."""
    cases, before, found, _ = results
    case = cases[f"{reader} / {kind}"]
    got = found[case["id"]]
    lines = got["err"].strip().splitlines()
    assert got["code"] == 2, (got["code"], got["err"][-2000:])
    assert len(lines) == 1 and lines[0].startswith("trainer "), got["err"]
    assert "Traceback" not in got["err"] + got["out"]
    assert Path(case["target"]).name in lines[0], lines[0]
    phrase = KINDS[kind][1]
    if phrase:
        assert phrase in lines[0], lines[0]
    else:
        assert any(word in lines[0] for word in SPARSE_WORDS), lines[0]
    assert got["seconds"] < 10, got["seconds"]
    assert list(Path(case["out"]).iterdir()) == []
    assert snapshot(Path(case["dir"])) == before[case["id"]]


def test_the_whole_family_is_fast_and_bounded(results):
    """Promise: every refusal above together stays within seconds and far below the 8 GiB the files claim (the
    child's peak RSS, tokenizer loads included)."""
    _, _, found, seconds = results
    assert seconds < 60, seconds
    assert found["maxrss_kib"] < (1536 << 10), found["maxrss_kib"]


def test_exact_lines_for_a_fifo(results):
    """The words of the refusal: the file, its kind, the kind of file expected."""
    cases, _, found, _ = results
    for reader, what in (
        ("status record.json", "a run record"),
        ("verify --lock", "a lock"),
        ("attest --sign-key", "a PEM private key"),
        ("verify --key", "a PEM public key"),
        ("logs", "a training log"),
        ("verify attestation.json", "a run attestation"),
    ):
        case = cases[f"{reader} / fifo"]
        line = found[case["id"]]["err"].strip()
        assert f"{case['target']}: a FIFO, not a regular file ({what} must be one)" in line, line


# ------------------------------------------------------------------------------------------ trainer logs


def _child(code: str, timeout: float = 60) -> dict:
    """Run ``code`` in a child process (this checkout on the path); it prints JSON; returns that, with the child's
    peak RSS (KiB) and wall time."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.monotonic() - start
    return out


RUN_CLI = """
import contextlib, io, json, resource, sys
from trainer import cli
err, out = io.StringIO(), io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
    code = cli.main({argv!r})
print(json.dumps({{"code": code, "err": err.getvalue(), "out": out.getvalue(),
                  "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
"""


def test_logs_streams_an_8gib_sparse_log_in_bounded_memory(tmp_path):
    """Promise: `trainer logs` reads its log as a stream of lines of at most 64 KiB: an 8 GiB log whose first line
    is an 8 GiB hole, followed by a real step line, gives that step, in seconds, with the child's peak RSS far
    below the file (before: MemoryError at 5.75 GB); the over-long line is skipped and counted, never parsed."""
    log = tmp_path / "train.log"
    with open(log, "wb") as handle:
        handle.truncate(SPARSE)
        handle.seek(SPARSE)
        handle.write(b"\n" + megatron_log(2).encode())
    got = _child(RUN_CLI.format(argv=["logs", str(log), "-o", str(tmp_path / "out.jsonl")]))
    assert got["code"] == 0, got["err"]
    assert f"{log}: 1 line longer than 65,536 bytes skipped (line 1; a step line is shorter)" in got["out"], got["out"]
    assert [json.loads(line)["step"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == [1, 2]
    assert got["maxrss_kib"] < (400 << 10) and got["wall_s"] < 20, got


def test_logs_skips_one_20mb_miles_line_in_bounded_memory(tmp_path):
    """Promise: a 20 MB miles step line (before: 3.4 GB RSS in the parser) is longer than the 64 KiB cap: skipped
    and counted, so a log of only that line is one line naming the file and the skipped line, exit 2."""
    log = tmp_path / "miles.log"
    log.write_text("step 0: {'train/loss': 1.0, 'x': '" + "a" * (20 << 20) + "'}\n")
    got = _child(RUN_CLI.format(argv=["logs", str(log), "-o", str(tmp_path / "out.jsonl")]))
    assert got["code"] == 2 and got["err"].count("\n") == 1, got["err"]
    assert got["err"].startswith(f"trainer logs: error: {log}: no training step lines found")
    assert "1 line longer than 65,536 bytes skipped (line 1; a step line is shorter)" in got["err"]
    assert got["maxrss_kib"] < (400 << 10), got["maxrss_kib"]
    assert not (tmp_path / "out.jsonl").exists()


def call(capsys, *args):
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "over,needle",
    [
        (
            {3: {"step": "1" + "0" * 30}},
            "line 4: iteration 1000000000000000000000000000000 is not a step metrics.jsonl holds "
            "(1..9,223,372,036,854,775,807)",
        ),
        ({3: {"step": "9" * 5000}}, "line 4: iteration 99999999999999999999... (5,000 digits) is not a step"),
        ({3: {"step": "0"}}, "line 4: iteration 0 is not a step metrics.jsonl holds"),
        ({2: {"ms": "-5.0"}}, "line 3: step time -0.005 s, expected a positive finite number of seconds"),
        ({2: {"ms": "inf"}}, "line 3: step time inf s, expected a positive finite number of seconds"),
        ({2: {"ms": "nan"}}, "line 3: step time nan s, expected a positive finite number of seconds"),
        ({2: {"ms": "0.0"}}, "line 3: step time 0.0 s, expected a positive finite number of seconds"),
        ({2: {"loss": "abc"}}, "line 3: lm loss 'abc' is not a number"),
    ],
)
def test_logs_refuses_values_report_and_converge_would_refuse(tmp_path, capsys, over, needle):
    """Promise: `trainer logs` never writes a metrics.jsonl that report or converge then refuse: a step beyond a
    signed 64-bit integer (10^30, 5,000 digits), step 0, a step time that is negative, zero, inf or NaN are refused
    with one line naming the log file and line (before: written, then refused by the next command); nothing written."""
    log = tmp_path / "train.log"
    log.write_text(megatron_log(5, over))
    code, _, err = call(capsys, "logs", log, "-o", tmp_path / "m.jsonl")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"trainer logs: error: {log} {needle}"), err
    assert not (tmp_path / "m.jsonl").exists()


def test_logs_refuses_bad_miles_values_naming_file_and_line(tmp_path, capsys):
    """Promise: the same for miles: perf time -inf, a global batch size of 0, a 0-based step beyond int64."""
    prefix = "(MegatronTrainRayActor pid=1) [2026-10-13 10:01:00] log_utils.py:542 - "
    good = prefix + "step 0: {'train/loss': 2.0, 'train/grad_norm': 1.0, 'train/step': 0}\n"
    for line, needle in (
        (prefix + "perf 0: {'perf/actor_train_time': -inf}", "line 2: step time -inf s, expected a positive"),
        (
            prefix + "step 1: {'train/loss': 1.9, 'train/global_batch_size': 0}",
            "line 2: global batch size 0.0, expected a positive integer number of rows",
        ),
        (
            prefix + "step 99999999999999999999: {'train/loss': 1.9}",
            "line 2: step 99999999999999999999 (+1) is not a step",
        ),
    ):
        log = tmp_path / "miles.log"
        log.write_text(good + line + "\n")
        code, _, err = call(capsys, "logs", log, "-o", tmp_path / "m.jsonl")
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"trainer logs: error: {log} {needle}"), err
        assert not (tmp_path / "m.jsonl").exists()


def test_logs_to_report_and_converge_round_trip(world, tmp_path, capsys):
    """Promise: what `trainer logs` writes, report and converge read: a 20-step Megatron log (one step with a NaN loss
    and grad norm, kept as documented) -> metrics.jsonl -> `converge` answers (rc 0 or 1, never refuses the file),
    and `report` of a run with those metrics succeeds."""
    log = tmp_path / "train.log"
    log.write_text(megatron_log(20, {20: {"loss": "nan"}}))
    run = shutil.copytree(world["run"], tmp_path / "run")
    code, out, err = call(capsys, "logs", log, "-o", run, "--force", "--seq-length", "8192")
    assert code == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21)) and rows[-1]["lm_loss"] == "NaN"
    assert all(r["step_time_s"] == 20.27 and r["tokens"] == 128 * 8192 for r in rows)
    code, _, err = call(capsys, "report", run, "--no-plot", "--no-cost", "--out", tmp_path / "rep")
    assert code == 0, err
    code, _, err = call(capsys, "converge", run, run, "--no-plot", "--out", tmp_path / "conv")
    assert code == 1 and err == "", err  # the NaN step fails the check: an answer, not a refusal
    result = json.loads((tmp_path / "conv" / "convergence.json").read_text())
    assert result["metrics"]["steps"] == 20 and result["passed"] is False


# ------------------------------------------------------------------------------------------ trainer data


def test_data_build_refuses_a_100mb_message_and_a_long_parquet_message(tmp_path, capsys):
    """Promise: `trainer data build` applies the 1 MiB line cap to jsonl (a 100 MB one-message line is refused at
    its first MiB: before, the tokenizer aborted the process) and the 1,000,000-character message cap to parquet,
    before tokenizing; one line naming the file, the line or row, and the cap; nothing written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    big = tmp_path / "big.jsonl"
    with open(big, "w") as handle:
        handle.write('{"id": "x", "messages": [{"role": "user", "content": "')
        for _ in range(100):
            handle.write("a" * (1 << 20))
        handle.write('"}, {"role": "assistant", "content": "ok"}]}\n')
    code, _, err = call(capsys, "data", "build", "--input", big, "--out", tmp_path / "rows")
    assert code == 2 and err == (
        f"trainer data: error: {big} line 1: longer than 1,048,576 bytes (the most a conversation line may have)\n"
    ), err
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table(
        {
            "id": ["p0"],
            "messages": pa.array(
                [[{"role": "user", "content": "b" * 1_000_001}, {"role": "assistant", "content": "ok"}]],
                pa.list_(message),
            ),
        }
    )
    pq.write_table(table, tmp_path / "long.parquet")
    code, _, err = call(capsys, "data", "build", "--input", tmp_path / "long.parquet", "--out", tmp_path / "rows")
    assert code == 2 and err == (
        f"trainer data: error: {tmp_path / 'long.parquet'} row 0: messages[0].content: "
        "1,000,001 characters, more than the 1,000,000 a message may have (the tokenizer's "
        "memory grows ~125 bytes per character)\n"
    ), err
    assert not (tmp_path / "rows").exists()


def test_a_conversation_over_the_rendered_cap_is_refused_before_tokenizing():
    """Promise: four messages each under the message cap, together over 4,000,000 rendered characters, are refused by
    render (the tokenizer never sees them); one just under passes."""
    from trainer.data import chat

    part = "c" * 999_990
    messages = [{"role": "user", "content": part}, {"role": "assistant", "content": part}] * 2
    with pytest.raises(chat.ConversationError, match=r"^messages: 3,99\d,\d{3} characters rendered|^messages: 4,0"):
        chat.render(messages + [{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "y" * 50}])
    assert len(chat.render(messages[:2]).text) > 1_999_980


def test_a_batch_is_cut_at_its_character_budget(tmp_path, monkeypatch):
    """Promise: the tokenizer is never handed more than BATCH_CHARS rendered characters at once (beyond one
    conversation): batches are cut early, every conversation still comes once, in packing order."""
    from trainer.data import build

    src = tmp_path / "c.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"c{i}",
                    "messages": [{"role": "user", "content": "q" * 40}, {"role": "assistant", "content": "a" * 40}],
                }
            )
            + "\n"
            for i in range(7)
        )
    )
    entry = build.read_input(src)
    order = build.permutation([entry], 1)
    config = build.BuildConfig()
    whole = [b for b in build.conversations([entry], order, config, build.Stats())]
    size = len(whole[0][0][1].text)
    monkeypatch.setattr(build, "BATCH_CHARS", 2 * size + 1)
    cut = [b for b in build.conversations([entry], order, config, build.Stats())]
    assert [len(b) for b in whole] == [7] and [len(b) for b in cut] == [2, 2, 2, 1]
    assert [p for b in cut for _, _, p in b] == list(range(7))
    assert all(sum(len(r.text) for _, r, _ in b) <= 2 * size + 1 for b in cut)


def test_data_example_does_not_replace_an_existing_file(tmp_path, capsys):
    """Promise: `trainer data example --out EXISTING` refuses (one line, the file unchanged) unless --force."""
    target = tmp_path / "mine.jsonl"
    target.write_text("my own data\n")
    code, _, err = call(capsys, "data", "example", "--out", target, "--conversations", "3")
    assert code == 2 and err == (
        f"trainer data: error: --out {target}: exists; pass --force to replace it, or write to another file\n"
    ), err
    assert target.read_text() == "my own data\n"
    code, _, err = call(capsys, "data", "example", "--out", tmp_path, "--conversations", "3")
    assert code == 2 and "a directory" in err
    code, out, err = call(capsys, "data", "example", "--out", target, "--conversations", "3", "--force")
    assert code == 0 and len(target.read_text().splitlines()) == 3, err


# ------------------------------------------------------------------------------------------ keys


def test_keygen_writes_0600_and_a_0644_key_signs_nothing(world, tmp_path, capsys):
    """Promise: `trainer keygen` writes the private key 0600; a private key the group or others may read (0644, 0640)
    is refused as ssh refuses it ("permissions 0644 for KEY are too open", exit 2, one line) before anything is
    signed; a key over 16 KiB is refused from its size; 0600 and 0400 load."""
    from trainer import signing

    old = os.umask(0)
    try:
        private, public, keyid = signing.keygen(tmp_path / "k")
    finally:
        os.umask(old)
    assert (os.stat(private).st_mode & 0o777, os.stat(public).st_mode & 0o777) == (0o600, 0o644)
    assert signing.load_signer(private).public_key.keyid == keyid
    run = shutil.copytree(world["run"], tmp_path / "run")
    before = snapshot(run)
    for mode in (0o644, 0o640, 0o604):
        os.chmod(private, mode)
        code, _, err = call(capsys, "attest", run, "--sign-key", private)
        assert code == 2 and err == (
            f"trainer attest: error: --sign-key {private}: permissions {mode:04o} for {private} "
            f"are too open (a private key must be readable by its owner only: chmod 600 "
            f"{private}); nothing signed\n"
        ), err
    os.chmod(private, 0o400)
    assert signing.load_signer(private).public_key.keyid == keyid
    big = tmp_path / "big.pem"
    big.write_bytes(private.read_bytes() + b"\n" * (16 << 10))
    os.chmod(big, 0o600)
    with pytest.raises(UserError, match=r"big.pem: 16,\d{3} bytes, more than the 16,384 a PEM private key may have"):
        signing.load_signer(big)
    assert snapshot(run) == before


def test_streamed_step_count_equals_the_whole_file_count(tmp_path):
    """Promise: verify and attest count metrics.jsonl steps streamed (an 8 GiB metrics file costs no memory) with the
    same answer as counting the bytes whole, whatever the block boundaries; a FIFO is refused."""
    from trainer.record.attest import StepCounter, count_steps, count_steps_in

    samples = [b"", b"\n", b"a", b"a\n", b"a\r\nb", b" \n\t\n{}\n", b"x\r\ry\n\n z ", b'{"step": 1}\n' * 5 + b"  "]
    for data in samples:
        for size in (1, 2, 3, 7, 1 << 20):
            counter = StepCounter()
            for i in range(0, len(data), size):
                counter.feed(data[i : i + size])
            assert counter.total() == count_steps(data), (data, size)
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "wb") as handle:
        handle.write(b'{"step": 1}\n{"step": 2}\n')
        handle.truncate(SPARSE)
    start = time.monotonic()
    assert count_steps_in(metrics) == 3  # two lines and the NULs after them (bytes that are not blank)
    assert time.monotonic() - start < 20
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UserError, match="fifo: a FIFO, not a regular file"):
        count_steps_in(tmp_path / "fifo")


def test_a_lock_and_a_probe_read_through_the_bounded_reader(tmp_path):
    """Unit: inputs.open_regular refuses each kind by name; lines() streams a sparse file refusing its first line at
    the cap; raw_lines(long='skip') steps over an 8 GiB hole without reading it (SEEK_DATA) and keeps counting lines."""
    from trainer import inputs

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, words in ((fifo, "a FIFO"), (tmp_path, "a directory"), (Path("/dev/null"), "a character device")):
        with pytest.raises(UserError, match=f"^{path}: {words}, not a regular file \\(a lock must be one\\)$"):
            inputs.read_text(path, "lock")
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as handle:
        handle.truncate(SPARSE)
        handle.seek(4 << 30)
        handle.write(b"middle\n" + b"x" * 100_000 + b"\nlast\n")
    with pytest.raises(UserError, match=r"sparse line 1: longer than 1,048,576 bytes"):
        list(inputs.lines(sparse))
    start = time.monotonic()
    got = list(inputs.raw_lines(sparse, "log", 64 << 10, long="skip"))
    assert got == [(1, None), (2, None), (3, b"last\n"), (4, None)] and time.monotonic() - start < 2


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
