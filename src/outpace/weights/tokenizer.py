"""The tokenizer: built once from GGUF metadata, loaded from a model folder, and decoded as a stream.

`tokenizer_from_gguf` turns llama.cpp's vocabulary keys (tokenizer.ggml.*) into a `tokenizers`
tokenizer that splits text the way llama.cpp does for that file's `tokenizer.ggml.pre`.
`Tokenizer` wraps it with the model's special tokens and its Jinja chat template.
`IncrementalDecoder` turns token ids into text as they arrive, never splitting a UTF-8 character.
"""
from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from outpace.errors import CorruptModelError, InvalidParameterError, ModelNotFoundError, UnsupportedModelError

# llama.cpp token types (tokenizer.ggml.token_type).
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4

_GPT2_SPLIT = None  # ByteLevel's own regex: 's|'t|... ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> (split regex, digits split one by one first, whole-word lookup before merges).
# Digits first is StarCoder's scheme (SmolLM uses it); llama.cpp skips merges for words in the vocab
# only for Llama 3.
PRE_TOKENIZERS = {
    **{pre: (_GPT2_SPLIT, False, False) for pre in ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")},
    **{pre: (_GPT2_SPLIT, True, False) for pre in ("smollm", "starcoder", "refact", "codeshell", "command-r")},
    **{pre: (_LLAMA3_SPLIT, False, True) for pre in ("llama3", "llama-v3", "llama-bpe", "falcon3")},
    **{pre: (_LLAMA3_SPLIT, False, False) for pre in ("smaug-bpe", "dbrx")},
    **{pre: (_QWEN2_SPLIT, False, False) for pre in ("qwen2", "deepseek-r1-qwen")},
}


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> tuple[Backend, dict]:
    """(tokenizer, tokenizer_config) for the vocabulary in a GGUF's metadata.

    Token ids are the GGUF's positions, special tokens included: every token string maps to its own
    index, and control tokens are added under the same string, so no id moves.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama") or not tokens:
        raise UnsupportedModelError(f"GGUF tokenizer {kind!r} is not supported; outpace reads byte-level BPE "
                                    "('gpt2') and sentencepiece ('llama') vocabularies. Use another GGUF of the model.")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if kind == "gpt2":
        backend, default_add_bos = _byte_level(meta, tokens)
    else:
        backend, default_add_bos = _sentencepiece(meta, tokens, types), True
    add_bos = default_add_bos if add_bos is None else bool(add_bos)
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    # Special tokens are matched whole in raw text, before any normalizer or pre-tokenizer.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, token_type in zip(tokens, types) if token_type in (CONTROL, UNKNOWN)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, token_type in zip(tokens, types) if token_type == USER_DEFINED])

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    single = ([f"{bos}:0"] if add_bos and bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos and eos else [])
    specials = [(t, tokens.index(t)) for t in {bos, eos} if t and f"{t}:0" in single]
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "unk_token": token("unknown"), "pad_token": token("padding") or eos,
              "add_bos_token": add_bos, "add_eos_token": add_eos, "clean_up_tokenization_spaces": False}
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return backend, config


def _byte_level(meta: Mapping[str, Any], tokens: list[str]) -> tuple[Backend, bool]:
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                                    f"{sorted(PRE_TOKENIZERS)}. Use a GGUF of a supported model family.")
    split, is_digits_first, ignore_merges = PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if is_digits_first else []
    if split is not None:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]
    backend.decoder = decoders.ByteLevel()
    return backend, pre in ("llama3", "llama-v3", "llama-bpe", "falcon3")


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> Backend:
    """Sentencepiece BPE as llama.cpp runs it: merges ranked by the merged token's score, unknown
    characters spelled as <0xNN> byte tokens, and a space before text that starts a fragment."""
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for index, piece in enumerate(tokens):
        if types[index] != 1:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
    backend = Backend(models.BPE(vocab, merges, unk_token=tokens[unk], fuse_unk=True, byte_fallback=True))
    is_prefixed = meta.get("tokenizer.ggml.add_space_prefix", True)
    spaces = [normalizers.Replace(" ", "\u2581")]
    backend.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if is_prefixed else []) + spaces)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if is_prefixed else []))
    return backend


class Tokenizer:
    """Text <-> token ids for one model, plus its special tokens and chat template."""

    def __init__(self, backend: Backend, config: Mapping[str, Any], eos_token_ids: set[int]):
        self.backend = backend
        self.config = dict(config)
        self.bos_token: str | None = config.get("bos_token")
        self.eos_token: str | None = config.get("eos_token")
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_ids = set(eos_token_ids)
        if self.eos_token and backend.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(backend.token_to_id(self.eos_token))
        self._template: jinja2.Template | None = None

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"{folder} has no tokenizer.json; pass a model folder converted by outpace "
                                     "or one downloaded from Hugging Face with its tokenizer files.")
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        for key in ("bos_token", "eos_token"):  # Hugging Face may spell these as AddedToken dicts
            if isinstance(config.get(key), dict):
                config[key] = config[key].get("content")
        eos_ids: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            value = _read_json(folder / name).get("eos_token_id")
            eos_ids.update(value if isinstance(value, list) else [] if value is None else [value])
        return cls(backend, config, eos_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (the longest vocabulary entry: a
        byte-level entry spells one byte per character, a sentencepiece one at least its text),
        so a text of n characters holds at least n / max_token_chars tokens."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch runs without holding the GIL (encode holds it, about 0.5 s per MB of text),
        # so a long prompt never stalls the server's other threads
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    special_tokens_in_content: bool = False) -> list[int]:
        """The token ids of messages rendered by the chat template. Only the template's own markup
        becomes control tokens: special-token text inside the messages ("<|im_end|><|im_start|>system"
        typed into a user's content) is tokenized as the plain text it is, so it cannot forge a
        role. special_tokens_in_content=True parses it as control tokens instead.

        Without special-token text in the messages the ids equal encode(rendered text), which
        also splits at each special token and encodes the pieces between apart.
        """
        if special_tokens_in_content:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
        hidden: list[str] = []
        shielded = [_shield(message, self._specials_or_marks, hidden) for message in messages]
        pieces = self._specials.split(self.apply_chat_template(shielded, add_generation_prompt))
        texts = [_MARKED.sub(lambda m: hidden[int(m[1])], piece) for piece in pieces[0::2]]  # [plain, special, ...]
        ids: list[int] = []
        for i, encoding in enumerate(self._plain.encode_batch(texts, add_special_tokens=False)):
            ids += encoding.ids
            if 2 * i + 1 < len(pieces):
                ids.append(self.backend.token_to_id(pieces[2 * i + 1]))
        return ids

    @functools.cached_property
    def _special_texts(self) -> list[str]:
        """The control tokens' texts, longest first (the leftmost-longest match the backend makes)."""
        texts = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        return sorted(texts, key=len, reverse=True)

    @functools.cached_property
    def _specials(self) -> re.Pattern:
        # a capturing group: split() keeps the special tokens between the plain pieces
        return re.compile("(" + "|".join(map(re.escape, self._special_texts)) + ")" if self._special_texts else "($^)")

    @functools.cached_property
    def _specials_or_marks(self) -> re.Pattern:
        return re.compile("|".join([*map(re.escape, self._special_texts), _MARK_OPEN, _MARK_CLOSE]))

    @functools.cached_property
    def _plain(self) -> Backend:
        """The backend that reads special-token text as text (other added tokens still apply)."""
        plain = Backend.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold part of a character, which
        decode alone shows as U+FFFD): an added token's text, a byte-level entry's bytes, a
        sentencepiece byte token (<0xNN>) its byte, another sentencepiece piece its text with
        U+2581 as a space."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        if self._byte_values is not None:
            values = self._byte_values
            return bytes(values[c] for c in piece) if all(c in values for c in piece) else piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token as text, as OpenAI's logprobs spell it: its bytes as UTF-8, any byte that
        does not complete a character escaped as \\xNN."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_values(self) -> dict[str, int] | None:
        """A byte-level vocabulary's characters -> the bytes they spell (GPT-2's table: printable
        bytes as themselves, the others as the characters from U+0100 on), or None."""
        if not isinstance(self.backend.decoder, decoders.ByteLevel):
            return None
        printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        others = [b for b in range(256) if b not in printable]
        return {**{chr(b): b for b in printable}, **{chr(0x100 + i): b for i, b in enumerate(others)}}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **context: Any) -> str:
        """The model's own Jinja template rendered with the variables Hugging Face templates expect."""
        if self._template is None:
            self._template = _compile_template(self.config.get("chat_template"))
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **context)
        except jinja2.TemplateError as error:
            raise InvalidParameterError(f"the model's chat template rejected these messages: {error}") from None


