"""DeepSeek-V4 rendering and its loss masks: the official fixtures byte for byte, our own cases token by token
with the real tokenizer, and the refusals."""

import functools
import hashlib
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers
from helpers import GOLDEN
from trainer.data import chat
from trainer.data.build import load_tokenizer

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK, DSML = "<think>", "</think>", "｜DSML｜"
FIXTURES = GOLDEN / "dsv4-encoding"  # the official encoder's four fixtures, with SOURCE.json
TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_time", "arguments": '{"city": "Zürich", "utc": false, "n": 2}'},
}
CALL_TEXT = (
    f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="get_time">\n'
    f'<{DSML}parameter name="city" string="true">Zürich</{DSML}parameter>\n'
    f'<{DSML}parameter name="utc" string="false">false</{DSML}parameter>\n'
    f'<{DSML}parameter name="n" string="false">2</{DSML}parameter>\n'
    f"</{DSML}invoke>\n</{DSML}tool_calls>"
)


@pytest.fixture(scope="module")
def tok():
    tokenizer, special, _ = load_tokenizer()
    return tokenizer, special


@functools.cache
def shipped():
    tokenizer, special, _ = load_tokenizer()
    return tokenizer, special


def ids_of(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def expected(tokenizer, pieces):
    """Hand-written (text, supervised) pieces -> (ids, mask) as the convention says they must be."""
    ids, mask = [], []
    for text, supervised in pieces:
        piece = ids_of(tokenizer, text)
        ids += piece
        mask += [int(supervised)] * len(piece)
    return ids, mask


def encode_one(tok, messages, loss_mask="deepseek_v4", **encoding):
    tokenizer, special = tok
    ids, mask, lengths = chat.encode(tokenizer, special, [chat.render(messages, chat.Encoding(**encoding))], loss_mask)
    assert lengths.tolist() == [len(ids)]
    return ids.tolist(), mask.tolist()


def both_masks(tok, messages, pieces, **encoding):
    """Assert ids and both masks against hand-written pieces ``(text, part)``, part 0 prompt, 1 opener, 2 response."""
    tokenizer, _ = tok
    assert chat.render(messages, chat.Encoding(**encoding)).text == "".join(text for text, _ in pieces)
    for loss_mask, lowest in (("deepseek_v4", 1), ("deepseek_v4_official", 2)):
        want = expected(tokenizer, [(text, part >= lowest) for text, part in pieces])
        assert encode_one(tok, messages, loss_mask, **encoding) == want, loss_mask
    return want


def fixture(n):
    data = json.loads((FIXTURES / f"test_input_{n}.json").read_text(encoding="utf-8"))
    if isinstance(data, dict):  # test_input_1: the official test puts the tools on the first message
        data["messages"][0]["tools"] = data["tools"]
        data = data["messages"]
    return data


def test_fixtures_are_the_recorded_bytes():
    source = json.loads((FIXTURES / "SOURCE.json").read_text())
    assert source["upstream"]["revision"] == "60d8d70770c6776ff598c94bb586a859a38244f1"
    assert len(source["sha256"]) == 8
    for name, digest in source["sha256"].items():
        assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("n,mode", [(1, "thinking"), (2, "thinking"), (3, "thinking"), (4, "chat")])
def test_official_fixtures_byte_for_byte(n, mode):
    assert json.loads((FIXTURES / "SOURCE.json").read_text())["calls"][f"test_input_{n}.json"]["thinking_mode"] == mode
    rendered = chat.render(fixture(n), chat.Encoding(thinking_mode=mode))
    assert rendered.text.encode("utf-8") == (FIXTURES / f"test_output_{n}.txt").read_bytes()
    assert "".join(text for text, _ in rendered.pieces) == rendered.text


def test_official_fixtures_tokenize_piecewise_as_a_whole(tok):
    tokenizer, special = tok
    for n, mode in ((1, "thinking"), (2, "thinking"), (3, "thinking"), (4, "chat")):
        rendered = chat.render(fixture(n), chat.Encoding(thinking_mode=mode))
        whole = ids_of(tokenizer, rendered.text)
        for loss_mask in chat.LOSS_MASKS:
            ids, mask = chat.mask_from_pieces(tokenizer, rendered, loss_mask)
            assert ids == whole
            assert mask.sum() > 0 and mask[0] == 0 and mask[-1] == 1  # ends with the final assistant turn's EOS
    # fixture 4: the action task's opener "</think><｜action｜>" after <｜Assistant｜>, then the answer
    rendered = chat.render(fixture(4), chat.Encoding(thinking_mode="chat"))
    ids, v4 = chat.mask_from_pieces(tokenizer, rendered, "deepseek_v4")
    _, official = chat.mask_from_pieces(tokenizer, rendered, "deepseek_v4_official")
    action = tokenizer.token_to_id("<｜action｜>")
    k = ids.index(action)
    assert ids[k - 2 : k + 1] == [special.assistant, special.think_end, action]
    assert (v4[k - 2 : k + 1].tolist(), official[k - 2 : k + 1].tolist()) == ([0, 1, 1], [0, 0, 0])
    assert (v4 != official).sum() == 3  # the two openers: "</think>" of turn 1, "</think><｜action｜>" of turn 2


def test_special_ids_are_single_tokens_of_the_shipped_tokenizer(tok):
    _, special = tok
    assert (special.bos, special.eos, special.user, special.assistant, special.think_start, special.think_end) == (
        0,
        1,
        128803,
        128804,
        128821,
        128822,
    )


def test_worked_example_of_the_docstring(tok):
    messages = [
        {"role": "system", "content": "You are concise."},
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "One."},
    ]
    rendered = chat.render(messages)
    assert rendered.text == f"{BOS}You are concise.{USER}First?{ASSISTANT}</think>One.{EOS}"
    ids, mask = encode_one(tok, messages)
    assert ids == [0, 3476, 477, 47468, 16, 128803, 10318, 33, 128804, 128822, 6111, 16, 1]
    assert mask == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]


