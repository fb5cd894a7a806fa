"""DeepSeek-V4 chat rendering and the loss-mask conventions ``deepseek_v4`` and ``deepseek_v4_official``.

Source of the format: DeepSeek's official encoder for DeepSeek-V4 (``encoding/encoding_dsv4.py`` of the
model repository ``deepseek-ai/DeepSeek-V4-Flash`` at revision ``60d8d70770c6776ff598c94bb586a859a38244f1``,
sha256 ``bdbd57c1…5055e0``) and its four test fixtures, which ``tests/golden/dsv4-encoding/`` keeps as data
and ``tests/test_data_chat.py`` reproduces byte for byte. This module is our own implementation of the
rules below, not a copy of that code.

Messages (Tulu 3 / OpenAI schema: ``[{"role", "content", ...}, ...]``)
---------------------------------------------------------------------
===================  ===================================================================================
role                 keys besides ``role`` (a key whose value is null counts as absent)
===================  ===================================================================================
``system``           ``content`` (string or null), ``tools``, ``response_format``
``developer``        ``content`` (non-empty string), ``tools``, ``response_format``, ``task``
``user``             ``content`` (string), ``task``, ``mask``
``tool``             ``content`` (string, or a list of ``{"type": "text", "text"}`` blocks), ``tool_call_id``
``assistant``        ``content`` (string; null only beside ``tool_calls``), ``reasoning_content``,
                     ``tool_calls``, ``wo_eos``, ``mask``
``latest_reminder``  ``content`` (string)
===================  ===================================================================================

``tools``: OpenAI function tools ``[{"type": "function", "function": {...}}]``; ``tool_calls``:
``[{"id"?, "type"?, "function": {"name": str, "arguments": JSON string of an object}}]``; ``task``: one
of ``action query authority domain title read_url``; ``wo_eos``: true ends the assistant turn without
EOS. ``mask`` (in the official fixtures) is not part of the rendered text and does not change the loss
mask, which follows the named convention. Any other key, a wrong type, or something the format cannot
express is refused with :class:`ConversationError`, one line naming the message
(``messages[3].tool_calls[0].function.arguments: ...``); nothing is dropped silently.

The rules (official encoder, ``encode_messages`` with ``add_default_bos_token``)
-----------------------------------------------------------------------------
1. **Merging.** A ``tool`` message becomes a ``<tool_result>CONTENT</tool_result>`` block of a user
   turn: appended to the user turn before it, if that is where the previous message went, else opening
   one. A user message right after a user turn (or a merged tool result) is appended to it as a text
   block, unless that turn has a ``task``. A turn's blocks are joined with ``\\n\\n``. Within one turn,
   tool results are put in the order of the ``tool_calls`` ids of the last assistant message that had
   calls (results with an unknown id sort first, stably).
2. **Mode.** ``thinking_mode`` ``chat`` or ``thinking``; ``auto`` (the default) is ``thinking`` when some
   assistant message carries ``reasoning_content``, else ``chat``. In chat mode reasoning is never
   rendered, so a non-empty ``reasoning_content`` is refused. ``drop_thinking`` (default true, the
   official default) is turned off when any message has ``tools``; in thinking mode with it on, the
   messages before the last user/developer turn lose their ``reasoning_content`` and ``developer``
   messages there are dropped: the format's rule, counted in :attr:`Rendered.reasoning_dropped` /
   :attr:`Rendered.developer_dropped` and in the build manifest.
3. **Text of each message** (after 1-2), in order, after ``BOS``:
   ``reasoning_effort="max"`` in thinking mode prefixes the first message with the effort prompt;
   system: ``CONTENT`` [+ ``\\n\\n`` + tools section] [+ ``\\n\\n`` + response-format section];
   developer: ``<｜User｜>CONTENT`` [+ the same two sections]; user: ``<｜User｜>BLOCKS``;
   latest_reminder: ``<｜latest_reminder｜>CONTENT``;
   assistant: [``REASONING</think>``] + ``CONTENT`` [+ ``\\n\\n`` + DSML tool-call block] + ``EOS``
   (no EOS with ``wo_eos``); the reasoning part is there in thinking mode unless the turn follows a
   ``task`` turn, empty reasoning included (``</think>`` alone), and is empty for turns before the last
   user turn when reasoning is dropped.
4. **Transition.** After a message followed by an assistant or latest_reminder message, or at the end:
   a ``task`` message adds its task token (``action``: ``<｜Assistant｜>`` + mode token +
   ``<｜action｜>``; others: the token alone); a user or developer message adds ``<｜Assistant｜>`` +
   ``<think>`` (thinking mode, if reasoning is kept or the turn is at/after the last user turn) or
   ``</think>``. Other messages add nothing, so e.g. a later system message is its raw content.
5. DSML tool-call block: ``<｜DSML｜tool_calls>\\n`` + calls joined by ``\\n`` + ``\\n</｜DSML｜tool_calls>``,
   a call ``<｜DSML｜invoke name="NAME">\\n`` + parameters joined by ``\\n`` + ``\\n</｜DSML｜invoke>``, a
   parameter ``<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`` (a string value
   as is and ``true``; anything else as JSON, ``json.dumps(ensure_ascii=False)``, and ``false``).
   Tool schemas in the tools section are the ``function`` objects as JSON, one per line.

A training conversation must end with an assistant message (the official encoder then ends with its EOS).

Loss masks (token-aligned)
--------------------------
``mask[i] = 1`` iff token ``i`` is a *supervised target*: the model is trained to predict token ``i``
from tokens ``0..i-1``. Each rendered piece has a part: prompt, *opener* (what a transition emits after
``<｜Assistant｜>``: the mode token ``<think>``/``</think>``, and ``<｜action｜>`` of an action task) or
*response* (an assistant message's own text, through its EOS).

- ``deepseek_v4`` (the default; Megatron-Bridge's DeepSeek-V4 SFT convention): opener and response are
  supervised, i.e. from right after ``<｜Assistant｜>`` through EOS inclusive; an assistant turn with no
  ``<｜Assistant｜>`` before it (after a non-action task token, a later system message, another assistant
  turn) has its response supervised.
- ``deepseek_v4_official``: the official encoder's prompt/response split: only the response is
  supervised; the opener belongs to the prompt (``encode_messages`` of the conversation up to the
  last user turn ends with it, ``parse_message_from_completion_text`` starts after it). In thinking mode
  ``</think>`` closing the reasoning is part of the response; ``<think>`` is prompt.

Which one the recipe used is not public: it launches miles with ``--rollout-function-path
pretokenized_sft_rollout.generate_rollout`` (not a module of miles 78527b91, whose own SFT masks,
``--loss-mask-type``, are only ``qwen``, ``qwen3`` and ``distill_qwen``), i.e. with pretokenized rows whose mask
came from its own builder. So the default stays ``deepseek_v4``, and a build names its convention.

Everything else is 0: BOS, system, user/tool/developer/reminder text, ``<｜User｜>``, ``<｜Assistant｜>``
itself, and the EOS the builder inserts between conversations. A conversation's mask depends on that
conversation only: one that ends inside an assistant turn (``wo_eos``) leaves the next conversation's BOS,
system and user tokens at 0 (:func:`encode` masks a batch as the concatenation of its conversations
masked one by one). Training uses the label-aligned form
(``trainer.data``): ``labels[i] = tokens[i + 1]`` and ``loss_mask[i] = mask[i + 1]``; the last position of
a row has no label (``labels = -100``, ``loss_mask = 0``), so the first token of a row is never a target.

Worked example (DeepSeek-V4-Flash ``tokenizer.json``, sha256 ``8f9f37ca…633cf``)::

    messages = [{"role": "system", "content": "You are concise."},
                {"role": "user", "content": "First?"},
                {"role": "assistant", "content": "One."}]
    text = "<｜begin▁of▁sentence｜>You are concise.<｜User｜>First?<｜Assistant｜></think>One.<｜end▁of▁sentence｜>"

    i   token               id      deepseek_v4  deepseek_v4_official  labels[i]  loss_mask[i] (deepseek_v4)
    0   BOS                 0       0            0                     3476       0
    1   You                 3476    0            0                     477        0
    2   ␣are                477     0            0                     47468      0
    3   ␣concise            47468   0            0                     16         0
    4   .                   16      0            0                     128803     0
    5   <｜User｜>           128803  0            0                     10318      0
    6   First               10318   0            0                     33         0
    7   ?                   33      0            0                     128804     0
    8   <｜Assistant｜>      128804  0            0                     128822     1
    9   </think>            128822  1            0                     6111       1
    10  One                 6111    1            1                     16         1
    11  .                   16      1            1                     1          1
    12  EOS                 1       1            1                     -100       0

Content is tokenized as text by the same tokenizer call as the markers, so a special-token string
written inside content encodes as that special token (as with the official encoder); the mask still
follows the message roles. Every boundary between pieces of different parts must touch a special token
(the tokenizer splits there), else the turn is refused: its first token could merge with the text before.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import numpy as np

LOSS_MASKS = ("deepseek_v4", "deepseek_v4_official")  # named loss-mask conventions this module implements
THINKING_MODES = ("auto", "chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")  # "high" renders like None (the official encoder adds text only for "max")
FORMAT_SOURCE = "deepseek-ai/DeepSeek-V4-Flash@60d8d70770c6776ff598c94bb586a859a38244f1 encoding/encoding_dsv4.py"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
LATEST_REMINDER = "<｜latest_reminder｜>"
DSML = "｜DSML｜"
TASK_TOKENS = {name: f"<｜{name}｜>" for name in ("action", "query", "authority", "domain", "title", "read_url")}
SPECIAL_TOKENS = {
    "bos": BOS,
    "eos": EOS,
    "user": USER,
    "assistant": ASSISTANT,
    "think_start": THINK_START,
    "think_end": THINK_END,
}
MARKERS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, LATEST_REMINDER, *TASK_TOKENS.values())  # single tokens
ROLES = ("system", "developer", "user", "tool", "assistant", "latest_reminder")
MAX_MESSAGE_CHARS = 1_000_000
"""Characters of one message field (``content``, ``reasoning_content``, a tool result) at most, checked before any
rendering or tokenizing: the tokenizer needs ~125 bytes per character (a 10 MB message took 1.25 GB; a 100 MB one
aborted the process), so 1,000,000 characters (~250,000 tokens, 30 rows of 8,192) is ~125 MB."""
MAX_CONVERSATION_CHARS = 4_000_000
"""Characters of one rendered conversation at most (~500 MB in the tokenizer), checked before it is tokenized."""

# Text of the format (the official encoder's templates, reproduced as data; the fixtures pin every byte).
TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside \
{THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
RESPONSE_FORMAT_SECTION = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

PROMPT, OPENER, RESPONSE = 0, 1, 2  # parts of a piece
KEYS = {
    "system": {"content", "tools", "response_format"},
    "developer": {"content", "tools", "response_format", "task"},
    "user": {"content", "task", "mask"},
    "tool": {"content", "tool_call_id"},
    "assistant": {"content", "reasoning_content", "tool_calls", "wo_eos", "mask"},
    "latest_reminder": {"content"},
}


class ConversationError(ValueError):
    """A conversation that cannot be rendered; ``str(err)`` names the field, e.g. ``messages[1].role: ...``."""


@dataclass(frozen=True)
class Encoding:
    """How conversations are rendered (module docstring, rule 2): ``thinking_mode`` (auto, chat, thinking),
    ``drop_thinking`` (the official default true), ``reasoning_effort`` (None, "high", "max")."""

    thinking_mode: str = "auto"
    drop_thinking: bool = True
    reasoning_effort: str | None = None

    def __post_init__(self) -> None:
        if self.thinking_mode not in THINKING_MODES:
            raise ValueError(f"thinking_mode {self.thinking_mode!r}: expected one of {', '.join(THINKING_MODES)}")
        if self.reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort {self.reasoning_effort!r}: expected none, high or max")

    def manifest(self) -> dict[str, Any]:
        """The options as recorded in a build manifest, with the format's source."""
        return {
            "format": FORMAT_SOURCE,
            "thinking_mode": self.thinking_mode,
            "drop_thinking": self.drop_thinking,
            "reasoning_effort": self.reasoning_effort,
        }


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
    def from_tokenizer(cls, tokenizer: Any) -> SpecialIds:
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

    ``text``: the whole conversation as one string; ``pieces``: the same text cut where the part changes,
    ``(text, part)`` pairs (``PROMPT``, ``OPENER``, ``RESPONSE``) whose concatenation is ``text``;
    ``assistant_turns``: assistant messages rendered; ``thinking``: the mode used; ``reasoning_dropped`` /
    ``developer_dropped``: what the format's drop-thinking rule removed; ``scan_exact``: the ``deepseek_v4``
    mask equals :func:`deepseek_v4_mask` of the ids (every supervised run follows ``<｜Assistant｜>`` and ends
    with EOS, and no content holds either marker).
    """

    text: str
    pieces: tuple[tuple[str, int], ...]
    assistant_turns: int
    thinking: bool = False
    reasoning_dropped: int = 0
    developer_dropped: int = 0
    scan_exact: bool = True

    def segments(self, loss_mask: str = "deepseek_v4") -> list[tuple[str, bool]]:
        """``(text, supervised)`` runs under ``loss_mask``, adjacent runs of equal supervision joined."""
        if loss_mask not in LOSS_MASKS:
            raise ValueError(f"loss_mask {loss_mask!r}: expected one of {', '.join(LOSS_MASKS)}")
        lowest = OPENER if loss_mask == "deepseek_v4" else RESPONSE
        out: list[tuple[str, bool]] = []
        for text, part in self.pieces:
            supervised = part >= lowest
            if out and out[-1][1] == supervised:
                out[-1] = (out[-1][0] + text, supervised)
            else:
                out.append((text, supervised))
        return out


# ---------------------------------------------------------------------------------------------- validation


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _what(value: Any) -> str:
    return "missing" if value is None else f"{type(value).__name__} {_short(value)}"


@overload
def _string(value: Any, where: str, *, optional: Literal[False] = False, nonempty: bool = False) -> str: ...


@overload
def _string(value: Any, where: str, *, optional: bool, nonempty: bool = False) -> str | None: ...


def _string(value: Any, where: str, *, optional: bool = False, nonempty: bool = False) -> str | None:
    """``value`` when it is a string (non-empty with ``nonempty``) of at most :data:`MAX_MESSAGE_CHARS` characters, or
    None with ``optional``; else :class:`ConversationError` naming ``where``."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ConversationError(
            f"{where}: expected a string, got {_what(value)}"
            if not isinstance(value, (list, dict))
            else f"{where}: expected a string, got {type(value).__name__}"
        )
    if nonempty and not value:
        raise ConversationError(f"{where}: expected a non-empty string")
    if len(value) > MAX_MESSAGE_CHARS:
        raise ConversationError(
            f"{where}: {len(value):,} characters, more than the {MAX_MESSAGE_CHARS:,} a message "
            "may have (the tokenizer's memory grows ~125 bytes per character)"
        )
    return value