class IncrementalDecoder:
    """Streams text for generated ids, one step at a time.

    Invariant: the concatenation of everything `step` and `finish` return equals
    decode(prompt + generated) minus decode(prompt); for byte-level BPE that is decode(generated).
    Each step decodes only a window ids[prefix:], and text is released only up to a complete
    character: a window ending in U+FFFD (an unfinished UTF-8 sequence) waits for more ids.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        # ids[prefix:read] is context already emitted; a few prompt ids give the first word its space.
        self.read = len(self.ids)
        self.prefix = max(self.read - 4, 0)

    def step(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        return self._emit(is_final=False)

    def finish(self) -> str:
        """Whatever is held back (an unfinished character at the very end), as decode would show it."""
        return self._emit(is_final=True)

    def _emit(self, is_final: bool) -> str:
        if len(self.ids) == self.read:
            return ""
        decode = self.tokenizer.decode
        context = decode(self.ids[self.prefix:self.read], self.skip_special_tokens)
        text = decode(self.ids[self.prefix:], self.skip_special_tokens)
        if text.endswith("\ufffd") and not is_final:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(context):]


# Special-token text (and these marks themselves) inside messages is replaced by a mark holding its
# index in a list, through the template, and put back into the plain text pieces afterwards.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARKED = re.compile(_MARK_OPEN + r"(\d+)" + _MARK_CLOSE)


def _shield(value: Any, pattern: re.Pattern, hidden: list[str]) -> Any:
    """value with every match of pattern in its strings (nested in lists and dicts) replaced by a mark."""
    if isinstance(value, str):
        def mark(match: re.Match) -> str:
            hidden.append(match[0])
            return f"{_MARK_OPEN}{len(hidden) - 1}{_MARK_CLOSE}"
        return pattern.sub(mark, value)
    if isinstance(value, dict):
        return {k: _shield(v, pattern, hidden) for k, v in value.items()}
    if isinstance(value, list):
        return [_shield(v, pattern, hidden) for v in value]
    return value


def _compile_template(source: Any) -> jinja2.Template:
    if isinstance(source, list):  # Hugging Face's named templates: [{"name": ..., "template": ...}]
        source = {t.get("name"): t.get("template") for t in source}.get("default")
    if not source:
        raise UnsupportedModelError("this model has no chat template (tokenizer_config.json has no chat_template); "
                                    "send a plain prompt to the completions endpoint instead of chat messages.")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise CorruptModelError(f"the model's chat template does not parse ({error}); fix chat_template "
                                "in tokenizer_config.json.") from None


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False, ensure_ascii=False):
    # Unlike jinja's own tojson, no HTML escaping: templates embed tool schemas verbatim.
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorruptModelError(f"{path} is not valid JSON ({error}); delete the model folder to convert again.")
