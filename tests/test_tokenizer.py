"""The tokenizer built from GGUF metadata encodes, decodes and renders chat exactly like transformers'
own GGUF tokenizer, except where transformers departs from llama.cpp (tested as such), and the
incremental decoder streams exactly the text a full decode gives."""
from __future__ import annotations

import random

import pytest

from outpace.errors import InvalidParameterError, UnsupportedModelError
from gguf_writer import write_test_gguf
from outpace.weights.gguf import convert_gguf
from outpace.weights.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = [
    "Hello, world!", "  leading spaces", "trailing   ", "tabs\tand\nnewlines\r\n", "   \n\n\n   ", "",
    "ünïcödé façade Ångström", "你好，世界！这是一个测试。", "日本語のテキスト", "Привет, мир", "مرحبا بالعالم",
    "emoji 🎉🚀 family 👨‍👩‍👧 flag 🇫🇷", "def f(x):\n    return x ** 2  # square\n", "x=123; y = 4567.89 ",
    "I'm sure they'll say it's fine", "\u00a0non-breaking\u2009thin", "a" * 80,
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|><repo_name>x<file_sep>", "<|im_start|", "<|im_end|>trailing",
]
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer in français, s'il vous plaît 🙂"},
]


@pytest.fixture(scope="module")
def ours(default_model_dir) -> Tokenizer:
    return Tokenizer.from_folder(default_model_dir)


@pytest.fixture(scope="module")
def reference(default_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours, reference, add_special_tokens):
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens) == expected, text


def test_decode_round_trips_and_matches_transformers(ours, reference):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


def test_digits_split_one_by_one_like_llama_cpp(ours):
    """tokenizer.ggml.pre = 'smollm' means StarCoder's split: every digit on its own first, then GPT-2's
    regex. transformers' GGUF loader ignores it (it gives 'a', 'Ġ', 'Ġ', '1' here); llama.cpp and the
    model's own tokenizer.json keep the space run whole."""
    tokens = lambda text: [ours.backend.id_to_token(i) for i in ours.encode(text)]
    assert tokens("a  1") == ["a", "ĠĠ", "1"]
    assert tokens("x 2024") == ["x", "Ġ", "2", "0", "2", "4"]


def test_chat_template_matches_transformers(ours, reference):
    for messages in (CONVERSATION, CONVERSATION[1:]):  # without a system message the template adds one
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_special_tokens(ours, reference):
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.eos_token_ids == {reference.eos_token_id} == {2}


def test_template_errors(ours):
    with pytest.raises(UnsupportedModelError, match="no chat template"):
        Tokenizer(ours.backend, {}, set()).apply_chat_template(CONVERSATION)
    strict = Tokenizer(ours.backend, {"chat_template": "{{ raise_exception('roles must alternate') }}"}, set())
    with pytest.raises(InvalidParameterError, match="roles must alternate"):
        strict.apply_chat_template(CONVERSATION)


def _stream(tokenizer, prompt, ids, rng) -> list[str]:
    decoder, pieces, at = IncrementalDecoder(tokenizer, prompt), [], 0
    while at < len(ids):
        size = rng.choice([1, 1, 1, 2, 3, 5])  # a speculative step accepts several tokens at once
        pieces.append(decoder.step(ids[at:at + size]))
        at += size
    return pieces + [decoder.finish()]


@pytest.mark.parametrize("seed", range(3))
def test_incremental_decoder_concatenates_to_full_decode(ours, seed):
    """Multi-byte characters split across tokens are held back until whole, never emitted as U+FFFD."""
    rng = random.Random(seed)
    prompt = ours.encode(ours.apply_chat_template(CONVERSATION[1:2]), add_special_tokens=False)
    for text in TEXTS:
        ids = ours.encode(text)
        pieces = _stream(ours, prompt if seed else [], ids, rng)
        assert "".join(pieces) == ours.decode(ids), text
        assert not any("\ufffd" in piece for piece in pieces), text


def test_incremental_decoder_one_token_at_a_time_on_multibyte_text(ours):
    ids = ours.encode("日本語 👨‍👩‍👧 ünï 你好")
    assert any("\ufffd" in ours.decode([i]) for i in ids)  # the text really splits characters
    decoder = IncrementalDecoder(ours, [])
    pieces = [decoder.step([i]) for i in ids]
    assert "".join(pieces) == ours.decode(ids) and decoder.finish() == ""


def test_incremental_decoder_on_random_ids(ours):
    """Even invalid UTF-8 (random byte tokens) streams to exactly what decode shows."""
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert "".join(_stream(ours, [], ids, rng)) == ours.decode(ids)


@pytest.fixture
def sentencepiece(tmp_path, monkeypatch) -> Tokenizer:
    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path / "home"))
    write_test_gguf(tmp_path / "spm.gguf", tokenizer="llama")
    return Tokenizer.from_folder(convert_gguf(tmp_path / "spm.gguf"))


def test_sentencepiece_follows_llama_cpp(sentencepiece):
    """llama.cpp puts a space before every text fragment that starts the prompt or follows a special
    token, and spells characters missing from the vocabulary as <0xNN> byte tokens."""
    tok = sentencepiece
    tokens = lambda text, special=True: [tok.backend.id_to_token(i) for i in tok.encode(text, special)]
    assert tokens("hello world") == ["<s>", "\u2581hello", "\u2581world"]
    assert tokens(" the") == ["<s>", "\u2581", "\u2581the"]
    assert tokens("<s>hello</s>the", False) == ["<s>", "\u2581hello", "</s>", "\u2581the"]
    assert tokens("é", False) == ["\u2581", "<0xC3>", "<0xA9>"]
    for text in ("hello world", " the  world", "héllo wörld 你好", "a\nb\tc"):
        assert tok.decode(tok.encode(text)) == text


def test_byte_level_test_vocabulary_matches_transformers(tmp_path, monkeypatch):
    """The GPT-2 split (tokenizer.ggml.pre = 'gpt2') of write_test_gguf's small vocabulary."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path / "home"))
    write_test_gguf(tmp_path / "t.gguf")
    ours = Tokenizer.from_folder(convert_gguf(tmp_path / "t.gguf"))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in ["hello world", "the  world in   the", "Hello 123 ünï 🎉", "<|im_start|>user\nhello<|im_end|>"]:
        assert ours.encode(text) == reference.encode(text), text
