"""`trainer data build` on bad input: one line naming file and row, exit code 2, nothing left behind; skip options."""

import hashlib
import json
import os

import pytest

import helpers
from trainer import cli
from trainer.data import synthetic
from trainer.data.build import shipped_tokenizer_path

GOOD = {
    "id": "good-1",
    "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
    "source": "t",
}


def jsonl(path, *rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def parquet_with(path, messages_rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table(
        {
            "id": [f"p{i}" for i in range(len(messages_rows))],
            "messages": pa.array(messages_rows, pa.list_(message)),
            "source": ["t"] * len(messages_rows),
        }
    )
    pq.write_table(table, path)
    return path


def run(capsys, *args):
    code = cli.main(["data", "build", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(capsys, tmp_path, inputs, expected, extra=()):
    out = tmp_path / "out"
    code, _, err = run(capsys, "--input", *inputs, "--out", out, "--row-tokens", 8, *extra)
    assert code == 2
    assert err.startswith("trainer data: error: ") and err.count("\n") == 1, err
    assert expected in err, err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary directory left
    return err


def test_row_without_messages(capsys, tmp_path):
    src = jsonl(tmp_path / "a.jsonl", GOOD, {"id": "x", "source": "t"})
    assert_refused(
        capsys, tmp_path, [src], f"{src} line 2: messages: missing; expected a list of {{role, content}} objects"
    )


def test_unknown_role_in_parquet(capsys, tmp_path):
    src = parquet_with(
        tmp_path / "a.parquet",
        [GOOD["messages"], [{"role": "function", "content": "x"}, {"role": "assistant", "content": "y"}]],
    )
    assert_refused(
        capsys,
        tmp_path,
        [src],
        f"{src} row 1: messages[0].role: unknown role 'function' "
        "(expected system, developer, user, tool, assistant or latest_reminder)",
    )


def test_what_the_format_cannot_express_is_refused_not_dropped(capsys, tmp_path):
    call = {"id": "c", "function": {"name": "f", "arguments": "x=1"}}
    bad = {
        "id": "b",
        "source": "t",
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "r"},
            {"role": "assistant", "content": "a"},
        ],
    }
    src = jsonl(tmp_path / "a.jsonl", GOOD, bad)
    assert_refused(
        capsys, tmp_path, [src], f"{src} line 2: messages[1].tool_calls[0].function.arguments: expected a JSON object"
    )
    extra = {
        "id": "e",
        "source": "t",
        "messages": [{"role": "user", "content": "q", "name": "bob"}, {"role": "assistant", "content": "a"}],
    }
    src = jsonl(tmp_path / "a.jsonl", GOOD, extra)
    assert_refused(capsys, tmp_path, [src], f"{src} line 2: messages[0].name: not part of the DeepSeek-V4 format")


def test_non_string_content(capsys, tmp_path):
    src = jsonl(
        tmp_path / "a.jsonl",
        GOOD,
        GOOD,
        {"id": "n", "messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]},
    )
    assert_refused(capsys, tmp_path, [src], f"{src} line 3: messages[0].content: expected a string, got int 5")


def test_invalid_json_line(capsys, tmp_path):
    src = jsonl(tmp_path / "a.jsonl", GOOD, '{"id": "broken", "messages": [')
    assert_refused(capsys, tmp_path, [src], f"{src} line 2: not valid JSON")


@pytest.mark.parametrize("name,content", [("empty.jsonl", b""), ("blank.jsonl", b"\n \n"), ("empty.parquet", b"")])
def test_empty_file(capsys, tmp_path, name, content):
    src = tmp_path / name
    src.write_bytes(content)
    good = jsonl(tmp_path / "good.jsonl", GOOD)
    assert_refused(capsys, tmp_path, [good, src], f"{src}: empty file")


def test_parquet_without_rows(capsys, tmp_path):
    src = parquet_with(tmp_path / "none.parquet", [])
    assert_refused(capsys, tmp_path, [src], f"{src}: empty file (0 conversations)")


def test_truncated_parquet(capsys, tmp_path):
    whole = tmp_path / "whole.parquet"
    synthetic.write(whole, 3)
    src = tmp_path / "cut.parquet"
    src.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    whole.unlink()
    assert_refused(capsys, tmp_path, [src], f"{src}: not a readable parquet file (")


def test_tokenizer_with_another_hash(capsys, tmp_path):
    src = jsonl(tmp_path / "a.jsonl", GOOD)
    other = tmp_path / "tokenizer.json"
    other.write_text(
        json.dumps(json.loads(shipped_tokenizer_path().read_text()), indent=1)
    )  # same tokenizer, other bytes
    digest = hashlib.sha256(other.read_bytes()).hexdigest()
    err = assert_refused(
        capsys, tmp_path, [src], f"tokenizer {other}: sha256 {digest} != expected 8f9f37ca", ["--tokenizer", other]
    )
    assert "--tokenizer-sha256" in err
    assert_refused(
        capsys,
        tmp_path,
        [src],
        f"sha256 {digest} != expected {'0' * 64}",
        ["--tokenizer", other, "--tokenizer-sha256", "0" * 64],
    )
    # named explicitly by its hash, the other file is accepted and recorded
    code, out, err = run(
        capsys,
        "--input",
        src,
        "--out",
        tmp_path / "ok",
        "--row-tokens",
        8,
        "--tokenizer",
        other,
        "--tokenizer-sha256",
        digest,
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["manifest"]["tokenizer_sha256"] == digest


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--input", "nothing-*.jsonl"], "--input nothing-*.jsonl: no file matches"),
        (["--input", "missing.jsonl"], "--input missing.jsonl: no such file"),
        (["--input", "notes.txt"], "notes.txt: unknown input type .txt; expected .parquet or .jsonl"),
        (["--input", "a.jsonl", "--data", "nosuch"], "nosuch"),
        (["--input", "a.jsonl", "--rows", "-1"], "--rows -1: expected 0 (all rows) or a positive number"),
        (["--input", "a.jsonl", "--row-tokens", "1"], "row_tokens 1: expected at least 2 tokens per row"),
    ],
)
def test_bad_arguments(capsys, tmp_path, monkeypatch, args, expected):
    monkeypatch.chdir(tmp_path)
    jsonl(tmp_path / "a.jsonl", GOOD)
    (tmp_path / "notes.txt").write_text("x")
    code, _, err = run(capsys, *args, "--out", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "out").exists()


def test_out_that_is_not_a_build_is_left_alone(capsys, tmp_path):
    src = tmp_path / "in.jsonl"
    synthetic.write(src, 20, seed=3)
    out = tmp_path / "out"
    out.mkdir()
    (out / "important.txt").write_text("keep me")
    code, _, err = run(capsys, "--input", str(src), "--out", str(out))
    assert code == 2
    assert err.strip().endswith(
        "a non-empty directory that is not a rows build (no manifest.json); refusing to write into it"
    )
    assert sorted(p.name for p in out.iterdir()) == ["important.txt"]


def test_unwritable_output_is_one_line(capsys, tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    code = cli.main(["data", "example", "--out", str(tmp_path / "dir.jsonl"), "--conversations", "3"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_failed_build_removes_the_directories_it_made(capsys, tmp_path):
    bad = jsonl(tmp_path / "bad.jsonl", GOOD, {"id": "b", "messages": [{"role": "user", "content": "q"}]})
    code, _, err = run(capsys, "--input", bad, "--out", tmp_path / "new" / "deeper" / "out")
    assert code == 2 and f"{bad} line 2: messages[0].role: conversation ends with a user turn" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_published_build_has_the_usual_modes(capsys, tmp_path):
    good = jsonl(tmp_path / "good.jsonl", GOOD, dict(GOOD, id="g2"))
    umask = os.umask(0o022)
    try:
        code, _, err = run(capsys, "--input", good, "--out", tmp_path / "out", "--row-tokens", 8)
    finally:
        os.umask(umask)
    assert code == 0, err
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()} == {
        "rows.parquet": 0o644,
        "manifest.json": 0o644,
    }


def test_failed_build_leaves_an_earlier_build_intact(capsys, tmp_path):
    good = jsonl(tmp_path / "good.jsonl", *[dict(GOOD, id=f"g{i}") for i in range(4)])
    out = tmp_path / "out"
    code, _, err = run(capsys, "--input", good, "--out", out, "--row-tokens", 8)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = jsonl(tmp_path / "bad.jsonl", {"id": "b"})
    code, _, err = run(capsys, "--input", good, bad, "--out", out, "--row-tokens", 8)
    assert code == 2 and f"{bad} line 1: messages: missing" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_skip_options_are_off_by_default_and_counted(capsys, tmp_path):
    rows = [dict(GOOD, id=f"g{i}") for i in range(6)]
    src = jsonl(
        tmp_path / "a.jsonl",
        rows[0],
        {"id": "x"},
        rows[1],
        {"id": "y", "messages": [{"role": "bot", "content": "?"}]},
        *rows[2:],
    )
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    code, _, err = run(capsys, "--input", src, "--out", tmp_path / "o1", "--row-tokens", 8, "--skip-bad-rows")
    assert code == 0, err
    manifest = json.loads((tmp_path / "o1" / "manifest.json").read_text())
    assert manifest["skipped"]["bad_rows"] == 2 and manifest["conversations"] == {
        "inputs": 8,
        "packed": 6,
        "bad_skipped": 2,
    }
    assert manifest["skipped"]["skip_bad_rows"] is True and manifest["skipped"]["skip_bad_files"] is False
    assert manifest["skipped"]["reasons"] == [
        "a.jsonl line 2: messages: missing; expected a list of {role, content} objects",
        "a.jsonl line 4: messages[0].role: unknown role 'bot' "
        "(expected system, developer, user, tool, assistant or latest_reminder)",
    ]
    # an empty file still stops a build with --skip-bad-rows only; --skip-bad-files skips and records it
    assert_refused(capsys, tmp_path, [src, empty], f"{empty}: empty file", ["--skip-bad-rows"])
    code, out, err = run(
        capsys,
        "--input",
        src,
        empty,
        "--out",
        tmp_path / "o2",
        "--row-tokens",
        8,
        "--skip-bad-rows",
        "--skip-bad-files",
        "--json",
    )
    assert code == 0, err
    manifest = json.loads(out)["manifest"]
    assert manifest["skipped"]["bad_files"] == 1
    assert [(i["name"], i["skipped"]) for i in manifest["inputs"] if "skipped" in i] == [
        ("empty.parquet", "empty.parquet: empty file (0 bytes); expected conversations in the Tulu 3 schema")
    ]
    assert (tmp_path / "o2" / "rows.parquet").read_bytes() == (tmp_path / "o1" / "rows.parquet").read_bytes()


def test_command_line_prints_one_line_without_traceback(tmp_path):
    src = jsonl(tmp_path / "a.jsonl", {"id": "x", "messages": "not a list"})
    proc = helpers.run_trainer("data", "build", "--input", src, "--out", tmp_path / "out", timeout=120)
    assert proc.returncode == 2
    assert (
        proc.stderr.splitlines()[-1]
        == f"trainer data: error: {src} line 1: messages: expected a list of {{role, content}} objects, got str"
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def verify(capsys, *args):
    code = cli.main(["data", "verify", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refused_verify(capsys, expected, *args):
    code, out, err = verify(capsys, *args)
    assert (code, out) == (2, "") and err.startswith("trainer data: error: ") and err.count("\n") == 1, err
    assert expected in err, err
    return err


def test_rederive_refuses_missing_or_changed_inputs_and_old_manifests(capsys, tmp_path):
    src = tmp_path / "c.jsonl"
    synthetic.write(src, 3, seed=4)
    out = tmp_path / "rows"
    assert cli.main(["data", "build", "--input", str(src), "--out", str(out), "--row-tokens", "256", "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)["manifest"]
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    assert verify(capsys, out, "--rederive", 4, "--input", src)[0] == 0
    # no inputs named: the line lists what the manifest records
    refused_verify(
        capsys,
        f"--rederive 4: give the build's inputs with --input FILE ... (the manifest names them by file name "
        f"and sha256 only: c.jsonl (sha256 {sha[:12]}…))",
        out,
        "--rederive",
        4,
    )
    # missing: the files given hold other bytes under other names
    other = tmp_path / "other.jsonl"
    synthetic.write(other, 3, seed=5)
    refused_verify(
        capsys,
        f"input c.jsonl (sha256 {sha}): missing, no --input file has its bytes; cannot re-derive",
        out,
        "--rederive",
        4,
        "--input",
        other,
    )
    refused_verify(
        capsys,
        f"--input {tmp_path / 'gone.jsonl'}: no such file",
        out,
        "--rederive",
        4,
        "--input",
        tmp_path / "gone.jsonl",
    )
    # changed: the file of that name now has other bytes
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    synthetic.write(moved / "c.jsonl", 4, seed=4)
    changed = hashlib.sha256((moved / "c.jsonl").read_bytes()).hexdigest()
    refused_verify(
        capsys,
        f"input c.jsonl: {moved / 'c.jsonl'} has sha256 {changed}, the build read sha256 {sha} "
        "(changed since the build)",
        out,
        "--rederive",
        4,
        "--input",
        moved / "c.jsonl",
    )
    # the same bytes under another name are the build's input (matched by sha256)
    (moved / "renamed.jsonl").write_bytes(src.read_bytes())
    assert verify(capsys, out, "--rederive", 4, "--input", moved / "renamed.jsonl", moved / "c.jsonl")[0] == 0
    # another tokenizer
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(json.dumps(json.loads(shipped_tokenizer_path().read_text()), indent=1))
    digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    refused_verify(
        capsys,
        f"tokenizer {tokenizer}: sha256 {digest}, the build used sha256 {manifest['tokenizer_sha256']}; "
        "pass --tokenizer PATH of that file to re-derive",
        out,
        "--rederive",
        4,
        "--input",
        src,
        "--tokenizer",
        tokenizer,
    )
    refused_verify(
        capsys, "--rederive 0: expected a positive number of rows to re-derive", out, "--rederive", 0, "--input", src
    )
    refused_verify(capsys, "--input and --tokenizer are for --rederive N", out, "--input", src)
    # a manifest from before row_anchors: still verifies, cannot be re-derived, and says so in one line
    old = json.loads((out / "manifest.json").read_text())
    del old["row_anchors"]
    (out / "manifest.json").write_text(json.dumps(old, indent=2))
    code, text, _ = verify(capsys, out)
    assert code == 0 and f"rows_sha256 {manifest['rows_sha256']}" in text
    refused_verify(
        capsys,
        f"{out / 'manifest.json'}: records no row_anchors (a build from before verify --rederive existed), so its "
        "rows cannot be re-derived; plain verify still checks its hashes",
        out,
        "--rederive",
        4,
        "--input",
        src,
    )
    old["row_anchors"] = {"every_rows": 16, "starts": [[0]]}
    (out / "manifest.json").write_text(json.dumps(old, indent=2))
    refused_verify(
        capsys,
        "manifest.json: cannot re-derive from this manifest (ValueError: row_anchors: expected every_rows >= 1 and "
        f"{-(-manifest['rows'] // 16)} [position, offset] pairs)",
        out,
        "--rederive",
        4,
        "--input",
        src,
    )


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
