"""EAGLE-3 drafting through the engine on tiny float64 targets (no near-ties).

Guards: whatever a head drafts (a random head is the adversary), chains and trees, greedy output
equals plain greedy output, batched with fewer slots than requests, prompts cached in chunks, and
rejected drafts rolled back; the head's cache must stay what a head computed from scratch would
hold (its proposals, after prompt chunks, rejections and multi-token acceptances by n-gram drafts
beside it, are the drafts of the head run over the sequence's whole history); each tree node must
be one of the best children of its parent along its own path (the tree's mask and positions in
the head's cache); seeded sampled output, chains and trees, must be plain seeded sampling's.
"""
import contextlib
import itertools

import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.engine.graph_step import GraphStep
from outpace.kernels import fused
from outpace.model.draft_head import attend
from outpace.runner.cuda_graphs import CudaGraphRunner
from outpace.runner.model_runner import ModelRunner, Row
from outpace.speculative import ngram_gpu
from outpace.speculative.chain import ChainGraphStep, DrafterChain
from outpace.speculative.factory import lookup_twin
from outpace.speculative.head_graphs import HeadGraphs
from heads import target_config, write_eagle3_head
from tiny import make_tiny

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42],
           list(range(500, 520)) * 2]
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
OPTIONS = dict(dtype="float64", device="cpu", max_num_seqs=3, max_model_len=256, max_prefill_tokens=8,
               calibrate=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, default_model_dir):
    target = tmp_path_factory.mktemp("tiny-4-layers")
    make_tiny("llama-4-layers", target, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    head = tmp_path_factory.mktemp("random-head")
    write_eagle3_head(head, target_config(target))
    return target, head


@pytest.fixture(scope="module")
def plain(folders):
    return [o.token_ids for o in LLM(str(folders[0]), spec="none", **OPTIONS).generate(PROMPTS, PARAMS)]


def _llm(folders, **spec):
    spec = dict(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=4) | spec
    return LLM(str(folders[0]), spec=SpecConfig(**spec), **OPTIONS)


@pytest.mark.parametrize("tree_width", [1, 3])
def test_a_random_head_keeps_greedy_output(folders, plain, tree_width):
    llm = _llm(folders, tree_width=tree_width)
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert sum(o.spec["num_draft_tokens"] for o in out) > 0
    drafter = llm.engine.drafter
    assert drafter.hidden_layers == (0, 1, 2) and not drafter.tokens
    assert sorted(llm.engine.scheduler.free_slots) == [0, 1, 2]



def test_chains_cut_by_p_min_keep_greedy_output(folders, plain):
    """A head's chains stop at their first draft below p_min: rows draft a part of their budgets,
    fewer tokens in all, and greedy output stays plain's."""
    drafted = {}
    for p_min in (0.0, 0.9):
        llm = _llm(folders, p_min=p_min)
        drafter, cuts = llm.engine.drafter, []
        propose = drafter.propose

        def recorded(batch):
            drafts = propose(batch)
            cuts.extend((n, k) for n, k in zip(drafts.num_draft_host, batch.budget) if k)
            return drafts

        drafter.propose = recorded
        out = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in out] == plain
        drafted[p_min] = sum(o.spec["num_draft_tokens"] for o in out)
        # without a stop a row drafts its whole budget, or nothing where its prompt is not caught up
        assert any(0 < n < k for n, k in cuts) if p_min else all(n in (0, k) for n, k in cuts)
    assert 0 < drafted[0.9] < drafted[0.0]


def test_a_heads_chains_stop_below_head_p_min_unless_told():
    from outpace.config import HEAD_P_MIN
    assert SpecConfig(method="eagle3").p_min == SpecConfig(method="mtp", draft_head="m").p_min == HEAD_P_MIN > 0
    assert SpecConfig(method="draft", draft_model="d").p_min == SpecConfig().p_min == 0.0
    assert SpecConfig(method="eagle3", p_min=0.0).p_min == 0.0
    with pytest.raises(ValueError, match="p_min"):
        SpecConfig(method="eagle3", p_min=1.0)

def test_a_tree_head_asked_for_chains_drafts_chains(folders, plain):
    """The controller may give a tree head's step chains (DraftBatch.tree_width 1): steps that
    alternate between chains and trees keep greedy output, and the chain steps' drafts are
    chains."""
    llm = _llm(folders, tree_width=3)
    steps, shapes = itertools.count(), []
    llm.engine.controller.step_tree_width = lambda batch_size: 1 if next(steps) % 2 else 3
    drafter = llm.engine.drafter
    propose = drafter.propose

    def recorded(batch):
        drafts = propose(batch)
        shapes.append((batch.tree_width, drafts.parents is None))
        return drafts
    drafter.propose = recorded
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain
    assert {(1, True), (3, False)} <= set(shapes) and (1, False) not in shapes


class Recorded:
    """Each propose of a head drafter: the rows' tokens at the time and what was drafted."""

    def __init__(self, llm, drafter):
        self.calls, self.engine, self.propose = [], llm.engine, drafter.propose
        drafter.propose = self

    def __call__(self, batch):
        drafts = self.propose(batch)
        parents = None if drafts.parents is None else drafts.parents.tolist()
        for i, (seq_id, rows) in enumerate(zip(batch.seq_ids, drafts.host_rows())):
            if rows:
                tree = None if parents is None else parents[i][:len(rows)]
                self.calls.append((list(self.engine.sequences[seq_id].token_ids), rows, tree))
        return drafts


