"""Packing, manifest, determinism and the rows loader of `trainer data build`, on generated and hand-made inputs."""

import hashlib
import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

import helpers
from trainer.data import Rows, chat, synthetic
from trainer.data.build import (
    BuildConfig,
    RowWriter,
    build,
    default_config,
    load_tokenizer,
    sample_rows,
    shipped_tokenizer_path,
)
from trainer.errors import UserError

REQUIRED_KEYS = {
    "rows",
    "row_tokens",
    "padding_tokens",
    "supervised_token_ratio",
    "seed",
    "tokenizer_sha256",
    "rows_sha256",
    "parquet_sha256",
    "parquet_bytes",
    "inputs",
}


@pytest.fixture(scope="module")
def tok():
    tokenizer, special, _ = load_tokenizer()
    return tokenizer, special


def conv(cid, *turns, system=None):
    messages = [{"role": "system", "content": system}] if system is not None else []
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"id": cid, "messages": messages, "source": "test"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def read_rows(out):
    table = pq.read_table(out / "rows.parquet")
    return (
        [np.array(x, dtype=np.int64) for x in table.column("tokens").to_pylist()],
        [np.array(x, dtype=np.int64) for x in table.column("loss_mask").to_pylist()],
        table.column("source_ids").to_pylist(),
    )


def reference_rows(tok, files, seed, row_tokens):
    """The packing rule of trainer/data/build.py written out plainly: (rows, masks, sources, skipped)."""
    tokenizer, special = tok
    keyed = []
    for path in files:
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        for row, line in enumerate(text for text in path.read_text(encoding="utf-8").splitlines() if text.strip()):
            keyed.append((hashlib.sha256(f"{seed}:{sha}:{row}".encode()).digest(), json.loads(line)))
    keyed.sort(key=lambda kv: kv[0])
    stream, mask, owner = [], [], []
    for n, (_, item) in enumerate(keyed):
        if n:
            stream.append(special.eos), mask.append(0), owner.append(None)
        ids, m, _ = chat.encode(tokenizer, special, [chat.render(item["messages"])])
        stream += ids.tolist()
        mask += m.tolist()
        owner += [item["id"]] * len(ids)
    rows, masks, sources, skipped = [], [], [], 0
    for lo in range(0, len(stream) - row_tokens + 1, row_tokens):
        r_mask = mask[lo : lo + row_tokens]
        if sum(r_mask[1:]) == 0:
            skipped += 1
            continue
        rows.append(stream[lo : lo + row_tokens])
        masks.append(r_mask)
        sources.append(list(dict.fromkeys(o for o in owner[lo : lo + row_tokens] if o is not None)))
    return rows, masks, sources, skipped


def test_packing_matches_the_written_out_rule(tmp_path, tok):
    a = tmp_path / "a.jsonl"
    synthetic.write(a, 6, seed=3)
    b = write_jsonl(
        tmp_path / "b.jsonl",
        [
            conv("short-1", "Hi?", "Hello."),
            conv("sys-1", "Translate: chat", "le chat", system="You translate."),
            conv("multi-1", "1?", "one", "2?", "two", "3?", "three"),
            conv("empty-1", "Be silent.", ""),
            conv("uni-1", "日本語で？", "はい、日本語です 🙂"),
        ],
    )
    manifest = build([str(a), str(b)], tmp_path / "out", BuildConfig(row_tokens=256, seed=7))
    rows, masks, sources = read_rows(tmp_path / "out")
    want_rows, want_masks, want_sources, skipped = reference_rows(tok, [a, b], 7, 256)
    assert len(rows) == len(want_rows) == manifest["rows"] > 10
    assert [r.tolist() for r in rows] == want_rows
    assert [m.tolist() for m in masks] == want_masks
    assert sources == want_sources
    assert manifest["skipped"]["unsupervised_rows"] == skipped
    assert manifest["conversations"] == {"inputs": 11, "packed": 11, "bad_skipped": 0}
    assert (
        manifest["tokens_encoded"] + manifest["separator_tokens"]
        == (len(rows) + skipped) * 256 + manifest["tail_tokens_dropped"]
    )
    assert manifest["separator_tokens"] == 10


