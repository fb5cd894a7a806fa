"""DeepSeek-V4 rendering and the deepseek_v4 loss mask, token by token, with the real tokenizer."""

import numpy as np
import pytest

import helpers
from trainer.data import chat
from trainer.data.build import load_tokenizer

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


@pytest.fixture(scope="module")
def tok():
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


def encode_one(tok, messages):
    tokenizer, special = tok
    ids, mask, lengths = chat.encode(tokenizer, special, [chat.render(messages)])
    assert lengths.tolist() == [len(ids)]
    return ids.tolist(), mask.tolist()


def test_special_ids_are_single_tokens_of_the_shipped_tokenizer(tok):
    _, special = tok
    assert (special.bos, special.eos, special.user, special.assistant, special.think_start, special.think_end) == (
        0, 1, 128803, 128804, 128821, 128822)


def test_worked_example_of_the_docstring(tok):
    messages = [{"role": "system", "content": "You are concise."}, {"role": "user", "content": "First?"},
                {"role": "assistant", "content": "One."}]
    rendered = chat.render(messages)
    assert rendered.text == f"{BOS}You are concise.{USER}First?{ASSISTANT}</think>One.{EOS}"
    ids, mask = encode_one(tok, messages)
    assert ids == [0, 3476, 477, 47468, 16, 128803, 10318, 33, 128804, 128822, 6111, 16, 1]
    assert mask == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]


def test_multi_turn_without_system(tok):
    tokenizer, _ = tok
    messages = [{"role": "user", "content": "First?"}, {"role": "assistant", "content": "One."},
                {"role": "user", "content": "Second?"}, {"role": "assistant", "content": "Two."}]
    want = expected(tokenizer, [(f"{BOS}{USER}First?{ASSISTANT}", 0), (f"</think>One.{EOS}", 1),
                                (f"{USER}Second?{ASSISTANT}", 0), (f"</think>Two.{EOS}", 1)])
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
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "dropped"},
                {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6", "reasoning_content": "3 and 3 make 6"}]
    rendered = chat.render(messages)
    assert rendered.text == f"{BOS}{USER}2+2?{ASSISTANT}</think>4{EOS}{USER}3+3?{ASSISTANT}<think>3 and 3 make 6</think>6{EOS}"
    ids, mask = encode_one(tok, messages)
    assert (ids, mask) == expected(tokenizer, [(f"{BOS}{USER}2+2?{ASSISTANT}", 0), (f"</think>4{EOS}", 1),
                                             (f"{USER}3+3?{ASSISTANT}", 0), (f"<think>3 and 3 make 6</think>6{EOS}", 1)])
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
    messages = [{"role": "system", "content": "Réponds."}, {"role": "user", "content": user},
                {"role": "assistant", "content": answer}]
    ids, mask = encode_one(tok, messages)
    text = f"{BOS}Réponds.{USER}{user}{ASSISTANT}</think>{answer}{EOS}"
    assert ids == ids_of(tokenizer, text)  # the same tokens as encoding the whole text
    want_ids, want_mask = expected(tokenizer, [(f"{BOS}Réponds.{USER}{user}{ASSISTANT}", 0), (f"</think>{answer}{EOS}", 1)])
    assert (ids, mask) == (want_ids, want_mask)
    # the marker inside user content is an unsupervised 128804; the EOS inside the answer a supervised 1
    assert [m for t, m in zip(ids, mask) if t == 128804] == [0, 0]
    assert [m for t, m in zip(ids, mask) if t == 1] == [1, 1]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_batch_encoding_equals_one_by_one(tok):
    tokenizer, special = tok
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * i}] for i in range(5)]
    ids, mask, lengths = chat.encode(tokenizer, special, [chat.render(c) for c in convs])
    start = 0
    for conv, n in zip(convs, lengths.tolist()):
        one_ids, one_mask = encode_one(tok, conv)
        assert ids[start : start + n].tolist() == one_ids and mask[start : start + n].tolist() == one_mask
        start += n
    assert start == len(ids)


def test_mask_scan_on_a_stream_with_separators(tok):
    _, special = tok
    # BOS u A m c EOS | sep EOS | BOS u A m EOS
    stream = np.array([0, 5, 128804, 128822, 7, 1, 1, 0, 5, 128804, 128822, 1])
    assert chat.deepseek_v4_mask(stream, special).tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("messages,message", [
    (None, "messages: expected a list of {role, content} objects, got missing"),
    ("hi", "messages: expected a list of {role, content} objects, got str"),
    ([], "messages: empty list"),
    (["hi"], "messages[0]: expected an object with role and content, got str"),
    ([{"role": "tool", "content": "x"}], "messages[0].role: unknown role 'tool' (expected system, user or assistant)"),
    ([{"content": "x"}], "messages[0].role: unknown role None"),
    ([{"role": "user", "content": 3}], "messages[0].content: expected a string, got int 3"),
    ([{"role": "user"}], "messages[0].content: expected a string, got missing"),
    ([{"role": "user", "content": None}], "messages[0].content: expected a string, got missing"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": ["a"]}], "messages[1].content: expected a string, got list"),
    ([{"role": "assistant", "content": "a"}], "messages[0].role: assistant turn follows the start; expected user"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "messages[1].role: assistant turn follows the start; expected user"),
    ([{"role": "user", "content": "q"}, {"role": "user", "content": "q"}], "messages[1].role: user turn follows a user turn; expected assistant"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
     "messages[2].role: assistant turn follows an assistant turn; expected user"),
    ([{"role": "user", "content": "q"}, {"role": "system", "content": "s"}], "messages[1].role: system message after messages[0]"),
    ([{"role": "user", "content": "q"}], "messages[0].role: conversation ends with a user turn"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}],
     "messages[2].role: conversation ends with a user turn"),
    ([{"role": "system", "content": "s"}], "messages: no user or assistant turn"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": 1}],
     "messages[1].reasoning_content: expected a string, got int 1"),
])
def test_role_and_content_errors(messages, message):
    with pytest.raises(chat.ConversationError) as err:
        chat.render(messages)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
