"""The `outpace` command: generate, pull, bench, serve, train-head."""
from __future__ import annotations

import argparse
import json
import os
import sys

from outpace.config import DRAFT_WEIGHTS, HEAD_P_MIN, SPEC_METHODS, WEIGHTS
from outpace.errors import InvalidParameterError, OutpaceError

# the names in outpace.weights.hub.REGISTRY (tests/test_release.py keeps them in step)
KNOWN_MODELS = "smollm2-135m (the default), qwen2.5-coder-1.5b-instruct, qwen2.5-coder-0.5b-instruct"
DTYPE_HELP = ("float32, bfloat16 or auto (default): bfloat16 on CUDA and on CPUs whose outpace kernels "
              "vectorise it (AVX2, AVX-512, NEON), float32 on other CPUs")


def bounded_int(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high] (high None: no bound above), else a usage error
    that gives the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            within = f"from {low} to {high}" if high is not None else f"of at least {low}"
            raise argparse.ArgumentTypeError(f"give an integer {within}, not {text!r}")
        return value
    return parse


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help=f"a known name ({KNOWN_MODELS}), a Hugging Face folder, or a .gguf file")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="a GGUF's quantized matrices: quantized keeps them in the file's types (CPU), bf16 or fp32 "
                        "dequantizes them (and sets --dtype); auto (default): quantized on the CPU")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt plus output tokens (default 2048)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="CUDA: run decode/verify steps eagerly instead of replaying graphs captured at start")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N GPUs (cuda:0..N-1) or N CPU processes; under torchrun, its "
                        "world size (default 1)")
    p.add_argument("--no-overlap", action="store_true",
                   help="CUDA graphs: launch each greedy step only after the host has read the last one's "
                        "tokens (by default it is launched before, so the GPU never waits for the host)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="prefill every prompt whole; by default a request starts from the keys of a finished "
                        "request's kept slot or a running one's, as far as its prompt begins with the same "
                        "tokens")
    p.add_argument("--recurrent-rollback", default="auto", choices=["auto", "snapshots", "replay"],
                   help="hybrid models (recurrent layers): a rejected draft's state is rolled back from a snapshot "
                        "per verified token, or by replaying the accepted tokens from a checkpoint (less memory); "
                        "auto (default): snapshots unless they would take over a quarter of the memory left")


