"""User-facing configuration: small dataclasses validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from outpace.errors import InvalidParameterError


def _check(condition: bool, message: str, param: str | None = None) -> None:
    if not condition:
        raise InvalidParameterError(message, param)


MAX_NUM_STOP = 16           # SamplingParams.stop: strings per request (each costs the stop check per character)
MAX_STOP_CHARS = 256        # and characters per string
MAX_LOGPROBS = 20           # SamplingParams.logprobs: the most alternatives a token reports (OpenAI's bound)
MAX_REPETITION_PENALTY = 100.0  # SamplingParams.repetition_penalty at most (1: none; 1.1-1.5 the usual)
MAX_LOGIT_BIAS = 100.0      # SamplingParams.logit_bias: a bias's size at most (OpenAI's range: +-100)
MAX_LOGIT_BIAS_TOKENS = 1024    # and tokens biased per request


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 and min_p 0 disable filters.
    logprobs N (0..MAX_LOGPROBS): each output token comes with the target's log-probability of it
    and of its N most likely alternatives, from the model's own distribution (before temperature
    and the filters), as vLLM reports them; None: none computed. prompt_logprobs N: the same for
    each prompt token after the first (the request then reuses no cached prefix: every prompt
    position is computed). Penalties, as vLLM applies them before temperature: repetition_penalty
    r divides a positive logit by r and multiplies a negative one by r for every token of the
    prompt and output; then frequency_penalty times each token's count in the output so far, and
    presence_penalty once for each token in it, are taken off its logit. logit_bias {token id:
    bias in [-100, 100]} is added to those tokens' logits before the penalties (-100 bars a token in
    practice, 100 all but forces it). min_tokens: the output's first min_tokens tokens are never
    EOS or a stop token id (their logits are barred), and no stop string ends it before then."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    detokenize: bool = True         # False: outputs hold token ids alone, text "" (no stop strings then)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(math.isfinite(self.temperature), f"temperature must be a finite number, got {self.temperature}")
        _check(self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(len(self.stop) <= MAX_NUM_STOP, f"stop holds {len(self.stop)} strings; at most {MAX_NUM_STOP} are "
                                               "allowed: keep the ones that matter")
        _check(all(len(s) <= MAX_STOP_CHARS for s in self.stop),
               f"a stop string is longer than {MAX_STOP_CHARS} characters: shorten it")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and -2 <= value <= 2,
                   f"{name} must be a number in [-2, 2] (0: none), got {value!r}")
        _check(isinstance(self.repetition_penalty, (int, float)) and not isinstance(self.repetition_penalty, bool)
               and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
               f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1: none), got "
               f"{self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (type(value) is int and 0 <= value <= MAX_LOGPROBS),
                   f"{name} must be an integer in [0, {MAX_LOGPROBS}] (alternatives a token reports) or None, "
                   f"got {value!r}")
        _check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            type(t) is int and t >= 0 and isinstance(b, (int, float)) and not isinstance(b, bool)
            and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias.items())),
            f"logit_bias must map token ids (integers >= 0) to biases in [-{MAX_LOGIT_BIAS:g}, "
            f"{MAX_LOGIT_BIAS:g}], got {str(self.logit_bias)[:100]}", "logit_bias")
        _check(len(self.logit_bias or ()) <= MAX_LOGIT_BIAS_TOKENS,
               f"logit_bias holds {len(self.logit_bias or ())} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are "
               "allowed: keep the ones that matter", "logit_bias")
        _check(type(self.min_tokens) is int and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
               "min_tokens")
        _check(self.detokenize or not self.stop, "stop strings need the output's text: drop stop, or keep "
                                                 "detokenize on")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1

    @property
    def shapes_logits(self) -> bool:
        """Whether tokens are picked from logits these params change (sampling/penalties.py)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0


HEAD_METHODS = ("eagle3", "mtp")       # the methods whose drafter is a head on the target's hidden states
SPEC_METHODS = ("none", "ngram", "draft", *HEAD_METHODS)
MAX_TREE_WIDTH = 8              # the most candidates a head drafts per tree node
MAX_NUM_DRAFT_TOKENS = 32       # the most tokens drafted per step, wherever a bound is needed
# the shortest n-gram match that drafts ahead of a draft model (SpecConfig.min_ngram): a row the
# lookup drafts is one the model does not, and shorter matches' drafts are accepted less often
# than a draft model's (docs/BENCHMARKS.md, the draft model)
DRAFT_CHAIN_MIN_NGRAM = 3
# a head's chains stop at the first draft whose top probability is below this (SpecConfig.p_min):
# on the CPU the stop reads 1.4-1.5% above none with the AVX-512 kernels and level with the AVX2 ones,
# and 0.1-0.2 read level with each other (docs/BENCHMARKS.md and the benchmark log, the EAGLE-3 head)
HEAD_P_MIN = 0.15


