"""The OpenAI wire protocol: request bodies parsed and checked into SamplingParams, and the error
object every 4xx/5xx carries: {"error": {"message", "type", "param", "code"}}.

Fields are checked by hand so each message names the field and says what to send instead. Fields
the server does not know are ignored (as OpenAI-compatible servers do); fields it knows but cannot
honour (tools, response_format beyond text) are refused with a 400 rather than silently dropped.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from outpace.config import (MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, MAX_NUM_STOP,
                            MAX_REPETITION_PENALTY, MAX_STOP_CHARS, SamplingParams)
from outpace.errors import OutpaceError

MISSING = object()
MAX_CHOICES = 16        # n: the most choices one request asks for (each runs as a request in the engine)
MAX_PROMPTS = 64        # completions: the most prompts one request holds, and the most choices (prompts times n)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(error: OutpaceError, param: str | None = None) -> ApiError:
    """A 400 naming the parameter the error names, else `param`."""
    return ApiError(400, str(error), getattr(error, "param", None) or param)


@dataclass
class GenerateRequest:
    """One parsed completions or chat request; max_tokens None means 'whatever the context leaves';
    model None: the one the server serves."""

    model: str | None
    prompts: list[str | list[int]] | None = None   # completions: a batch of one or more prompts
    messages: list[dict] | None = None             # chat: [{role, content: str}]
    max_tokens: int | None = None
    sampling: dict = field(default_factory=dict)   # SamplingParams fields other than max_tokens
    n: int = 1                                     # choices, each sampled apart (seed s: choice i takes s + i)
    echo: bool = False                             # completions: the text (and logprobs) begin with the prompt's
    stream: bool = False
    include_usage: bool = False
    speculate: bool = True                         # extension: False decodes plainly (a baseline)
    cache_salt: str = ""                           # extension (vLLM's): reuse only cached prefixes of this salt

    @property
    def prompt_param(self) -> str:
        return "messages" if self.messages is not None else "prompt"

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """SamplingParams once the prompt's length is known: max_tokens must fit in the context."""
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise ApiError(400, f"the prompt has {num_prompt_tokens} tokens but the context holds {max_model_len} "
                                f"(prompt plus at least one new token): shorten the prompt", self.prompt_param,
                           code="context_length_exceeded")
        if self.max_tokens is not None and self.max_tokens > room:
            raise ApiError(400, f"max_tokens is {self.max_tokens} but the prompt has {num_prompt_tokens} tokens "
                                f"and the context holds {max_model_len}: ask for at most {room} tokens or "
                                f"shorten the prompt", "max_tokens", code="context_length_exceeded")
        try:
            return SamplingParams(max_tokens=self.max_tokens or room, **self.sampling)
        except OutpaceError as error:
            raise bad_request(error) from None


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object. Refused with a 400: invalid JSON or UTF-8 (json.loads alone would
    let UTF-8-encoded surrogates through), NaN and Infinity (not JSON), integers of over 4,300
    digits, nesting deeper than the interpreter's recursion limit, and lone surrogates
    ("\\ud800"), which no tokenizer or UTF-8 encoder accepts."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        raise ApiError(400, "the request body nests arrays or objects too deeply; send a flatter JSON object") from None
    except ValueError as error:     # JSONDecodeError, UnicodeDecodeError, an integer too long to convert
        raise ApiError(400, f"the request body is not valid JSON ({str(error)[:200]}); send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_kind(body)}")
    if _ESCAPED_SURROGATE.search(raw):      # valid UTF-8 holds none, so only a \u escape can make one
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "a string in the request body holds a lone UTF-16 surrogate (such as \\ud800); "
                                "send text as valid UTF-8 or as escaped surrogate pairs") from None
    return body


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _refuse_constant(name: str):
    raise ApiError(400, f"the request body holds {name}, which is not JSON; send a finite number")