def test_multi_turn_without_system(tok):
    tokenizer, _ = tok
    messages = [
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "One."},
        {"role": "user", "content": "Second?"},
        {"role": "assistant", "content": "Two."},
    ]
    want = expected(
        tokenizer,
        [
            (f"{BOS}{USER}First?{ASSISTANT}", 0),
            (f"</think>One.{EOS}", 1),
            (f"{USER}Second?{ASSISTANT}", 0),
            (f"</think>Two.{EOS}", 1),
        ],
    )
    assert encode_one(tok, messages) == want
    ids, mask = want
    # every assistant marker is unsupervised and followed by a supervised </think>; every EOS is supervised
    for i, token in enumerate(ids):
        if token == 128804:
            assert (mask[i], ids[i + 1], mask[i + 1]) == (0, 128822, 1)
        if token == 1:
            assert mask[i] == 1
    assert sum(mask) == len(ids_of(tokenizer, "</think>One.")) + 1 + len(ids_of(tokenizer, "</think>Two.")) + 1


def test_thinking_final_turn_and_dropped_earlier_reasoning(tok):
    tokenizer, _ = tok
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "dropped"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "3 and 3 make 6"},
    ]
    rendered = chat.render(messages)
    assert (
        rendered.text
        == f"{BOS}{USER}2+2?{ASSISTANT}</think>4{EOS}{USER}3+3?{ASSISTANT}<think>3 and 3 make 6</think>6{EOS}"
    )
    ids, mask = encode_one(tok, messages)
    assert (ids, mask) == expected(
        tokenizer,
        [
            (f"{BOS}{USER}2+2?{ASSISTANT}", 0),
            (f"</think>4{EOS}", 1),
            (f"{USER}3+3?{ASSISTANT}", 0),
            (f"<think>3 and 3 make 6</think>6{EOS}", 1),
        ],
    )
    think = ids.index(128821)
    assert ids[think - 1] == 128804 and mask[think - 1] == 0 and mask[think] == 1  # the mode token is supervised
    assert "dropped" not in rendered.text


def test_empty_assistant_content_still_supervises_mode_token_and_eos(tok):
    ids, mask = encode_one(tok, [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}])
    assert ids[-3:] == [128804, 128822, 1]
    assert mask[-3:] == [0, 1, 1]
    assert sum(mask) == 2


