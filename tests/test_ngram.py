"""N-gram (prompt lookup) drafting: the incremental NgramDrafter, the batched tensor version and a
brute-force rescan must agree token for token."""
from __future__ import annotations

import random

import pytest
import torch

from outpace.config import SpecConfig
from outpace.errors import InvalidParameterError
from outpace.speculative import ngram_gpu
from outpace.speculative.drafter import DraftBatch
from outpace.speculative.ngram import NgramDrafter


def reference(tokens, k, min_ngram, max_ngram, match):
    """The semantics written out as a rescan: longest n first, occurrences that end before L-1."""
    L = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        starts = [c for c in range(n, L) if tokens[c - n:c] == tokens[L - n:]]
        if starts:
            c = max(starts) if match == "recent" else min(starts)
            return tokens[c:c + k]
    return None


def batch(seq_ids, budget):
    """A DraftBatch of these rows (slots and positions are not a host drafter's concern)."""
    return DraftBatch(list(seq_ids), list(budget), list(range(len(seq_ids))), [0] * len(seq_ids))


def draft_cpu(tokens, k, min_ngram=1, max_ngram=4, match="recent", split=None):
    """NgramDrafter's draft after begin(tokens[:split]) and accept(tokens[split:])."""
    split = len(tokens) if split is None else split
    drafter = NgramDrafter(min_ngram=min_ngram, max_ngram=max_ngram, match=match)
    drafter.begin(7, tokens[:split])
    drafter.accept(7, tokens[split:])
    (draft,) = drafter.propose(batch([7], [k])).host_rows()
    return draft or None


def draft_tensor(tokens, k, min_ngram=1, max_ngram=4, match="recent", split=None):
    """The tensor version on a buffer wider than the sequence (stale columns filled with tokens)."""
    buf, lengths = ngram_gpu.new_buffer(3, len(tokens) + 5)
    buf.fill_(tokens[-1] if tokens else 0)  # stale columns must never be read as tokens
    ngram_gpu.write_row(buf, lengths, 1, tokens)
    out, num = ngram_gpu.propose(buf, lengths, torch.tensor([1]), k, min_ngram, max_ngram, match)
    assert out.shape == (1, k)
    n = int(num[0])
    assert out[0, n:].eq(0).all()
    return out[0, :n].tolist() or None


@pytest.fixture(params=["cpu", "tensor"])
def draft(request):
    return draft_cpu if request.param == "cpu" else draft_tensor


def test_longest_ngram_wins_over_more_recent_shorter(draft):
    # (1, 2) occurred at the start; the 1-gram (2) occurred more recently, followed by 4.
    tokens = [1, 2, 3, 9, 2, 4, 1, 2]
    assert draft(tokens, 3, max_ngram=2) == [3, 9, 2]
    assert draft(tokens, 3, max_ngram=1) == [4, 1, 2]
    assert reference(tokens, 3, 1, 2, "recent") == [3, 9, 2]


def test_draft_reports_its_match_length():
    """The draft controller weighs a draft by how many tail tokens its match rested on."""
    drafter = NgramDrafter(min_ngram=1, max_ngram=3)
    drafter.begin(0, [1, 2, 3, 9, 2, 4, 1, 2])          # tail (1, 2) matched at the start
    drafter.begin(1, [5, 6, 7, 5, 6, 7, 8, 6, 7])       # tail (6, 7) matched, most recently before 8
    drafter.begin(2, [4, 8, 4])                         # tail (4) matched
    drafts = drafter.propose(batch([0, 1, 2], [3, 3, 3]))
    assert drafts.host_rows() == [[3, 9, 2], [8, 6, 7], [8, 4]]
    assert drafts.match_len == [2, 2, 1]
    cut = drafts.truncated([1, 3, 0])
    assert cut.host_rows() == [[3], [8, 6, 7], []] and cut.num_draft.tolist() == [1, 3, 0]


