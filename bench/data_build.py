"""Benchmark: `trainer data build` throughput (tokens/s) against raw `tokenizers` batch encoding of the same text.

The bench generates a synthetic Tulu-3-schema corpus (``trainer.data.synthetic``, parquet, at least
``--min-tokens`` DeepSeek-V4 tokens), renders every conversation once (untimed) for the baseline, then
alternates, ``--repeats`` times each:

- baseline: ``Tokenizer.encode_batch_fast`` over the rendered texts in batches of the builder's size, ids
  taken out of every encoding (``len(encoding.ids)``): tokenization alone, on all cores;
- builder: ``trainer.data.build.build`` end to end from the parquet file: read and hash the input, permute,
  render, tokenize, mask, pack, write ``rows.parquet`` (zstd) and the manifest.

Both count the same tokens (checked). Goal: builder >= 0.8 x baseline tokens/s. Reported: the
wall-clock ratio (baseline time / builder time; the goal's figure) and the CPU-time ratio (process CPU
seconds, all threads), which other load on a shared machine disturbs less, and the 1-minute load average.

Usage: python bench/data_build.py [--min-tokens N] [--repeats N] [--json]
Prints a Markdown row for bench/RESULTS.md, or JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).absolute().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.data import build as builder  # noqa: E402
from trainer.data import chat, synthetic  # noqa: E402

TOKENS_PER_CONVERSATION = 2500  # about, for the generator's defaults (measured: 5.05 M tokens / 2,000)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-tokens", type=int, default=20_000_000, help="corpus size floor in tokens (default 20 M)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, interleaved (default 3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a Markdown row")
    args = parser.parse_args()

    tokenizer, special, _ = builder.load_tokenizer()
    count = int(args.min_tokens / TOKENS_PER_CONVERSATION * 1.05) + 1
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.parquet"
        synthetic.write(corpus, count, seed=1)
        texts = [chat.render(row["messages"]).text for row in synthetic.conversations(count, seed=1)]
        size = builder.BATCH_CONVERSATIONS

        def raw() -> int:
            tokens = 0
            for lo in range(0, len(texts), size):
                for encoding in tokenizer.encode_batch_fast(texts[lo : lo + size], add_special_tokens=False):
                    tokens += len(encoding.ids)
            return tokens

        base_s, build_s, base_cpu, build_cpu = [], [], [], []
        raw_tokens = built_tokens = 0
        manifest = {}
        for i in range(args.repeats):
            start, cpu = time.perf_counter(), time.process_time()
            raw_tokens = raw()
            base_s.append(time.perf_counter() - start)
            base_cpu.append(time.process_time() - cpu)
            start, cpu = time.perf_counter(), time.process_time()
            manifest = builder.build([str(corpus)], Path(tmp) / f"rows{i}", builder.BuildConfig())
            build_s.append(time.perf_counter() - start)
            build_cpu.append(time.process_time() - cpu)
            built_tokens = manifest["tokens_encoded"]
        if raw_tokens != built_tokens:
            raise SystemExit(
                f"bench: the builder encoded {built_tokens} tokens, raw encoding {raw_tokens}: not the same text"
            )
        if raw_tokens < args.min_tokens:
            raise SystemExit(
                f"bench: corpus has {raw_tokens} tokens < --min-tokens {args.min_tokens}; "
                "raise TOKENS_PER_CONVERSATION margin"
            )
    base, built = statistics.median(base_s), statistics.median(build_s)
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "conversations": count,
        "tokens": raw_tokens,
        "rows": manifest["rows"],
        "repeats": args.repeats,
        "raw_median_s": round(base, 2),
        "build_median_s": round(built, 2),
        "raw_tokens_per_s": round(raw_tokens / base),
        "build_tokens_per_s": round(raw_tokens / built),
        "ratio": round(base / built, 3),
        "raw_cpu_median_s": round(statistics.median(base_cpu), 2),
        "build_cpu_median_s": round(statistics.median(build_cpu), 2),
        "cpu_ratio": round(statistics.median(base_cpu) / statistics.median(build_cpu), 3),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"| {result['date']} | {result['machine']} | `python bench/data_build.py --repeats {args.repeats}` | "
            f"{result['tokens']:,} tokens, {count:,} conversations, {result['rows']:,} rows | "
            f"{result['raw_tokens_per_s']:,} tok/s ({result['raw_median_s']} s) | "
            f"{result['build_tokens_per_s']:,} tok/s ({result['build_median_s']} s) | {result['ratio']} | "
            f"{result['cpu_ratio']} | {result['load_average_1min']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