def test_unicode_and_marker_strings_inside_content(tok):
    tokenizer, _ = tok
    user = f"naïve 日本語 🙂 what does {ASSISTANT} mean?"
    answer = f"It is a marker; {EOS} ends a turn. Ελληνικά"
    messages = [
        {"role": "system", "content": "Réponds."},
        {"role": "user", "content": user},
        {"role": "assistant", "content": answer},
    ]
    ids, mask = encode_one(tok, messages)
    text = f"{BOS}Réponds.{USER}{user}{ASSISTANT}</think>{answer}{EOS}"
    assert ids == ids_of(tokenizer, text)  # the same tokens as encoding the whole text
    want_ids, want_mask = expected(
        tokenizer, [(f"{BOS}Réponds.{USER}{user}{ASSISTANT}", 0), (f"</think>{answer}{EOS}", 1)]
    )
    assert (ids, mask) == (want_ids, want_mask)
    # the marker inside user content is an unsupervised 128804; the EOS inside the answer a supervised 1
    assert [m for t, m in zip(ids, mask, strict=True) if t == 128804] == [0, 0]
    assert [m for t, m in zip(ids, mask, strict=True) if t == 1] == [1, 1]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_batch_encoding_equals_one_by_one(tok):
    tokenizer, special = tok
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * i}] for i in range(5)]
    ids, mask, lengths = chat.encode(tokenizer, special, [chat.render(c) for c in convs])
    start = 0
    for conv, n in zip(convs, lengths.tolist(), strict=True):
        one_ids, one_mask = encode_one(tok, conv)
        assert ids[start : start + n].tolist() == one_ids and mask[start : start + n].tolist() == one_mask
        start += n
    assert start == len(ids)


def test_mask_scan_on_a_stream_with_separators(tok):
    _, special = tok
    # BOS u A m c EOS | sep EOS | BOS u A m EOS
    stream = np.array([0, 5, 128804, 128822, 7, 1, 1, 0, 5, 128804, 128822, 1])
    assert chat.deepseek_v4_mask(stream, special).tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]


def test_mask_scan_restarts_at_each_conversation(tok):
    _, special = tok
    # conversation 1 ends inside an assistant turn (wo_eos): BOS u A m c | conversation 2: BOS u A m EOS
    stream = np.array([0, 5, 128804, 128822, 7, 0, 5, 128804, 128822, 1])
    assert chat.deepseek_v4_mask(stream, special, [5, 5]).tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    # one scan scope over both (what encode did before issue 26): conversation 2's BOS and prompt were supervised
    assert chat.deepseek_v4_mask(stream, special).tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    assert chat.deepseek_v4_mask(stream, special, [5, 0, 5]).tolist() == [
        0,
        0,
        0,
        1,
        1,
        0,
        0,
        0,
        1,
        1,
    ]  # empty: no scope
    with pytest.raises(
        ValueError, match="lengths: 2 conversations of 9 tokens in all; expected >= 0 each and 10 in all"
    ):
        chat.deepseek_v4_mask(stream, special, [5, 4])


def test_conversation_without_final_eos_does_not_leak_into_the_next(tok):
    # issue 26 point 1: the next conversation of the batch had its BOS, system, <｜User｜>, user text and
    # <｜Assistant｜> supervised because the batch scan was still "inside" the wo_eos assistant turn
    tokenizer, special = tok
    first = [{"role": "user", "content": "Continue:"}, {"role": "assistant", "content": "partial", "wo_eos": True}]
    second = [
        {"role": "system", "content": "You are concise."},
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "One."},
    ]
    for loss_mask, opener in (("deepseek_v4", 1), ("deepseek_v4_official", 0)):
        ids, mask, lengths = chat.encode(tokenizer, special, [chat.render(first), chat.render(second)], loss_mask)
        want_first = expected(tokenizer, [(f"{BOS}{USER}Continue:{ASSISTANT}", 0), (END_THINK, opener), ("partial", 1)])
        want_second = expected(
            tokenizer, [(f"{BOS}You are concise.{USER}First?{ASSISTANT}", 0), (END_THINK, opener), (f"One.{EOS}", 1)]
        )
        assert lengths.tolist() == [len(want_first[0]), 13]
        assert ids.tolist() == want_first[0] + want_second[0]
        assert mask.tolist() == want_first[1] + want_second[1], loss_mask
        # the docstring's worked example: 9 prompt tokens (BOS .. <｜Assistant｜>) unsupervised
        assert mask[lengths[0] :].tolist() == [0] * 9 + [opener, 1, 1, 1]