def test_recent_versus_first(draft):
    tokens = [5, 1, 5, 2, 5]  # (5) continues with 1 at c=1 and with 2 at c=3
    assert draft(tokens, 2, match="recent") == [2, 5]
    assert draft(tokens, 2, match="first") == [1, 5]


def test_continuation_truncated_at_buffer_end(draft):
    # The run 'a a a a': the suffix 'a a a' matches at c=3, one token before the end.
    assert draft([4, 4, 4, 4], 5, max_ngram=3) == [4]
    assert draft([4, 4, 4, 4], 5, max_ngram=3, match="first") == [4]
    assert draft([4, 4, 4, 4], 5, max_ngram=1, match="first") == [4, 4, 4]
    assert draft([8, 3, 9, 8, 3], 4) == [9, 8, 3]


def test_no_match_is_none(draft):
    assert draft([1, 2, 3, 4], 4) is None
    assert draft([1], 4) is None
    assert draft([], 4) is None


def test_min_ngram_respected(draft):
    tokens = [3, 7, 1, 9, 5, 7]  # only the 1-gram (7) recurs
    assert draft(tokens, 2, min_ngram=1) == [1, 9]
    assert draft(tokens, 2, min_ngram=2) is None


def test_suffix_never_matches_itself(draft):
    assert draft([1, 2, 3], 4) is None
    assert draft([1, 2, 3], 4, split=1) is None
    assert draft([2, 2], 4, max_ngram=2) == [2]  # only n=1 matches: the 2-gram is the suffix itself


def test_prompt_only_and_generated_only_matches(draft):
    # The suffix (1, 2) recurs in the prompt only.
    assert draft([1, 2, 3, 4, 9, 1, 2], 3, split=4) == [3, 4, 9]
    # The suffix (7, 8) recurs in the generated tokens only.
    assert draft([1, 2, 7, 8, 9, 7, 8], 3, split=2) == [9, 7, 8]


def test_zero_max_tokens_and_unknown_lengths():
    drafter = NgramDrafter(SpecConfig(min_ngram=1, max_ngram=2))
    drafter.begin(0, [1, 2, 1, 2])
    drafter.begin(1, [3, 3])
    assert drafter.propose(batch([0, 1], [0, 2])).host_rows()[0] == []
    assert drafter.propose(batch([0, 1], [2, 2])).host_rows()[1] == [3]
    drafter.end(0)
    with pytest.raises(KeyError):
        drafter.propose(batch([0], [2]))


def test_explicit_arguments_are_validated():
    with pytest.raises(InvalidParameterError):
        NgramDrafter(min_ngram=3, max_ngram=2)
    with pytest.raises(InvalidParameterError):
        NgramDrafter(match="last")
    assert NgramDrafter(SpecConfig(max_ngram=5), match="first").max_ngram == 5


def test_append_writes_only_the_accepted_tokens():
    """Guards the batched append: ragged num_new (0 included) and a row filled to the last column."""
    buf, lengths = ngram_gpu.new_buffer(4, 6)
    ngram_gpu.write_row(buf, lengths, 0, [1, 2, 3])
    ngram_gpu.write_row(buf, lengths, 2, [4])
    ngram_gpu.write_row(buf, lengths, 3, [5, 5])
    before = buf.clone()
    rows = torch.tensor([3, 0, 2])
    new = torch.tensor([[6, 7, 8], [9, 10, 11], [12, 13, 14]])
    ngram_gpu.append(buf, lengths, rows, new, torch.tensor([1, 3, 0]))
    assert lengths.tolist() == [6, 0, 1, 3]
    assert buf[0].tolist() == [1, 2, 3, 9, 10, 11]
    assert buf[2].tolist() == before[2].tolist()
    assert buf[3, :3].tolist() == [5, 5, 6]
    assert buf[3, 3:].tolist() == before[3, 3:].tolist()
    assert buf[1].tolist() == before[1].tolist()