def _reference(head, embed, hidden, tokens, path):
    """The head run from scratch: pairs 0 .. n-1 of the sequence (the target's hidden states
    [n, layers, H], tokens[1..n]), then `path` fed as a chain of drafts; the logits after it."""
    n = len(tokens) - 1
    positions = torch.arange(n)
    residual, q, k, v = head.project(head.features(hidden), embed(torch.tensor(tokens[1:])), positions)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    out = head.finish(residual[None], attend(q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             mask[None, None]))[0][-1]
    keys, values = k, v
    for j, token in enumerate(path):
        residual, q, k, v = head.project(out[None], embed(torch.tensor([token])), torch.tensor([n + j]))
        keys, values = torch.cat([keys, k]), torch.cat([values, v])
        out = head.finish(residual[None], attend(q[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                                 torch.ones(1, 1, 1, len(keys), dtype=torch.bool)))[0, 0]
    return head.logits(out)


def _hidden(llm, tokens, layers):
    runner = ModelRunner(llm.engine.model, 1, 256, 8)
    return runner.forward([Row(0, tokens[:-1], 0)], hidden_layers=layers)[1][0]


@pytest.mark.parametrize("ngram_first", [False, True])
def test_drafts_are_the_heads_run_from_scratch(folders, plain, ngram_first):
    llm = _llm(folders, ngram_first=ngram_first)
    drafter = llm.engine.drafter.drafters[1] if ngram_first else llm.engine.drafter
    recorded = Recorded(llm, drafter)
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    if ngram_first:         # n-gram drafts were accepted beside the head's: multi-token catch-ups
        assert sum(o.spec["num_accepted_tokens"] for o in out) > 0
    assert len(recorded.calls) > 20
    _assert_drafts_from_scratch(llm, drafter, recorded.calls[::2])


def _assert_drafts_from_scratch(llm, drafter, calls):
    """Each recorded chain is the head's greedy chain run from scratch over the sequence."""
    head = drafter.head
    for tokens, drafted, _ in calls:
        hidden = _hidden(llm, tokens, drafter.hidden_layers)
        want = []
        while len(want) < len(drafted):
            logits = _reference(head, drafter.embed, hidden, tokens, want)
            want.append(int(head.to_target(logits.argmax())))
        assert drafted == want


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "gpu-path"])
def test_a_plain_request_costs_the_head_nothing(folders, plain, graphs):
    """speculate=False (the benchmarks' plain baseline in the same engine), alone and batched with
    speculating requests: the head catches up on no plain row (its catch-up on every plain step
    once made the CPU's plain baseline 30% slower than plain decoding without a head), and the
    speculating rows' drafts are still the head run from scratch."""
    llm = _llm(folders)
    engine, drafter = llm.engine, llm.engine.drafter
    if graphs:
        engine.runner = CudaGraphRunner(engine.model, 3, 256, 8, num_draft_tokens=4, progress=False,
                                        hidden_layers=drafter.hidden_layers)
        engine.steps = GraphStep(engine.runner, drafter, engine.controller, 256, 4, scheduler=engine.scheduler,
                                 overlap=True)
    caught_up, catch_up = [], drafter._catch_up

    def counted(hidden, tokens, slots, *args):
        caught_up.append(list(slots))
        return catch_up(hidden, tokens, slots, *args)
    drafter._catch_up = counted
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS, speculate=False)] == plain and not caught_up
    recorded = Recorded(llm, drafter)
    seqs = [engine.add_request(p, PARAMS, speculate=i % 2 == 0) for i, p in enumerate(PROMPTS)]
    plain_slots = []
    while engine.has_unfinished():
        plain_slots.append({s.slot for s in seqs if not s.speculate and s.slot is not None and not s.is_finished})
        caught_up.clear()
        engine.step()
        assert not plain_slots[-1] & {slot for call in caught_up for slot in call}
    assert [s.output_ids for s in seqs] == plain and any(plain_slots)
    assert len(recorded.calls) > 10
    _assert_drafts_from_scratch(llm, drafter, recorded.calls[::2])


def test_the_head_catches_up_only_when_it_drafts(folders, plain):
    """Verified pairs wait until their row drafts (a catch-up on every step cost the CPU's head
    about an eighth of a step whether it drafted or not): rows that drafted and were then left
    undrafted for longer than the pending buffer holds catch up as it fills, every prompt drafts
    (one of a single token too), and each draft is still the head run from scratch. Steps that
    draft nothing for anyone run no head forward."""
    llm = _llm(folders)
    engine, drafter = llm.engine, llm.engine.drafter
    asked, num_draft = {"calls": 0}, engine.controller.num_draft

    def long_plain_stretches(*args, **kwargs):     # 8 asks with a draft, then 40 without
        asked["calls"] += 1
        return num_draft(*args, **kwargs) if asked["calls"] % 48 < 8 else 0
    engine.controller.num_draft = long_plain_stretches
    forwards, catch_up = [], drafter._catch_up
    drafter._catch_up = lambda *args: forwards.append(1) or catch_up(*args)
    recorded = Recorded(llm, drafter)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(folders[0]), spec="none", **OPTIONS).generate(PROMPTS, params)]
    steps = []                                      # per decode step: (it drafted, head forwards)
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    while engine.has_unfinished():
        forwards.clear()
        calls = len(recorded.calls)
        plan_prefills = bool(engine.scheduler.waiting)
        engine.step()
        if not plan_prefills:
            steps.append((len(recorded.calls) > calls, len(forwards)))
    assert [s.output_ids for s in seqs] == want
    assert all(any(tokens[:len(p)] == p for tokens, _, _ in recorded.calls) for p in PROMPTS)
    undrafted = [n for drafted, n in steps if not drafted]
    assert len(undrafted) > 40 and sum(n > 0 for n in undrafted) < len(undrafted) / 4
    _assert_drafts_from_scratch(llm, drafter, recorded.calls[::3])


def test_rows_that_never_draft_are_given_up(folders):
    """A row whose pending buffer fills without its having drafted since its last catch-up is
    given up: the head drafts no more for it and runs no forward for it (a catch-up of every
    position cost the CPU's head a forward a token for no draft). Output stays plain's."""
    llm = _llm(folders)
    engine, drafter = llm.engine, llm.engine.drafter
    engine.controller.num_draft = lambda *args, **kwargs: 0
    forwards, catch_up, prefilled = [], drafter._catch_up, drafter.prefilled
    in_prompt = [False]

    def prompt_chunks(chunks):              # a prompt's chunks are caught up as they are cached
        in_prompt[0] = True
        prefilled(chunks)
        in_prompt[0] = False
    drafter.prefilled = prompt_chunks
    drafter._catch_up = lambda *args: forwards.append(in_prompt[0]) or catch_up(*args)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(folders[0]), spec="none", **OPTIONS).generate(PROMPTS, params)]
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    given_up = set()
    while engine.has_unfinished():
        engine.step()
        given_up |= drafter.given_up
    assert [s.output_ids for s in seqs] == want
    assert given_up == {s.seq_id for s in seqs} and forwards and all(forwards)
    assert not drafter.given_up and not drafter.ready


def test_a_head_on_graph_steps_reads_their_hidden_states(folders, plain):
    """The GPU path (CudaGraphRunner's static steps, run eagerly here, with GraphStep): the
    target's hidden states come from the graph step's buffer, and the head's drafts are still
    its run from scratch, with steps where nobody drafts among them (launched ahead of the host's
    read where the controller would not draft next either: the head catches up on each before
    the launched step overwrites its hidden states)."""
    llm = _llm(folders)
    engine, drafter = llm.engine, llm.engine.drafter
    engine.runner = CudaGraphRunner(engine.model, 3, 256, 8, num_draft_tokens=4, progress=False,
                                    hidden_layers=drafter.hidden_layers)
    engine.steps = GraphStep(engine.runner, drafter, engine.controller, 256, 4, scheduler=engine.scheduler,
                             overlap=True)
    shapes, forward = [], engine.runner.forward

    def recorded_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        shapes.append(engine.runner.last_shape)
        return out
    engine.runner.forward = recorded_forward
    asked, num_draft = {"calls": 0}, engine.controller.num_draft

    def some_plain(*args, **kwargs):            # stretches of four asks answered with no draft
        asked["calls"] += 1
        return 0 if asked["calls"] // 4 % 2 else num_draft(*args, **kwargs)
    engine.controller.num_draft = some_plain
    recorded = Recorded(llm, drafter)
    launched, launch = [], engine.steps._launch_next
    engine.steps._launch_next = lambda *args: launched.append(launch(*args)) or launched[-1]
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert sum(s is not None for s in shapes) > 20 and engine.steps.launched is None
    assert sum(x is not None for x in launched) > 5
    assert len(recorded.calls) > 20
    _assert_drafts_from_scratch(llm, drafter, recorded.calls[::2])