def parse_completion(body: dict) -> GenerateRequest:
    prompt = _field(body, "prompt", (str, list), required=True)
    # a text, token ids, or a batch of either: a list of texts or of lists of ids
    is_batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if is_batch else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt holds {len(prompts)} prompts; send at most {MAX_PROMPTS} a request", "prompt")
    for p in prompts:
        if isinstance(p, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise ApiError(400, "prompt must be a string, a list of token ids (integers), or a list of either",
                           "prompt")
        if not p:
            raise ApiError(400, "prompt is empty: send at least one character or token id", "prompt")
    _unsupported(body, "suffix", allowed=(None, ""))
    _unsupported(body, "best_of", allowed=(None, 1))
    request = _common(body, max_tokens=_max_tokens(body, ("max_tokens",), default=16))
    # legacy completions: logprobs N asks for each token's logprob and its N likeliest alternatives,
    # echo's prompt tokens' too (scoring a text: lm-evaluation-harness's loglikelihood requests)
    request.sampling["logprobs"] = _integer(body, "logprobs", None, low=0, high=MAX_LOGPROBS)
    request.echo = _field(body, "echo", bool, default=False)
    if request.echo:
        request.sampling["prompt_logprobs"] = request.sampling["logprobs"]
    if len(prompts) * request.n > MAX_PROMPTS:
        raise ApiError(400, f"{len(prompts)} prompts of n={request.n} choices each make {len(prompts) * request.n} "
                            f"choices; a request may ask for at most {MAX_PROMPTS}", "n")
    request.prompts = prompts
    return request


def parse_chat(body: dict) -> GenerateRequest:
    messages = _field(body, "messages", list, required=True)
    if not messages:
        raise ApiError(400, "messages is empty: send at least one message", "messages")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with role and content, got {_kind(message)}", where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"{where}.role must be a string such as 'system', 'user' or 'assistant'", f"{where}.role")
        parsed.append({**message, "content": _content(message.get("content"), f"{where}.content")})
    _unsupported(body, "tools", allowed=(None, []))
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(400, "response_format is not supported beyond {\"type\": \"text\"}; leave it out",
                       "response_format")
    request = _common(body, max_tokens=_max_tokens(body, ("max_completion_tokens", "max_tokens"), default=None))
    # chat: logprobs true asks for each token's logprob, top_logprobs N for its N likeliest alternatives
    top = _integer(body, "top_logprobs", None, low=0, high=MAX_LOGPROBS)
    if _field(body, "logprobs", bool, default=False):
        request.sampling["logprobs"] = top or 0
    elif top:
        raise ApiError(400, "top_logprobs needs logprobs: set logprobs to true as well", "top_logprobs")
    request.messages = parsed
    return request


def _common(body: dict, max_tokens: int | None) -> GenerateRequest:
    model = _field(body, "model", str, default=None)
    n = _integer(body, "n", 1, low=1, high=MAX_CHOICES)
    sampling = {
        "temperature": _number(body, "temperature", 1.0, low=0.0, high=2.0),
        "top_p": _number(body, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
        "top_k": _integer(body, "top_k", 0, low=-1),
        "min_p": _number(body, "min_p", 0.0, low=0.0, high=1.0),
        "seed": _integer(body, "seed", None, low=0, high=2**63 - 1),
        "stop": _stop(body),
        "ignore_eos": _field(body, "ignore_eos", bool, default=False),
        "presence_penalty": _number(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, low=0.0, high=MAX_REPETITION_PENALTY,
                                      low_open=True),    # vLLM's extension
        "logit_bias": _logit_bias(body),
        "min_tokens": _integer(body, "min_tokens", 0, low=0),    # vLLM's extension
    }
    sampling["top_k"] = max(sampling["top_k"], 0)      # -1 is vLLM's spelling of 'off'
    stream = _field(body, "stream", bool, default=False)
    options = _field(body, "stream_options", dict, default=None) or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError(400, "stream_options.include_usage must be true or false", "stream_options")
    return GenerateRequest(model=model, max_tokens=max_tokens, sampling=sampling, n=n, stream=stream,
                           include_usage=include_usage, speculate=_field(body, "speculate", bool, default=True),
                           cache_salt=_field(body, "cache_salt", str, default=""))


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        value = _field(body, name, int, default=None)
        if value is not None:
            if value < 1:
                raise ApiError(400, f"{name} must be at least 1, got {_show(value)}", name)
            return value
    return default


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, the ids as strings (JSON's keys)."""
    value = _field(body, "logit_bias", dict, default=None)
    if not value:
        return None
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise ApiError(400, f"logit_bias holds {len(value)} tokens; send at most {MAX_LOGIT_BIAS_TOKENS}", "logit_bias")
    bias = {}
    for key, b in value.items():
        if not re.fullmatch(r"[0-9]{1,9}", key):
            raise ApiError(400, f"logit_bias's keys must be token ids (\"50256\"), got {_show(json.dumps(key), 40)}",
                           "logit_bias")
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise ApiError(400, f"logit_bias's values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                f"got {_show(json.dumps(b), 40)} for token {key}", "logit_bias")
        bias[int(key)] = float(b)
    return bias


def _stop(body: dict) -> list[str]:
    stop = _field(body, "stop", (str, list), default=None)
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_NUM_STOP:
        raise ApiError(400, f"stop holds {len(stop)} strings; send at most {MAX_NUM_STOP}", "stop")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise ApiError(400, f"stop holds a string of {longest} characters; each may have at most {MAX_STOP_CHARS}",
                       "stop")
    return stop


def _content(content, where: str) -> str:
    """A message's content: a string, or a list of {type: 'text', text} parts joined."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"{where} may hold only text parts ({{\"type\": \"text\", \"text\": ...}}); "
                                    "images and audio are not supported", where)
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where} must be a string or a list of text parts, got {_kind(content)}", where)


def _number(body: dict, name: str, default: float, low: float, high: float | None = None,
            low_open: bool = False) -> float:
    value = _field(body, name, float, default=default)
    is_finite = not isinstance(value, float) or math.isfinite(value)
    if not is_finite or value < low or (low_open and value == low) or (high is not None and value > high):
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise ApiError(400, f"{name} must be {'in ' if high is not None else ''}{span}, got {_show(value)}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = _field(body, name, int, default=default)
    if value is not None and (value < low or high is not None and value > high):
        span = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ApiError(400, f"{name} must be {span}, got {_show(value)}", name)
    return value


def _unsupported(body: dict, name: str, allowed: tuple, hint: str = "leave it out") -> None:
    value = body.get(name)
    if not any(value == a and type(value) is type(a) for a in allowed):
        raise ApiError(400, f"{name}={_show(json.dumps(value), 100)} is not supported by this server; {hint}", name)


def _field(body: dict, name: str, kinds, required: bool = False, default=None):
    """body[name] checked against kinds (int excludes bool; float accepts int); null means absent."""
    value = body.get(name, MISSING)
    if value is MISSING or value is None:
        if required:
            raise ApiError(400, f"{name} is required", name)
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    accepted = {float: (int, float)}.get(kinds[0], kinds) if len(kinds) == 1 else kinds
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, accepted):
        names = " or ".join(_NAMES[k] for k in kinds)
        raise ApiError(400, f"{name} must be {names}, got {_kind(value)}", name)
    return value


_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "an array",
          dict: "an object"}


def _show(value, limit: int = 40) -> str:
    """A value as an error message quotes it: at most `limit` characters (a string as it is)."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    for kind in (int, float, str, list, dict):
        if isinstance(value, kind):
            return _NAMES[kind]
    return type(value).__name__