def test_conversation_longer_than_a_row_continues_with_its_mask(tmp_path, tok):
    tokenizer, special = tok
    answer = " ".join(f"word{i}" for i in range(60))
    src = write_jsonl(tmp_path / "one.jsonl", [conv("long", "Count.", answer)])
    manifest = build([str(src)], tmp_path / "out", BuildConfig(row_tokens=16))
    rows, masks, sources = read_rows(tmp_path / "out")
    ids, mask, _ = chat.encode(tokenizer, special, [chat.render(conv("long", "Count.", answer)["messages"])])
    full = len(ids) // 16
    assert manifest["rows"] == full and len(ids) > 3 * 16
    # consecutive cuts: row k is stream[16k:16k+16], its mask the conversation's mask there
    assert np.concatenate(rows).tolist() == ids[: full * 16].tolist()
    assert np.concatenate(masks).tolist() == mask[: full * 16].tolist()
    assert masks[1][0] == 1 and masks[1].all()  # row 1 starts inside the answer: supervised from token 0 on
    assert all(s == ["long"] for s in sources)
    assert manifest["tail_tokens_dropped"] == len(ids) - full * 16 and manifest["padding_tokens"] == 0


def without_eos(cid, *turns, system=None):
    row = conv(cid, *turns, system=system)
    row["messages"][-1]["wo_eos"] = True
    return row


def test_wo_eos_conversation_leaves_the_next_prompt_unsupervised(tmp_path, tok):
    # issue 26 point 1: after a conversation ending without EOS, the next one in the same tokenizer batch had its
    # BOS, system, <｜User｜>, user text and <｜Assistant｜> set to 1
    # (3,206 prompt tokens in a 2,128-conversation build)
    tokenizer, special = tok
    rows_in = []
    for i in range(12):
        rows_in.append(
            without_eos(f"open-{i}", f"Continue {i}:", "and then" + " more" * i)
            if i % 3 == 0
            else conv(
                f"plain-{i}", f"Question {i}?", "Answer" + " yes" * i, system="You are concise." if i % 2 else None
            )
        )
    src = write_jsonl(tmp_path / "w.jsonl", rows_in)
    for loss_mask in chat.LOSS_MASKS:
        manifest = build([str(src)], tmp_path / loss_mask, BuildConfig(row_tokens=16, loss_mask=loss_mask))
        rows, masks, _ = read_rows(tmp_path / loss_mask)
        assert manifest["rows"] == len(rows) > 10
        stream, mask = np.concatenate(rows), np.concatenate(masks)
        # every BOS (a conversation's first token) and the run up to its first <｜Assistant｜> is prompt: mask 0
        checked = 0
        for at in np.flatnonzero(stream == special.bos).tolist():
            after = np.flatnonzero(stream[at:] == special.assistant)
            if after.size:
                assert mask[at : at + int(after[0]) + 1].tolist() == [0] * (int(after[0]) + 1), (loss_mask, at)
                checked += 1
        assert checked >= 8
    # and the rows are the one-by-one rule's (reference_rows encodes each conversation alone)
    want_rows, want_masks, _, _ = reference_rows(tok, [src], 42, 16)
    rows, masks, _ = read_rows(tmp_path / "deepseek_v4")
    assert [r.tolist() for r in rows] == want_rows and [m.tolist() for m in masks] == want_masks


def test_rows_without_targets_are_skipped(tmp_path, tok):
    tokenizer, special = tok
    first = conv("first", "Q", "A")
    ids, _, _ = chat.encode(tokenizer, special, [chat.render(first["messages"])])
    width = len(ids) - 1  # row 1 starts at first's final EOS: its only mask-1 token is token 0
    second = conv("second", " ".join(["prompt"] * 4 * width), "ok")
    src = write_jsonl(tmp_path / "two.jsonl", [first, second])
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    key = lambda seed, row: hashlib.sha256(f"{seed}:{sha}:{row}".encode()).digest()  # noqa: E731
    seed = next(s for s in range(100) if key(s, 0) < key(s, 1))  # a seed that packs `first` first
    manifest = build([str(src)], tmp_path / "out", BuildConfig(row_tokens=width, seed=seed))
    rows, masks, sources = read_rows(tmp_path / "out")
    assert manifest["skipped"]["unsupervised_rows"] >= 4  # row 1 (EOS at token 0) and the prompt-only rows
    assert rows[0].tolist() == ids[:width].tolist() and sources[0] == ["first"]
    for mask in masks:
        assert mask[1:].sum() > 0
    assert len(rows) == manifest["rows"] >= 1
    assert all(sources[k] == ["second"] for k in range(1, len(rows)))  # later kept rows hold second's answer