def _to_json(value: Any, where: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as err:
        raise ConversationError(f"{where}: not JSON-serialisable ({err})") from None


def _tools_section(tools: Any, where: str) -> str:
    if not isinstance(tools, list):
        raise ConversationError(
            f"{where}: expected a list of {{type: function, function: {{...}}}} tools, got {type(tools).__name__}"
        )
    schemas = []
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise ConversationError(
                f"{where}[{k}].function: expected an object (OpenAI function tool), got {_what(function)}"
            )
        schemas.append(_to_json(function, f"{where}[{k}].function"))
    return TOOLS_SECTION.replace("{schemas}", "\n".join(schemas))


def _tool_calls_block(calls: Any, where: str) -> tuple[str, list[str]]:
    """The DSML block of an assistant's ``tool_calls`` (with its leading ``\\n\\n``) and the calls' ids."""
    if not isinstance(calls, list):
        raise ConversationError(f"{where}: expected a list of tool calls, got {type(calls).__name__}")
    invokes, ids = [], []
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ConversationError(f"{at}.function: expected an object with name and arguments, got {_what(function)}")
        unknown = sorted(set(call) - {"id", "type", "function"}) + sorted(set(function) - {"name", "arguments", "id"})
        if unknown:
            raise ConversationError(
                f"{at}: key {unknown[0]!r} is not part of the DeepSeek-V4 format "
                "(expected id, type, function.name, function.arguments)"
            )
        if call.get("type") not in (None, "function"):
            raise ConversationError(f"{at}.type: {_short(call['type'])}; the format renders function calls only")
        name = _string(function.get("name"), f"{at}.function.name", nonempty=True)
        arguments = _string(function.get("arguments"), f"{at}.function.arguments")
        try:
            values = json.loads(arguments)
        except ValueError:
            values = None
        if not isinstance(values, dict):
            raise ConversationError(
                f"{at}.function.arguments: expected a JSON object (OpenAI format), got {_short(arguments)}"
            )
        params = [
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else _to_json(value, f'{at}.function.arguments')}</{DSML}parameter>"
            for key, value in values.items()
        ]
        invokes.append(f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
        call_id = call.get("id") or function.get("id") or ""
        ids.append(_string(call_id, f"{at}.id"))
    if not invokes:
        return "", []
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>", ids


def _tool_content(value: Any, where: str) -> str:
    if isinstance(value, list):
        texts = []
        for k, block in enumerate(value):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise ConversationError(
                    f"{where}[{k}]: expected a {{type: text, text: string}} block; "
                    "the format renders only text tool results"
                )
            texts.append(_string(block["text"], f"{where}[{k}].text"))
        joined = "\n\n".join(texts)
        if len(joined) > MAX_MESSAGE_CHARS:
            raise ConversationError(
                f"{where}: {len(joined):,} characters, more than the {MAX_MESSAGE_CHARS:,} a message "
                "may have (the tokenizer's memory grows ~125 bytes per character)"
            )
        return joined
    return _string(value, where)


@dataclass
class _Turn:
    """One message after merging: role, index of its (first) message, and what it renders."""

    role: str
    index: int
    message: dict[str, Any]
    blocks: list[tuple[str, str, int]] = field(
        default_factory=list
    )  # user: (kind, text, message index), kind text|tool
    reasoning: str | None = None


def _checked(messages: Any) -> list[dict[str, Any]]:
    """The messages with null-valued keys removed, after checking roles, keys and value types."""
    if not isinstance(messages, (list, tuple)):
        what = "missing" if messages is None else type(messages).__name__
        raise ConversationError(f"messages: expected a list of {{role, content}} objects, got {what}")
    if not messages:
        raise ConversationError("messages: empty list; expected at least a user and an assistant turn")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ConversationError(f"{where}: expected an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ConversationError(
                f"{where}.role: unknown role {_short(role)} (expected {', '.join(ROLES[:-1])} or {ROLES[-1]})"
            )
        present = {k: v for k, v in message.items() if v is not None and k != "role"}
        unknown = sorted(set(present) - KEYS[role])
        if unknown:
            raise ConversationError(
                f"{where}.{unknown[0]}: not part of the DeepSeek-V4 format for a message of role {role} "
                f"(expected {', '.join(sorted(KEYS[role]))})"
            )
        content = present.get("content")
        if role == "developer":
            _string(content, f"{where}.content", nonempty=True)
        elif role == "tool":
            _tool_content(content, f"{where}.content")
        elif role == "system":
            _string(content, f"{where}.content", optional=True)
        elif role == "assistant":
            _string(content, f"{where}.content", optional=bool(present.get("tool_calls")))
            _string(present.get("reasoning_content"), f"{where}.reasoning_content", optional=True)
            if not isinstance(present.get("wo_eos", False), bool):
                raise ConversationError(f"{where}.wo_eos: expected true or false, got {_what(present['wo_eos'])}")
        else:
            _string(content, f"{where}.content")
        if "task" in present and present["task"] not in TASK_TOKENS:
            raise ConversationError(
                f"{where}.task: unknown task {_short(present['task'])} (expected {', '.join(TASK_TOKENS)})"
            )
        if "mask" in present and (isinstance(present["mask"], bool) or present["mask"] not in (0, 1)):
            raise ConversationError(f"{where}.mask: expected 0 or 1, got {_what(present['mask'])}")
        present["role"] = role
        out.append(present)
    return out


def _merge(messages: list[dict[str, Any]]) -> list[_Turn]:
    """Rule 1: tool results and consecutive user messages merged into user turns, tool results ordered."""
    turns: list[_Turn] = []
    for i, message in enumerate(messages):
        role = message["role"]
        last = turns[-1] if turns else None
        if role == "tool":
            block = ("tool", _tool_content(message.get("content"), f"messages[{i}].content"), i)
            if last is not None and last.role == "user":
                last.blocks.append(block)
            else:
                turns.append(_Turn("user", i, {"role": "user"}, [block]))
        elif role == "user":
            block = ("text", message["content"], i)
            if last is not None and last.role == "user" and "task" not in last.message:
                if "task" in message:
                    raise ConversationError(
                        f"messages[{i}].task: a task on a user message merged into the turn of messages[{last.index}]; "
                        "the format keeps only the first message's task"
                    )
                last.blocks.append(block)
            else:
                turns.append(_Turn("user", i, message, [block]))
        else:
            turns.append(_Turn(role, i, message, reasoning=message.get("reasoning_content")))
    order: dict[str, int] = {}
    for turn in turns:  # tool results in the order of the last calls
        if turn.role == "assistant" and turn.message.get("tool_calls"):
            _, ids = _tool_calls_block(turn.message["tool_calls"], f"messages[{turn.index}].tool_calls")
            order = {call_id: k for k, call_id in enumerate(ids) if call_id}
        elif turn.role == "user" and order:
            results = [b for b in turn.blocks if b[0] == "tool"]
            if len(results) > 1:
                call_ids = {b[2]: messages[b[2]].get("tool_call_id", "") for b in results}
                ranked = iter(sorted(results, key=lambda b: order.get(call_ids[b[2]], 0)))
                turn.blocks = [next(ranked) if b[0] == "tool" else b for b in turn.blocks]
    return turns


# ---------------------------------------------------------------------------------------------- rendering


def render(messages: Any, encoding: Encoding = Encoding()) -> Rendered:
    """Render a ``messages`` list in the DeepSeek-V4 chat format (rules in the module docstring).

    Raises :class:`ConversationError` (one line naming the message and field) for anything the format
    cannot express: a bad structure, an unknown role or key, a wrong type, reasoning in chat mode, tool
    calls whose arguments are not a JSON object, a task the next message cannot take, a conversation
    without a final assistant message, or an assistant turn whose tokens cannot be masked apart.
    """
    checked = _checked(messages)
    if checked[-1]["role"] != "assistant":
        raise ConversationError(
            f"messages[{len(checked) - 1}].role: conversation ends with a {checked[-1]['role']} turn; "
            "expected a final assistant turn"
        )
    turns = _merge(checked)
    with_tools = any(m.get("tools") for m in checked)
    mode = encoding.thinking_mode
    thinking = mode == "thinking" or (mode == "auto" and any(t.reasoning is not None for t in turns))
    drop = encoding.drop_thinking and not with_tools
    if not thinking:
        for t in turns:
            if t.reasoning:
                raise ConversationError(
                    f"messages[{t.index}].reasoning_content: chat mode renders no reasoning; "
                    "use thinking_mode thinking (or auto)"
                )
    reasoning_dropped = developer_dropped = 0
    if thinking and drop:  # rule 2: the format's drop-thinking
        last_user = max((k for k, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)
        kept = []
        for k, t in enumerate(turns):
            if k < last_user and t.role == "developer":
                developer_dropped += 1
                continue
            if k < last_user and t.role == "assistant" and t.reasoning is not None:
                reasoning_dropped += bool(t.reasoning)
                t.reasoning = None
            kept.append(t)
        turns = kept
    last_user = max((k for k, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)

    pieces: list[tuple[str, int, int]] = [(BOS, PROMPT, turns[0].index)]  # (text, part, message index)
    for k, t in enumerate(turns):
        msg, where = t.message, f"messages[{t.index}]"
        if k == 0 and thinking and encoding.reasoning_effort == "max":
            pieces.append((REASONING_EFFORT_MAX, PROMPT, t.index))
        if t.role in ("system", "developer"):
            text = (USER if t.role == "developer" else "") + (msg.get("content") or "")
            if msg.get("tools"):
                text += "\n\n" + _tools_section(msg["tools"], f"{where}.tools")
            if msg.get("response_format"):
                text += "\n\n" + RESPONSE_FORMAT_SECTION.format(
                    schema=_to_json(msg["response_format"], f"{where}.response_format")
                )
            pieces.append((text, PROMPT, t.index))
        elif t.role == "user":
            text = "\n\n".join(
                body if kind == "text" else f"<tool_result>{body}</tool_result>" for kind, body, _ in t.blocks
            )
            pieces.append((USER + text, PROMPT, t.index))
        elif t.role == "latest_reminder":
            pieces.append((LATEST_REMINDER + msg["content"], PROMPT, t.index))
        else:  # assistant
            after_task = k > 0 and "task" in turns[k - 1].message
            reasoning = ""
            if thinking and not after_task and (not drop or k > last_user):
                reasoning = (t.reasoning or "") + THINK_END
            elif t.reasoning:  # after a task turn (chat-mode reasoning is refused above, dropped reasoning is None)
                raise ConversationError(
                    f"{where}.reasoning_content: this turn follows a task turn, where the format renders no reasoning"
                )
            calls, _ = (
                _tool_calls_block(msg["tool_calls"], f"{where}.tool_calls") if msg.get("tool_calls") else ("", [])
            )
            pieces.append(
                (reasoning + (msg.get("content") or "") + calls + ("" if msg.get("wo_eos") else EOS), RESPONSE, t.index)
            )
        following = turns[k + 1].role if k + 1 < len(turns) else None
        task = msg.get("task")
        if following not in (None, "assistant", "latest_reminder"):
            if task is not None:
                raise ConversationError(
                    f"{where}.task: the format renders a task token only before an assistant or latest_reminder "
                    f"turn; the next message is a {following} turn"
                )
            continue
        if task == "action":
            pieces += [
                (ASSISTANT, PROMPT, t.index),
                ((THINK_START if thinking else THINK_END) + TASK_TOKENS[task], OPENER, t.index),
            ]
        elif task is not None:
            pieces.append((TASK_TOKENS[task], PROMPT, t.index))
        elif t.role in ("user", "developer"):
            opener = THINK_START if thinking and (not drop or k >= last_user) else THINK_END
            pieces += [(ASSISTANT, PROMPT, t.index), (opener, OPENER, t.index)]
    return _finish(pieces, turns, thinking, reasoning_dropped, developer_dropped)


def _finish(
    pieces: list[tuple[str, int, int]],
    turns: list[_Turn],
    thinking: bool,
    reasoning_dropped: int,
    developer_dropped: int,
) -> Rendered:
    """Join pieces of one part, check that parts meet at special tokens, decide whether the id scan is exact."""
    joined: list[list[Any]] = []
    for text, part, index in pieces:
        if not text:
            continue
        if joined and joined[-1][1] == part:
            joined[-1][0] += text
        else:
            joined.append([text, part, index])
    roles = {t.index: t.role for t in turns}
    for (left, _, before), (right, _, index) in itertools.pairwise(joined):
        if not left.endswith(MARKERS) and not right.startswith(MARKERS):
            raise ConversationError(
                f"messages[{index}]: the {roles[index]} turn follows the {roles[before]} text of messages[{before}] "
                "with no special token between (the format puts no <｜Assistant｜> there), "
                "so its first token could merge with that text "
                "and the loss mask cannot split them"
            )
    text = "".join(p[0] for p in joined)
    if len(text) > MAX_CONVERSATION_CHARS:
        raise ConversationError(
            f"messages: {len(text):,} characters rendered, more than the {MAX_CONVERSATION_CHARS:,} a "
            "conversation may have (the tokenizer's memory grows ~125 bytes per character)"
        )
    supervised = [(k, p) for k, p in enumerate(joined) if p[1] != PROMPT]
    runs = [k for k, _ in supervised if k == 0 or joined[k - 1][1] == PROMPT]  # starts of supervised runs
    ends = [k for k, _ in supervised if k + 1 == len(joined) or joined[k + 1][1] == PROMPT]
    scan_exact = (
        all(k > 0 and joined[k - 1][0].endswith(ASSISTANT) for k in runs)
        and all(joined[k][0].endswith(EOS) for k in ends)
        and text.count(ASSISTANT) == text.count(EOS) == len(runs)
    )
    return Rendered(
        text=text,
        pieces=tuple((p[0], p[1]) for p in joined),
        assistant_turns=sum(t.role == "assistant" for t in turns),
        thinking=thinking,
        reasoning_dropped=reasoning_dropped,
        developer_dropped=developer_dropped,
        scan_exact=scan_exact,
    )


# ---------------------------------------------------------------------------------------------- masks


def deepseek_v4_mask(
    ids: np.ndarray, special: SpecialIds, lengths: Sequence[int] | np.ndarray | None = None
) -> np.ndarray:
    """The ``deepseek_v4`` token mask of a token stream, computed from marker ids alone, per conversation.

    ``ids``: int array of shape ``(n,)``; ``lengths``: tokens per conversation (int, summing to ``n``), the
    conversations lying back to back in ``ids`` (None: ``ids`` is one scan scope, e.g. one conversation).
    Returns a ``uint8`` array of shape ``(n,)``: ``mask[i] = 1`` iff the last ``<｜Assistant｜>`` or EOS
    strictly before ``i`` *within i's conversation* is ``<｜Assistant｜>``, i.e. 1 for the tokens after each
    ``<｜Assistant｜>`` through the next EOS inclusive, 0 elsewhere. The scan restarts at every conversation
    boundary, so a conversation ending inside an assistant turn (``wo_eos``) never carries "supervised" into
    the next one: the mask of a conversation is a function of that conversation only. Exact for a
    conversation whose :attr:`Rendered.scan_exact` is true; :func:`encode` uses :func:`mask_from_pieces` for
    the others. Raises ``ValueError`` if ``lengths`` is negative somewhere or does not sum to ``n``.
    """
    ids = np.asarray(ids)
    n = ids.shape[0]
    mask = np.zeros(n, dtype=np.uint8)
    counts = np.asarray([n] if lengths is None else lengths, dtype=np.int64)
    if (counts < 0).any() or int(counts.sum()) != n:
        raise ValueError(
            f"lengths: {counts.size} conversations of {int(counts.sum())} tokens in all; "
            f"expected >= 0 each and {n} in all"
        )
    if n < 2:
        return mask
    is_assistant = ids == special.assistant
    last = np.where(is_assistant | (ids == special.eos), np.arange(n, dtype=np.int64), -1)
    np.maximum.accumulate(last, out=last)  # last[i]: index of the last marker at or before i (-1: none)
    before = last[:-1]  # for token i >= 1: the last marker strictly before i
    conversation_start = np.repeat(np.cumsum(counts) - counts, counts)  # per token: where its conversation starts
    # a marker before the token's own conversation does not count (before = -1 fails this too: starts are >= 0)
    mask[1:] = is_assistant[before] & (before >= conversation_start[1:])
    return mask


def mask_from_pieces(
    tokenizer: Any, rendered: Rendered, loss_mask: str = "deepseek_v4"
) -> tuple[list[int], np.ndarray]:
    """Tokens and ``loss_mask`` mask of one conversation by encoding its segments one by one.

    Every segment boundary touches a special token (checked by :func:`render`), where the tokenizer
    splits anyway, so the concatenated ids equal the encoding of ``rendered.text``.
    Returns ``(ids, mask)`` with ``mask`` a ``uint8`` array of the same length.
    """
    segments = rendered.segments(loss_mask)
    encodings = tokenizer.encode_batch_fast([text for text, _ in segments], add_special_tokens=False)
    ids: list[int] = []
    flags: list[int] = []
    for encoding, (_, supervised) in zip(encodings, segments, strict=True):
        piece = encoding.ids
        ids += piece
        flags += [int(supervised)] * len(piece)
    return ids, np.array(flags, dtype=np.uint8)


def encode(
    tokenizer: Any, special: SpecialIds, conversations: Sequence[Rendered], loss_mask: str = "deepseek_v4"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens and ``loss_mask`` masks of rendered conversations, with one batch call to the tokenizer.

    Returns ``(ids, mask, lengths)``: ``ids`` an ``int32`` array of shape ``(n,)``, the token ids of every
    ``rendered.text`` back to back (no BOS/EOS added by the tokenizer: the text carries them); ``mask`` the
    ``uint8`` mask of the same shape; ``lengths`` an ``int64`` array of shape ``(len(conversations),)``,
    tokens per conversation (``n = lengths.sum()``). Each conversation's ids and mask are a function of that
    conversation alone: ``encode(convs)`` is the concatenation of ``encode([c])`` over ``c`` in ``convs``
    (the batch is only for speed). Raises ``ValueError`` for an unknown ``loss_mask``.
    """
    if loss_mask not in LOSS_MASKS:
        raise ValueError(f"loss_mask {loss_mask!r}: expected one of {', '.join(LOSS_MASKS)}")
    encodings = tokenizer.encode_batch_fast([r.text for r in conversations], add_special_tokens=False)
    id_lists = [encoding.ids for encoding in encodings]
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    ids = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32, count=int(lengths.sum()))
    # per-conversation scan (restarts at each boundary); the official mask comes from the pieces throughout
    mask = (
        deepseek_v4_mask(ids, special, lengths)
        if loss_mask == "deepseek_v4"
        else np.zeros(ids.shape[0], dtype=np.uint8)
    )
    start = 0
    for k, (rendered, length) in enumerate(zip(conversations, lengths.tolist(), strict=True)):
        if loss_mask != "deepseek_v4" or not rendered.scan_exact:  # follow the roles, not the marker ids
            piece_ids, piece_mask = mask_from_pieces(tokenizer, rendered, loss_mask)
            if piece_ids != id_lists[k]:  # render() puts every cut next to a special token; anything else is a bug
                raise RuntimeError("piecewise encoding differs from the encoding of the whole conversation")
            mask[start : start + length] = piece_mask
        start += length
    return ids, mask, lengths