def model_options(args) -> dict:
    """The engine options that add_model_args reads, as LLM / EngineConfig keywords."""
    return dict(dtype=args.dtype, weights=args.weights, device=args.device, max_model_len=args.max_model_len,
                cuda_graphs=not args.no_cuda_graphs, overlap=not args.no_overlap,
                tensor_parallel_size=args.tensor_parallel_size, prefix_caching=not args.no_prefix_caching,
                recurrent_snapshots={"auto": None, "snapshots": True, "replay": False}[args.recurrent_rollback])


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default="ngram", choices=SPEC_METHODS,
                   help="speculative decoding method (default ngram: prompt lookup; draft: a draft model; eagle3: "
                        "an EAGLE-3 head on the target's hidden states; mtp: a multi-token-prediction module)")
    p.add_argument("--draft-model", default=None,
                   help="with --spec draft: a small model of the target's tokenizer (a known name, a folder or a .gguf)")
    p.add_argument("--p-min", type=float, default=None,
                   help="stop drafting a row when the draft's top probability falls below this (default: 0, no stop, "
                        f"for --spec draft; {HEAD_P_MIN} for a head's chains, --spec eagle3 or mtp)")
    p.add_argument("--draft-vocab", type=int, default=32768,
                   help="with --spec draft: draft among the first N token ids, the most frequent in BPE vocabularies "
                        "(default 32768; 0: all): the draft's LM head shrinks to N rows")
    p.add_argument("--draft-window", type=int, default=0,
                   help="with --spec draft: the draft model reads only the last N tokens of each prompt (0: all), "
                        "so its share of a long prompt's prefill shrinks")
    p.add_argument("--draft-weights", default="q4_0", choices=DRAFT_WEIGHTS,
                   help="with --spec draft, a GGUF draft model on the CPU: q4_0 (default) holds its matrices in "
                        "Q4_0 where the file's types take more bytes, so a drafted token reads fewer; file keeps "
                        "the file's types")
    p.add_argument("--draft-head", default=None,
                   help="with --spec eagle3: the head's folder (outpace train-head makes one; default: the head that "
                        "ships for a known model, smollm2-135m's); with --spec mtp: "
                        "the folder holding the module's weights")
    p.add_argument("--tree-width", type=int, default=1,
                   help="with --spec ngram, eagle3 or mtp: candidates per tree node, drafting token trees "
                        "where they measure faster than chains (a head's on a GPU: every step, inside the CUDA "
                        "graphs) (default 1: chains)")
    p.add_argument("--ngram-first", action="store_true",
                   help="with --spec draft, eagle3 or mtp: n-gram lookup drafts where the tail matches, the model "
                        "or head elsewhere")
    p.add_argument("--num-draft-tokens", type=int, default=8, help="most tokens drafted per step (default 8)")
    p.add_argument("--min-ngram", type=int, default=None,
                   help="shortest suffix matched (default 1; 3 with --spec draft --ngram-first)")
    p.add_argument("--max-ngram", type=int, default=4, help="longest suffix matched, tried first (default 4)")
    p.add_argument("--lookup-memory", type=int, default=0,
                   help="tokens of finished requests n-gram lookup keeps and drafts from, for later requests of "
                        "the same cache salt, on the CPU: a retry or a workload's repeated calls draft the "
                        "earlier answer (default 0: none; 65536 takes about 38 MB)")
    p.add_argument("--exact", action="store_true",
                   help="numerically exact mode: speculative greedy output bit-identical to plain greedy")


def spec_config(args):
    from outpace.config import SpecConfig
    return SpecConfig(method=args.spec, num_draft_tokens=args.num_draft_tokens, min_ngram=args.min_ngram,
                      max_ngram=args.max_ngram, lookup_memory=args.lookup_memory, exact=args.exact,
                      draft_model=args.draft_model, p_min=args.p_min, draft_vocab=args.draft_vocab,
                      draft_window=args.draft_window, draft_weights=args.draft_weights, ngram_first=args.ngram_first,
                      draft_head=args.draft_head, tree_width=args.tree_width)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"new tokens at most (default {max_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 (default) disables top-k")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="makes sampled output reproducible")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="taken off the logit of each token in the "
                   "output (-2 to 2; 0: none)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="times each token's count in the output, "
                   "taken off its logit (-2 to 2; 0: none)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="divides the positive logits (multiplies "
                   "the negative ones) of the prompt's and output's tokens (1: none)")
    p.add_argument("--min-tokens", type=int, default=0, help="the output's first N tokens are never EOS or a stop")
    p.add_argument("--logit-bias", type=logit_bias, default=None, metavar="ID:BIAS,...",
                   help="added to those token ids' logits (-100 to 100; -100 bars a token)")


def logit_bias(text: str) -> dict[int, float]:
    """--logit-bias's "ID:BIAS,ID:BIAS" as {token id: bias}."""
    try:
        return {int(token): float(bias) for token, bias in (item.split(":") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give token ids and biases as ID:BIAS,ID:BIAS "
                                         "(e.g. 198:-100,13:5)") from None


def sampling_params(args):
    from outpace.config import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.max_tokens, logprobs=getattr(args, "logprobs", None),
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens,
                          logit_bias=args.logit_bias)


def settle_heap() -> None:
    """Takes what loading made (modules, the weights' Python objects, the tokenizer) out of the
    garbage collector's sweeps: it lives as long as the process, and sweeping it again and again
    took about 1.4% of the engine's thread in n-gram decoding of the default model on an AVX2 CPU
    (perf samples; none after). The commands call it once their engine is built; a program that
    imports the library decides this for its own heap."""
    import gc
    gc.collect()
    gc.freeze()


