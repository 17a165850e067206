"""Character tokenizer, local Hugging Face tokenizer, and `load_tokenizer` specs."""

import json

import pytest

from megatron_gspo.data import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def test_char_roundtrip_and_special_ids():
    tok = load_tokenizer("char")
    assert isinstance(tok, Tokenizer)
    ids = tok.encode("123+045=")
    assert len(ids) == 8 and min(ids) >= 2  # 0 and 1 are pad and eos
    assert tok.decode(ids) == "123+045="
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.stop_ids) == (0, 1, None, (1,))
    # The response of a synthetic task ends with eos; decoding drops it so rewards compare digits only.
    assert tok.decode(tok.encode("168") + [tok.eos_id, tok.pad_id]) == "168"
    assert tok.decode(tok.encode("1") + [tok.eos_id], skip_special_tokens=False) == "1<eos>"
    assert len(set(tok.encode("0123456789+-*="))) == 14 and tok.vocab_size == 16


def test_char_unknown_character_names_it_and_the_text():
    with pytest.raises(ValueError, match=r"character 'x' at position 2 of '12x4' is not in the tokenizer"):
        load_tokenizer("char").encode("12x4")
    with pytest.raises(ValueError, match="token id 99 is outside"):
        load_tokenizer("char").decode([99])


def test_char_custom_alphabet():
    tok = load_tokenizer("char:ab ")
    assert tok.vocab_size == 5
    assert tok.decode(tok.encode("ab ba")) == "ab ba"
    with pytest.raises(ValueError, match="repeats characters"):
        CharTokenizer("aba")
    with pytest.raises(ValueError, match="non-empty alphabet"):
        load_tokenizer("char:")


def test_hf_tokenizer_from_local_directory(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "<|im_end|>": 3, "hello": 4, "world": 5, "42": 6}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_end|>"],
    )
    fast.save_pretrained(tmp_path)
    # Chat models list more than one end-of-response id in generation_config.json.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1]}))

    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    ids = tok.encode("hello world 42")
    assert ids == [4, 5, 6]  # no special tokens added
    assert tok.decode(ids + [tok.eos_id]) == "hello world 42"
    assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.vocab_size) == (1, 0, None, 7)
    assert tok.stop_ids == (1, 3)


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="tokenizer directory .*missing.* does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="could not load a tokenizer from"):
        load_tokenizer(str(tmp_path))  # exists, but holds no tokenizer files
