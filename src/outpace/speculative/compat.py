"""Whether a draft model may draft for a target: the two must mean the same token by the same id.

The draft never tokenizes text: it reads the target's token ids and proposes ids the target
verifies, so what must agree is the id -> token map, not the way text is split (pre-tokenizers
and merge ranks may differ; that costs acceptance, never correctness). Compared, in this order:

  kind       the tokenizer model (BPE, Unigram, ...) and its byte scheme (byte-level stand-ins or
             byte fallback): the same token string means other bytes under another scheme
  size       the vocabularies' lengths. A size difference is allowed only where every surplus id
             of the longer one is unused padding: not an added token, and never produced by its
             BPE model (neither an alphabet symbol, nor a merge's result, nor a byte-fallback
             token). llama.cpp pads GGUF vocabularies to the embedding's rows with such tokens
             ([PAD151665] ...), and models of one family are padded to different lengths.
  specials   bos, the eos set and pad ids, then every added token (chat markup such as
             <|im_start|>, fill-in-the-middle markers, ...): same id, same text, same special flag
  texts      the token text of every shared id

Chat templates are not compared: the target's template renders the prompt, and the draft reads
the ids that come of it (Qwen2.5-Coder's 0.5B and 1.5B templates differ in one line of the tool
instructions). The result is the number of shared ids: ids below it mean the same token to both
models; a drafter keeps its proposals below it.
"""
from __future__ import annotations

import json

from tokenizers import Tokenizer as Backend

from outpace.errors import IncompatibleModelsError
from outpace.weights.tokenizer import Tokenizer

NUM_SHOWN = 5  # differing ids quoted in an error


def check_vocab_compatible(target: Tokenizer, draft: Tokenizer) -> int:
    """The number of ids [0, n) that mean the same token to target and draft; raises
    IncompatibleModelsError saying what differs when the draft cannot draft for the target."""
    kinds = vocab_kind(target.backend), vocab_kind(draft.backend)
    if kinds[0] != kinds[1]:
        _fail(f"the target's vocabulary is {kinds[0]}, the draft's {kinds[1]}")
    num_shared = min(target.vocab_size, draft.vocab_size)
    for who, tokenizer in (("target", target), ("draft", draft)):
        used = _in_use(tokenizer.backend, range(num_shared, tokenizer.vocab_size))
        if used:
            _fail(f"the target has {target.vocab_size} tokens, the draft {draft.vocab_size}, and the {who}'s "
                  f"surplus ids are not all unused padding: {_quote(tokenizer.backend, used)}")
    specials = [(name, t, d) for name, t, d in (
        ("bos id", target.bos_token_id, draft.bos_token_id),
        ("eos ids", sorted(target.eos_token_ids), sorted(draft.eos_token_ids)),
        ("pad id", _pad_id(target), _pad_id(draft))) if t != d]
    if specials:
        _fail("; ".join(f"the target's {name} is {t}, the draft's {d}" for name, t, d in specials))
    added = _added(target.backend, num_shared), _added(draft.backend, num_shared)
    if added[0] != added[1]:
        ids = sorted(i for i in added[0].keys() | added[1].keys() if added[0].get(i) != added[1].get(i))
        shown = ", ".join(f"{i}: {added[0].get(i)} (target) vs {added[1].get(i)} (draft)" for i in ids[:NUM_SHOWN])
        _fail(f"their added tokens differ at {len(ids)} ids, first {shown}")
    texts = [target.backend.id_to_token(i) for i in range(num_shared)]
    differ = [i for i, text in enumerate(texts) if draft.backend.id_to_token(i) != text]
    if differ:
        shown = ", ".join(f"{i}: {texts[i]!r} (target) vs {draft.backend.id_to_token(i)!r} (draft)"
                          for i in differ[:NUM_SHOWN])
        _fail(f"{len(differ)} of {num_shared} token texts differ, first {shown}")
    return num_shared


def vocab_kind(backend: Backend) -> str:
    """'BPE, byte-level', 'BPE, byte fallback', 'Unigram', ...: what a token string means."""
    decoder = backend.decoder.__getstate__().decode() if backend.decoder is not None else ""
    is_fallback = getattr(backend.model, "byte_fallback", False)
    scheme = ", byte-level" if '"ByteLevel"' in decoder else ", byte fallback" if is_fallback else ""
    return type(backend.model).__name__ + scheme


def _in_use(backend: Backend, ids: range) -> list[int]:
    """The ids among `ids` that are not unused padding (see the module's notes)."""
    if not ids:
        return []
    state = json.loads(backend.model.__getstate__())
    if state["type"] != "BPE":  # no rule says which ids another model kind never produces
        return list(ids)
    merged = {a + b for a, b in (m if isinstance(m, list) else m.split(" ", 1) for m in state["merges"])}
    added = backend.get_added_tokens_decoder()

    def is_produced(token: str) -> bool:
        is_byte = state.get("byte_fallback") and len(token) == 6 and token.startswith("<0x") and token.endswith(">")
        return len(token) == 1 or is_byte or token in merged

    return [i for i in ids if i in added or is_produced(backend.id_to_token(i))]


def _added(backend: Backend, num_shared: int) -> dict[int, str]:
    return {i: f"{t.content!r}{' (special)' if t.special else ''}"
            for i, t in backend.get_added_tokens_decoder().items() if i < num_shared}


def _pad_id(tokenizer: Tokenizer) -> int | None:
    pad = tokenizer.config.get("pad_token")
    return tokenizer.backend.token_to_id(pad) if isinstance(pad, str) else None


def _quote(backend: Backend, ids: list[int]) -> str:
    shown = ", ".join(f"{i}: {backend.id_to_token(i)!r}" for i in ids[:NUM_SHOWN])
    return f"{len(ids)} ids, first {shown}"


def _fail(what: str) -> None:
    raise IncompatibleModelsError(f"the draft model cannot draft for the target: {what}. A draft model must "
                                  "share the target's vocabulary (the same tokenizer, id for id): pick a smaller "
                                  "model of the target's own family.")