DRAFT_WEIGHTS = ("q4_0", "file")


@dataclass
class SpecConfig:
    """Speculative decoding. method 'ngram' drafts by prompt lookup over prompt plus output;
    'draft' by a small model of the same tokenizer (draft_model: a known name, a Hugging Face
    folder or a .gguf file), which stops drafting a row when its top probability falls below p_min
    (None: 0, no stop),
    and drafts among the first draft_vocab token ids (0: all of them; BPE vocabularies number their
    tokens by merge order, most frequent first, and the draft's LM head is then that much smaller)
    and reads only the last draft_window tokens of each prompt (0: all of it); draft_weights: how
    the draft model's quantized matrices are held where they load quantized (a GGUF on the CPU):
    'q4_0' in Q4_0 where the file's type takes more bytes a weight (requantized at the first load
    and kept in the model's folder: fewer bytes to read a drafted token, at a rounding that changes
    drafts alone), 'file' as the file holds them;
    'eagle3' by an EAGLE-3 head on the target's hidden states (draft_head: its folder; without
    one, the head that ships for a known model: outpace/heads/<name>); 'mtp' by
    a multi-token-prediction module (draft_head: the folder holding its weights, the target's own
    where it ships one); a head's chain stops, as a draft model's does, at its first draft below
    p_min (None: HEAD_P_MIN), where it drafts outside CUDA graphs (on the CPU; a graph step
    drafts and verifies the chain's whole depth, so a stop would save nothing there).
    With ngram_first, n-gram lookup drafts where the sequence's tail matches,
    the model or head elsewhere.

    tree_width: candidates per tree node (1: chains); above 1 a head drafts token trees of its
        best candidates, n-gram lookup of the matched suffix's several earlier continuations, on
        the steps where the controller measured trees to yield more than chains (it drafts
        chains where they yield more); a head on a GPU drafts trees every step, inside the CUDA
        graphs.

    num_draft_tokens: most tokens drafted per step (TensorRT-LLM's max_draft_len).
    min_ngram / max_ngram: suffix lengths tried, longest first (max_matching_ngram_size). min_ngram
        None: 1, or DRAFT_CHAIN_MIN_NGRAM where n-gram lookup drafts ahead of a draft model
        (method 'draft' with ngram_first): a short match's drafts are accepted less often than the
        model's, and a row the lookup drafts is one the model does not. Ahead of a head, a draft
        from a shorter match than the head's threshold gives way to the head's where it drafts
        (Drafter.lookup_yields_below).
    match: which earlier occurrence of the suffix drafts: 'recent' (the last one) or 'first'.
    lookup_memory: tokens of finished requests that n-gram lookup keeps and drafts from, for the
        later requests of the same cache salt (a retry, the same template again), on the CPU
        (0, the default: none; the device lookup of a GPU reads each sequence's own tokens alone).
    exact: every forward is numerically independent of how many tokens it holds, so speculative
        greedy output is bit-identical to plain greedy output in the same mode.
    """

    method: str = "ngram"
    num_draft_tokens: int = 8
    min_ngram: int | None = None
    max_ngram: int = 4
    match: str = "recent"
    lookup_memory: int = 0
    exact: bool = False
    draft_model: str | None = None
    p_min: float | None = None
    draft_vocab: int = 32768
    draft_window: int = 0
    draft_weights: str = "q4_0"
    ngram_first: bool = False
    draft_head: str | None = None
    tree_width: int = 1

    def __post_init__(self) -> None:
        _check(self.method in SPEC_METHODS, f"spec method must be one of {SPEC_METHODS}, got {self.method!r}")
        _check(1 <= self.num_draft_tokens <= MAX_NUM_DRAFT_TOKENS,
               f"num_draft_tokens must be in [1, {MAX_NUM_DRAFT_TOKENS}], got {self.num_draft_tokens}")
        if self.min_ngram is None:
            self.min_ngram = DRAFT_CHAIN_MIN_NGRAM if self.method == "draft" and self.ngram_first else 1
        _check(self.min_ngram >= 1, f"min_ngram must be >= 1, got {self.min_ngram}")
        _check(self.max_ngram >= self.min_ngram,
               f"max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})")
        _check(self.match in ("recent", "first"), f"match must be 'recent' or 'first', got {self.match!r}")
        _check(self.lookup_memory >= 0, f"lookup_memory must be >= 0 tokens (0: none), got {self.lookup_memory}")
        _check(self.method != "draft" or bool(self.draft_model),
               "method 'draft' needs draft_model: a known model name, a Hugging Face folder or a .gguf file")
        if self.p_min is None:
            self.p_min = HEAD_P_MIN if self.method in HEAD_METHODS else 0.0
        _check(0.0 <= self.p_min < 1.0, f"p_min must be in [0, 1), got {self.p_min}")
        _check(self.draft_vocab >= 0, f"draft_vocab must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")
        _check(self.draft_window >= 0, f"draft_window must be >= 0 (0: the whole prompt), got {self.draft_window}")
        _check(self.draft_weights in DRAFT_WEIGHTS,
               f"draft_weights must be one of {DRAFT_WEIGHTS}, got {self.draft_weights!r}")
        _check(self.method != "mtp" or bool(self.draft_head),
               "method 'mtp' needs draft_head: the folder holding the module's weights (the target's own where it ships one)")
        _check(1 <= self.tree_width <= MAX_TREE_WIDTH, f"tree_width must be in [1, {MAX_TREE_WIDTH}], got {self.tree_width}")
        _check(self.tree_width == 1 or self.method in ("ngram", *HEAD_METHODS) and not self.ngram_first,
               "tree_width above 1 (token trees) needs method 'ngram', 'eagle3' or 'mtp' without ngram_first")
        _check(self.tree_width == 1 or not self.exact, "exact mode verifies chains: use tree_width 1 with exact")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


