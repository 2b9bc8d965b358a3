"""Token trees: one verify forward over a tree, the longest path of the target's own tokens, and
the path's cache entries moved into place.

Guards: a tree forward must give each node the logits of a plain forward of its root-to-node path
(its mask and rotary positions); the acceptance rule must reduce to greedy chain verification on
chains and walk the right branch of a tree; through the engine, trees whose right branch is not
the first (so the accepted path's entries must move) and random trees must keep greedy output,
batched, with prompt chunks and slot reuse.
"""
import random

import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.kernels import cpu_kernels
from outpace.runner.model_runner import ModelRunner, Row
from outpace.sampling.rejection import verify_greedy
from outpace.sampling.tree import tree_ancestors, verify_tree, verify_tree_paths
from outpace.speculative import controller
from outpace.speculative.drafter import Drafter, Drafts
from outpace.weights.loader import load_model
from tiny import make_tiny

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42],
           list(range(500, 520)) * 2]
PARAMS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
OPTIONS = dict(dtype="float64", device="cpu", max_num_seqs=3, max_model_len=256, max_prefill_tokens=8,
               calibrate=False)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-llama-trees")
    make_tiny("llama", folder, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    return folder


def path_to(node: int, nodes: list[int], parents: list[int]) -> list[int]:
    """The tokens from the root's first child down to `node`."""
    path = []
    while node >= 0:
        path.insert(0, nodes[node])
        node = parents[node]
    return path


def test_each_node_sees_its_path(tiny_folder):
    model = load_model(tiny_folder, torch.float64, "cpu", 128)
    runner, chain = ModelRunner(model, 2, 128, 16), ModelRunner(model, 1, 128, 16)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    # root, then nodes: 0 and 1 children of the root, 2 a child of 1, 3 a child of 0, 4 a child of 2
    nodes, parents = [20, 21, 22, 23, 24], [-1, -1, 1, 0, 2]
    for r in (runner, chain):
        r.forward([Row(1 if r is runner else 0, prompt[:-1], 0)], logits="none")
    tree, _ = runner.forward_tree([Row(1, [prompt[-1]] + nodes, len(prompt) - 1)], [parents])
    for j in range(len(nodes)):
        want, _ = chain.forward([Row(0, [prompt[-1]] + path_to(j, nodes, parents), len(prompt) - 1)])
        torch.testing.assert_close(tree[0, j + 1], want[0, -1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(tree[0, 0], want[0, 0], rtol=1e-10, atol=1e-10)


def test_chains_verify_as_greedy_chains():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        B, K = 4, 6
        target = torch.randint(0, 3, (B, K + 1), generator=gen)
        drafts = torch.randint(0, 3, (B, K), generator=gen)
        num = torch.randint(0, K + 1, (B,), generator=gen)
        chain = torch.arange(-1, K - 1).expand(B, K)
        out, num_out, path = verify_tree(target, drafts, chain, num)
        want, want_num = verify_greedy(target, drafts, num)
        assert torch.equal(num_out, want_num)
        for b in range(B):
            n = int(num_out[b])
            assert out[b, :n].tolist() == want[b, :n].tolist()
            assert path[b, :n - 1].tolist() == list(range(1, n))


def test_the_matching_branch_is_taken():
    # target after root: 7; after node 1 (token 7): 8; after node 3 (token 8): 9, which no node carries
    target = torch.tensor([[7, 0, 8, 0, 9, 0]])
    drafts = torch.tensor([[5, 7, 6, 8, 8]])
    parents = torch.tensor([[-1, -1, 0, 1, 0]])
    out, num_out, path = verify_tree(target, drafts, parents, torch.tensor([5]))
    assert num_out.tolist() == [3] and out[0, :3].tolist() == [7, 8, 9] and path[0, :2].tolist() == [2, 4]


def _random_tree(rng: random.Random, K: int, vocab: int):
    """A tree of K nodes in order of depth (each depth's nodes after the one above's), siblings
    of distinct tokens: (parents, depths, tokens)."""
    parents, depths, tokens, level = [], [], [], [-1]
    while len(parents) < K:
        below = []
        for parent in level:
            children = rng.sample(range(vocab), rng.randint(0, 3) if parent >= 0 else rng.randint(1, 3))
            for token in children[:K - len(parents)]:
                below.append(len(parents))
                parents.append(parent)
                depths.append(depths[parent] + 1 if parent >= 0 else 1)
                tokens.append(token)
        level = below or [len(parents) - 1]
    return parents, depths, tokens


def test_paths_by_ancestors_are_verify_trees():
    """verify_tree_paths (fixed work for CUDA graphs, through tree_ancestors) gives verify_tree's
    tokens, lengths and paths on random trees of a few tokens (so paths run deep), with rows cut
    short (is_node) and targets that follow a path of the tree for a while."""
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for _ in range(200):
        B, K, vocab = 3, rng.randint(1, 12), 4
        trees = [_random_tree(rng, K, vocab) for _ in range(B)]
        parents = torch.tensor([t[0] for t in trees])
        depths = torch.tensor([t[1] for t in trees])
        drafts = torch.tensor([t[2] for t in trees])
        num = torch.randint(0, K + 1, (B,), generator=gen)
        target = torch.randint(0, vocab, (B, K + 1), generator=gen)
        for b in range(B):              # the target takes a random branch at each depth it can
            at = 0
            while True:
                children = [j for j in range(int(num[b])) if parents[b, j] == at - 1]
                if not children:
                    break
                child = rng.choice(children)
                target[b, at] = drafts[b, child]
                at = child + 1
        ancestors = tree_ancestors(parents, int(depths.max()))
        for b in range(B):
            for j in range(K):
                path, at = set(), j
                while at >= 0:
                    path.add(at)
                    at = int(parents[b, at])
                assert {i for i in range(K) if ancestors[b, j, i]} == path
        is_node = torch.arange(K)[None, :] < num[:, None]
        out, num_out, path = verify_tree_paths(target, drafts, parents, ancestors, depths, is_node)
        want, want_num, want_path = verify_tree(target, drafts, parents, num)
        assert torch.equal(num_out, want_num) and torch.equal(path, want_path)
        for b in range(B):
            assert out[b, :int(num_out[b])].tolist() == want[b, :int(num_out[b])].tolist()


class TreeDrafter(Drafter):
    """Trees of up to `budget` nodes: at each depth the true token (when `truth` is given) and
    decoys, the true one placed at a random position among its siblings, so the accepted path
    usually runs through later nodes; the chain continues below the true node."""

    def __init__(self, truth=None, branching: int = 2, seed: int = 0):
        self.truth, self.branching, self.rng = truth, branching, random.Random(seed)
        self.tokens = {}

    def begin(self, seq_id, token_ids):
        self.tokens[seq_id] = [tuple(token_ids), 0]

    def accept(self, seq_id, token_ids):
        self.tokens[seq_id][1] += len(token_ids)

    def propose(self, batch):
        rows, parents = [], []
        for seq_id, budget in zip(batch.seq_ids, batch.budget):
            prompt, done = self.tokens[seq_id]
            truth = self.truth[prompt][done:] if self.truth else []
            nodes, tree, parent, depth = [], [], -1, 0
            while len(nodes) < budget:
                siblings = [self.rng.randrange(49152) for _ in range(self.branching)]
                true_at = self.rng.randrange(self.branching)
                if depth < len(truth):
                    siblings[true_at] = truth[depth]
                siblings = siblings[:budget - len(nodes)]
                first = len(nodes)
                nodes += siblings
                tree += [parent] * len(siblings)
                parent = first + min(true_at, len(siblings) - 1)
                depth += 1
            rows.append(nodes)
            parents.append(tree + [-1] * (max(batch.budget) - len(tree)))
        drafts = Drafts.from_lists(rows)
        width = drafts.tokens.shape[1]
        drafts.parents = torch.tensor([p[:width] for p in parents], dtype=torch.long).view(len(rows), width)
        return drafts


@pytest.fixture(scope="module")
def plain(tiny_folder):
    return [o.token_ids for o in LLM(str(tiny_folder), spec="none", **OPTIONS).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("kind", ["true-branch", "random"])
def test_tree_speculation_keeps_greedy_output(tiny_folder, plain, kind):
    truth = {tuple(p): o for p, o in zip(PROMPTS, plain)} if kind == "true-branch" else None
    drafter = TreeDrafter(truth, branching=3 if kind == "random" else 2)
    llm = LLM(str(tiny_folder), spec=SpecConfig(num_draft_tokens=6), drafter=drafter, **OPTIONS)
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    steps = sum(o.spec["num_verify_steps"] for o in out)
    if kind == "true-branch":       # every depth's true node accepted: 3 a step (6 nodes, 2 a depth) + 1
        assert steps < sum(len(p) for p in plain) / 3
    assert sorted(llm.engine.scheduler.free_slots) == [0, 1, 2]


def test_sampled_trees_give_plain_seeded_sampling(tiny_folder):
    """Every node of one depth takes that output position's noise, so tree speculation emits what
    plain seeded sampling emits, token for token, whatever the trees (true branches among decoys,
    random ones), batched with greedy rows."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(PROMPTS) - 1)] + [PARAMS]
    llm = LLM(str(tiny_folder), spec="none", **OPTIONS)
    want = [[o.token_ids for o in llm.generate([p], sp)][0] for p, sp in zip(PROMPTS, params)]
    for truth in ({tuple(p): w for p, w in zip(PROMPTS, want)}, None):
        llm = LLM(str(tiny_folder), spec=SpecConfig(num_draft_tokens=6), drafter=TreeDrafter(truth, seed=5),
                  **OPTIONS)
        engine = llm.engine
        seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
        while engine.has_unfinished():
            engine.step()
        assert [s.output_ids for s in seqs] == want
        if truth is not None:
            assert sum(s.stats.num_accepted_tokens for s in seqs) > 0


@pytest.mark.skipif(not cpu_kernels.has_library(), reason="the CPU kernels did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_the_cpu_kernels_each_node_computes_its_paths_bits(default_model_dir, dtype):
    """Where the CPU kernels attend, a tree forward reads each node's keys through its path's
    table: every node's logits must be bit for bit those of its path verified as a chain (the
    losslessness of quantized trees rests on it), for two rows of different trees and lengths."""
    model = load_model(default_model_dir, dtype, "cpu", 256)
    runner, chain = ModelRunner(model, 3, 256, 16), ModelRunner(model, 1, 256, 16)
    assert runner._attention(True, None, False).value == "cpu_kernel"
    prompts = [list(range(300, 340)), list(range(900, 917))]
    trees = [([20, 21, 22, 23, 24, 25], [-1, -1, 1, 0, 2, 4]), ([30, 31, 32], [-1, 0, -1])]
    for slot, prompt in zip((1, 2), prompts):
        runner.forward([Row(slot, prompt[:-1], 0)], logits="none")
    rows = [Row(slot, [p[-1]] + nodes, len(p) - 1) for slot, p, (nodes, _) in zip((1, 2), prompts, trees)]
    tree, _ = runner.forward_tree(rows, [parents for _, parents in trees])
    for b, (prompt, (nodes, parents)) in enumerate(zip(prompts, trees)):
        chain.forward([Row(0, prompt[:-1], 0)], logits="none")
        for j in range(len(nodes)):
            want, _ = chain.forward([Row(0, [prompt[-1]] + path_to(j, nodes, parents), len(prompt) - 1)])
            assert torch.equal(tree[b, j + 1], want[0, -1]), (b, j)
        assert torch.equal(tree[b, 0], want[0, 0])


@pytest.mark.skipif(not cpu_kernels.has_library(), reason="the CPU kernels did not build")
@pytest.mark.parametrize("kind", ["true-branch", "random"])
def test_bfloat16_trees_on_the_cpu_kernels_keep_greedy_output(default_model_dir, kind):
    """The default model's quantized weights with bfloat16 activations, whose plain steps attend
    in the CPU kernels: trees of decoys and true branches, batched with prompt chunks, keep every
    greedy output."""
    options = dict(OPTIONS, dtype="bfloat16", max_model_len=128)
    prompts = [[1, 9038, 2114, 253, 23790], list(range(400, 437)), [28, 4093, 2, 28, 4093]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain_out = [o.token_ids for o in LLM(str(default_model_dir), spec="none", **options).generate(prompts, params)]
    truth = {tuple(p): o for p, o in zip(prompts, plain_out)} if kind == "true-branch" else None
    llm = LLM(str(default_model_dir), spec=SpecConfig(num_draft_tokens=6), drafter=TreeDrafter(truth, seed=3),
              **options)
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == plain_out
    if kind == "true-branch":
        assert sum(o.spec["num_accepted_tokens"] for o in out) > 0


@pytest.mark.skipif(not cpu_kernels.has_library(), reason="the CPU kernels did not build")
def test_sampled_bfloat16_trees_on_the_cpu_kernels_give_plain_seeded_sampling(default_model_dir):
    """Sampled rows (and a greedy one) of the default model's quantized weights in bfloat16,
    trees attending in the CPU kernels: tree speculation emits what plain seeded sampling emits,
    token for token, with true branches among decoys."""
    options = dict(OPTIONS, dtype="bfloat16", max_model_len=128)
    prompts = [[1, 9038, 2114, 253, 23790], list(range(400, 437)), [28, 4093, 2, 28, 4093]]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=70 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts) - 1)] + [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    llm = LLM(str(default_model_dir), spec="none", **options)
    want = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    truth = {tuple(p): w for p, w in zip(prompts, want)}
    llm = LLM(str(default_model_dir), spec=SpecConfig(num_draft_tokens=6), drafter=TreeDrafter(truth, seed=9),
              **options)
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == want
    assert sum(o.spec["num_accepted_tokens"] for o in out) > 0


BRANCHY = [1, 2, 3, 9, 4, 1, 2, 3, 8, 4, 1, 2, 3, 7, 5, 1, 2, 3]     # "1 2 3" went three ways


def test_ngram_trees_hold_every_continuation_of_the_match():
    """n-gram trees: with one earlier occurrence of the matched suffix the tree is the chain
    lookup drafts; with several it holds each continuation's first token (parents before their
    children), the most frequent and most recent first, deeper nodes after broader ones."""
    from outpace.speculative.drafter import DraftBatch
    from outpace.speculative.ngram import NgramDrafter

    def draft(tokens, budget, width, asked=0):
        drafter = NgramDrafter(SpecConfig(method="ngram", tree_width=width))
        drafter.begin(0, tokens)
        out = drafter.propose(DraftBatch([0], [budget], [0], [len(tokens) - 1], [PARAMS], [0], [0], [], asked))
        tree = out.parents is not None
        return out.host_rows()[0], (out.parents[0, :len(out.host_rows()[0])].tolist() if tree else None)
    single = [5, 6, 7, 8, 9, 10, 5, 6, 7]
    nodes, parents = draft(single, 4, 3)
    assert (nodes, parents) == (draft(single, 4, 1)[0], [-1, 0, 1, 2])
    nodes, parents = draft(BRANCHY, 6, 3)
    assert all(p < j for j, p in enumerate(parents))
    assert [n for n, p in zip(nodes, parents) if p == -1] == [7, 8, 9]        # every way, the most recent first
    assert nodes[3:] == [5, 4, 4] and parents[3:] == [0, 1, 2]
    # a step the controller gives chains: the chain drafter's draft (the most recent continuation)
    assert draft(BRANCHY, 6, 3, asked=1) == draft(BRANCHY, 6, 1) == ([7, 5, 1, 2, 3], None)


def test_ngram_trees_keep_greedy_and_sampled_output(tiny_folder, plain):
    """n-gram trees through the engine (float64, batched, prompt chunks): greedy output is plain
    greedy output and seeded sampled output plain seeded sampling's, with trees that branch."""
    prompts = PROMPTS + [BRANCHY * 2]
    spec = SpecConfig(method="ngram", tree_width=3, num_draft_tokens=6)
    llm = LLM(str(tiny_folder), spec=spec, **OPTIONS)
    drafter, branched = llm.engine.drafter, []
    propose = drafter.propose

    def recorded(batch):
        drafts = propose(batch)
        for row, n in zip(drafts.parents.tolist(), drafts.num_draft_host):
            branched.append(len(row[:n]) != len(set(row[:n])))
        return drafts
    drafter.propose = recorded
    want = [o.token_ids for o in LLM(str(tiny_folder), spec="none", **OPTIONS).generate(prompts, PARAMS)]
    out = llm.generate(prompts, PARAMS)
    assert [o.token_ids for o in out] == want and any(branched)
    assert sum(o.spec["num_draft_tokens"] for o in out) > 0
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=60 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    plain_llm = LLM(str(tiny_folder), spec="none", **OPTIONS)
    sampled = [plain_llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == sampled
    assert sorted(llm.engine.scheduler.free_slots) == [0, 1, 2]


def test_timed_steps_mix_trees_and_chains_and_keep_greedy_output(tiny_folder, monkeypatch):
    """With its step costs measured, the controller drafts chains and probes trees (here every
    other drafting step: how many steps draft at all depends on the measured costs); greedy
    output stays plain greedy output whichever shape each step took."""
    monkeypatch.setattr(controller, "SHAPE_PROBE", 2)
    prompts = PROMPTS + [BRANCHY * 2]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    options = dict(OPTIONS, calibrate=True)
    llm = LLM(str(tiny_folder), spec=SpecConfig(method="ngram", tree_width=3, num_draft_tokens=6), **options)
    drafter, widths = llm.engine.drafter, []
    propose = drafter.propose

    def recorded(batch):
        widths.append(batch.tree_width)
        return propose(batch)
    drafter.propose = recorded
    want = [o.token_ids for o in LLM(str(tiny_folder), spec="none", **options).generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert {1, 3} <= set(widths)


class MalformedTrees(TreeDrafter):
    """TreeDrafter's trees with one node's parent pointing at itself or a later node (no path)."""

    def propose(self, batch):
        drafts = super().propose(batch)
        parents = drafts.parents.clone()
        for i, n in enumerate(drafts.num_draft_host):
            if n > 2:
                parents[i, 2] = 2 + i % 2 * (n - 3)         # itself, or the row's last node
        drafts.parents = parents
        return drafts


@pytest.mark.parametrize("where", ["pytorch", "cpu_kernels"])
def test_a_malformed_tree_costs_its_nodes_never_the_output(tiny_folder, plain, default_model_dir, where, capsys):
    """A drafter whose trees have a node without a path (its parent itself or a later node):
    every output stays plain greedy output, the nodes from the malformed one on are not
    verified, and stderr says so once. Through PyTorch's masked attention (float64) and the CPU
    kernels' key tables (the default model in bfloat16)."""
    if where == "cpu_kernels":
        if not cpu_kernels.has_library():
            pytest.skip("the CPU kernels did not build")
        folder, options = default_model_dir, dict(OPTIONS, dtype="bfloat16", max_model_len=128)
        want = [o.token_ids for o in LLM(str(folder), spec="none", **options).generate(PROMPTS, PARAMS)]
    else:
        folder, options, want = tiny_folder, OPTIONS, plain
    truth = {tuple(p): o for p, o in zip(PROMPTS, want)}
    llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=6), drafter=MalformedTrees(truth, seed=7), **options)
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == want
    assert all(o.spec["num_draft_tokens"] <= 2 * o.spec["num_verify_steps"] for o in out)
    assert capsys.readouterr().err.count("proposed a token tree with a node whose parent") == 1
