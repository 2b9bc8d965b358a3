"""Prefix caching: a request starts from the keys a freed slot kept of an earlier request's tokens.

Guards: the scheduler gives a request the free slot holding the longest prefix of its prompt (of
its salt) and starts its prefill there, never at or past the prompt's last token; a slot keeps
no more than its sequence cached (a stop cuts tokens whose keys were written); the slot freed
longest ago goes first, so kept prefixes last. With a tiny float64 model, conversations give the
same output with prefix caching as without it whatever the drafter (rejected drafts leave stale
keys past the kept length, which must never be reused); a draft model's own cache starts from its
kept prefix too, and as its own draft the target is then still accepted every time; a head
reuses the pairs its slot kept and drafts exactly what it drafts from fresh ones; a recurrent
model and another salt reuse nothing; in exact mode a reused key is a fresh prefill's, bit for bit.

Prefix sharing: a request whose prompt begins as a running sequence's waits while that sequence
still caches much of what they share, then starts from a copy of its keys (and of its drafter's
entries), within the drafter's bound; requests sent together answer as they do alone, whatever the
drafter, on the CPU's path and the GPU's, with fewer prompt tokens computed; one whose source is
cancelled starts from what the source's freed slot kept.
"""
import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.engine.scheduler import SHARE_WAIT_TOKENS, Scheduler
from outpace.engine.sequence import Sequence
from heads import target_config, write_eagle3_head
from test_head_drafter import in_graph_step
from test_spec_lossless import RandomDrafter
from tiny import make_tiny

OPTIONS = dict(dtype="float64", device="cpu", max_num_seqs=2, max_model_len=256, max_prefill_tokens=8,
               calibrate=False)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# two conversations, three user turns each; each turn's prompt is the last prompt, its answer and these
