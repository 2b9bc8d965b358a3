"""Hybrid families (recurrent layers beside attention) match transformers' own implementation, and
their recurrent state rolls back after verification exactly as if only the accepted tokens had run.

Tolerances: float32 logits within 1e-4 of the reference's (logits of magnitude about 10; the
reference computes its norms and delta rule in float32 as well, in another order); float64 greedy
output token for token. Rollback: float64, within 1e-10 of the plain run.
"""
import copy

import pytest
import torch

from outpace import LLM, SamplingParams
from outpace.errors import UnsupportedModelError
from outpace.bench.models import QWEN35_08B
from outpace.model import delta_rule
from outpace.model.config import ModelConfig
from outpace.model.hybrid_config import hybrid_fields
from outpace.runner.model_runner import ModelRunner, Row
from outpace.weights.loader import load_model
from tiny import HYBRID_FAMILIES, make_tiny, slot_state

MAX_LEN = 256


@pytest.fixture(scope="module", params=sorted(HYBRID_FAMILIES))
def family(request, tmp_path_factory):
    """(folder, transformers model in float64) of one family."""
    folder = tmp_path_factory.mktemp(request.param)
    return folder, make_tiny(request.param, folder, dtype=torch.float64)


@pytest.fixture(scope="module")
def ours64(family):
    return load_model(family[0], torch.float64, "cpu", max_len=MAX_LEN)


def runner_for(model, num_slots=4, max_row_tokens=1, snapshots=True) -> ModelRunner:
    runner = ModelRunner(model, num_slots=num_slots, max_len=MAX_LEN, max_step_tokens=64)
    runner.cache = model.make_cache(num_slots, MAX_LEN + 64, runner.dtype, runner.device,
                                    max_row_tokens=max_row_tokens, snapshots=snapshots)
    return runner


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(runner, slot, ids, chunk):
    for start in range(0, len(ids), chunk):
        runner.forward([Row(slot, ids[start:start + chunk], start)], logits="none")


def test_delta_rule_forms_agree():
    """The blockwise form gives the token-by-token form's outputs and last state for any block
    size, the per-token states end in the last state, and tokens with g = b = 0 (padding) leave
    the state exactly as it was."""
    g = torch.Generator().manual_seed(0)
    B, S, H, dk, dv = 2, 45, 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(B, S, H, dk, generator=g, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(B, S, H, dv, generator=g, dtype=torch.float64)
    decay = -3 * torch.rand(B, S, H, generator=g, dtype=torch.float64)
    strength = torch.rand(B, S, H, generator=g, dtype=torch.float64)
    start = torch.randn(B, H, dk, dv, generator=g, dtype=torch.float64)
    out, last = delta_rule.steps(q, k, v, decay, strength, start)
    for block in (1, 4, 16, 64):
        got, got_last = delta_rule.chunks(q, k, v, decay, strength, start, block=block)
        torch.testing.assert_close(got, out, atol=1e-12, rtol=0)
        torch.testing.assert_close(got_last, last, atol=1e-12, rtol=0)
    _, states = delta_rule.steps(q, k, v, decay, strength, start, keep_states=True)
    assert torch.equal(states[:, -1], last)
    padded = delta_rule.steps(q, k, v, decay.index_fill(1, torch.arange(40, 45), 0),
                              strength.index_fill(1, torch.arange(40, 45), 0), start, keep_states=True)[1]
    assert torch.equal(padded[:, 40:], padded[:, 39:40].expand(-1, 5, -1, -1, -1))


@pytest.mark.parametrize("chunk", [1, 9, 40])
def test_float32_logits_match_reference(family, chunk):
    """A prompt cached in chunks of any size (the state carried between them; chunks of more than
    gated_deltanet.STEP_TOKENS run the delta rule in blocks), then decode steps, then a verify row of 5 tokens: each logit within 1e-4
    of transformers' full forward."""
    folder, ref64 = family
    ref = copy.deepcopy(ref64).float()
    ours = load_model(folder, torch.float32, "cpu", max_len=MAX_LEN)
    ids = tokens(50, seed=1)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    runner = runner_for(ours, max_row_tokens=5)
    prefill(runner, 2, ids[:40], chunk)
    for p in range(40, 45):
        got, _ = runner.forward([Row(2, ids[p:p + 1], p)])
        torch.testing.assert_close(got[0, 0], expected[p], atol=1e-4, rtol=1e-4)
    got, _ = runner.forward([Row(2, ids[45:50], 45)])
    torch.testing.assert_close(got[0], expected[45:50], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1, 19])