MESSAGE_TEXTS = [
    "",
    "a",
    " lead",
    "x\ny",
    "中文 🙂",
    "naïve",
    f"{ASSISTANT}inside",
    f"e{EOS}",
    f"{BOS}b",
    f"{USER}u",
    "</think>t",
    "<think>",
]
texts = st.lists(st.sampled_from(MESSAGE_TEXTS), min_size=1, max_size=3).map("".join)


@st.composite
def conversations(draw):
    """A rendered conversation: optional system prompt, 1-3 user/assistant exchanges (reasoning, tool calls, a
    later system message, wo_eos on any assistant turn, the last one included), one of the rendering modes."""
    messages = [{"role": "system", "content": draw(texts)}] if draw(st.booleans()) else []
    for k in range(draw(st.integers(1, 3))):
        if k and draw(st.integers(0, 4)) == 0:
            messages.append({"role": "system", "content": "S" + draw(texts)})
        messages.append({"role": "user", "content": draw(texts)})
        answer = {"role": "assistant", "content": "r" + draw(texts)}
        if draw(st.integers(0, 3)) == 0:
            answer["tool_calls"] = [
                {"id": "c0", "function": {"name": "f", "arguments": json.dumps({"k": draw(texts)})}}
            ]
            messages += [answer, {"role": "tool", "tool_call_id": "c0", "content": draw(texts)}]
            answer = {"role": "assistant", "content": "r" + draw(texts)}
        if draw(st.booleans()):
            answer["reasoning_content"] = draw(texts)
        if draw(st.booleans()):
            answer["wo_eos"] = True
        messages.append(answer)
    encoding = chat.Encoding(
        thinking_mode=draw(st.sampled_from(["auto", "thinking"])), drop_thinking=draw(st.booleans())
    )
    try:
        return chat.render(messages, encoding)
    except chat.ConversationError:
        return chat.render(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "wo_eos": draw(st.booleans())}]
        )


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(batch=st.lists(conversations(), min_size=1, max_size=6))
def test_property_a_batch_encodes_as_its_conversations_one_by_one(batch):
    tokenizer, special = (
        shipped()
    )  # not a fixture argument: hypothesis would print the tokenizer with a failing example
    for loss_mask in chat.LOSS_MASKS:
        ids, mask, lengths = chat.encode(tokenizer, special, batch, loss_mask)
        assert (
            ids.dtype == np.int32
            and mask.dtype == np.uint8
            and lengths.tolist() == [len(ids_of(tokenizer, r.text)) for r in batch]
        )
        alone = [chat.encode(tokenizer, special, [r], loss_mask) for r in batch]
        assert ids.tolist() == [t for one in alone for t in one[0].tolist()]
        assert mask.tolist() == [m for one in alone for m in one[1].tolist()], loss_mask
        for r, one in zip(batch, alone, strict=True):  # and each alone is the role-based mask of its pieces
            piece_ids, piece_mask = chat.mask_from_pieces(tokenizer, r, loss_mask)
            assert (one[0].tolist(), one[1].tolist()) == (piece_ids, piece_mask.tolist())
            assert one[1][0] == 0  # BOS is never a target, whatever the conversation before ended with


def tools_section(*tools):
    # the section text is pinned byte for byte by official fixtures 1 and 3
    return chat.TOOLS_SECTION.replace(
        "{schemas}", "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    )


def test_tool_call_turn_and_tool_result_token_by_token(tok):
    messages = [
        {"role": "system", "content": "Be brief.", "tools": [TOOL]},
        {"role": "user", "content": "Time in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        {"role": "assistant", "content": "Noon."},
    ]
    ids, _ = both_masks(
        tok,
        messages,
        [
            (f"{BOS}Be brief.\n\n{tools_section(TOOL)}{USER}Time in Zürich?{ASSISTANT}", 0),
            (END_THINK, 1),
            (CALL_TEXT + EOS, 2),
            (f"{USER}<tool_result>12:00</tool_result>{ASSISTANT}", 0),
            (END_THINK, 1),
            (f"Noon.{EOS}", 2),
        ],
    )
    tokenizer, _ = tok
    assert tokenizer.token_to_id(DSML) in ids  # the DSML marker is one token of the call block


def test_consecutive_user_turns_merge_and_tool_results_follow_call_order(tok):
    calls = [
        {"id": "x", "function": {"name": "f", "arguments": "{}"}},
        {"id": "y", "function": {"name": "g", "arguments": '{"k": [1]}'}},
    ]
    messages = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "y", "content": "Y"},
        {"role": "tool", "tool_call_id": "x", "content": [{"type": "text", "text": "X"}]},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "done"},
    ]
    block = (
        f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="f">\n\n</{DSML}invoke>\n<{DSML}invoke name="g">\n'
        f'<{DSML}parameter name="k" string="false">[1]</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>'
    )
    both_masks(
        tok,
        messages,
        [
            (f"{BOS}{USER}a\n\nb{ASSISTANT}", 0),
            (END_THINK, 1),
            (block + EOS, 2),
            (f"{USER}<tool_result>X</tool_result>\n\n<tool_result>Y</tool_result>\n\nthanks{ASSISTANT}", 0),
            (END_THINK, 1),
            (f"done{EOS}", 2),
        ],
    )