def cmd_generate(args) -> None:
    from outpace.llm import LLM
    if args.logprobs is not None and not args.json:
        raise InvalidParameterError("--logprobs reports them in --json's output: add --json")
    params = sampling_params(args)
    llm = LLM(args.model, spec=spec_config(args), max_num_seqs=1, **model_options(args))
    settle_heap()
    printed = 0

    def stream(seq):
        nonlocal printed
        if not args.json:
            sys.stdout.write(seq.text[printed:])
            sys.stdout.flush()
            printed = len(seq.text)

    run = llm.chat if args.chat else llm.generate
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    out = run(prompt, params, on_tokens=stream)[0]
    if args.json:
        print(json.dumps({
            "text": out.text, "token_ids": out.token_ids, "num_prompt_tokens": out.num_prompt_tokens,
            "num_generated_tokens": out.num_generated_tokens, "finish_reason": out.finish_reason,
            "timing": out.timing, "spec": out.spec if args.spec != "none" else None,
            **({"logprobs": [[{"token_id": t, "token": lp.decoded_token, "logprob": lp.logprob, "rank": lp.rank}
                              for t, lp in entry.items()] for entry in out.logprobs]}
               if out.logprobs is not None else {}),
        }))
    else:
        sys.stdout.write(out.text[printed:] + "\n")
        sys.stdout.flush()
        t, n = out.timing, out.num_generated_tokens
        # a rate needs two tokens: the first one's time is the prompt's
        rate = f"{t['decode_tokens_per_s']:.1f} tokens/s" if n > 1 else f"the first after {t['prefill_s']:.2f} s"
        print(f"[{n} token{'' if n == 1 else 's'}, {rate}, finish: {out.finish_reason}]", file=sys.stderr)


def cmd_serve(args) -> None:
    import logging
    import signal
    import threading

    import torch
    import uvicorn

    from outpace.config import EngineConfig
    from outpace.engine.llm_engine import LLMEngine
    from outpace.server.app import build_app
    from outpace.server.listener import uvicorn_config
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server_config = serve_config(args)          # bad flags fail before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs, max_prefill_tokens=args.max_prefill_tokens,
                          spec=spec_config(args), calibrate=not args.no_calibrate, **model_options(args))
    engine = LLMEngine(config)
    settle_heap()
    app = build_app(engine, args.model, server_config, engine_thread=False)
    # the engine loop stays in this thread, the one that loaded the model (AsyncEngine.run says
    # why); the HTTP server runs beside it, and its shutdown (or a failed start) ends the loop
    server = uvicorn.Server(uvicorn_config(app, server_config, host=args.host, port=args.port, log_level="info"))
    runner = app.state.engine
    failed: list[BaseException] = []

    def serve_http() -> None:
        # however the HTTP server ends, the engine loop ends too: uvicorn reports an OSError of its
        # start (a port in use) and shuts the app down, but any other error (a host name that
        # cannot be encoded) ended this thread alone and left the loop running for good
        try:
            server.run()
        except Exception as error:
            failed.append(error)
        finally:
            runner.stop()

    http = threading.Thread(target=serve_http, name="outpace-http", daemon=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)      # SIGTERM stops like Ctrl-C
    http.start()
    try:
        runner.run()
        while runner.error is not None and http.is_alive():    # the loop died: requests are told so
            http.join(timeout=1.0)
    except KeyboardInterrupt:
        runner.shutdown()
    else:
        if not server.started:
            why = f": {failed[0]}" if failed else " (see the error above)"
            raise SystemExit(f"outpace serve: could not serve on {args.host}:{args.port}{why}")
    finally:
        server.should_exit = True
        http.join(timeout=30)
        engine.close()


