"""Bad input ends with one clear message: a ValueError subclass from the API, no traceback from
the command line."""
import json
import shutil
import subprocess
import sys

import pytest

from outpace import LLM, SamplingParams, SpecConfig
from outpace.errors import (CorruptModelError, InvalidParameterError, ModelNotFoundError, OutpaceError,
                            PromptTooLongError, UnsupportedModelError)


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2), "min_p"),
])
def test_impossible_sampling_parameters(kwargs, words):
    with pytest.raises(InvalidParameterError, match=words):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(method="eagle"), dict(num_draft_tokens=0), dict(min_ngram=3, max_ngram=2),
                                    dict(match="last"), dict(tree_width=3, exact=True)])
def test_impossible_spec_config(kwargs):
    with pytest.raises(InvalidParameterError):
        SpecConfig(**kwargs)


def test_errors_are_value_errors():
    for cls in (ModelNotFoundError, UnsupportedModelError, CorruptModelError, PromptTooLongError, InvalidParameterError):
        assert issubclass(cls, OutpaceError) and issubclass(cls, ValueError)


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError):
        LLM(str(tmp_path / "nothing-here"))


def test_unsupported_architecture(tmp_path, default_model_dir):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_prompt_longer_than_context(default_model_dir):
    llm = LLM(str(default_model_dir), spec="none", max_model_len=64, max_num_seqs=1, calibrate=False)
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        llm.generate("word " * 100, SamplingParams(max_tokens=4))
    # the engine is unharmed: the next request runs
    assert llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3))[0].num_generated_tokens >= 1


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "outpace.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, words", [
    (["--model", "/no/such/model"], "not"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--logprobs", "2"], "--json"),
    (["--logprobs", "21", "--json"], "logprobs"),
])
def test_cli_prints_one_clear_line(args, words):
    result = run_cli("generate", "--prompt", "hi", "--spec", "none", *args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert words in result.stderr and result.stderr.startswith("outpace: error:")


@pytest.mark.parametrize("args, words", [
    (["serve", "--port", "99999"], "argument --port: give an integer "),
    (["serve", "--port", "http"], "argument --port: give an integer "),
    (["serve", "--threads", "-2"], "argument --threads: give an integer "),
    (["bench", "--dataset", "x.jsonl", "--threads", "0"], "argument --threads: give an integer "),
    (["serve", "--host", "a..b"], "--host 'a..b' names no address"),
])
def test_cli_refuses_an_impossible_address_or_thread_count_before_loading(args, words):
    """Regression: a port past 65535 or a host name that cannot be encoded failed in the HTTP
    server's start with a traceback, after the model had loaded, and left `serve` running without
    a server; a thread count below 1 failed in torch's set_num_threads."""
    result = run_cli(*args)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert words in result.stderr


def test_serve_ends_when_its_http_server_fails_to_start_with_any_error():
    """An error of the HTTP server's start other than the OSError uvicorn reports (here a
    ValueError) ends `serve` with a line that says it, rather than leaving the engine loop running
    with no server (regression: a host name that could not be encoded did that)."""
    script = ("import sys, uvicorn\n"
              "def run(self, sockets=None): raise ValueError('no such address family')\n"
              "uvicorn.Server.run = run\n"
              "from outpace.cli import main\n"
              "main(['serve', '--spec', 'none', '--max-model-len', '256', '--port', '0'])\n")
    # loading the default model and failing take seconds; a serve left running is cut at 120 s
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.rstrip().endswith("could not serve on 127.0.0.1:0: no such address family"), result.stderr


def test_cli_summary_of_one_token_gives_no_rate():
    """One token has no decode rate (regression: the summary read "1 tokens, 0.0 tokens/s")."""
    one, three = (run_cli("generate", "--prompt", "hi", "--spec", "none", "--max-tokens", n) for n in ("1", "3"))
    assert one.returncode == three.returncode == 0
    assert "[1 token, the first after " in one.stderr and "tokens/s" not in one.stderr
    assert "[3 tokens, " in three.stderr and " tokens/s, finish: length]" in three.stderr


def test_cli_json_holds_the_logprobs():
    result = run_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "4", "--logprobs", "2",
                     "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert [entry[0]["token_id"] for entry in out["logprobs"]] == out["token_ids"]
    assert "".join(entry[0]["token"] for entry in out["logprobs"]) == out["text"]
    assert all(2 <= len(entry) <= 3 and entry[0]["logprob"] <= 0 for entry in out["logprobs"])


def test_cli_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    result = run_cli("generate", "--prompt", "hi", "--model", str(bad))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