@pytest.mark.parametrize("match", ["recent", "first"])
@pytest.mark.parametrize("min_ngram,max_ngram", [(1, 1), (1, 3), (2, 4), (1, 5)])
def test_incremental_and_batched_equal_rescan(match, min_ngram, max_ngram):
    """Random growth over a tiny vocabulary (matches everywhere), ragged lengths in one batch:
    NgramDrafter, the tensor version (fed through append) and the rescan draft the same tokens."""
    rng = random.Random(1000 * min_ngram + 10 * max_ngram + (match == "first"))
    num_seqs, max_len, num_steps = 6, 160, 40
    drafter = NgramDrafter(min_ngram=min_ngram, max_ngram=max_ngram, match=match)
    buf, lengths = ngram_gpu.new_buffer(num_seqs + 2, max_len)
    buf.random_(0, 4)  # stale garbage past every row's length
    seqs, rows = {}, {}
    for s in range(num_seqs):
        vocab = rng.choice([2, 3, 5])
        seqs[s] = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        rows[s] = num_seqs + 1 - s  # rows in a different order from sequence ids
        drafter.begin(s, seqs[s])
        ngram_gpu.write_row(buf, lengths, rows[s], seqs[s])

    for _ in range(num_steps):
        k = rng.randrange(1, 7)
        live = [s for s in seqs if len(seqs[s]) + k + 1 <= max_len]
        rng.shuffle(live)
        drafts = drafter.propose(batch(live, [k] * len(live))).host_rows()
        row_ids = torch.tensor([rows[s] for s in live])
        out, num = ngram_gpu.propose(buf, lengths, row_ids, k, min_ngram, max_ngram, match)
        new = torch.zeros(len(live), k + 1, dtype=torch.int64)
        num_new = torch.zeros(len(live), dtype=torch.int64)
        for i, s in enumerate(live):
            want = reference(seqs[s], k, min_ngram, max_ngram, match)
            got = drafts[i] or None
            assert got == want, (seqs[s], k)
            assert int(num[i]) == len(want or []) and out[i, :len(want or [])].tolist() == (want or [])
            assert out[i, len(want or []):].eq(0).all()
            # Accept 1..K+1 tokens, biased towards the draft so long matches form.
            added = [t if rng.random() < 0.7 else rng.randrange(4) for t in (want or [])]
            added = (added + [rng.randrange(3) for _ in range(k + 1)])[:rng.randrange(1, k + 2)]
            drafter.accept(s, added)
            seqs[s] += added
            new[i, :len(added)] = torch.tensor(added)
            num_new[i] = len(added)
        ngram_gpu.append(buf, lengths, row_ids, new, num_new)
        for s in live:
            assert buf[rows[s], :lengths[rows[s]]].tolist() == seqs[s]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("match", ["recent", "first"])
