"""The draft/target vocabulary check: a pair that means the same token by every shared id passes
(padding ids beyond the shorter vocabulary allowed), and a pair differing in any one way (kind,
used surplus ids, special ids, added tokens, token texts) fails with a message naming that way and
the first differing ids."""
from __future__ import annotations

import pytest
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as Backend

from outpace.errors import IncompatibleModelsError
from outpace.speculative.compat import check_vocab_compatible
from outpace.weights.tokenizer import Tokenizer

ALPHABET = list("abcdehlorw\u0120")  # \u0120: byte-level BPE's stand-in for a space
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("\u0120", "w"), ("o", "r")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny(*, merges: list[tuple[str, str]] = MERGES, specials: list[str] = SPECIALS, special_flags: bool = True,
         extra: list[str] = (), byte_level: bool = True, bos: str = "<|endoftext|>", eos: str = "<|im_end|>",
         pad: str = "<|endoftext|>", unigram: bool = False, swap: tuple[int, int] | None = None) -> Tokenizer:
    """A small BPE tokenizer laid out as a GGUF one is: the alphabet and MERGES' results (ids 0-16),
    the added special tokens (17-19), then `extra` tokens (padding or not). swap: two ids whose
    tokens trade places."""
    tokens = ALPHABET + [a + b for a, b in MERGES] + specials + list(extra)
    if swap:
        i, j = swap
        tokens[i], tokens[j] = tokens[j], tokens[i]
    vocab = {t: i for i, t in enumerate(tokens)}
    if unigram:
        backend = Backend(models.Unigram([(t, -1.0) for t in tokens], 0, False))
    else:
        backend = Backend(models.BPE(vocab, merges, byte_fallback=not byte_level))
    backend.decoder = decoders.ByteLevel() if byte_level else decoders.ByteFallback()
    added = [AddedToken(t, special=special_flags, normalized=False) for t in specials]
    if special_flags:
        backend.add_special_tokens(added)
    else:
        backend.add_tokens(added)
    return Tokenizer(backend, {"bos_token": bos, "eos_token": eos, "pad_token": pad}, {vocab[eos]})


def incompatible(target: Tokenizer, draft: Tokenizer, match: str) -> None:
    with pytest.raises(IncompatibleModelsError, match=r"^the draft model cannot draft for the target: " + match):
        check_vocab_compatible(target, draft)


def test_same_vocabulary_shares_every_id():
    assert tiny().vocab_size == 20
    assert check_vocab_compatible(tiny(), tiny()) == 20


@pytest.mark.parametrize("padded", ["draft", "target"])
def test_padding_beyond_the_shorter_vocabulary_is_allowed(padded):
    """llama.cpp pads a GGUF vocabulary to the embedding's rows with tokens nothing produces."""
    pads = {"extra": ["[PAD20]", "[PAD21]", "[PAD22]"]}
    target, draft = (tiny(), tiny(**pads)) if padded == "draft" else (tiny(**pads), tiny())
    assert check_vocab_compatible(target, draft) == 20


@pytest.mark.parametrize("surplus, draft", [
    ("'\u0120wor'", dict(merges=MERGES + [("\u0120w", "or")], extra=["[PAD20]", "\u0120wor"])),  # a merge's result
    ("'z'", dict(extra=["[PAD20]", "z"])),                                              # an alphabet symbol
    (r"'<\|fim_prefix\|>'", dict(specials=SPECIALS + ["<|fim_prefix|>"], extra=["[PAD21]"])),  # an added token
], ids=["merged", "symbol", "added"])
def test_surplus_ids_the_tokenizer_produces_are_not_padding(surplus, draft):
    incompatible(tiny(), tiny(**draft), r"the target has 20 tokens, the draft 22, and the draft's surplus ids are "
                                        rf"not all unused padding: 1 ids, first 2\d: {surplus}\.")


def test_surplus_of_another_model_kind_is_never_padding():
    incompatible(tiny(unigram=True, byte_level=False, extra=["[PAD20]"]), tiny(unigram=True, byte_level=False),
                 r"the target has 21 tokens, the draft 20, and the target's surplus ids are not all unused "
                 r"padding: 1 ids, first 20: '\[PAD20\]'")


def test_byte_scheme_differs():
    """The same string is other bytes to byte-level BPE ('\u0120' a space) and to byte fallback."""
    incompatible(tiny(), tiny(byte_level=False), r"the target's vocabulary is BPE, byte-level, the draft's BPE, "
                                                 r"byte fallback\.")
    incompatible(tiny(unigram=True), tiny(), r"the target's vocabulary is Unigram, byte-level, the draft's BPE, "
                                             r"byte-level\.")


@pytest.mark.parametrize("draft, message", [
    (dict(bos="<|im_start|>"), "the target's bos id is 17, the draft's 18"),
    (dict(eos="<|endoftext|>"), r"the target's eos ids is \[19\], the draft's \[17\]"),
    (dict(pad="<|im_end|>", eos="<|endoftext|>"),
     r"the target's eos ids is \[19\], the draft's \[17\]; the target's pad id is 17, the draft's 19"),
])
def test_special_ids_differ(draft, message):
    incompatible(tiny(), tiny(**draft), message + r"\.")


def test_added_tokens_differ_in_text_or_flag():
    """Chat markup is what the target's template writes: its ids must be the draft's."""
    renamed = tiny(specials=["<|endoftext|>", "<|im_begin|>", "<|im_end|>"])
    incompatible(tiny(), renamed, r"their added tokens differ at 1 ids, first 18: '<\|im_start\|>' \(special\) "
                                  r"\(target\) vs '<\|im_begin\|>' \(special\) \(draft\)\.")
    incompatible(tiny(), tiny(special_flags=False), r"their added tokens differ at 3 ids, first 17: "
                                                    r"'<\|endoftext\|>' \(special\) \(target\) vs "
                                                    r"'<\|endoftext\|>' \(draft\), 18: ")


def test_token_texts_differ():
    incompatible(tiny(), tiny(swap=(2, 12)), r"2 of 20 token texts differ, first 2: 'c' \(target\) vs 'll' "
                                             r"\(draft\), 12: 'll' \(target\) vs 'c' \(draft\)\.")


def test_gguf_vocabularies_padded_to_other_lengths_are_compatible(tmp_path, monkeypatch):
    """Two GGUFs of one vocabulary whose embeddings (and so [PADn] tails) differ in rows."""
    from gguf_writer import write_test_gguf
    from outpace.weights.gguf import convert_gguf

    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path / "home"))
    write_test_gguf(tmp_path / "target.gguf", "qwen2", {"vocab_size": 320})
    write_test_gguf(tmp_path / "draft.gguf", "qwen2", {"vocab_size": 288})
    target, draft = (Tokenizer.from_folder(convert_gguf(tmp_path / f"{m}.gguf")) for m in ("target", "draft"))
    assert (target.vocab_size, draft.vocab_size) == (320, 288)
    assert check_vocab_compatible(target, draft) == 288
    assert check_vocab_compatible(draft, target) == 288