def in_graph_step(llm: LLM):
    """The LLM's engine (a head's, 3 slots, 256 positions, 4 drafts) on the GPU path, built on the
    CPU: the head's part of the target's graph step (HeadGraphStep, run eagerly), three drafts every
    step. Returns that part."""
    engine, drafter = llm.engine, llm.engine.drafter
    drafter.graphs = HeadGraphs(drafter, 3, 256, 5, 4, chains=True)
    step = drafter.graph_step(3, 5)
    engine.runner = CudaGraphRunner(engine.model, 3, 256, 8, num_draft_tokens=4, progress=False,
                                    hidden_layers=drafter.hidden_layers, extension=step)
    engine.steps = GraphStep(engine.runner, drafter, engine.controller, 256, 4, scheduler=engine.scheduler,
                             overlap=True)
    engine.controller.num_draft = lambda *args, **kwargs: 3
    return step


def test_a_head_drafts_inside_the_targets_graph_step(folders, plain):
    """The GPU path with the head's part of the target's graph step (HeadGraphStep, run eagerly
    here): greedy steps are drafted, verified and launched ahead of the host's read inside the
    target's step (the head drafting on the host no more), output stays plain's, and each chain
    drafted in the step is the head run from scratch over its sequence up to the step's start,
    a start the device derived itself in a step launched ahead."""
    llm = _llm(folders)
    engine, drafter = llm.engine, llm.engine.drafter
    step = in_graph_step(llm)
    proposed, propose = [], drafter.propose
    drafter.propose = lambda batch: proposed.append(batch) or propose(batch)
    launched, launch = [], engine.steps._launch_next
    engine.steps._launch_next = lambda *args: launched.append(launch(*args)) or launched[-1]
    chains, before = [], step.before

    def recorded(b, t, input_ids):              # (sequence, the step's start, the chain it verifies)
        before(b, t, input_ids)
        at = {s.slot: s.seq_id for s in engine.scheduler.running}
        for r, room in enumerate(step.inputs_view[0, :b].tolist()):
            if room and t > 1:
                chains.append((at[r], int(step.starts[r]), step.drafts[r, :min(room, t - 1)].tolist()))
    step.before = recorded
    seqs = [engine.add_request(p, PARAMS) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == plain
    assert not proposed and sum(x is not None and any(x.budget) for x in launched) > 10
    assert sum(s.stats.num_draft_tokens for s in seqs) > 100
    tokens = {s.seq_id: s.token_ids for s in seqs}
    calls = [(tokens[seq_id][:start + 1], drafted, None) for seq_id, start, drafted in chains]
    assert len(calls) > 20
    _assert_drafts_from_scratch(llm, drafter, calls[::3])


@pytest.mark.parametrize("shapes", ["trees", "trees and chains"])
def test_a_tree_head_drafts_inside_the_targets_graph_step(folders, plain, shapes):
    """The GPU path with a tree head's part of the target's graph step (HeadTreeGraphStep, run
    eagerly here): greedy steps are drafted as token trees, verified with the trees' mask and
    positions inside the target's step (launched ahead too), and output stays plain's. A random
    head's drafts are all rejected, so each tree also gets the target's own tokens along a path
    of late siblings: verifying them accepts that path and moves its keys, values and hidden
    states into place. Each tree the head drafted holds at each node one of the best children
    along its path, by the head run from scratch (so its catch-up read the moved hidden states).
    Steps the controller gives chains draft them outside the graph and verify them through the
    same graph, as chains."""
    width = 3
    llm = _llm(folders, tree_width=width, num_draft_tokens=6)
    engine, drafter = llm.engine, llm.engine.drafter
    drafter.graphs = HeadGraphs(drafter, 3, 256, 7, 6, chains=False)
    step = drafter.graph_step(3, 7)
    assert step.trees
    engine.runner = CudaGraphRunner(engine.model, 3, 256, 8, num_draft_tokens=6, progress=False,
                                    hidden_layers=drafter.hidden_layers, extension=step)
    engine.steps = GraphStep(engine.runner, drafter, engine.controller, 256, 6, scheduler=engine.scheduler,
                             overlap=True)
    engine.controller.num_draft = lambda *args, **kwargs: 5
    steps = itertools.count()
    engine.controller.step_tree_width = lambda batch_size: 1 if shapes != "trees" and next(steps) % 3 == 0 else width
    proposed = Recorded(llm, drafter)
    launched, launch = [], engine.steps._launch_next
    engine.steps._launch_next = lambda *args: launched.append(launch(*args)) or launched[-1]
    seqs = [engine.add_request(p, PARAMS) for p in PROMPTS]
    full = {s.seq_id: p + out for s, p, out in zip(seqs, PROMPTS, plain)}
    trees, tree = [], drafter.graphs.tree

    def tree_with_a_right_path(b, N, k, starts, active, rooms):
        tokens, parents, depth, is_node, levels = tree(b, N, k, starts, active, rooms)
        at = {s.slot: s.seq_id for s in engine.scheduler.running}
        tokens = tokens.clone()
        for r in range(b):
            if not active[r, 0]:
                continue
            sequence, start = full[at[r]], int(starts[r])
            kept = is_node[r].tolist()
            index = {j: n for n, j in enumerate(j for j, keep in enumerate(kept) if keep)}
            trees.append((sequence[:start + 1], [t for t, keep in zip(tokens[r].tolist(), kept) if keep],
                          [index.get(p, -1) for p, keep in zip(parents[r].tolist(), kept) if keep]))
            assert len(trees[-1][1]) == min(int(rooms[r]), N)
            node = -1
            for d in range(1, len(sequence) - start):   # the last of each node's children gets its token
                children = [j for j in range(N) if kept[j] and parents[r, j] == node]
                if not children:
                    break
                node = children[-1]
                tokens[r, node] = sequence[start + d]
        return tokens, parents, depth, is_node, levels
    drafter.graphs.tree = tree_with_a_right_path
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == plain
    assert sum(x is not None and any(x.budget) for x in launched) > 5
    assert sum(s.stats.num_draft_tokens for s in seqs) > 100
    assert sum(s.stats.num_accepted_tokens for s in seqs) > 50
    if shapes == "trees":
        assert not proposed.calls
    else:
        assert proposed.calls and all(tree is None for _, _, tree in proposed.calls)
    assert len(trees) > 20
    _assert_best_children(llm, trees[::3], width)


def test_a_chains_lookup_in_the_graph_keeps_the_heads_cache(folders):
    """The GPU path with n-gram first: where the controller gives the head no row, the lookup's
    device twin drafts and verifies inside the graph step (launched ahead too), and the head
    catches up on every position that step verified (accepted lookup drafts and all) from the
    graph's hidden states; where the head drafts, the chain drafts on the host. The head's drafts
    stay its run from scratch (each of them: a head that missed a position drafts otherwise
    afterwards), and the output plain's."""
    llm = _llm(folders, ngram_first=True)
    engine = llm.engine
    spec = engine.config.spec
    chain = engine.drafter = DrafterChain(engine.drafter.drafters, lookup_twin(spec, 3, 256, "cpu", use_graph=False))
    head = chain.drafters[1]
    engine.runner = CudaGraphRunner(engine.model, 3, 256, 8, num_draft_tokens=4, progress=False,
                                    hidden_layers=chain.hidden_layers, extension=chain.graph_step(3, 5))
    engine.steps = steps = GraphStep(engine.runner, chain, engine.controller, 256, 4, scheduler=engine.scheduler,
                                     overlap=True)
    asked, num_draft = {"calls": 0}, engine.controller.num_draft

    def some_plain(*args, paid=True, **kwargs):     # stretches of two asks in which the head drafts nothing
        asked["calls"] += paid
        return 0 if paid and asked["calls"] // 2 % 2 else num_draft(*args, paid=paid, **kwargs)
    engine.controller.num_draft = some_plain
    in_graph, verify = [0], steps.verify

    def counted(plan, proposal, chunks):      # tokens accepted in steps the graph verified itself
        result = verify(plan, proposal, chunks)
        if proposal.in_graph:
            in_graph[0] += sum(result.counts) - len(result.counts)
        return result
    steps.verify = counted
    recorded = Recorded(llm, head)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    out = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in LLM(str(folders[0]), spec="none", **OPTIONS).generate(
        PROMPTS, params)]
    assert in_graph[0] > 0
    assert len(recorded.calls) > 10
    _assert_drafts_from_scratch(llm, head, recorded.calls)
    assert not chain.lookup.rows and sorted(engine.scheduler.free_slots) == [0, 1, 2]