def test_cuda_graph_capture_matches_cpu(match):
    """Guards the hot path's promise: no host sync (capture would fail) and CUDA == CPU results."""
    gen = torch.Generator().manual_seed(0)
    buf, lengths = ngram_gpu.new_buffer(32, 4096)
    buf.random_(0, 6, generator=gen)
    lengths.copy_(torch.randint(0, 4097, (32,), generator=gen))
    rows = torch.randperm(32, generator=gen)[:24]
    want = ngram_gpu.propose(buf, lengths, rows, 8, 1, 4, match)
    buf, lengths, rows = buf.cuda(), lengths.cuda(), rows.cuda()
    new, num_new = torch.randint(0, 6, (24, 9), device="cuda"), torch.zeros(24, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as capture requires
        ngram_gpu.propose(buf, lengths, rows, 8, 1, 4, match)
        ngram_gpu.append(buf, lengths, rows, new, num_new)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = ngram_gpu.propose(buf, lengths, rows, 8, 1, 4, match)
        ngram_gpu.append(buf, lengths, rows, new, num_new)  # num_new = 0: the buffer is unchanged
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
    assert int(want[1].gt(0).sum()) > 12  # matches happened (6-token vocabulary)


class Salts:
    """A DraftContext's salt: the cache salt each sequence was given."""

    def __init__(self, salts):
        self.salt = salts.get


def test_memory_drafts_a_finished_requests_continuation():
    """A later request whose tail an ended one held drafts what followed there, and says how many
    tail tokens agree; none where lookup_memory is 0 or no request has ended."""
    answer = list(range(100, 140))
    for memory, want in ((65536, (answer[12:20], 12)), (0, ([], 0))):     # 0: the default
        drafter = NgramDrafter(SpecConfig(lookup_memory=memory))
        drafter.begin(1, answer[:10])
        drafter.begin(2, [7, 8] + answer[:12])
        assert drafter.propose(batch([2], [8])).host_rows() == [[]]     # 1 has not ended
        drafter.accept(1, answer[10:])
        drafter.end(1)
        drafts = drafter.propose(batch([2], [8]))
        assert (drafts.host_rows()[0], drafts.match_len[0]) == want


MEMORY = SpecConfig(lookup_memory=65536)


def test_memory_serves_only_its_salt():
    drafter = NgramDrafter(MEMORY)
    drafter.bind(Salts({1: "alice", 2: "bob", 3: "alice"}))
    drafter.begin(1, [5, 6, 7, 8, 9, 10])
    drafter.end(1)
    drafter.begin(2, [1, 5, 6, 7])
    drafter.begin(3, [1, 5, 6, 7])
    assert drafter.propose(batch([2, 3], [4, 4])).host_rows() == [[], [8, 9, 10]]


def test_own_match_wins_where_it_agrees_as_far_back():
    """The memory drafts only where its match agrees with the tail further back than the
    sequence's own: here both agree on 3 tokens (a tie: its own), then the memory on 4."""
    drafter = NgramDrafter(MEMORY)
    drafter.begin(1, [1, 9, 2, 3, 40, 41])
    drafter.end(1)
    drafter.begin(2, [9, 2, 3, 50, 51, 9, 2, 3])
    assert drafter.propose(batch([2], [2])).host_rows() == [[50, 51]]
    drafter.begin(3, [7, 0, 1, 2, 3, 60, 61])
    drafter.end(3)
    drafter.begin(4, [5, 1, 2, 3, 80, 0, 1, 2, 3])
    drafts = drafter.propose(batch([4], [2]))
    assert drafts.host_rows() == [[60, 61]] and drafts.match_len == [4]


def test_memory_forgets_the_oldest_beyond_its_tokens():
    drafter = NgramDrafter(SpecConfig(lookup_memory=25))
    for seq_id in range(3):         # 10 tokens each: the first goes when the third arrives
        drafter.begin(seq_id, [1000 * seq_id + i for i in range(10)])
        drafter.end(seq_id)
    memory = drafter.memory
    assert memory.size == 20 and list(memory.docs) == [1, 2]
    # no table entry points at the first document any more
    assert all(value >> 32 != 0 for table in memory.tables for value in table.values())
    for seq_id, want in ((10, []), (11, [1005, 1006])):
        drafter.begin(seq_id, [1000 * (seq_id - 10) + i for i in (2, 3, 4)])
        assert drafter.propose(batch([seq_id], [2])).host_rows() == [want]


def test_memory_rejects_a_negative_size():
    with pytest.raises(InvalidParameterError, match="lookup_memory"):
        SpecConfig(lookup_memory=-1)


def test_memory_stays_off_on_a_gpu():
    """A GPU engine's lookups draft inside its CUDA graphs (or, for trees, on a host whose loop
    bounds the step): the factory keeps no memory there, whatever is asked."""
    from outpace.speculative.factory import make_drafter
    spec = SpecConfig(tree_width=2, lookup_memory=65536)
    assert make_drafter(spec, "smollm2-135m", "cpu", 2, 256, False).memory is not None
    assert make_drafter(spec, "smollm2-135m", "cuda", 2, 256, False).memory is None