def test_later_system_message_is_its_raw_text(tok):
    messages = [
        {"role": "system", "content": "S1"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "S2"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    both_masks(
        tok,
        messages,
        [
            (f"{BOS}S1{USER}q1{ASSISTANT}", 0),
            (END_THINK, 1),
            (f"a1{EOS}", 2),
            (f"S2{USER}q2{ASSISTANT}", 0),
            (END_THINK, 1),
            (f"a2{EOS}", 2),
        ],
    )
    assert chat.render(messages).scan_exact


def test_reasoning_in_every_position(tok):
    convo = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
    ]
    # thinking mode, the format's drop_thinking: r1 goes, and the render says so
    assert chat.render(convo).reasoning_dropped == 1
    both_masks(
        tok,
        convo,
        [
            (f"{BOS}{USER}q1{ASSISTANT}", 0),
            (END_THINK, 1),
            (f"a1{EOS}", 2),
            (f"{USER}q2{ASSISTANT}", 0),
            (THINK, 1),
            (f"r2{END_THINK}a2{EOS}", 2),
        ],
    )
    # drop_thinking off: every turn opens with <think> and keeps its reasoning
    assert chat.render(convo, chat.Encoding(drop_thinking=False)).reasoning_dropped == 0
    both_masks(
        tok,
        convo,
        [
            (f"{BOS}{USER}q1{ASSISTANT}", 0),
            (THINK, 1),
            (f"r1{END_THINK}a1{EOS}", 2),
            (f"{USER}q2{ASSISTANT}", 0),
            (THINK, 1),
            (f"r2{END_THINK}a2{EOS}", 2),
        ],
        drop_thinking=False,
    )
    # thinking mode without reasoning: the last turn opens with <think> and closes an empty reasoning
    plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    both_masks(
        tok, plain, [(f"{BOS}{USER}q{ASSISTANT}", 0), (THINK, 1), (f"{END_THINK}a{EOS}", 2)], thinking_mode="thinking"
    )
    # reasoning beside tool calls, tools present (so nothing is dropped), and the max-effort prompt
    messages = [
        {"role": "system", "content": "", "tools": [TOOL]},
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning_content": "call it", "tool_calls": [CALL]},
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "reasoning_content": "got it", "content": "Noon."},
    ]
    both_masks(
        tok,
        messages,
        [
            (f"{BOS}{chat.REASONING_EFFORT_MAX}\n\n{tools_section(TOOL)}{USER}q{ASSISTANT}", 0),
            (THINK, 1),
            (f"call it{END_THINK}{CALL_TEXT}{EOS}", 2),
            (f"{USER}<tool_result>12:00</tool_result>{ASSISTANT}", 0),
            (THINK, 1),
            (f"got it{END_THINK}Noon.{EOS}", 2),
        ],
        reasoning_effort="max",
    )


def test_developer_turn_and_its_drop(tok):
    messages = [
        {"role": "developer", "content": "d1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
    ]
    rendered = chat.render(
        messages
    )  # thinking (auto): the developer turn before the last user turn is the format's to drop
    assert rendered.developer_dropped == 1
    both_masks(
        tok,
        messages,
        [(BOS, 0), (f"a1{EOS}", 2), (f"{USER}q2{ASSISTANT}", 0), (THINK, 1), (f"r2{END_THINK}a2{EOS}", 2)],
    )
    kept = chat.render(messages, chat.Encoding(drop_thinking=False))
    assert kept.developer_dropped == 0 and kept.text.startswith(f"{BOS}{USER}d1{ASSISTANT}{THINK}{END_THINK}a1{EOS}")


def test_assistant_after_assistant_and_without_eos(tok):
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "assistant", "content": "b", "wo_eos": True},
    ]
    rendered = chat.render(messages)
    assert not rendered.scan_exact  # two turns in one supervised run, the last without EOS: masked from the pieces
    both_masks(tok, messages, [(f"{BOS}{USER}q{ASSISTANT}", 0), (END_THINK, 1), (f"a{EOS}b", 2)])