def test_a_chain_with_the_heads_graph_step_drafts_every_step_in_the_graph(folders, plain):
    """The GPU path with n-gram first and the head's graph step (ChainGraphStep, run eagerly
    here): no step drafts on the host, head or lookup; in each greedy step a row takes the
    lookup's draft from a match of 2 tokens or more, or from any match where the head has no room
    for it, and the head's chain elsewhere where it has room. Output stays plain's, each lookup
    draft is the lookup's over the sequence up to the step's start (derived on the device in a
    step launched ahead), and each chain the head's run from scratch."""
    llm = _llm(folders, ngram_first=True)
    engine = llm.engine
    ngram, head = engine.drafter.drafters
    head.graphs = HeadGraphs(head, 3, 256, 5, 4, chains=True)
    chain = engine.drafter = DrafterChain([ngram, head], lookup_twin(engine.config.spec, 3, 256, "cpu",
                                                                      use_graph=False))
    step = chain.graph_step(3, 5)
    assert isinstance(step, ChainGraphStep) and head.step is step.head and head.cost_per_token(1) == 0.0
    engine.runner = CudaGraphRunner(engine.model, 3, 256, 8, num_draft_tokens=4, progress=False,
                                    hidden_layers=chain.hidden_layers, extension=step)
    engine.steps = GraphStep(engine.runner, chain, engine.controller, 256, 4, scheduler=engine.scheduler,
                             overlap=True)
    asked = {"calls": 0}

    def lengths(*args, paid=True, **kwargs):        # 3 a row, but stretches of two asks without the head
        asked["calls"] += paid
        return 0 if paid and asked["calls"] // 2 % 2 else 3
    engine.controller.num_draft = lengths
    proposed, propose = [], chain.propose
    chain.propose = lambda batch: proposed.append(batch) or propose(batch)
    drafted, before = [], step.before

    def recorded(b, t, input_ids):      # (sequence, the step's start, room, head's room, its draft)
        before(b, t, input_ids)
        at = {s.slot: s.seq_id for s in engine.scheduler.running}
        view, num = step.inputs_view, step.lookup.num_draft
        for r in range(b):
            room, paid = int(view[2, r]), int(view[3, r])
            if r in at and t > 1 and (room or paid):
                drafted.append((at[r], int(step.head.starts[r]), room, paid, input_ids[r, 1:1 + num[r]].tolist()))
    step.before = recorded
    seqs = [engine.add_request(p, PARAMS) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == plain
    assert not proposed
    tokens = {s.seq_id: s.token_ids for s in seqs}
    by = {"lookup": 0, "short lookup": 0, "head": []}
    for seq_id, start, room, paid, got in drafted:
        seen = torch.tensor(tokens[seq_id][:start + 1])
        draft, num, match = ngram_gpu.propose_matched(seen[None], torch.tensor([start + 1]), torch.tensor([0]),
                                                      4, 1, 4)
        n = min(int(num), room)
        if n and (int(match) >= 2 or not paid):
            assert got == draft[0, :n].tolist()
            by["lookup" if int(match) >= 2 else "short lookup"] += 1
        elif paid:
            assert len(got) == paid
            by["head"].append((tokens[seq_id][:start + 1], got, None))
        else:
            assert got == []
    assert by["lookup"] > 5 and by["short lookup"] > 5 and len(by["head"]) > 20
    _assert_drafts_from_scratch(llm, head, by["head"][::3])
    assert not chain.lookup.rows and sorted(engine.scheduler.free_slots) == [0, 1, 2]


@pytest.mark.parametrize("tree_width", [1, 3])
def test_the_heads_own_graph_bodies_keep_its_drafts(folders, plain, tree_width):
    """The head's catch-up and chains as HeadGraphs run them (static shapes: graph row = slot,
    inactive rows in the spare region, a mask over the whole cache; eagerly here, as the bodies
    of its CUDA graphs): output equals plain output, the chains are still the head's run from
    scratch and stay on the device until the step's synchronisation, and trees (drafted eagerly
    over the graphs' catch-up) keep the output too and are the head's best children along their
    paths."""
    llm = _llm(folders, tree_width=tree_width)
    engine, drafter = llm.engine, llm.engine.drafter
    drafter.graphs = HeadGraphs(drafter, 3, 256, 5, 4, chains=tree_width == 1)
    caught_up, catch_up = [], drafter.graphs.catch_up
    drafter.graphs.catch_up = lambda result: caught_up.append(catch_up(result)) or caught_up[-1]
    recorded = Recorded(llm, drafter)
    proposals, drafted, propose = [], [], recorded.propose

    def propose_and_count(batch):
        proposals.append(propose(batch))
        drafted.append(int(proposals[-1].num_draft.sum()))       # before anything else can touch it
        return proposals[-1]
    recorded.propose = propose_and_count
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert len(caught_up) > 20 and all(caught_up)
    # the drafts' lengths the step's host read gives are those proposed
    assert sum(o.spec["num_draft_tokens"] for o in out) == sum(drafted) > 0
    if tree_width > 1:      # each tree drafted from the stored outputs the catch-up bodies left
        _assert_best_children(llm, recorded.calls[::3], tree_width)
    if tree_width == 1:
        assert all(p.num_draft_host is None for p in proposals if p.tokens.numel())
        assert len(recorded.calls) > 20
        _assert_drafts_from_scratch(llm, drafter, recorded.calls[::2])
    assert sorted(engine.scheduler.free_slots) == [0, 1, 2]


def test_a_catch_up_graph_ignores_a_stale_row_past_its_pairs(folders):
    """A catch-up graph's bucket may hold rows of no sequence in the step (a slot between two
    running ones whose sequence ended), whose last accepted pair is a stale index from a wider
    step. Regression: it was gathered as it was, past the narrower step's pairs; on a GPU that is
    a device-side assert, which ends every request of the engine. Here the bodies run eagerly, so
    it raised an IndexError."""
    from outpace.speculative.drafter import DraftBatch, Verified
    llm = _llm(folders)
    drafter = llm.engine.drafter
    graphs = HeadGraphs(drafter, 3, 256, 5, 4, chains=True)
    layers, H = len(drafter.hidden_layers), drafter.head.cfg.target_hidden_size

    def step(slots, width):
        batch = DraftBatch(list(slots), [0] * len(slots), list(slots), [10] * len(slots), [], [], [], [])
        return Verified(batch, torch.ones(len(slots), width, dtype=torch.long),
                        torch.full((len(slots),), width), torch.zeros(len(slots), width, layers, H, dtype=torch.float64))
    assert graphs.catch_up(step([0, 1, 2], 5))          # every row accepted all 5: last pair 4
    before = drafter.last_out[1].clone()
    assert graphs.catch_up(step([0, 2], 1))             # slot 1 inactive, its last pair still 4
    torch.testing.assert_close(drafter.last_out[1], before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ngram_first,tree_width", [(False, 1), (True, 1), (False, 3)])
def test_the_heads_cuda_graphs_keep_greedy_output(folders, ngram_first, tree_width):
    """On a GPU the head replays its own graphs (catch-up and chains) beside the target's, and
    alone drafts greedy steps' chains (or token trees) inside the target's graphs: greedy
    output equals plain greedy output of the same engine setup, batched, with rollback (float64:
    no near-ties between the target's decode and verify steps); with n-gram first, its lookup's
    device twin drafting in the target's graphs too."""
    options = OPTIONS | dict(device="cuda")
    plain = [o.token_ids for o in LLM(str(folders[0]), spec="none", **options).generate(PROMPTS, PARAMS)]
    llm = LLM(str(folders[0]), spec=SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=4,
                                               ngram_first=ngram_first, tree_width=tree_width), **options)
    drafter = llm.engine.drafter.drafters[1] if ngram_first else llm.engine.drafter
    assert drafter.graphs is not None and drafter.graphs.graphs
    calls, catch_up = [], drafter.graphs.catch_up
    drafter.graphs.catch_up = lambda result: calls.append(catch_up(result)) or calls[-1]
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert len(calls) > 20 and all(calls)
    assert sum(o.spec["num_draft_tokens"] for o in out) > 0
    # the head drafts inside the target's graph steps: alone (HeadGraphStep, or HeadTreeGraphStep
    # for trees), or beside the lookup's device twin (ChainGraphStep)
    extension = llm.engine.runner.extension
    assert drafter.step is not None and getattr(drafter.step, "trees", False) == (tree_width > 1)
    # trees every step, sized by the depths they reach
    assert (llm.engine.controller.tree_depth is not None) == (tree_width > 1)
    assert extension.head is drafter.step if ngram_first else extension is drafter.step


@pytest.mark.skipif(not fused.has_conditional_nodes(), reason="needs a CUDA GPU and PyTorch's conditional graph nodes")
def test_a_captured_chain_runs_only_the_depths_its_rooms_reach(folders):
    """HeadGraphs.chain with rows' rooms, captured in a CUDA graph: each depth is a conditional
    node, so a replay drafts only as deep as an active row's room reaches (the deeper entries
    keep what they held) and nothing where no row has room; the depths it drafts are those of the
    chain captured without rooms."""
    llm = LLM(str(folders[0]), spec=SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=4),
              **OPTIONS | dict(device="cuda"))
    graphs = llm.engine.drafter.graphs
    b, K, device = 2, 4, graphs.rows.device
    starts = torch.tensor([20, 30], device=device)
    active = torch.ones(b, 1, dtype=torch.bool, device=device)
    rooms = torch.zeros(b, dtype=torch.long, device=device)
    full, drafts = torch.zeros(b, K, dtype=torch.long, device=device), torch.zeros(b, K, dtype=torch.long, device=device)
    with torch.inference_mode(), fused.for_graphs():
        graphs.chain(b, K, starts, active, full)                # every depth, as the head alone drafts
        graphs.chain(b, K, starts, active, drafts, rooms)       # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphs.chain(b, K, starts, active, drafts, rooms)
    for room in (0, 2, 1, 4):
        rooms.copy_(torch.tensor([room, room // 2], device=device))
        drafts.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        want = torch.where(torch.arange(K, device=device) < room, full, -1)
        assert torch.equal(drafts, want), (room, drafts, full)


def test_tree_nodes_are_best_children_along_their_paths(folders, plain):
    width = 3
    llm = _llm(folders, tree_width=width, num_draft_tokens=6)
    recorded = Recorded(llm, llm.engine.drafter)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain
    _assert_best_children(llm, recorded.calls[::3], width)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_tree_nodes_are_best_children_along_their_paths(folders):
    """On a GPU sampled rows' trees draft eagerly from the stored outputs that the head's catch-up
    graphs leave: each node is among the best children along its path, as the same head run from
    scratch on the CPU gives them (a stored output left behind by a catch-up would give other
    trees). Greedy rows' trees draft inside the target's graph (the CPU test above)."""
    width = 3
    spec = SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=6, tree_width=width)
    gpu = LLM(str(folders[0]), spec=spec, **OPTIONS | dict(device="cuda"))
    assert gpu.engine.drafter.graphs is not None
    recorded = Recorded(gpu, gpu.engine.drafter)
    gpu.generate(PROMPTS, SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True))
    _assert_best_children(_llm(folders, tree_width=width, num_draft_tokens=6), recorded.calls[::3], width)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_tree_steps_attend_alike_through_the_kernel_and_the_mask(folders):
    """A tree step in bfloat16 (the head's trees drafted, the target's forward, verification)
    attends through the attention kernel with ancestor words where graphs are captured
    (fused.for_graphs) and through the additive mask elsewhere: from the same random caches
    (short contexts, so a tree key wrongly seen or missed shows), both draw the same trees and
    verify them alike, the target's logits within bfloat16's rounding. Two candidates whose scores
    tie within that rounding may trade places (siblings in another order, or a child grown under a
    tied cousin), so nodes are named by their tokens from the root and the two trees must share
    their first depth and all nodes but such a swap's."""
    spec = SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=6, tree_width=3)
    llm = LLM(str(folders[0]), spec=spec, **OPTIONS | dict(device="cuda", dtype="bfloat16"))
    runner, head = llm.engine.runner, llm.engine.drafter
    step = runner.extension
    with fused.for_graphs():            # the kernel takes trees on this card (its own check passed)
        assert step.trees and fused.graph_tree_attention(torch.bfloat16, 16, runner.device, 2 * 7)
    gen = torch.Generator(device="cuda").manual_seed(0)
    state = (runner.cache.k, runner.cache.v, head.k_cache, head.v_cache, head.last_out)
    for tensor in state:
        tensor.copy_(torch.randn(tensor.shape, generator=gen, device="cuda"))
    saved = [tensor.clone() for tensor in state]
    b, t, L = 2, 7, runner.kv_lens[0]
    got = []
    for kernel in (True, False):
        for tensor, copy in zip(state, saved):
            tensor.copy_(copy)
        runner.starts[:b] = torch.tensor([3, 9])
        runner.input_ids[:b * t] = torch.tensor([5] * t + [77] * t)
        step.inputs_view[0, :b] = torch.tensor([6, 4])
        with torch.inference_mode(), fused.for_graphs() if kernel else contextlib.nullcontext():
            runner._run_step(b, t, L)
        out = step.result[:b].clone()
        got.append((_node_paths(runner.input_ids[:b * t].view(b, t), step.parents[:b, :t - 1]),
                    runner.logits[:b * t].view(b, t, -1).clone(),
                    [row[:2 + int(row[0])].tolist() for row in out]))       # tokens out, with their count
    (paths, logits, result), (paths_mask, logits_mask, result_mask) = got
    assert len({p[:-1] for p in paths[0]}) > 2                  # a tree (three parents at least), not a chain
    for row, (mine, theirs) in enumerate(zip(paths, paths_mask)):
        assert {p for p in mine if len(p) == 1} == {p for p in theirs if len(p) == 1}
        common = [p for p in mine if p in theirs]
        assert len(common) >= len(mine) - 2, (mine, theirs)    # one swapped node and its child at most
        where = [theirs.index(p) for p in common]
        # the kernel and the mask sum keys in other orders (and a node of both trees may sit at
        # another index of its row): a few bfloat16 spacings apart (about 0.08), where a key
        # wrongly seen or missed moves the logits by their own size
        torch.testing.assert_close(logits[row, 1:][[mine.index(p) for p in common]], logits_mask[row, 1:][where],
                                   rtol=3e-2, atol=1e-1)
        torch.testing.assert_close(logits[row, 0], logits_mask[row, 0], rtol=3e-2, atol=1e-1)
        # the tokens out: the same wherever the accepted path is a path of both trees
        out, out_mask = result[row][2:], result_mask[row][2:]
        if all(tuple(out[:d]) in common for d in range(1, len(out))):
            assert out == out_mask, (row, out, out_mask)


