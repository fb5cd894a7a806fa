"""DeepSeek-V4 chat rendering and the ``deepseek_v4`` loss mask.

Source of the format: DeepSeek's reference encoder for DeepSeek-V4 (``encoding/encoding_dsv4.py`` in the
model repository), summarised in the bundle's shared docs (``DSV4_FORMAT.md``). This is our own
implementation of those facts.

Rendering one conversation (Tulu 3 schema: ``messages`` = ``[{"role", "content"}, ...]``)::

    BOS + system content (raw, no role token; only as messages[0])
        + for each user turn:       <｜User｜> + content
        + for each assistant turn:  <｜Assistant｜> + MODE + content + EOS

``MODE`` is ``</think>`` (chat mode). An assistant message that carries a ``reasoning_content`` string
and is the final turn (after the last user turn) renders in thinking mode, ``<think>`` + reasoning +
``</think>`` + content; the reasoning of earlier turns is dropped, as the reference encoder does by
default. Roles must alternate user/assistant after an optional system message and the conversation must
end with an assistant turn; other keys of a message are ignored. Content is tokenized as text by the
same tokenizer call as the markers, so a special-token string written inside content encodes as that
special token (as with the reference encoder); the loss mask still follows the message roles.

The ``deepseek_v4`` loss mask (token-aligned)
---------------------------------------------
``mask[i] = 1`` iff token ``i`` is a *supervised target*: the model is trained to predict token ``i``
from tokens ``0..i-1``. Supervised are, for every assistant turn, the tokens from right after
``<｜Assistant｜>`` (so the ``<think>``/``</think>`` mode token is supervised) through the turn's EOS
inclusive. Everything else is 0: BOS, system, ``<｜User｜>`` and user content, ``<｜Assistant｜>`` itself,
and the EOS the builder inserts between conversations.

Training uses the label-aligned form (``trainer.data``): ``labels[i] = tokens[i + 1]`` and
``loss_mask[i] = mask[i + 1]``; the last position of a row has no label (``labels = -100``,
``loss_mask = 0``) and so the first token of a row is never a target.

Worked example (DeepSeek-V4-Flash ``tokenizer.json``, sha256 ``8f9f37ca…633cf``)::

    messages = [{"role": "system", "content": "You are concise."},
                {"role": "user", "content": "First?"},
                {"role": "assistant", "content": "One."}]
    text = "<｜begin▁of▁sentence｜>You are concise.<｜User｜>First?<｜Assistant｜></think>One.<｜end▁of▁sentence｜>"

    i   token               id      mask  labels[i]  loss_mask[i]   (labels/loss_mask: trainer.data, row = these 13)
    0   BOS                 0       0     3476       0
    1   You                 3476    0     477        0
    2   ␣are                477     0     47468      0
    3   ␣concise            47468   0     16         0
    4   .                   16      0     128803     0
    5   <｜User｜>           128803  0     10318      0
    6   First               10318   0     33         0
    7   ?                   33      0     128804     0
    8   <｜Assistant｜>      128804  0     128822     1
    9   </think>            128822  1     6111       1
    10  One                 6111    1     16         1
    11  .                   16      1     1          1
    12  EOS                 1       1     -100       0

So the prediction made at ``<｜Assistant｜>`` (of ``</think>``) and every prediction up to the one of EOS
carries loss, and the prediction made at EOS (of whatever follows) does not.

Errors: :class:`ConversationError` (a ``ValueError``) with one line naming the field
(``messages[2].role``) and what was expected.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import numpy as np

LOSS_MASKS = ("deepseek_v4",)  # named loss-mask conventions this module implements

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = {"bos": BOS, "eos": EOS, "user": USER, "assistant": ASSISTANT, "think_start": THINK_START, "think_end": THINK_END}
ROLES = ("system", "user", "assistant")


class ConversationError(ValueError):
    """A conversation that cannot be rendered; ``str(err)`` names the field, e.g. ``messages[1].role: ...``."""


@dataclass(frozen=True)
class SpecialIds:
    """Token ids of the format's markers in one tokenizer (each string must be a single token)."""

    bos: int
    eos: int
    user: int
    assistant: int
    think_start: int
    think_end: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "SpecialIds":
        """Look the markers up in a ``tokenizers.Tokenizer``; raise ``ValueError`` naming a missing one."""
        ids = {}
        for name, text in SPECIAL_TOKENS.items():
            token_id = tokenizer.token_to_id(text)
            if token_id is None:
                raise ValueError(f"tokenizer has no token {text!r} ({name}); expected the DeepSeek-V4 vocabulary")
            ids[name] = token_id
        return cls(**ids)


@dataclass(frozen=True)
class Rendered:
    """One rendered conversation.

    ``text`` is the whole conversation as one string; ``pieces`` the same text cut at mask boundaries,
    ``(text, supervised)`` pairs whose concatenation is ``text``; ``assistant_turns`` counts EOS-closed turns.
    """

    text: str
    pieces: Tuple[Tuple[str, bool], ...]
    assistant_turns: int