TURNS = [[[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [9, 10, 11], [12]],
         [[100, 200, 300, 100, 200], [7] * 12, [42, 43]]]


def sequence(seq_id: int, prompt: list[int], salt: str = "", reuse: bool = True) -> Sequence:
    seq = Sequence(seq_id, prompt, SamplingParams())
    seq.reuse_prefix, seq.cache_salt = reuse, salt
    return seq


def run_to_end(scheduler: Scheduler, seq: Sequence, output: list[int]) -> None:
    scheduler.add(seq)
    scheduler.schedule()
    seq.token_ids += output
    seq.num_cached = len(seq.token_ids) - 1         # the last token is never cached
    scheduler.finish(seq)


def test_a_next_turn_starts_where_the_last_left_off():
    scheduler = Scheduler(3, 4)
    first = sequence(0, [1, 2, 3, 4, 5])
    run_to_end(scheduler, first, [6, 7, 8])                     # keeps [1 .. 7]
    run_to_end(scheduler, sequence(1, [9, 9, 9]), [1])
    turn = sequence(2, [1, 2, 3, 4, 5, 6, 7, 8, 10, 11])
    scheduler.add(turn)
    plan = scheduler.schedule()
    assert turn.slot == first.slot and turn.num_reused == turn.num_cached == 7
    assert [(c.start, c.end) for c in plan.prefill] == [(7, 9)]      # up to its last token
    assert first.slot not in scheduler.kept                     # the slot's keys are the new sequence's now


def test_a_prompt_the_slot_holds_whole_still_feeds_its_last_token():
    scheduler = Scheduler(1, 4)
    run_to_end(scheduler, sequence(0, [1, 2, 3, 4]), [5, 6])
    again = sequence(1, [1, 2, 3])
    scheduler.add(again)
    plan = scheduler.schedule()
    assert again.num_cached == 2 and not plan.prefill and plan.decode == [again]


def test_a_stop_that_cut_cached_tokens_keeps_only_the_tokens_left():
    scheduler = Scheduler(1, 4)
    seq = sequence(0, [1, 2, 3])
    scheduler.add(seq)
    scheduler.schedule()
    seq.num_cached = 6                  # a verify cached drafts past a stop string the stopper then dropped
    seq.token_ids += [4]
    scheduler.finish(seq)
    assert scheduler.kept[0].token_ids == [1, 2, 3, 4]


def test_another_salt_or_no_reuse_starts_from_nothing_in_the_slot_freed_longest_ago():
    scheduler = Scheduler(3, 4)
    for seq_id, prompt in enumerate([[1, 2, 3], [4, 5, 6], [7, 8, 9]]):
        run_to_end(scheduler, sequence(seq_id, prompt, salt="a"), [0])
    # slots 0, 1, 2 keep [1, 2, 3], [4, 5, 6], [7, 8, 9], freed in that order
    for freed_first, seq in enumerate((sequence(3, [4, 5, 6, 1], salt="b"),
                                       sequence(4, [7, 8, 9, 1], salt="a", reuse=False))):
        scheduler.add(seq)
        scheduler.schedule()
        assert seq.num_cached == 0 and seq.slot == freed_first
        scheduler.finish(seq)
    same = sequence(5, [7, 8, 9, 1], salt="a")
    scheduler.add(same)
    scheduler.schedule()
    assert same.slot == 2 and same.num_cached == 3


def test_low_slots_first_takes_the_lowest_slot_unless_one_holds_a_prefix():
    scheduler = Scheduler(3, 4, low_slots_first=True)
    first, second = sequence(0, [1, 2, 3]), sequence(1, [9, 9])
    for seq in (first, second):
        scheduler.add(seq)
    scheduler.schedule()
    for seq in (first, second):
        seq.token_ids += [0]
        seq.num_cached = len(seq.token_ids) - 1
        scheduler.finish(seq)
    turn, other = sequence(2, [9, 9, 0, 5]), sequence(3, [5, 5])
    for seq in (turn, other):
        scheduler.add(seq)
    scheduler.schedule()
    # slot 2, never used, would go first by age
    assert (turn.slot, turn.num_cached) == (1, 2) and (other.slot, other.num_cached) == (0, 0)


def test_a_scratch_slot_keeps_nothing():
    scheduler = Scheduler(1, 4)
    run_to_end(scheduler, sequence(0, [1, 2, 3]), [4])
    assert scheduler.take_scratch_slot() == 0 and not scheduler.kept


@pytest.fixture(scope="module")
def folders(tmp_path_factory, default_model_dir):
    target = tmp_path_factory.mktemp("tiny-target")
    make_tiny("llama", target, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    hybrid = tmp_path_factory.mktemp("tiny-hybrid")
    make_tiny("qwen3_5", hybrid, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    return target, hybrid


def converse(llm: LLM) -> tuple[list, list]:
    """TURNS' two conversations side by side, each turn of both in one generate call: their
    answers, and the prompt tokens each turn found cached."""
    prompts, answers, cached = [[], []], [], []
    for turn in zip(*TURNS):
        prompts = [p + t for p, t in zip(prompts, turn)]
        outs = llm.generate(prompts, PARAMS)
        answers.append([o.token_ids for o in outs])
        cached.append([o.num_cached_tokens for o in outs])
        prompts = [p + o.token_ids for p, o in zip(prompts, outs)]
    return answers, cached


@pytest.fixture(scope="module")
def uncached(folders):
    llm = LLM(str(folders[0]), spec="none", prefix_caching=False, **OPTIONS)
    answers, cached = converse(llm)
    assert cached == [[0, 0]] * 3
    return answers


def expected_cached(answers: list) -> list:
    """Turn t finds cached its last prompt and answer but the answer's last token."""
    cached, lengths = [[0, 0]], [0, 0]
    for t in range(1, 3):
        lengths = [n + len(TURNS[c][t - 1]) + len(answers[t - 1][c]) for c, n in enumerate(lengths)]
        cached.append([n - 1 for n in lengths])
    return cached


@pytest.mark.parametrize("drafter", ["plain", "ngram", "ngram trees", "random"])
def test_conversations_equal_their_uncached_answers(folders, uncached, drafter):
    """Rejected drafts write keys past a sequence's length, and a tree's accepted path is moved into
    place: a kept prefix must hold the accepted tokens' keys and stop before the rest."""
    options = dict(spec="none") if drafter == "plain" else dict(spec=SpecConfig(num_draft_tokens=4))
    if drafter == "ngram trees":
        options = dict(spec=SpecConfig(num_draft_tokens=6, tree_width=3))
    if drafter == "random":
        options = dict(drafter=RandomDrafter(49152), spec=SpecConfig(num_draft_tokens=4))
    llm = LLM(str(folders[0]), **options, **OPTIONS)
    answers, cached = converse(llm)
    assert answers == uncached
    assert cached == expected_cached(uncached)
    if drafter == "random":
        assert llm.engine.stats.num_draft_tokens > llm.engine.stats.num_accepted_tokens


def test_a_request_cancelled_while_its_prompt_is_cached_leaves_what_it_cached(folders, uncached):
    llm = LLM(str(folders[0]), spec=SpecConfig(num_draft_tokens=4), **dict(OPTIONS, max_num_seqs=1))
    engine, prompt = llm.engine, TURNS[0][0] + TURNS[0][0]          # 22 tokens: chunks of 8
    seq = engine.add_request(prompt, PARAMS)
    engine.step()
    engine.step()
    assert seq.num_cached == 16
    engine.abort(seq.seq_id)
    again = llm.generate(prompt, PARAMS)[0]
    assert again.num_cached_tokens == 16
    fresh = LLM(str(folders[0]), spec="none", prefix_caching=False, **OPTIONS)
    assert again.token_ids == fresh.generate(prompt, PARAMS)[0].token_ids


def test_the_target_as_its_own_draft_model_reuses_its_kept_keys(folders):
    """A draft cache entry that its kept prefix got wrong would show as a rejected draft."""
    spec = SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4, draft_vocab=0)
    llm = LLM(str(folders[0]), spec=spec, **OPTIONS)
    drafter = llm.engine.drafter
    fed = []
    forward = drafter.runner.forward
    drafter.runner.forward = lambda rows, *a, **k: fed.append(sum(len(r.token_ids) for r in rows)) or forward(
        rows, *a, **k)
    prompts, reads = [[], []], []
    for turn in zip(*TURNS):
        prompts = [p + t for p, t in zip(prompts, turn)]
        fed.clear()
        outs = llm.generate(prompts, PARAMS)
        reads.append(sum(fed))
        prompts = [p + o.token_ids for p, o in zip(prompts, outs)]
    assert llm.engine.stats.num_accepted_tokens == llm.engine.stats.num_draft_tokens > 0
    # the third turn reads its new user tokens and drafts, not the conversation so far
    assert reads[2] < sum(len(p) for p in prompts) / 2
    assert sorted(llm.engine.scheduler.kept) == [0, 1] and sorted(drafter.kept_keys.kept) == [0, 1]


def test_a_draft_model_catches_up_past_its_kept_keys(folders, uncached):
    """A plain turn in between moves the target's kept prefix past the draft model's: the draft
    catches up on the tokens it lacks, and is still accepted every time."""
    spec = SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4, draft_vocab=0)
    llm = LLM(str(folders[0]), spec=spec, **dict(OPTIONS, max_num_seqs=1))
    prompt = []
    for index, turn in enumerate(TURNS[0]):
        prompt += turn
        out = llm.generate(prompt, PARAMS, speculate=index != 1)[0]
        assert out.token_ids == uncached[index][0]
        prompt += out.token_ids
    assert llm.engine.stats.num_accepted_tokens == llm.engine.stats.num_draft_tokens > 0


def test_another_salt_reuses_nothing(folders):
    llm = LLM(str(folders[0]), spec="none", **OPTIONS)
    prompt = TURNS[0][0]
    first = llm.generate(prompt, PARAMS, cache_salt="a")[0]
    prompt = prompt + first.token_ids + TURNS[0][1]
    assert llm.generate(prompt, PARAMS, cache_salt="b")[0].num_cached_tokens == 0
    assert llm.generate(prompt, PARAMS, cache_salt="a")[0].num_cached_tokens == len(prompt) - len(TURNS[0][1]) - 1


def test_a_recurrent_model_reuses_nothing(folders):
    """A recurrent layer's state holds the whole sequence, not a prefix the next turn can start from."""
    llm = LLM(str(folders[1]), spec="none", **OPTIONS)
    prompt = TURNS[0][0]
    first = llm.generate(prompt, PARAMS)[0]
    assert llm.generate(prompt + first.token_ids + TURNS[0][1], PARAMS)[0].num_cached_tokens == 0


def recorded(drafter) -> list:
    """The drafter's drafts, step by step, as host lists."""
    drafts, propose = [], drafter.propose

    def record(batch):
        out = propose(batch)
        drafts.append(out.host_rows())
        return out
    drafter.propose = record
    return drafts


@pytest.fixture(scope="module")
def head_target(tmp_path_factory, default_model_dir) -> tuple[str, SpecConfig]:
    """A tiny float64 target and a random EAGLE-3 head for it: (target folder, spec)."""
    target, head = tmp_path_factory.mktemp("head-target"), tmp_path_factory.mktemp("head")
    make_tiny("llama-4-layers", target, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    write_eagle3_head(head, target_config(target))
    return str(target), SpecConfig(method="eagle3", draft_head=str(head), num_draft_tokens=4)


def test_a_head_drafts_from_its_kept_pairs_what_it_drafts_from_fresh_ones(head_target):
    """A head's pairs come from the target's hidden states, which a reused prefix does not
    recompute: it reuses the pairs its slot kept, and drafts exactly what it drafts without them."""
    target, spec = head_target
    runs = []
    for on in (True, False):
        llm = LLM(target, spec=spec, prefix_caching=on, **OPTIONS)
        drafts = recorded(llm.engine.drafter)
        prompt, cached = [], []
        for turn in TURNS[0]:
            prompt += turn
            out = llm.generate(prompt, PARAMS)[0]
            cached.append(out.num_cached_tokens)
            prompt += out.token_ids
        runs.append((prompt, drafts, cached))
    (prompt, drafts, cached), (fresh_prompt, fresh_drafts, _) = runs
    assert prompt == fresh_prompt and drafts == fresh_drafts and any(map(any, drafts))
    assert cached[0] == 0 and min(cached[1:]) > 0


def test_exact_mode_reuses_the_keys_a_fresh_prefill_writes(folders):
    """Exact mode's forwards do not depend on their shapes: in bfloat16 the keys a turn's decode
    steps wrote are, bit for bit, those a fresh prefill of the same tokens writes in one chunk
    (outside exact mode a chunk this long may take float32 products: runner/model_runner.py)."""
    options = dict(OPTIONS, dtype="bfloat16", max_num_seqs=1, max_prefill_tokens=256)
    spec = SpecConfig(num_draft_tokens=4, exact=True)
    llm = LLM(str(folders[0]), spec=spec, **options)
    llm.generate(list(range(1000, 1140)), PARAMS)
    kept = llm.engine.scheduler.kept[0].token_ids
    fresh = LLM(str(folders[0]), spec=spec, prefix_caching=False, **options)
    fresh.generate(kept + [5], SamplingParams(temperature=0, max_tokens=1))
    n = len(kept)
    for a, b in ((llm.engine.runner.cache.k, fresh.engine.runner.cache.k),
                 (llm.engine.runner.cache.v, fresh.engine.runner.cache.v)):
        assert torch.equal(a[:, 0, :, :n], b[:, 0, :, :n])


def test_a_request_waits_for_a_running_prompt_it_shares_then_copies_its_keys():
    scheduler = Scheduler(4, 16, share_bound=lambda source, seq: None)
    prompt = list(range(100))
    first, second = sequence(0, prompt), sequence(1, prompt[:90] + [7, 8])
    other_salt, no_reuse = sequence(2, prompt, salt="b"), sequence(3, prompt, reuse=False)
    for seq in (first, second):
        scheduler.add(seq)
    cached = 0
    while second.slot is None:
        plan = scheduler.schedule()
        # it waits while the first has SHARE_WAIT_TOKENS or more of their 90 to cache
        assert (second.slot is None) == (90 - cached >= SHARE_WAIT_TOKENS)
        first.num_cached = cached = min(cached + 16, 99)     # the chunk the plan gave it
    assert second.slot != first.slot and plan.copies == [(first, second, second.num_cached)]
    assert second.num_cached == second.num_reused == 64 > 90 - SHARE_WAIT_TOKENS
    # the step's prompt budget (16) goes to the first; the second caches from 64 on in a later step
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefill] == [(0, 64, 80)]
    for seq in (other_salt, no_reuse):          # neither waits nor shares
        scheduler.add(seq)
        plan = scheduler.schedule()
        assert seq.slot is not None and seq.num_cached == 0 and not plan.copies


def test_a_drafters_bound_cuts_what_a_request_takes_of_a_running_prefix():
    scheduler = Scheduler(2, 64, share_bound=lambda source, seq: 5)
    first, second = sequence(0, list(range(40))), sequence(1, list(range(40)))
    scheduler.add(first)
    scheduler.schedule()
    first.num_cached = 39
    scheduler.add(second)
    assert scheduler.schedule().copies == [(first, second, 5)] and second.num_cached == 5


SHARED = list(range(300, 360))                  # 60 tokens every prompt begins with
# the tokens' logprobs too: a copied key that was not the source's moves them, if not the argmax
SCORED = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
TAILS = [[1, 2, 3], [4, 5], [1, 2, 3]]          # the first and the last prompt alike


def together(llm: LLM) -> tuple[list, list, int]:
    """The three prompts sent together: their answers, the prompt tokens each found cached, and the
    prompt tokens the target's forwards cached in chunks."""
    computed, prefilled = [], llm.engine._prefilled

    def counting(plan, *args):
        computed.extend(c.end - c.start for c in plan.prefill)
        return prefilled(plan, *args)
    llm.engine._prefilled = counting
    outs = llm.generate([SHARED + t for t in TAILS], SCORED)
    del llm.engine._prefilled
    scores = [[entries[t].logprob for t, entries in zip(o.token_ids, o.logprobs)] for o in outs]
    return ([o.token_ids for o in outs], scores), [o.num_cached_tokens for o in outs], sum(computed)


@pytest.fixture(scope="module")
def alone(folders):
    llm = LLM(str(folders[0]), spec="none", prefix_caching=False, **dict(OPTIONS, max_num_seqs=3))
    answers, cached, computed = together(llm)
    assert cached == [0, 0, 0] and computed == 3 * len(SHARED) + 2 + 1 + 2     # up to each last token
    return answers, computed


@pytest.mark.parametrize("drafter", ["plain", "ngram", "random", "draft model", "gpu path", pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_requests_sharing_a_prompts_start_answer_as_they_do_alone(folders, alone, drafter):
    """A copied key or draft entry that was not the source's, or one past what the source had
    cached, moves an answer's logprobs (float64: the rest agree to rounding; a GPU's graphs norm
    in float32, test_logprobs.py)."""
    spec = SpecConfig(method="draft", draft_model=str(folders[0]), num_draft_tokens=4, draft_vocab=0) \
        if drafter == "draft model" else "none" if drafter == "plain" else SpecConfig(num_draft_tokens=4)
    options = dict(OPTIONS, max_num_seqs=3)
    if drafter in ("gpu path", "cuda"):
        from test_cuda_graphs import device_path_llm
        llm = device_path_llm(folders[0], spec, "cuda" if drafter == "cuda" else "cpu")
    else:
        llm = LLM(str(folders[0]), spec=spec, **options,
                  **(dict(drafter=RandomDrafter(49152)) if drafter == "random" else {}))
    (answers, scores), cached, computed = together(llm)
    tolerance = 1e-4 if drafter == "cuda" else 1e-9
    assert answers == alone[0][0] and sum(scores, []) == pytest.approx(sum(alone[0][1], []), abs=tolerance)
    assert cached[0] == 0 and min(cached[1:]) > 0 and computed == alone[1] - sum(cached)
    if drafter == "draft model":        # its own copied entries are right: the target accepts every draft
        assert llm.engine.stats.num_accepted_tokens == llm.engine.stats.num_draft_tokens > 0


def test_a_head_drafts_from_shared_pairs_what_it_drafts_from_its_own(head_target):
    """A head's pairs come from the target's hidden states, which a shared prefix does not
    recompute: it copies the source's pairs, and drafts for each sequence what it drafts without."""
    target, spec = head_target
    runs = []
    for on in (True, False):
        llm = LLM(target, spec=spec, prefix_caching=on, **dict(OPTIONS, max_num_seqs=3))
        drafts, propose = {}, llm.engine.drafter.propose

        def record(batch, propose=propose, drafts=drafts):
            out = propose(batch)
            for seq_id, row in zip(batch.seq_ids, out.host_rows()):
                drafts.setdefault(seq_id, []).append(row)
            return out
        llm.engine.drafter.propose = record
        outs = llm.generate([SHARED + t for t in TAILS], PARAMS)
        runs.append(([o.token_ids for o in outs], [o.num_cached_tokens for o in outs],
                     [[r for r in rows if r] for _, rows in sorted(drafts.items())]))
    (answers, cached, drafts), (fresh_answers, _, fresh_drafts) = runs
    assert answers == fresh_answers and drafts == fresh_drafts and any(map(any, drafts))
    assert cached[0] == 0 and min(cached[1:]) > 0


def test_a_head_in_the_graph_step_drafts_from_shared_pairs_what_it_drafts_from_its_own(head_target):
    """The GPU path (HeadGraphStep, run eagerly here), three drafts every step: each chain the
    graph step drafts for a sequence at a position begins as the one it drafts there without
    sharing (the copied pairs are the ones its own catch-up would have written), and the answers
    match."""
    target, spec = head_target
    runs = []
    for on in (True, False):
        llm = LLM(target, spec=spec, prefix_caching=on, **dict(OPTIONS, max_num_seqs=3))
        engine, step = llm.engine, in_graph_step(llm)
        chains, before = {}, step.before

        def recorded(b, t, input_ids, before=before, step=step, engine=engine, chains=chains):
            before(b, t, input_ids)         # (sequence, the step's start) -> the chain it verifies
            at = {s.slot: s.seq_id for s in engine.scheduler.running}
            for r, room in enumerate(step.inputs_view[0, :b].tolist()):
                if room and t > 1:
                    chains[at[r], int(step.starts[r])] = step.drafts[r, :min(room, t - 1)].tolist()
        step.before = recorded
        outs = llm.generate([SHARED + t for t in TAILS], PARAMS)
        runs.append(([o.token_ids for o in outs], [o.num_cached_tokens for o in outs], chains))
    (answers, cached, chains), (fresh_answers, _, fresh_chains) = runs
    common = chains.keys() & fresh_chains.keys()
    assert answers == fresh_answers and len(common) > 20
    # a step's room may differ between the runs: the shorter chain begins the longer
    shorter = {key: min(len(chains[key]), len(fresh_chains[key])) for key in common}
    assert {k: chains[k][:n] for k, n in shorter.items()} == {k: fresh_chains[k][:n] for k, n in shorter.items()}
    assert cached[0] == 0 and min(cached[1:]) > 0


def test_a_request_waiting_for_a_cancelled_one_caches_its_prompt_itself(folders, alone):
    """The running sequence a request waits for is cancelled mid-prompt: the request then starts
    from what that one's freed slot kept, and answers as it does alone."""
    llm = LLM(str(folders[0]), spec=SpecConfig(num_draft_tokens=4), **dict(OPTIONS, max_num_seqs=3))
    engine = llm.engine
    first, second = (engine.add_request(SHARED + TAILS[i], SCORED) for i in (0, 1))
    engine.step()
    assert first.num_cached == 8 and second.slot is None        # it waits for the first's prompt
    engine.abort(first.seq_id)
    while engine.has_unfinished():
        engine.step()
    assert second.num_reused == 8 and second.token_ids[len(SHARED) + 2:] == alone[0][0][1]