def test_official_split_leaves_the_mode_token_in_the_prompt(tok):
    messages = [
        {"role": "system", "content": "You are concise."},
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "One."},
    ]
    ids, mask = encode_one(tok, messages, "deepseek_v4_official")
    assert ids == [0, 3476, 477, 47468, 16, 128803, 10318, 33, 128804, 128822, 6111, 16, 1]
    assert mask == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="loss_mask 'other'"):
        encode_one(tok, messages, "other")


def random_conversation(rng):
    """A random conversation over every role and key of the format, ending with an assistant turn."""
    texts = ["", "a", " lead", "x\ny", "中文 🙂", f"{ASSISTANT}inside", f"e{EOS}", "</think>t"]
    messages = []
    for _ in range(rng.randint(0, 6)):
        role = rng.choice(["system", "user", "user", "assistant", "assistant", "tool", "developer", "latest_reminder"])
        m = {"role": role, "content": rng.choice(texts)}
        if role == "developer":
            m["content"] = "dev" + m["content"]
        if role in ("system", "developer") and rng.random() < 0.2:
            m["tools"] = [TOOL]
        if role == "user" and rng.random() < 0.1:
            m["task"] = rng.choice(sorted(chat.TASK_TOKENS))
        if role == "tool" and rng.random() < 0.5:
            m["tool_call_id"] = rng.choice(["c0", "c1"])
        if role == "assistant":
            if rng.random() < 0.3:
                m["tool_calls"] = [
                    {"id": f"c{k}", "function": {"name": "f", "arguments": json.dumps({"k": k, "s": " v"})}}
                    for k in range(rng.randint(1, 2))
                ]
                m["content"] = rng.choice([None, "", "ok"])
            if rng.random() < 0.5:
                m["reasoning_content"] = rng.choice(["", "think", " r"])
            if rng.random() < 0.05:
                m["wo_eos"] = True
        messages.append(m)
    return messages + [{"role": "assistant", "content": rng.choice(["end", " end", "\nend"])}]


def test_property_masks_cut_where_the_tokenizer_cuts(tok):
    # whatever renders: piecewise encoding == whole encoding (every cut touches a special token), both masks end at
    # an EOS or the text's end, and the fast id scan equals the role-based deepseek_v4 mask where it claims to
    import random

    tokenizer, special = tok
    rng = random.Random(7)
    rendered_count = exact = 0
    for _ in range(400):
        try:
            rendered = chat.render(
                random_conversation(rng),
                chat.Encoding(thinking_mode=rng.choice(["auto", "thinking"]), drop_thinking=rng.random() < 0.5),
            )
        except chat.ConversationError as err:
            assert "\n" not in str(err) and str(err).startswith("messages")
            continue
        rendered_count += 1
        whole = ids_of(tokenizer, rendered.text)
        masks = {}
        for loss_mask in chat.LOSS_MASKS:
            ids, mask, _ = chat.encode(tokenizer, special, [rendered], loss_mask)
            assert ids.tolist() == whole
            masks[loss_mask] = mask
        assert (masks["deepseek_v4"] >= masks["deepseek_v4_official"]).all()  # the official split supervises a subset
        if rendered.scan_exact:
            exact += 1
            assert chat.deepseek_v4_mask(np.array(whole), special).tolist() == masks["deepseek_v4"].tolist()
    assert rendered_count > 200 and exact > 20