def test_manifest_fields_and_hash_definitions(tmp_path):
    src = tmp_path / "corpus.parquet"
    synthetic.write(src, 8, seed=11)
    manifest = build([str(src)], tmp_path / "out", BuildConfig(row_tokens=512))
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert on_disk == manifest and REQUIRED_KEYS <= set(manifest)
    rows, masks, _ = read_rows(tmp_path / "out")
    digest = hashlib.sha256()
    for r, m in zip(rows, masks, strict=True):
        digest.update(r.astype("<i4").tobytes() + m.astype(np.uint8).tobytes())
    data = (tmp_path / "out" / "rows.parquet").read_bytes()
    assert manifest["rows_sha256"] == digest.hexdigest()
    assert (manifest["parquet_sha256"], manifest["parquet_bytes"]) == (hashlib.sha256(data).hexdigest(), len(data))
    assert manifest["inputs"] == [
        {
            "name": "corpus.parquet",
            "sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
            "bytes": src.stat().st_size,
            "format": "parquet",
            "conversations": 8,
        }
    ]
    supervised = sum(int(m[1:].sum()) for m in masks)
    assert manifest["supervised_tokens"] == supervised
    assert manifest["supervised_token_ratio"] == round(supervised / (len(rows) * 512), 6)
    assert 0.5 < manifest["supervised_token_ratio"] < 0.95
    assert manifest["tokenizer_sha256"] == hashlib.sha256(shipped_tokenizer_path().read_bytes()).hexdigest()
    assert (manifest["seed"], manifest["row_tokens"], manifest["padding_tokens"], manifest["loss_mask"]) == (
        42,
        512,
        0,
        "deepseek_v4",
    )
    assert all(len(r) == 512 for r in rows)