def serve_config(args):
    """The serve command's ServerConfig: the API key from --api-key or OUTPACE_API_KEY; a server
    bound to loopback serves loopback host names only unless --allowed-hosts says otherwise. A
    --host that names no address fails here, before the model loads."""
    import os
    import socket

    from outpace.server.config import ServerConfig
    try:
        socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as error:
        raise InvalidParameterError(f"--host {args.host!r} names no address to listen on ({error}): give an "
                                    "address of this machine, such as 127.0.0.1 or 0.0.0.0") from None
    api_key = args.api_key if args.api_key is not None else os.environ.get("OUTPACE_API_KEY")
    config = ServerConfig(api_key=api_key, allowed_origins=args.allowed_origins, allowed_hosts=args.allowed_hosts,
                          max_body_bytes=args.max_body_bytes, read_timeout_s=args.read_timeout,
                          keep_alive_s=args.keep_alive_timeout, special_tokens_in_content=args.special_tokens_in_content,
                          log_interval_s=args.log_interval)
    return config.for_bind_host(args.host)


def cmd_pull(args) -> None:
    from outpace.weights.hub import resolve_model
    print(resolve_model(args.name))


def cmd_bench(args) -> None:
    from outpace.bench.specbench import bench_command
    bench_command(args, spec_config(args), sampling_params(args))


