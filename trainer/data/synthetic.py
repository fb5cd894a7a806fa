"""Generated conversations in the Tulu 3 SFT schema, for examples, tests and the build benchmark.

Each row is ``{"id": "synthetic-{seed}-{i}", "messages": [{"role", "content"}, ...], "source": "synthetic"}``:
an optional system message (1 in 4), then 1 to 3 user/assistant turns of pseudo-words drawn from a fixed
vocabulary that includes non-ASCII words (accents, Greek, CJK, emoji). The text is meaningless; its
lengths are of the order of Tulu 3's long conversations (user turns 8-150 words, assistant turns 20-600
words; about 2,500 DeepSeek-V4 tokens per conversation on average: 2,000 conversations give 5.05 M tokens). The
output is a function of ``(conversations, seed)`` only: the same bytes on any machine for a given pyarrow version.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.publish import atomic_write

_UNICODE_WORDS = [
    "naïve",
    "café",
    "Ελληνικά",
    "日本語",
    "中文",
    "한국어",
    "über",
    "façade",
    "🙂",
    "Привет",
    "عربى",
    "ñandú",
]
_SYSTEMS = ["You are a helpful assistant.", "You are concise.", "Answer in one paragraph.", "Réponds en français."]


def _vocabulary(rng: random.Random, size: int = 6000) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 10))) for _ in range(size)]
    return words + _UNICODE_WORDS


def conversations(count: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Yield ``count`` Tulu-3-schema rows (see the module docstring), deterministic in ``(count, seed)``."""
    rng = random.Random(seed)
    words = _vocabulary(rng)

    def text(low: int, high: int) -> str:
        return " ".join(rng.choices(words, k=rng.randint(low, high))) + "."

    for i in range(count):
        messages = []
        if rng.random() < 0.25:
            messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": text(8, 150)})
            messages.append({"role": "assistant", "content": text(20, 600)})
        yield {"id": f"synthetic-{seed}-{i}", "messages": messages, "source": "synthetic"}


def write(path: Path, count: int, seed: int = 0) -> int:
    """Write ``count`` generated conversations to ``path`` (``.jsonl`` or ``.parquet``, zstd); return bytes written.

    Raises :class:`UserError` for another suffix or a non-positive count.
    """
    path = Path(path)
    if count < 1:
        raise UserError(f"--conversations {count}: expected a positive number")
    rows = list(conversations(count, seed))
    if path.suffix == ".jsonl":
        data = "".join(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n" for row in rows).encode()
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        message = pa.struct([("role", pa.string()), ("content", pa.string())])
        schema = pa.schema([("id", pa.string()), ("messages", pa.list_(message)), ("source", pa.string())])
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), sink, compression="zstd")
        data = sink.getvalue().to_pybytes()
    else:
        raise UserError(f"--out {path}: expected a .jsonl or .parquet file name")
    atomic_write(path, data)
    return len(data)