def _node_paths(ids: torch.Tensor, parents: torch.Tensor) -> list[list[tuple[int, ...]]]:
    """Per row of a tree step (ids [b, t]: the row's token, then its nodes'; parents [b, t - 1],
    -1 below the root), each node's tokens from the root's child down to it."""
    return [_tree_paths(tokens, up) for tokens, up in zip(ids[:, 1:].tolist(), parents.tolist())]


def _tree_paths(nodes: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Each node's tokens from the root's child down to it (parents: each node's, -1 below the root,
    always an earlier node)."""
    paths: list[tuple[int, ...]] = []
    for j, (token, parent) in enumerate(zip(nodes, parents)):
        assert parent < j
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


def _assert_best_children(llm, calls, width: int):
    """Each recorded tree (real trees among them) holds at each node one of the `width` best
    children of its path, by llm's head run from scratch."""
    drafter = llm.engine.drafter
    head = drafter.head
    assert any(len(set(tree)) > 1 and tree.count(-1) > 1 for _, _, tree in calls)   # real trees
    for tokens, nodes, tree in calls:
        hidden = _hidden(llm, tokens, drafter.hidden_layers)
        for token, path in zip(nodes, _tree_paths(nodes, tree)):
            best = head.to_target(_reference(head, drafter.embed, hidden, tokens, list(path[:-1])).topk(width).indices)
            assert token in best.tolist()


@pytest.mark.parametrize("tree_width", [1, 3])
def test_seeded_sampling_with_a_head_is_plain_seeded_sampling(folders, tree_width):
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=20, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(folders[0]), spec="none", **OPTIONS).generate(PROMPTS, params)]
    out = _llm(folders, tree_width=tree_width).generate(PROMPTS[::-1], params)[::-1]
    assert [o.token_ids for o in out] == plain
    assert sum(o.spec["num_draft_tokens"] for o in out) > 0