def cmd_train_head(args) -> None:
    from outpace.train.head_trainer import TrainConfig, train_head
    fields = {f for f in TrainConfig.__dataclass_fields__}
    summary = train_head(TrainConfig(**{k: v for k, v in vars(args).items() if k in fields}))
    last = summary["acceptance"][-1]
    print(f"head written to {args.out}/head ({summary['head_bytes'] / 2**20:.1f} MiB); {last['mean_accepted']:.3f} "
          f"drafts accepted a position on held-back answers after {summary['steps']} steps")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outpace", description="Speculative-decoding LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="format the prompt with the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's log-probability and its N likeliest alternatives (0-20)")
    add_model_args(g)
    add_sampling_args(g, max_tokens=256)
    add_spec_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=bounded_int(0, 65535), default=8000, help="port (default 8000)")
    s.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded at once; more wait (default 8)")
    s.add_argument("--max-prefill-tokens", type=int, default=512, help="prompt tokens cached per step (default 512)")
    s.add_argument("--no-calibrate", action="store_true",
                   help="skip measuring verify cost at start (faster start; the draft controller assumes flat cost)")
    s.add_argument("--threads", type=bounded_int(1), default=None, help="torch CPU threads (default: all cores)")
    s.add_argument("--log-interval", type=float, default=10.0, help="seconds between summary log lines (default 10)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
                        "OUTPACE_API_KEY environment variable; neither: no key)")
    s.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="web origins (https://app.example.com, or *) whose pages may call the API (CORS; default: none)")
    s.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="Host header names served (* for any, *.example.com for its subdomains); default: "
                        "localhost, 127.0.0.1 and ::1 when bound to loopback (against DNS rebinding), any otherwise")
    s.add_argument("--max-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 (default: 64 bytes per context token, at least 1 MiB)")
    s.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers, and then its body (default 30)")
    s.add_argument("--keep-alive-timeout", type=int, default=5,
                   help="seconds an idle kept-alive connection stays open (default 5)")
    s.add_argument("--special-tokens-in-content", action="store_true",
                   help="parse special-token text inside chat messages as control tokens (unsafe: users can "
                        "forge turns); by default only the chat template's own markup gives control tokens")
    add_model_args(s)
    add_spec_args(s)
    s.set_defaults(func=cmd_serve)

    p = sub.add_parser("pull", help="fetch a known model into the cache")
    p.add_argument("name", nargs="?", default="smollm2-135m", help=f"a known name: {KNOWN_MODELS}")
    p.set_defaults(func=cmd_pull)

    b = sub.add_parser("bench", help="Spec-Bench prompts with and without speculation: tokens/s, speedup, acceptance")
    b.add_argument("--dataset", required=True, help="Spec-Bench JSONL file (question_id, category, turns)")
    b.add_argument("--category", nargs="+", default=None, help="run only these categories (default: all)")
    b.add_argument("--limit-per-category", type=int, default=None, help="first N questions of each category")
    b.add_argument("--repeat", type=int, default=1,
                   help="run the questions N times and time the last: its requests repeat earlier ones, as "
                        "retries or a workload's fixed calls do (default 1)")
    b.add_argument("--out", default="bench-out", help="folder for results.json, results.md, speedup.png")
    b.add_argument("--threads", type=bounded_int(1), default=None, help="torch CPU threads (default: all cores)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_args(b)
    add_sampling_args(b, max_tokens=256)
    add_spec_args(b)
    b.set_defaults(func=cmd_bench)
    t = sub.add_parser("train-head", help="train an EAGLE-3 head for a model on its own answers (self-distillation)")
    t.add_argument("--model", default="smollm2-135m", help=f"the target: a known name ({KNOWN_MODELS}) or a folder")
    t.add_argument("--prompts", default=None, help="JSONL of {\"prompt\": ...} lines (.gz allowed); never Spec-Bench")
    t.add_argument("--self-prompts", type=int, default=0,
                   help="prompts the target first writes itself (sampled user turns of its chat template), added "
                        "to --prompts' (default 0)")
    t.add_argument("--file-prompts", type=int, default=None,
                   help="use this many of --prompts' file, drawn with the seed (default all): with --self-prompts, "
                        "the mix's share of each")
    t.add_argument("--out", required=True, help="folder for data, checkpoints and the head (a rerun resumes it)")
    t.add_argument("--num-prompts", type=int, default=4000, help="prompts answered for training (default 4000)")
    t.add_argument("--task-prompts", type=int, default=0,
                   help="prompts then built from the training answers (summaries, passages and a question, "
                        "extraction, translation there and back) and trained on too (default 0); they hold up to "
                        "four answers: give --max-prompt-tokens 1024")
    t.add_argument("--held-out", type=int, default=64, help="prompts held back to measure acceptance (default 64)")
    t.add_argument("--max-tokens", type=int, default=256, help="answer tokens at most (default 256)")
    t.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped (default 512)")
    t.add_argument("--draft-vocab", type=int, default=None,
                   help="the head's draft vocabulary (default 8192; with --init-head, that head's, and a larger "
                        "one widens it by the answers' most frequent tokens)")
    t.add_argument("--init-head", default=None,
                   help="train this head further (its folder, or 'shipped': the one that ships for --model) "
                        "instead of a new one; it keeps its draft vocabulary unless --draft-vocab widens it")
    t.add_argument("--lm-head-int8", action="store_true",
                   help="save the head's LM head as int8 with a scale a row, half its bytes (read by outpace alone)")
    t.add_argument("--ttt-steps", type=int, default=7, help="unrolled steps of the training-time test (default 7)")
    t.add_argument("--epochs", type=int, default=2, help="passes over the answers (default 2)")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (a rerun continues)")
    t.add_argument("--batch-size", type=int, default=16, help="sequences a step (default 16)")
    t.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    t.add_argument("--seed", type=int, default=0, help="the same seed gives the same head (default 0)")
    t.add_argument("--eval-every", type=int, default=100, help="steps between acceptance measurements (default 100)")
    t.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)")
    t.add_argument("--max-num-seqs", type=int, default=64, help="prompts the target answers at once (default 64)")
    t.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    t.add_argument("--dtype", default="auto", help="the target's dtype while answering: " + DTYPE_HELP)
    t.set_defaults(func=cmd_train_head)
    return parser


def main(argv: list[str] | None = None) -> None:
    if "RANK" in os.environ:        # started by torchrun: ranks other than 0 serve rank 0's forwards
        from outpace.runner.workers import run_worker, torchrun_rank
        launched = torchrun_rank()
        if launched is not None and launched[0] > 0:
            run_worker()
            return
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except OutpaceError as e:
        print(f"outpace: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("outpace: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