def _content(message: Any, index: int, key: str = "content", optional: bool = False) -> str | None:
    value = message.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        what = "missing" if key not in message or value is None else f"{type(value).__name__} {_short(value)}"
        raise ConversationError(f"messages[{index}].{key}: expected a string, got {what}")
    return value


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render(messages: Any) -> Rendered:
    """Render a Tulu-3-schema ``messages`` list in the DeepSeek-V4 chat format (see the module docstring).

    Raises :class:`ConversationError` for: ``messages`` not a non-empty list, a message that is not an
    object, an unknown role, a system message after messages[0], roles not alternating user/assistant,
    a conversation not ending with an assistant turn, a non-string ``content`` (or ``reasoning_content``).
    """
    if not isinstance(messages, (list, tuple)):
        what = "missing" if messages is None else type(messages).__name__
        raise ConversationError(f"messages: expected a list of {{role, content}} objects, got {what}")
    if not messages:
        raise ConversationError("messages: empty list; expected at least a user and an assistant turn")
    pieces: List[Tuple[str, bool]] = []
    prompt = [BOS]  # unsupervised text accumulated since the last supervised piece
    last_user = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), default=-1)
    expected = "user"
    turns = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConversationError(f"messages[{i}]: expected an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ConversationError(f"messages[{i}].role: unknown role {_short(role)} (expected system, user or assistant)")
        content = _content(message, i)
        if role == "system":
            if i != 0:
                raise ConversationError(f"messages[{i}].role: system message after messages[0]; only the first message may be system")
            prompt.append(content)
            continue
        if role != expected:
            after = "the start" if expected == "user" and turns == 0 else ("a user turn" if role == "user" else "an assistant turn")
            raise ConversationError(f"messages[{i}].role: {role} turn follows {after}; expected {expected}")
        if role == "user":
            prompt += (USER, content, ASSISTANT)
            expected = "assistant"
            continue
        reasoning = _content(message, i, "reasoning_content", optional=True)
        pieces.append(("".join(prompt), False))
        prompt = []
        if reasoning is not None and i > last_user:
            pieces.append((THINK_START + reasoning + THINK_END + content + EOS, True))
        else:
            pieces.append((THINK_END + content + EOS, True))
        turns += 1
        expected = "user"
    if turns == 0 and expected == "user":
        raise ConversationError("messages: no user or assistant turn; expected at least a user and an assistant turn")
    if expected != "user":
        raise ConversationError(f"messages[{len(messages) - 1}].role: conversation ends with a user turn; expected a final assistant turn")
    if prompt:  # cannot happen: the last message is an assistant turn
        pieces.append(("".join(prompt), False))
    return Rendered("".join(text for text, _ in pieces), tuple(pieces), turns)


def deepseek_v4_mask(ids: np.ndarray, special: SpecialIds) -> np.ndarray:
    """The ``deepseek_v4`` token mask of a token stream, computed from marker ids alone.

    ``ids``: int array of shape ``(n,)``, one or more rendered conversations (with separator EOS tokens
    between them). Returns a ``uint8`` array of shape ``(n,)``: 1 for the tokens after each
    ``<｜Assistant｜>`` through the next EOS inclusive, 0 elsewhere. Exact only when ``<｜Assistant｜>``
    and EOS occur nowhere but as markers (no content contains their strings); :func:`encode` checks that
    and falls back to :func:`mask_from_pieces` otherwise.
    """
    ids = np.asarray(ids)
    n = ids.shape[0]
    mask = np.zeros(n, dtype=np.uint8)
    if n < 2:
        return mask
    is_assistant = ids == special.assistant
    last = np.where(is_assistant | (ids == special.eos), np.arange(n, dtype=np.int64), -1)
    np.maximum.accumulate(last, out=last)  # last[i]: index of the last marker at or before i (-1: none)
    before = last[:-1]  # for token i >= 1: the last marker strictly before i
    mask[1:] = is_assistant[before] & (before >= 0)
    return mask


def mask_from_pieces(tokenizer: Any, rendered: Rendered) -> Tuple[List[int], np.ndarray]:
    """Tokens and ``deepseek_v4`` mask of one conversation by encoding its pieces one by one.

    Every piece boundary sits next to a special token (after ``<｜Assistant｜>``, after EOS), where the
    tokenizer splits anyway, so the concatenated ids equal the encoding of ``rendered.text``.
    Returns ``(ids, mask)`` with ``mask`` a ``uint8`` array of the same length.
    """
    encodings = tokenizer.encode_batch_fast([text for text, _ in rendered.pieces], add_special_tokens=False)
    ids: List[int] = []
    flags: List[int] = []
    for encoding, (_, supervised) in zip(encodings, rendered.pieces):
        piece = encoding.ids
        ids += piece
        flags += [int(supervised)] * len(piece)
    return ids, np.array(flags, dtype=np.uint8)


def encode(tokenizer: Any, special: SpecialIds, conversations: Sequence[Rendered]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens and ``deepseek_v4`` masks of rendered conversations, with one batch call to the tokenizer.

    Returns ``(ids, mask, lengths)``: ``ids`` an ``int32`` array of shape ``(n,)``, the token ids of every
    ``rendered.text`` back to back (no BOS/EOS added by the tokenizer: the text carries them); ``mask`` the
    ``uint8`` mask of the same shape; ``lengths`` an ``int64`` array of shape ``(len(conversations),)``,
    tokens per conversation (``n = lengths.sum()``).
    """
    encodings = tokenizer.encode_batch_fast([r.text for r in conversations], add_special_tokens=False)
    id_lists = [encoding.ids for encoding in encodings]
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    ids = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32, count=int(lengths.sum()))
    mask = deepseek_v4_mask(ids, special)
    start = 0
    for k, (rendered, length) in enumerate(zip(conversations, lengths.tolist())):
        turns = rendered.assistant_turns
        if rendered.text.count(ASSISTANT) != turns or rendered.text.count(EOS) != turns:
            # a marker string inside content: follow the roles, not the ids
            piece_ids, piece_mask = mask_from_pieces(tokenizer, rendered)
            if piece_ids != id_lists[k]:  # the tokenizer splits at special tokens; anything else is a bug
                raise RuntimeError("piecewise encoding differs from the encoding of the whole conversation")
            mask[start : start + length] = piece_mask
        start += length
    return ids, mask, lengths