def test_on_the_cpu_the_heads_products_run_in_the_kernels(folders):
    """A float32 head on the CPU computes its products (q, k and v as one), norms, SwiGLU and
    rotation in the CPU kernels, as the target does (PyTorch's bfloat16 products made the shipped
    head's forward 2.7x slower, its norms 6x): its outputs are the same head's through PyTorch's
    ops, and greedy output stays plain's."""
    from outpace.kernels import cpu_kernels
    from outpace.kernels.cpu_linear import PackedLinear
    from outpace.model.eagle3 import load_eagle3_head
    if not cpu_kernels.has_library():
        pytest.skip("no C compiler: the CPU kernels are not built")
    options = dict(OPTIONS, dtype="float32")
    plain32 = [o.token_ids for o in LLM(str(folders[0]), spec="none", **options).generate(PROMPTS, PARAMS)]
    llm = LLM(str(folders[0]), spec=SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=4),
              **options)
    head = llm.engine.drafter.head
    assert isinstance(head.qkv, PackedLinear) and head.qkv.kernel and isinstance(head.lm_head, PackedLinear)
    reference = load_eagle3_head(folders[1], llm.engine.model.cfg, torch.float32, "cpu", 64)
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 3, head.cfg.target_hidden_size)
    embed = torch.randn(2, 5, head.cfg.hidden_size)
    positions = torch.arange(5).expand(2, 5)
    outs = []
    for h in (head, reference):
        residual, q, k, v = h.project(h.features(hidden), embed, positions)
        outs.append(h.logits(h.finish(residual, q.flatten(-2))))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain32


def _random_pairs(drafter, dtype: torch.dtype) -> tuple:
    """Random pairs of two rows of 5, in slots 2 and 0 from positions 3 and 0 (keys up to 8),
    over random caches: (feature, tokens, slots, positions, the caches' copies)."""
    torch.manual_seed(0)
    B, S = 2, 5
    feature = torch.randn(B, S, drafter.head.cfg.hidden_size).to(dtype)
    tokens = torch.randint(0, 49152, (B, S))
    slots = torch.tensor([2, 0])
    positions = torch.tensor([[3], [0]]) + torch.arange(S)
    drafter.k_cache.normal_()
    drafter.v_cache.normal_()
    return feature, tokens, slots, positions, (drafter.k_cache.clone(), drafter.v_cache.clone())


def _each_way(drafter, before: tuple, name: str, values: tuple, run) -> list[list]:
    """run()'s tensors, then the caches after it, with the drafter's attribute `name` set to each
    of values in turn and the caches reset to `before` each time."""
    results = []
    for value in values:
        setattr(drafter, name, value)
        drafter.k_cache.copy_(before[0])
        drafter.v_cache.copy_(before[1])
        with torch.inference_mode():
            results.append(run() + [drafter.k_cache.clone(), drafter.v_cache.clone()])
    return results