def test_float64_greedy_matches_reference(family, ours64, chunk):
    """Greedy decoding in float64 after a prompt cached in chunks gives transformers' tokens."""
    _, ref = family
    prompt = tokens(20, seed=2)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, 20:].tolist()
    runner = runner_for(ours64)
    prefill(runner, 1, prompt[:-1], chunk)
    out, last = [], prompt[-1]
    for p in range(19, 19 + 24):
        logits, _ = runner.forward([Row(1, [last], p)])
        last = int(logits[0, 0].argmax())
        out.append(last)
    assert out == expected


def test_ragged_rows_and_chunks_equal_rows_alone(ours64):
    """Verify rows of different lengths on scattered slots, with prompt chunks packed after them
    (one from position 0, one continuing its prompt), give each row the logits it has alone, and
    leave each chunk's slot as a forward of its own does."""
    prompts = {s: tokens(n, seed=10 + s) for s, n in ((0, 9), (1, 30), (5, 15), (3, 12), (4, 26))}
    rows = {0: 1, 1: 4, 5: 3}                     # slot -> tokens in the verify row
    alone = {}
    for s, n in rows.items():
        runner = runner_for(ours64, num_slots=6, max_row_tokens=4)
        prefill(runner, s, prompts[s][:-n], 8)
        alone[s] = runner.forward([Row(s, prompts[s][-n:], len(prompts[s]) - n)])[0][0, :n]
    runner = runner_for(ours64, num_slots=6, max_row_tokens=4)
    for s, n in rows.items():
        prefill(runner, s, prompts[s][:-n], 8)
    prefill(runner, 4, prompts[4][:10], 10)
    step = [Row(s, prompts[s][-n:], len(prompts[s]) - n) for s, n in rows.items()]
    chunks = [Row(3, prompts[3][:-1], 0), Row(4, prompts[4][10:-1], 10)]
    mixed, _ = runner.forward(step, chunks=chunks)
    runner.cache.commit(list(rows), [n - 1 for n in rows.values()])
    for i, (s, n) in enumerate(rows.items()):
        torch.testing.assert_close(mixed[i, :n], alone[s], atol=1e-10, rtol=1e-10)
    fresh = runner_for(ours64, num_slots=6)
    for s in (3, 4):
        p = prompts[s]
        fresh.forward([Row(s, p[:-1], 0)], logits="none")
        last = [Row(s, p[-1:], len(p) - 1)]
        torch.testing.assert_close(runner.forward(last)[0], fresh.forward(last)[0], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "replay"])
def test_commit_equals_plain_run(ours64, snapshots):
    """Verify 1 + k tokens on several rows, commit n accepted drafts (0, some, all, different per
    row): each slot's state and next logits are those of running its first n + 1 tokens plainly,
    one by one, within 1e-10."""
    slots = [0, 2, 3]
    prompts = {s: tokens(11 + s, seed=20 + s) for s in slots}
    for k, accepted in ((1, [0, 1, 1]), (3, [0, 2, 3]), (6, [6, 0, 4])):
        runner = runner_for(ours64, max_row_tokens=k + 1, snapshots=snapshots)
        plain = runner_for(ours64)
        verify, next_rows = [], []
        for s, n in zip(slots, accepted):
            p = prompts[s]
            prefill(runner, s, p[:-1], 8)
            prefill(plain, s, p[:-1], 8)
            row = [p[-1]] + tokens(k, seed=30 + s + k)        # the last prompt token and k drafts
            verify.append(Row(s, row, len(p) - 1))
            for j in range(n + 1):
                plain.forward([Row(s, row[j:j + 1], len(p) - 1 + j)])
            next_rows.append(Row(s, [7], len(p) + n))
        runner.forward(verify)
        runner.cache.commit(slots, accepted)
        for s in slots:
            for got, want in zip(slot_state(runner.cache.state, s), slot_state(plain.cache.state, s)):
                torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
        got, _ = runner.forward(next_rows)
        want = torch.cat([plain.forward([r])[0] for r in next_rows])
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
        with pytest.raises(ValueError, match="num_accepted"):
            runner.cache.commit(slots, [k + 1] * len(slots))