WEIGHTS = ("auto", "quantized", "bf16", "fp32")


@dataclass
class EngineConfig:
    """Capacity and placement, fixed at start. Defaults suit the default model on this CPU."""

    model: str = "smollm2-135m"
    dtype: str = "auto"             # auto: bfloat16 (CPU with bf16 support, and CUDA), else float32
    # a GGUF's quantized matrices: quantized keeps the file's blocks (CPU kernels; elsewhere they are
    # dequantized, saying so), bf16 / fp32 dequantize them and set dtype; auto: quantized on the CPU
    weights: str = "auto"
    device: str = "auto"            # auto: cuda when available, else cpu
    max_num_seqs: int = 8           # running sequences (KV slots); more requests wait in a queue
    max_model_len: int = 2048       # prompt plus output tokens per sequence
    max_prefill_tokens: int = 512   # prompt tokens cached per step (chunked prefill)
    spec: SpecConfig = field(default_factory=SpecConfig)
    calibrate: bool = True          # measure verify cost per batch size at start (draft controller)
    # a request starts from the keys a freed slot kept of an earlier request's tokens, or a running
    # request's slot holds, as far as its prompt begins with them (a conversation's next turn,
    # clients behind one document); off: every prompt is prefilled whole
    prefix_caching: bool = True
    cuda_graphs: bool = True        # CUDA: decode/verify steps replay graphs captured at start
    overlap: bool = True            # CUDA graphs: a greedy step's successor launches before its tokens are read
    # hybrid models: roll recurrent state back from a snapshot per verified token (True), or keep
    # a checkpoint and replay the accepted tokens' state updates, in less memory (False); None
    # (default): snapshots unless they would take more than a quarter of the memory left
    recurrent_snapshots: bool | None = None
    # ranks a model is split over (tensor parallelism): GPUs cuda:0..N-1, or N processes on the CPU
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16", "float64"),
               f"dtype must be auto, float32, bfloat16, float16 or float64, got {self.dtype!r}")
        _check(self.weights in WEIGHTS, f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        implied = {"bf16": "bfloat16", "fp32": "float32"}.get(self.weights)
        _check(implied is None or self.dtype in ("auto", implied),
               f"weights {self.weights} holds the model in {implied}: leave dtype auto, or pass weights quantized "
               f"to keep dtype {self.dtype}")
        self.dtype = implied or self.dtype
        _check(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"),
               f"device must be auto, cpu or cuda, got {self.device!r}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        _check(self.max_prefill_tokens >= 1, f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        _check(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