@pytest.mark.parametrize(
    "messages,message",
    [
        (None, "messages: expected a list of {role, content} objects, got missing"),
        ("hi", "messages: expected a list of {role, content} objects, got str"),
        ([], "messages: empty list"),
        (["hi"], "messages[0]: expected an object with role and content, got str"),
        (
            [{"role": "function", "content": "x"}],
            "messages[0].role: unknown role 'function' "
            "(expected system, developer, user, tool, assistant or latest_reminder)",
        ),
        ([{"content": "x"}], "messages[0].role: unknown role None"),
        ([{"role": "user", "content": 3}], "messages[0].content: expected a string, got int 3"),
        ([{"role": "user"}], "messages[0].content: expected a string, got missing"),
        ([{"role": "user", "content": None}], "messages[0].content: expected a string, got missing"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": ["a"]}],
            "messages[1].content: expected a string, got list",
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant"}],
            "messages[1].content: expected a string, got missing",
        ),
        (
            [{"role": "user", "content": "q"}],
            "messages[0].role: conversation ends with a user turn; expected a final assistant turn",
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "user", "content": "q"}],
            "messages[1].role: conversation ends with a user turn",
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}],
            "messages[2].role: conversation ends with a user turn",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "system", "content": "s"},
            ],
            "messages[2].role: conversation ends with a system turn",
        ),
        ([{"role": "system", "content": "s"}], "messages[0].role: conversation ends with a system turn"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": 1}],
            "messages[1].reasoning_content: expected a string, got int 1",
        ),
        # keys the format has no place for are refused, not dropped
        (
            [{"role": "user", "content": "q", "name": "bob"}, {"role": "assistant", "content": "a"}],
            "messages[0].name: not part of the DeepSeek-V4 format for a message of role user "
            "(expected content, mask, task)",
        ),
        (
            [{"role": "user", "content": "q", "tool_calls": [CALL]}, {"role": "assistant", "content": "a"}],
            "messages[0].tool_calls: not part of the DeepSeek-V4 format for a message of role user",
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tools": [TOOL]}],
            "messages[1].tools: not part of the DeepSeek-V4 format for a message of role assistant",
        ),
        (
            [{"role": "developer", "content": ""}, {"role": "assistant", "content": "a"}],
            "messages[0].content: expected a non-empty string",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool"},
                {"role": "assistant", "content": "a"},
            ],
            "messages[2].content: expected a string, got missing",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": [{"type": "image", "url": "x"}]},
                {"role": "assistant", "content": "a"},
            ],
            "messages[2].content[0]: expected a {type: text, text: string} block",
        ),
        # tool calls: arguments must be the JSON text of an object
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]},
                {"role": "tool", "content": "r"},
                {"role": "assistant", "content": "a"},
            ],
            "messages[1].tool_calls[0].function.arguments: expected a JSON object (OpenAI format), got 'not json'",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
                {"role": "tool", "content": "r"},
                {"role": "assistant", "content": "a"},
            ],
            "messages[1].tool_calls[0].function.arguments: expected a string, got dict",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
                {"role": "tool", "content": "r"},
                {"role": "assistant", "content": "a"},
            ],
            "messages[1].tool_calls[0].function.name: expected a string, got missing",
        ),
        (
            [
                {"role": "system", "content": "s", "tools": [{"type": "function"}]},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
            ],
            "messages[0].tools[0].function: expected an object (OpenAI function tool), got missing",
        ),
        # reasoning the mode cannot show, tasks that would vanish, turns that cannot be masked apart
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}],
            "messages[1].reasoning_content: chat mode renders no reasoning",
        ),
        (
            [
                {"role": "user", "content": "q", "task": "query"},
                {"role": "user", "content": "p"},
                {"role": "assistant", "content": "a"},
            ],
            "messages[0].task: the format renders a task token only before an assistant or latest_reminder turn; "
            "the next message is a user turn",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "user", "content": "p", "task": "query"},
                {"role": "assistant", "content": "a"},
            ],
            "messages[1].task: a task on a user message merged into the turn of messages[0]",
        ),
        (
            [{"role": "user", "content": "q", "task": "nope"}, {"role": "assistant", "content": "a"}],
            "messages[0].task: unknown task 'nope'",
        ),
        (
            [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
            "messages[1]: the assistant turn follows the system text of messages[0] with no special token between",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "latest_reminder", "content": "today"},
                {"role": "assistant", "content": "a"},
            ],
            "messages[2]: the assistant turn follows the latest_reminder text of messages[1]",
        ),
    ],
)
def test_role_and_content_errors(messages, message):
    mode = "chat" if any(isinstance(m, dict) and m.get("reasoning_content") == "r" for m in messages or []) else "auto"
    with pytest.raises(chat.ConversationError) as err:
        chat.render(messages, chat.Encoding(thinking_mode=mode))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