@pytest.mark.parametrize("qk_norm", [False, True])
def test_on_the_cpu_causal_forwards_run_in_the_attention_kernel(folders, qk_norm):
    """On the CPU a float32 head's catch-ups and chains attend in the target's attention kernel
    (rotation, cache writes and attention in one call): their outputs, and the keys and values
    they write, are the PyTorch path's through a causal mask, over entries written before; also
    where the head norms its queries and keys (random norms given to the same head here)."""
    from outpace.kernels import cpu_kernels
    from outpace.model.layers import RMSNorm
    if not cpu_kernels.has_library():
        pytest.skip("no C compiler: the CPU kernels are not built")
    llm = LLM(str(folders[0]), spec=SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=4),
              **dict(OPTIONS, dtype="float32"))
    drafter = llm.engine.drafter
    assert drafter.kernel_attention
    torch.manual_seed(0)
    if qk_norm:
        D = drafter.head.cfg.head_dim
        drafter.head.q_norm, drafter.head.k_norm = RMSNorm(D, 1e-6), RMSNorm(D, 1e-6)
        with torch.no_grad():
            drafter.head.q_norm.weight.uniform_(0.5, 1.5)
            drafter.head.k_norm.weight.uniform_(0.5, 1.5)
        drafter.pair = drafter.head.cpu_pair_head(drafter.embed, torch.float32)
        assert drafter.pair is None         # the one-call layer serves heads without query/key norms
    feature, tokens, slots, positions, before = _random_pairs(drafter, torch.float32)
    results = _each_way(drafter, before, "kernel_attention", (True, False),
                        lambda: [drafter._causal_forward(feature, tokens, slots, positions, 8)])
    for kernel, torch_path in zip(*results):
        torch.testing.assert_close(kernel, torch_path, rtol=1e-4, atol=1e-4)
    assert not torch.equal(results[0][1], before[0])        # the pairs' keys were written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_cpu_a_head_layer_or_chain_is_one_kernel_call(folders, dtype):
    """On the CPU an EAGLE-3 head's catch-up forward, and a whole greedy chain, run in one kernel
    call each (cpu_kernels.PairHead): outputs, drafts and the keys and values written are the
    head's forwards through the same kernels one Python call at a time, bit for bit (no
    confidence stop: the next test has it)."""
    from outpace.kernels import cpu_kernels
    if not cpu_kernels.has_library():
        pytest.skip("no C compiler: the CPU kernels are not built")
    llm = LLM(str(folders[0]), spec=SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=4,
                                               p_min=0.0),
              **dict(OPTIONS, dtype=str(dtype).removeprefix("torch.")))
    drafter = llm.engine.drafter
    pair = drafter.pair
    assert pair is not None
    feature, tokens, slots, positions, before = _random_pairs(drafter, dtype)
    drafter.last_out.normal_()
    results = _each_way(drafter, before, "pair", (pair, None),
                        lambda: [drafter._causal_forward(feature, tokens, slots, positions, 8),
                                 *drafter._chains(slots, torch.tensor([7, 4]), 4, 7)])
    for one_call, per_op in zip(*results):
        assert torch.equal(one_call, per_op)
    assert not torch.equal(results[0][3], before[0])        # the pairs' keys were written



@pytest.mark.parametrize("pair", [True, False], ids=["kernel", "per op"])
def test_a_chain_stops_at_its_first_draft_below_p_min(folders, pair):
    """With p_min, a chain's length is its drafts before the first whose probability (the head's
    top softmax probability there) is below p_min, in the one-call kernel and per op alike, and
    its drafts up to there are those drafted without a stop. p_min is set between two of the
    probabilities a full chain drafts at, so that the rows stop at different depths."""
    from outpace.kernels import cpu_kernels
    if pair and not cpu_kernels.has_library():
        pytest.skip("no C compiler: the CPU kernels are not built")
    llm = LLM(str(folders[0]), spec=SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=4,
                                               p_min=0.0), **dict(OPTIONS, dtype="float32"))
    drafter = llm.engine.drafter
    one_call = drafter.pair if pair else None
    _, _, slots, _, before = _random_pairs(drafter, torch.float32)
    torch.manual_seed(1)
    drafter.last_out.normal_(std=3)
    logits, probabilities = drafter.head.logits, []

    def recorded(out):
        result = logits(out)
        probabilities.append(result.float().softmax(-1).amax(-1))
        return result

    depth, starts = 4, torch.tensor([7, 4])
    drafter.head.logits = recorded
    full, lengths = _each_way(drafter, before, "pair", (None,),
                              lambda: [drafter._chains(slots, starts, depth, 7)])[0][0]
    drafter.head.logits = logits
    assert lengths.tolist() == [depth, depth]
    probabilities = torch.stack(probabilities, 1)                       # [rows, depth]
    values = probabilities.flatten().sort().values
    cut = (values[3] + values[4]).item() / 2                            # between the 4th and 5th of 8
    below = probabilities < cut
    expected = torch.where(below.any(1), below.long().argmax(1), depth)
    assert expected.tolist() != [depth, depth] and expected.unique().numel() == 2, expected
    drafter.p_min = cut
    chains, lengths = _each_way(drafter, before, "pair", (one_call,),
                                lambda: [drafter._chains(slots, starts, depth, 7)])[0][0]
    assert lengths.tolist() == expected.tolist()
    for row, n in enumerate(expected.tolist()):
        assert chains[row, :n].tolist() == full[row, :n].tolist()

def test_on_the_cpu_drafting_is_priced_at_what_it_takes(folders, plain):
    """A head whose drafting takes far longer than its load-time measure (here each propose
    sleeps ten of the target's calibrated plain steps, so that it holds on a fast CPU and a slow
    one alike; on a real CPU the target's steps push the head's weights out of the caches) is
    priced at what its proposes take, and the controller stops drafting with it, where the same
    head at its own speed drafts on: output stays plain's either way. The controller is made to
    believe nine drafts in ten are accepted (the random head's are not), so that only the price
    decides whether drafting pays."""
    import time
    drafted = {}
    for slow in (False, True):
        llm = LLM(str(folders[0]), spec=SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=2),
                  **dict(OPTIONS, calibrate=True))
        # each row's gains at draft positions 1 and 2: P(first accepted), P(both)
        llm.engine.controller._gains = lambda seq_ids, available=None, matches=None: [
            [0.9, 0.81][:2 if available is None else available[i]] for i in range(len(seq_ids))]
        drafter = llm.engine.drafter
        measured = dict(drafter.per_token)
        if slow:
            chains = drafter._chains
            pause = 10 * llm.engine.controller.step_cost(len(PROMPTS), len(PROMPTS))
            drafter._chains = lambda *args: time.sleep(pause) or chains(*args)
        out = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in out] == plain
        drafted[slow] = sum(o.spec["num_draft_tokens"] for o in out)
        if slow:        # some bucket's price now holds the sleeps
            assert max(drafter.per_token[b] / measured[b] for b in measured) > 4
    assert drafted[True] < drafted[False] / 3