def test_reused_slot_starts_from_zero_state(ours64):
    """A new sequence in a slot another sequence used computes as in an unused slot."""
    a, b = tokens(30, seed=40), tokens(17, seed=41)
    runner, fresh = runner_for(ours64), runner_for(ours64)
    prefill(runner, 1, a, 8)
    runner.forward([Row(1, [5], 30)])
    prefill(runner, 1, b[:-1], 8)
    prefill(fresh, 1, b[:-1], 8)
    last = [Row(1, b[-1:], 16)]
    torch.testing.assert_close(runner.forward(last)[0], fresh.forward(last)[0], atol=1e-12, rtol=0)


def test_rollback_needs_commit_and_room(ours64):
    """A verify forward of several tokens a row must be committed before the next forward, and
    rows wider than the cache's max_row_tokens are refused: either would leave rejected tokens in
    the recurrent state."""
    runner = runner_for(ours64, max_row_tokens=3)
    prefill(runner, 0, tokens(10, seed=50), 8)
    with pytest.raises(UnsupportedModelError, match="max_row_tokens"):
        runner.forward([Row(0, tokens(4, seed=51), 10)])
    runner.forward([Row(0, tokens(3, seed=52), 10)])
    with pytest.raises(UnsupportedModelError, match="commit"):
        runner.forward([Row(0, [1], 11)])
    runner.cache.commit([0], [0])
    runner.forward([Row(0, [1], 11)])


def test_qwen35_08b_shape_parses():
    """The published Qwen3.5-0.8B text config (bench.models, as transformers writes it) reads as
    18 DeltaNet and 6 attention layers rotating 64 of 256 head dims."""
    import transformers
    cfg = transformers.Qwen3_5TextConfig(**QWEN35_08B).to_dict() | dict(architectures=["Qwen3_5ForCausalLM"])
    parsed = ModelConfig.from_dict(cfg)
    assert parsed.layer_types == (["deltanet"] * 3 + ["attention"]) * 6
    assert (parsed.rotary_dim, parsed.head_dim, parsed.delta_num_value_heads, parsed.rope_theta) == (64, 256, 16, 1e7)


def test_unsupported_configs_say_what_to_change():
    base = dict(architectures=["Qwen3NextForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=96,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                linear_num_key_heads=2, linear_num_value_heads=4)
    assert ModelConfig.from_dict(base | dict(num_experts=0)).layer_types == ["deltanet"] * 3 + ["attention"]
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        ModelConfig.from_dict(base)                  # transformers' default: 512 experts in every layer
    assert ModelConfig.from_dict(base | dict(num_experts=8, mlp_only_layers=[0, 1, 2, 3])).family == "qwen3_next"
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        ModelConfig.from_dict(base | dict(num_experts=0, layer_types=["full_attention"] * 3))
    with pytest.raises(UnsupportedModelError, match="multiple"):
        hybrid_fields("qwen3_5", dict(linear_num_key_heads=3, linear_num_value_heads=4),
                      dict(num_layers=4, head_dim=32, rope_scaling=None))


ENGINE_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42]]


@pytest.mark.parametrize("name", ["qwen3_5-vl", "lfm2"])      # both kinds of recurrent layer
def test_engine_greedy_matches_reference(name, tmp_path, default_model_dir):
    """Through the whole engine (plain decoding, float64): more prompts than slots and prompt
    chunks of 8 tokens, so prompts are cached in chunks riding in the others' decode forwards and
    slots are reused; each output equals transformers' greedy generate."""
    ref = make_tiny(name, tmp_path, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(str(tmp_path), spec="none", dtype="float64", device="cpu", max_num_seqs=3, max_model_len=128,
              max_prefill_tokens=8)
    for prompt, out in zip(ENGINE_PROMPTS, llm.generate(ENGINE_PROMPTS, params)):
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
        assert out.token_ids == expected.tolist()