def test_same_bytes_from_other_dirs_orders_and_processes(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two" / "deeper"
    one.mkdir()
    two.mkdir(parents=True)
    synthetic.write(one / "a.parquet", 5, seed=1)
    synthetic.write(one / "b.jsonl", 5, seed=2)
    write_jsonl(one / "c.jsonl", [conv("c1", "x?", "y"), conv("c2", "u?", "v")])
    for name in ("a.parquet", "b.jsonl", "c.jsonl"):
        shutil.copy(one / name, two / name)
    config = default_config()[0]  # what the CLI starts from: conf/train.yaml's data option
    config.row_tokens = 300
    first = build([str(one / "a.parquet"), str(one / "b.jsonl"), str(one / "c.jsonl")], tmp_path / "out1", config)
    proc = helpers.run_trainer(
        "data",
        "build",
        "--input",
        "c.jsonl",
        "*.parquet",
        "b.jsonl",
        "--out",
        tmp_path / "out2",
        "--row-tokens",
        "300",
        "--json",
        cwd=two,
        timeout=120,
        env={"PYTHONHASHSEED": "12345", "TZ": "Asia/Tokyo", "COLUMNS": "100"},
    )
    assert proc.returncode == 0, proc.stderr
    second = json.loads(proc.stdout)["manifest"]
    assert first == second
    for name in ("rows.parquet", "manifest.json"):
        assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes()
    config.batch_conversations = 2  # batching is not part of the result
    build([str(two / "*.*")], tmp_path / "out3", config)
    for name in ("rows.parquet", "manifest.json"):
        assert (tmp_path / "out3" / name).read_bytes() == (tmp_path / "out1" / name).read_bytes()
    third = build(
        [str(two / "*")], tmp_path / "out1", BuildConfig(row_tokens=300, seed=43)
    )  # rebuild in place, other seed
    assert third["rows_sha256"] != first["rows_sha256"] and third["tokens_encoded"] == first["tokens_encoded"]
    assert sorted(p.name for p in (tmp_path / "out1").iterdir()) == ["manifest.json", "rows.parquet"]


def test_loss_mask_convention_and_encoding_are_named_in_the_manifest(tmp_path, tok):
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    agent = {
        "id": "agent",
        "source": "test",
        "messages": [
            {"role": "system", "content": "S", "tools": tools},
            {"role": "user", "content": "Time?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "ask the tool",
                "tool_calls": [{"id": "t", "function": {"name": "now", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "t", "content": "noon"},
            {"role": "assistant", "content": "Noon.", "reasoning_content": "done"},
        ],
    }
    thinker = {
        "id": "thinker",
        "source": "test",
        "messages": [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2", "reasoning_content": "dropped by the format"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "easy"},
        ],
    }
    src = write_jsonl(tmp_path / "a.jsonl", [conv("plain", "Hi?", "Hello.")] * 20 + [agent, thinker] * 10)
    v4 = build([str(src)], tmp_path / "v4", BuildConfig(row_tokens=64))
    official = build([str(src)], tmp_path / "official", BuildConfig(row_tokens=64, loss_mask="deepseek_v4_official"))
    assert (v4["loss_mask"], official["loss_mask"]) == ("deepseek_v4", "deepseek_v4_official")
    assert "mode token" in v4["loss_mask_definition"] and "prompt/response split" in official["loss_mask_definition"]
    assert v4["chat_encoding"] == {
        "format": chat.FORMAT_SOURCE,
        "thinking_mode": "auto",
        "drop_thinking": True,
        "reasoning_effort": None,
    }
    dropped = v4["dropped_by_drop_thinking"]
    assert (dropped["reasoning_content"], dropped["developer_messages"]) == (
        10,
        0,
    )  # thinker's first reasoning, ten times
    # same tokens, fewer targets: the official split leaves one opener token per assistant turn in the prompt
    rows_v4, masks_v4, _ = read_rows(tmp_path / "v4")
    rows_off, masks_off, _ = read_rows(tmp_path / "official")
    assert [r.tolist() for r in rows_v4] == [r.tolist() for r in rows_off] and v4["rows_sha256"] != official[
        "rows_sha256"
    ]
    assert v4["tokens_encoded"] == official["tokens_encoded"]
    tokenizer, special = tok
    stream = np.concatenate(rows_v4)
    diff = np.concatenate(masks_v4) - np.concatenate(masks_off)
    assert set(diff.tolist()) == {0, 1}
    assert set(stream[diff == 1].tolist()) == {special.think_start, special.think_end}  # exactly the openers
    assert (np.roll(stream, 1)[diff == 1] == special.assistant).all()
    with pytest.raises(UserError, match="loss_mask 'other': unknown"):
        build([str(src)], tmp_path / "x", BuildConfig(row_tokens=64, loss_mask="other"))


def test_max_rows_is_a_prefix_and_too_many_is_refused(tmp_path):
    src = tmp_path / "c.jsonl"
    synthetic.write(src, 4, seed=5)
    full = build([str(src)], tmp_path / "all", BuildConfig(row_tokens=256))
    part = build([str(src)], tmp_path / "part", BuildConfig(row_tokens=256, max_rows=3))
    assert part["rows"] == 3 and part["max_rows"] == 3
    assert [r.tolist() for r in read_rows(tmp_path / "part")[0]] == [
        r.tolist() for r in read_rows(tmp_path / "all")[0][:3]
    ]
    with pytest.raises(UserError, match=f"inputs give only {full['rows']} rows of 256 tokens; --rows asks for 1,000"):
        build([str(src)], tmp_path / "more", BuildConfig(row_tokens=256, max_rows=1000))
    assert not (tmp_path / "more").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all", "c.jsonl", "part"]


def test_worked_example_of_the_chat_docstring_through_build_and_loader(tmp_path):
    src = write_jsonl(tmp_path / "one.jsonl", [conv("ex", "First?", "One.", system="You are concise.")])
    manifest = build([str(src)], tmp_path / "out", BuildConfig(row_tokens=13))
    assert (manifest["rows"], manifest["tail_tokens_dropped"], manifest["supervised_tokens"]) == (1, 0, 4)
    (batch,) = list(Rows(tmp_path / "out").batches(micro_batch_size=1))
    assert batch.tokens.tolist() == [[0, 3476, 477, 47468, 16, 128803, 10318, 33, 128804, 128822, 6111, 16, 1]]
    assert batch.labels.tolist() == [[3476, 477, 47468, 16, 128803, 10318, 33, 128804, 128822, 6111, 16, 1, -100]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0]]
    assert batch.position_ids.tolist() == [list(range(13))]


def test_loader_batches_shards_and_verifies(tmp_path):
    src = tmp_path / "c.jsonl"
    synthetic.write(src, 6, seed=9)
    manifest = build([str(src)], tmp_path / "out", BuildConfig(row_tokens=128))
    rows, masks, _ = read_rows(tmp_path / "out")
    data = Rows(tmp_path / "out")
    assert len(data) == manifest["rows"] == len(rows) >= 40
    seen = []
    for rank in range(4):
        batches = list(data.batches(micro_batch_size=2, dp_rank=rank, dp_size=4))
        assert len(batches) == len(rows) // 8 == data.num_batches(2, 4)
        for step, b in enumerate(batches):
            assert b.tokens.shape == b.labels.shape == b.loss_mask.shape == b.position_ids.shape == (2, 128)
            assert b.tokens.dtype == b.labels.dtype == b.loss_mask.dtype == b.position_ids.dtype == np.int64
            assert b.row_index.tolist() == [step * 8 + rank * 2, step * 8 + rank * 2 + 1]
            for j, r in enumerate(b.row_index):
                assert b.tokens[j].tolist() == rows[r].tolist()
                assert b.labels[j, :-1].tolist() == rows[r][1:].tolist() and b.labels[j, -1] == -100
                assert b.loss_mask[j, :-1].tolist() == masks[r][1:].tolist() and b.loss_mask[j, -1] == 0
                assert b.position_ids[j].tolist() == list(range(128))
            seen += b.row_index.tolist()
    assert sorted(seen) == list(range(len(rows) // 8 * 8))  # ranks partition the rows, none twice
    again = [b.row_index.tolist() for b in Rows(tmp_path / "out").batches(2, 1, 4, epoch=1)]
    assert again == [b.row_index.tolist() for b in data.batches(2, 1, 4, epoch=1)]
    assert again != [b.row_index.tolist() for b in data.batches(2, 1, 4)]
    assert [b.row_index.tolist() for b in data.batches(2, 1, 4, start=2)] == [
        b.row_index.tolist() for b in data.batches(2, 1, 4)
    ][2:]
    with pytest.raises(UserError, match="dp_rank 4: expected 0 <= dp_rank < dp_size 4"):
        next(data.batches(2, 4, 4))
    path = tmp_path / "out" / "rows.parquet"
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(UserError, match="rows.parquet: .* bytes, sha256 .*; the manifest says"):
        Rows(tmp_path / "out")


def test_command_line_summary_and_json(tmp_path, capsys, monkeypatch):
    from trainer import cli

    monkeypatch.setenv("COLUMNS", "200")  # rich's console width: one table line per row
    src = tmp_path / "c.jsonl"
    synthetic.write(src, 3, seed=4)
    assert (
        cli.main(
            ["data", "build", "--input", str(src), "--out", str(tmp_path / "a"), "--row-tokens", "512", "--seed", "9"]
        )
        == 0
    )
    table = capsys.readouterr().out
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert f"{manifest['rows']:,} x 512 tokens = {manifest['rows'] * 512:,} (padding 0)" in table
    assert "tokens/s" in table
    assert (
        f"│ {manifest['rows_sha256']} " in table
        and f"│ {manifest['parquet_sha256']} · {manifest['parquet_bytes']:,} bytes" in table
    )
    assert f"{manifest['supervised_token_ratio']:.4f}" in table and "0 bad conversations" in table
    assert (
        cli.main(
            [
                "data",
                "build",
                "--input",
                str(src),
                "--out",
                str(tmp_path / "b"),
                "--row-tokens",
                "512",
                "--seed",
                "9",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["manifest"] == manifest and result["manifest"]["seed"] == 9 and result["tokens_per_second"] > 0
    assert result["matches_config"] == {
        "data": "dsv4-tulu3-fixed8192-v1",
        "rows": False,
        "rows_sha256": False,
        "parquet_sha256": False,
    }
    assert cli.main(["data", "verify", str(tmp_path / "b")]) == 0
    assert f"{manifest['rows']:,} rows x 512 tokens, rows_sha256 {manifest['rows_sha256']}" in capsys.readouterr().out
    (tmp_path / "b" / "manifest.json").unlink()
    assert cli.main(["data", "verify", str(tmp_path / "b")]) == 1
    assert "manifest.json: no such file" in capsys.readouterr().err
    # the encoding and mask flags reach the manifest
    thinker = {
        "id": "t",
        "source": "test",
        "messages": [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2", "reasoning_content": "one and one"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "easy"},
        ],
    }
    write_jsonl(src, [thinker] * 40)
    args = ["data", "build", "--input", str(src), "--row-tokens", "64", "--json"]
    assert cli.main([*args, "--out", str(tmp_path / "c")]) == 0
    default = json.loads(capsys.readouterr().out)["manifest"]
    assert (
        cli.main(
            [
                *args,
                "--out",
                str(tmp_path / "d"),
                "--loss-mask",
                "deepseek_v4_official",
                "--keep-reasoning",
                "--reasoning-effort",
                "max",
            ]
        )
        == 0
    )
    chosen = json.loads(capsys.readouterr().out)["manifest"]
    assert (default["loss_mask"], chosen["loss_mask"]) == ("deepseek_v4", "deepseek_v4_official")
    assert (
        default["chat_encoding"]["drop_thinking"] is True
        and default["dropped_by_drop_thinking"]["reasoning_content"] == 40
    )
    assert chosen["chat_encoding"] == {
        "format": chat.FORMAT_SOURCE,
        "thinking_mode": "auto",
        "drop_thinking": False,
        "reasoning_effort": "max",
    }
    assert (
        chosen["dropped_by_drop_thinking"]["reasoning_content"] == 0
        and chosen["tokens_encoded"] > default["tokens_encoded"]
    )
    assert (
        cli.main([*args, "--out", str(tmp_path / "e"), "--thinking-mode", "chat"]) == 2
    )  # chat mode cannot show the reasoning
    assert "messages[1].reasoning_content: chat mode renders no reasoning" in capsys.readouterr().err


def forge(out, row, position):
    """Flip loss_mask[row][position] in out/rows.parquet, then rewrite the parquet and the manifest's hashes so that
    they agree (a forger who rehashes); return the value stored after the flip."""
    rows, masks, sources = read_rows(out)
    masks[row][position] ^= 1
    writer = RowWriter(out / "rows.parquet", len(rows[0]))
    for r, m, ids in zip(rows, masks, sources, strict=True):
        writer.add(r.astype(np.int32), m.astype(np.uint8), ids)
    rows_sha256 = writer.close()
    data = (out / "rows.parquet").read_bytes()
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.update(rows_sha256=rows_sha256, parquet_sha256=hashlib.sha256(data).hexdigest(), parquet_bytes=len(data))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    return int(masks[row][position])


def verify(capsys, *args):
    from trainer import cli

    code = cli.main(["data", "verify", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def rederive_corpus(tmp_path):
    """Inputs with what re-derivation must reproduce: wo_eos endings, a bad row (skipped), a prompt long enough for
    rows without targets, conversations longer than a row."""
    a = tmp_path / "a.jsonl"
    synthetic.write(a, 6, seed=3)
    b = write_jsonl(
        tmp_path / "b.jsonl",
        [
            without_eos("open-1", "Continue:", "and then"),
            conv("sys-1", "Hi?", "Hello.", system="You are concise."),
            {"id": "bad-1", "messages": [{"role": "user", "content": "q"}], "source": "t"},
            conv("long-prompt", " ".join(["prompt"] * 400), "ok"),
            without_eos("open-2", "More:", "yes " * 30),
            conv("multi", "1?", "one", "2?", "two"),
        ],
    )
    return [a, b]


def test_verify_rederive_reproduces_rows_and_catches_a_rehashed_forgery(tmp_path, capsys, monkeypatch):
    from trainer.data import build as builder

    inputs = rederive_corpus(tmp_path)
    out = tmp_path / "rows"
    manifest = build([str(p) for p in inputs], out, BuildConfig(row_tokens=64, skip_bad_rows=True))
    rows = manifest["rows"]
    assert rows > 60 and manifest["skipped"]["unsupervised_rows"] >= 3 and manifest["skipped"]["bad_rows"] == 1
    anchors = manifest["row_anchors"]
    assert anchors["every_rows"] == 16 and len(anchors["starts"]) == -(-rows // 16)
    assert anchors["starts"] == sorted(anchors["starts"]) and all(o >= -1 for _, o in anchors["starts"])
    code, text, err = verify(capsys, out, "--rederive", rows, "--input", *inputs)
    assert (code, err) == (0, "")
    assert text == (
        f"{out}: ok, {rows} rows x 64 tokens, rows_sha256 {manifest['rows_sha256']}; "
        f"{rows} sampled rows re-derived from the inputs: tokens and loss_mask match\n"
    )

    # a forger flips one mask bit and rehashes: plain verify passes, re-derivation names the row and position
    token = int(read_rows(out)[0][21][5])
    now = forge(out, 21, 5)
    assert verify(capsys, out)[0] == 0
    code, text, err = verify(capsys, out, "--rederive", rows, "--input", *inputs)
    assert (code, text) == (1, "")
    assert err == (
        f"trainer data verify: {out}: row 21: first difference at position 5: stored token {token} mask {now}, "
        f"re-derived token {token} mask {1 - now} (1 of 64 positions differ); 1 of {rows} re-derived rows differ "
        "(the hashes match: the rows were rewritten with consistent hashes, or built by other code)\n"
    )
    code, text, _ = verify(capsys, out, "--rederive", rows, "--input", *inputs, "--json")
    result = json.loads(text)
    assert code == 1 and result["ok"] is False and result["rederived"]["mismatched"] == 1
    assert (result["rederived"]["first"]["row"], result["rederived"]["first"]["position"]) == (21, 5)
    assert result["rederived"]["first"]["stored"] == [token, now] and result["rederived"]["first"]["derived"] == [
        token,
        1 - now,
    ]
    # a sample that misses row 21 passes; the sample is a function of (rows, N, seed)
    sample = sample_rows(rows, 5, 3)
    assert (
        sample == sample_rows(rows, 5, 3) == sorted(sample)
        and len(set(sample)) == 5
        and sample != sample_rows(rows, 5, 4)
    )
    seed = next(s for s in range(50) if 21 not in sample_rows(rows, 5, s))
    assert verify(capsys, out, "--rederive", 5, "--sample-seed", seed, "--input", *inputs)[0] == 0
    assert sample_rows(3, 10) == [0, 1, 2]

    # flipping a bit without rehashing is caught by the hash check first (exit 1 either way)
    path = out / "rows.parquet"
    build([str(p) for p in inputs], out, BuildConfig(row_tokens=64, skip_bad_rows=True))
    table = pq.read_table(path)
    masks = table.column("loss_mask").to_pylist()
    masks[3][7] ^= 1
    pq.write_table(table.set_column(1, "loss_mask", pa_list(masks, table.schema.field("loss_mask").type)), path)
    for extra in ([], ["--rederive", rows, "--input", *inputs]):
        code, _, err = verify(capsys, out, *extra)
        assert code == 1 and "rows.parquet: " in err and "the manifest says" in err and err.count("\n") == 1

    # every row an anchor (rows starting deep inside a conversation longer than a row)
    monkeypatch.setattr(builder, "ANCHOR_ROWS", 1)
    dense = build([str(p) for p in inputs], tmp_path / "dense", BuildConfig(row_tokens=64, skip_bad_rows=True))
    assert dense["row_anchors"]["every_rows"] == 1 and len(dense["row_anchors"]["starts"]) == rows
    assert dense["rows_sha256"] == manifest["rows_sha256"] and max(o for _, o in dense["row_anchors"]["starts"]) > 64
    assert verify(capsys, tmp_path / "dense", "--rederive", rows, "--input", *inputs)[0] == 0
    forge(tmp_path / "dense", rows - 1, 63)
    code, _, err = verify(capsys, tmp_path / "dense", "--rederive", rows, "--input", *inputs)
    assert code == 1 and f": row {rows - 1}: first difference at position 63: " in err


def rewrite(out, rows, masks, sources, starts):
    """Write ``rows``/``masks``/``sources`` and the anchors ``starts`` into out/ with hashes and counts that agree
    (a forger who rewrites the manifest too)."""
    writer = RowWriter(out / "rows.parquet", len(rows[0]))
    for r, m, ids in zip(rows, masks, sources, strict=False):
        writer.add(np.asarray(r).astype(np.int32), np.asarray(m).astype(np.uint8), ids)
    rows_sha256 = writer.close()
    data = (out / "rows.parquet").read_bytes()
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.update(
        rows_sha256=rows_sha256,
        parquet_sha256=hashlib.sha256(data).hexdigest(),
        parquet_bytes=len(data),
        rows=len(rows),
    )
    manifest["row_anchors"]["starts"] = starts
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def test_verify_rederive_checks_the_anchors_it_starts_from(tmp_path, capsys):
    """Promise: forged anchors do not make forged rows pass: a group replaced by a copy of another with its anchor
    copied too, a group removed with its anchor, the build cut short with its anchors, and a first anchor moved, each
    rehashed consistently, fail a full re-derivation (plain verify passes them all)."""
    import shutil

    inputs = rederive_corpus(tmp_path)
    good = tmp_path / "rows"
    manifest = build([str(p) for p in inputs], good, BuildConfig(row_tokens=64, skip_bad_rows=True))
    total, starts = manifest["rows"], manifest["row_anchors"]["starts"]
    assert total >= 48
    rows, masks, sources = read_rows(good)
    rows, masks = [list(r) for r in rows], [list(m) for m in masks]
    cases = {
        "copied": (
            rows[:16] + rows[:16] + rows[32:],
            masks[:16] + masks[:16] + masks[32:],
            sources[:16] + sources[:16] + sources[32:],
            [starts[0], starts[0], *starts[2:]],
            "row 16: first difference",
        ),
        "removed": (
            rows[:16] + rows[32:],
            masks[:16] + masks[32:],
            sources[:16] + sources[32:],
            [starts[0], *starts[2:]],
            "row 16: first difference",
        ),
        "cut": (
            rows[:32],
            masks[:32],
            sources[:32],
            starts[:2],
            "row 32: the inputs give more rows than the 32 stored",
        ),
        "moved": (rows[16:], masks[16:], sources[16:], starts[1:], "row 0: first difference"),
    }
    for name, (r, m, src, st, expected) in cases.items():
        out = tmp_path / name
        shutil.copytree(good, out)
        rewrite(out, r, m, src, st)
        assert verify(capsys, out)[0] == 0, name
        code, _, err = verify(capsys, out, "--rederive", total * 2, "--input", *inputs)
        assert code == 1 and expected in err and err.count("\n") == 1, (name, err)
    assert verify(capsys, good, "--rederive", total * 2, "--input", *inputs)[0] == 0


def pa_list(values, type_):
    import pyarrow as pa

    return pa.array(values, type=type_)


def test_verify_rederive_for_the_official_mask_and_the_separator_anchor(tmp_path, capsys, monkeypatch):
    from trainer.data import build as builder

    # rows of 7 tokens over conversations of 8 or 7 tokens (+1 separator): rows start at every kind of place
    src = write_jsonl(
        tmp_path / "s.jsonl",
        [conv(f"c{i}", "Q", "A" if i % 2 else "B", system="S") for i in range(30)]
        + [without_eos(f"w{i}", "Q", "A") for i in range(10)],
    )
    monkeypatch.setattr(builder, "ANCHOR_ROWS", 1)
    manifest = build([str(src)], tmp_path / "out", BuildConfig(row_tokens=7, loss_mask="deepseek_v4_official"))
    assert {-1, 0} <= {o for _, o in manifest["row_anchors"]["starts"]}  # at a separator, at a conversation's BOS
    code, text, _ = verify(capsys, tmp_path / "out", "--rederive", manifest["rows"], "--input", src)
    assert code == 0 and text.endswith("tokens and loss_mask match\n")


def test_defaults_come_from_the_data_config():
    config, expected = default_config("dsv4-tulu3-fixed8192-v1")
    assert (config.row_tokens, config.seed, config.loss_mask, config.name) == (
        8192,
        42,
        "deepseek_v4",
        "dsv4-tulu3-fixed8192-v1",
    )
    assert config.tokenizer_sha256 == "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf"
    assert expected["rows"] == 6400 and expected["rows_sha256"].startswith("6c7dfdc9")
    with pytest.raises(UserError, match="nosuch"):
        default_config("nosuch")


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