def test_on_the_cpu_one_stalled_propose_does_not_price_the_head_out(folders, plain):
    """One propose that stalls (a sleep of a hundred of the target's calibrated plain steps, 0.2 s
    at least, as on a busy machine) enters the price of a drafted token as at most PRICE_OUTLIER
    times the larger of the price and the last measure, where whole it would have multiplied the
    price several times, and the head drafts on in the next requests. Regression: the stall went
    into the price whole, a drafted token then cost several steps, and the head never drafted
    again to measure it anew (a 210-prompt bench drafted 282 tokens, all before it)."""
    import time
    from outpace.speculative.head_drafter import PRICE_DECAY, PRICE_OUTLIER
    llm = LLM(str(folders[0]), spec=SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=2),
              **dict(OPTIONS, calibrate=True))
    llm.engine.controller._gains = lambda seq_ids, available=None, matches=None: [
        [0.9, 0.81][:2 if available is None else available[i]] for i in range(len(seq_ids))]
    drafter = llm.engine.drafter
    chains, calls = drafter._chains, itertools.count()
    pause = max(0.2, 100 * llm.engine.controller.step_cost(len(PROMPTS), len(PROMPTS)))
    drafter._chains = lambda *args: (time.sleep(pause) if next(calls) == 3 else None) or chains(*args)
    price, measures = drafter._price, []

    def recorded(prices, name, bucket, seconds):
        before, last = prices[bucket], drafter.last_measured.get((name, bucket), prices[bucket])
        price(prices, name, bucket, seconds)
        measures.append((name, seconds, before, last, prices[bucket]))
    drafter._price = recorded
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    (_, seconds, before, last, after), = [m for m in measures if m[0] == "token" and m[1] > pause / 4]
    assert PRICE_DECAY * before + (1 - PRICE_DECAY) * seconds > 5 * before          # whole, the stall
    assert after <= (PRICE_DECAY * before + (1 - PRICE_DECAY) * PRICE_OUTLIER * max(before, last)) * (1 + 1e-9)
    again = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in again] == plain
    assert sum(o.spec["num_draft_tokens"] for o in again) > len(PROMPTS)


@pytest.mark.parametrize("relax", [0.9, 1.0], ids=["relaxed", "never relaxed"])
def test_on_the_cpu_a_head_priced_out_by_a_slowdown_drafts_again_after_it(folders, plain, monkeypatch, relax):
    """A head slowed for a while (each propose sleeping ten of the target's calibrated plain
    steps through one generate call) is priced out; once it is fast again, plain steps move its
    prices back toward their load-time measures (PRICE_RELAX, a tenth a step here for a short
    test) and it drafts again in the next call. Never relaxed (1.0), as before: it stays priced out,
    having no propose to measure the price anew."""
    import time
    from outpace.speculative import head_drafter
    monkeypatch.setattr(head_drafter, "PRICE_RELAX", relax)
    llm = LLM(str(folders[0]), spec=SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=2),
              **dict(OPTIONS, calibrate=True))
    llm.engine.controller._gains = lambda seq_ids, available=None, matches=None: [
        [0.9, 0.81][:2 if available is None else available[i]] for i in range(len(seq_ids))]
    drafter = llm.engine.drafter
    chains = drafter._chains
    pause = 10 * llm.engine.controller.step_cost(len(PROMPTS), len(PROMPTS))
    drafter._chains = lambda *args: time.sleep(pause) or chains(*args)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain
    drafter._chains = chains
    again = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in again] == plain
    drafted = sum(o.spec["num_draft_tokens"] for o in again)
    assert drafted > 4 * len(PROMPTS) if relax < 1 else drafted <= len(PROMPTS)

@pytest.mark.parametrize("every", [1, 12])
def test_on_the_cpu_a_catch_up_prices_the_step_and_a_long_one_is_left_out(folders, plain, every):
    """The head's catch-ups (prompt chunks' too, which price nothing) sleep five of the target's
    calibrated plain steps where the head drafts at every step (every 1), and only those of more
    pairs than a verify step gives where the controller lets it draft one step in twelve (every
    12). A step's usual catch-up is priced once a drafting step (step_cost) and never per drafted
    token; a long one prices neither, so one row's return after steps without drafts cannot
    price the head out. Regression: the catch-up was in the price of each drafted token, so a
    second token looked to cost a catch-up too."""
    import time
    llm = LLM(str(folders[0]), spec=SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=2),
              **dict(OPTIONS, calibrate=True))
    controller, drafter = llm.engine.controller, llm.engine.drafter
    controller._gains = lambda seq_ids, available=None, matches=None: [
        [0.9, 0.81][:2 if available is None else available[i]] for i in range(len(seq_ids))]
    steps, row_lengths = itertools.count(), controller.row_lengths
    controller.row_lengths = lambda seq_ids, *args, **kwargs: (
        row_lengths(seq_ids, *args, **kwargs) if next(steps) % every == 0 else [0] * len(seq_ids))
    per_token, per_step = dict(drafter.per_token), dict(drafter.per_step)
    pause = 5 * controller.step_cost(len(PROMPTS), len(PROMPTS))
    catch_up = drafter._catch_up

    def slow_catch_up(hidden, tokens, *args):
        if every == 1 or tokens.shape[1] > 3:
            time.sleep(pause)
        catch_up(hidden, tokens, *args)

    drafter._catch_up = slow_catch_up
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert sum(o.spec["num_draft_tokens"] for o in out) > 0
    # a price moves a tenth of the way to each measure (PRICE_DECAY): one slept catch-up in it
    # moves it by pause / 10, and a few dozen drafting steps are spread over three batch buckets
    assert max(drafter.per_token[b] - per_token[b] for b in per_token) < pause / 20
    rise = max(drafter.per_step[b] - per_step[b] for b in per_step)
    assert rise > pause / 8 if every == 1 else rise < pause / 20

def test_on_the_cpu_a_catch_up_is_priced_where_p_min_cuts_every_chain(folders, plain):
    """Where p_min cuts every chain of a step to nothing, the step still paid its catch-up, and
    that prices the step; no token was drafted, so the token's price stays. Regression: both
    prices moved only where a step drafted tokens, so a slowed catch-up went unpriced."""
    import time
    llm = LLM(str(folders[0]), spec=SpecConfig(method="eagle3", draft_head=str(folders[1]), num_draft_tokens=2),
              **dict(OPTIONS, calibrate=True))
    controller, drafter = llm.engine.controller, llm.engine.drafter
    controller._gains = lambda seq_ids, available=None, matches=None: [
        [0.9, 0.81][:2 if available is None else available[i]] for i in range(len(seq_ids))]
    drafter.p_min = 1.01                    # above every probability: each chain ends before its first draft
    per_token, per_step = dict(drafter.per_token), dict(drafter.per_step)
    pause = 5 * controller.step_cost(len(PROMPTS), len(PROMPTS))
    catch_up = drafter._catch_up

    def slow_catch_up(hidden, tokens, *args):
        time.sleep(pause)
        catch_up(hidden, tokens, *args)

    drafter._catch_up = slow_catch_up
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert sum(o.spec["num_draft_tokens"] for o in out) == 0
    assert drafter.per_token == per_token
    assert max(drafter.per_step[b] - per_step[b] for b in per_step) > pause / 8
