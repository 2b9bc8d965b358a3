"""The draft controller: drafts when it pays, stops when it does not, and probes again later."""
import pytest

from outpace.speculative.controller import PROBE_DRAFTS, DraftController

FLAT = {1: [1.0] * 9}
STEEP = {1: [1.0 + 0.2 * k for k in range(9)]}     # each drafted token costs a fifth of a plain step


def test_drafts_the_most_when_verification_is_free():
    assert DraftController(8, FLAT).num_draft([0], 1) == 8


def test_no_draft_when_acceptance_cannot_pay_for_it():
    c = DraftController(8, STEEP)
    for _ in range(20):
        c.observe(0, 8, 8, 0)
    assert c.num_draft([0], 1) == 0


def test_accepting_sequences_draft_more_than_rejecting_ones():
    c = DraftController(8, {1: [1.0 + 0.1 * k for k in range(9)]})
    for _ in range(10):
        c.observe(1, 8, 8, 8)
        c.observe(2, 8, 8, 1)
    assert c.num_draft([1], 1) > c.num_draft([2], 1)


def test_switched_off_sequence_is_probed_again():
    """Regression: once a sequence's estimate fell to zero drafts, no draft meant no new evidence,
    and speculation stayed off for the rest of the sequence."""
    c = DraftController(8, STEEP)
    for _ in range(20):
        c.observe(0, 8, 8, 0)
    assert c.num_draft([0], 1) == 0
    steps = 0
    while c.num_draft([0], 1) == 0 and steps < 100:
        c.observe(0, 0, 0, 0)
        steps += 1
    assert 0 < steps < 100


def test_cost_curve_of_the_nearest_larger_batch_bucket():
    c = DraftController(4, {1: [1.0, 1.0, 1.0, 1.0, 1.0], 8: [1.0, 2.0, 3.0, 4.0, 5.0]})
    assert c.cost_ratio(1, 4) == 1.0 and c.cost_ratio(5, 4) == 5.0 and c.cost_ratio(64, 1) == 2.0


def test_one_draft_length_for_the_batch_weighs_every_row():
    """A batch pays for its longest row: one fairly accepting row among rejecting ones does not
    pay for eight long rows, though alone it would draft the most."""
    cost = {1: [1.0 + 0.02 * k for k in range(9)], 8: [1.0 + 0.1 * k for k in range(9)]}
    c = DraftController(8, cost)
    for _ in range(10):
        c.observe(0, 8, 8, 2)
        for s in range(1, 8):
            c.observe(s, 8, 8, 0)
    assert c.num_draft([0], 1) >= 4
    assert c.num_draft(list(range(8)), 8) <= 1
    for s in range(1, 8):
        for _ in range(10):
            c.observe(s, 8, 8, 8)
    assert c.num_draft(list(range(8)), 8) == 8


def test_packed_costs_are_read_per_drafted_token():
    """A packing runner's calibration (b rows holding e drafted tokens) is read between its points,
    for any batch in the bucket; a draft length for the batch is cut to what each row has."""
    packed = DraftController(8, {8: [[0, 1.0], [64, 1.0 + 0.64]]}, packed=True)   # a drafted token costs 0.01
    assert packed.step_cost(8, 8 + 4) == packed.step_cost(5, 5 + 4) == 1.0 + 0.04
    for _ in range(10):
        for s in range(8):
            packed.observe(s, 8, 8, 8)
    assert packed.draft_lengths(list(range(8)), 8, available=[3] + [8] * 7) == [3] + [8] * 7


def test_rows_without_a_draft_gain_nothing():
    """Drafts known before the choice: rows that found no match do not pay for a long step."""
    cost = {8: [1.0 + 0.2 * k for k in range(9)]}
    c = DraftController(8, cost)
    for s in range(8):
        for _ in range(10):
            c.observe(s, 8, 8, 8)
    assert c.num_draft(list(range(8)), 8, available=[8] * 8) == 8
    assert c.num_draft(list(range(8)), 8, available=[8] + [0] * 7) == 0
    assert c.num_draft(list(range(8)), 8, available=[2] * 8) == 2


def test_rows_that_rarely_find_a_match_are_discounted():
    """Drafts not known before the choice (device drafter): a row's gain is weighted by how often
    it had a draft when asked."""
    cost = {8: [1.0 + 0.1 * k for k in range(9)]}
    c = DraftController(8, cost)
    for s in range(8):
        for _ in range(10):
            c.observe(s, 8, 8, 8)
    assert c.num_draft(list(range(8)), 8) == 8
    for s in range(8):
        for _ in range(30):
            c.observe(s, 8, 0, 0)
    assert c.hit_rate(0) < 0.1
    assert c.num_draft(list(range(8)), 8) == 0
    # not asked, no evidence: the hit rate relaxes back, so the rows are asked again (regression:
    # it stayed low for good, and a device-drafting sequence never drafted again)
    steps = 0
    while c.num_draft(list(range(8)), 8) == 0 and steps < 100:
        for s in range(8):
            c.observe(s, 0, 0, 0)
        steps += 1
    assert 0 < steps < 100


def test_measured_step_overhead_can_switch_speculation_off():
    """The start-up curve says verification is nearly free; steps that draft measure 3x slower
    (drafting, acceptance math): at a modest acceptance the controller stops drafting."""
    cost = {1: [1.0 + 0.01 * k for k in range(9)]}
    c = DraftController(8, cost)
    for _ in range(10):
        c.observe(0, 8, 8, 1)
    assert c.num_draft([0], 1) > 0
    for _ in range(50):
        c.observe_step(1, 1, 1.0)
        c.observe_step(1, 5, 3.0)
    assert c.cost_ratio(1, 4) > 2.5
    assert c.num_draft([0], 1) == 0


def test_bursty_acceptance_drafts_long():
    """Half the drafts are wrong at once, the other half right to the end (a copied span): the
    first-position rate is 0.5, yet long drafts pay, which one per-token rate would miss."""
    c = DraftController(8, {1: [1.0 + 0.1 * k for k in range(9)]})
    for _ in range(20):
        c.observe(0, 8, 8, 0)
        c.observe(0, 8, 8, 8)
    assert 0.4 < c.acceptance(0) < 0.6 and c.follow_rate(0) > 0.9
    assert c.num_draft([0], 1) == 8


def test_one_slow_step_does_not_end_speculation():
    """Regression: the first drafting step was slow once (first calls), its overhead stood for
    every later step, and the controller never drafted again."""
    c = DraftController(8, {1: [1.0 + 0.01 * k for k in range(9)]})
    for _ in range(10):
        c.observe(0, 8, 8, 4)
    c.observe_step(1, 9, 1000.0)
    assert c.cost_ratio(1, 8) <= 5 * 1.08 + 1e-9      # the forward plus at most 4 forwards
    steps = 0
    while c.num_draft([0], 1) == 0 and steps < 100:
        c.observe_step(1, 1, 1.0)
        c.observe(0, 0, 0, 0)
        steps += 1
    assert steps < 100


def test_host_work_per_token_discounts_drafting():
    """Where the host's work per token dwarfs the forward (a fast GPU, many rows), more tokens per
    step save little: the same acceptance that pays with free host work does not pay here."""
    cost = {32: [1.0 + 0.3 * k for k in range(9)]}
    c = DraftController(8, cost)
    for s in range(32):
        for _ in range(10):
            c.observe(s, 8, 8, 2)
    assert c.num_draft(list(range(32)), 32) > 0
    for _ in range(50):
        c.observe_tokens(32, 32 * 0.5)        # half a forward of host work per token
    assert c.num_draft(list(range(32)), 32) == 0


def test_calibration_times_the_rows_each_runner_runs(tmp_path, monkeypatch):
    """A padding runner is timed on b rows of s tokens; a packing runner on b rows holding e
    drafted tokens, drafts in as few rows as hold them (regression: the padding runner was timed
    on the packed layout, which it pads to full drafts, so every s >= 2 cost what s = 9 costs)."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from outpace.runner.calibrate import measure_verify_cost

    @dataclasses.dataclass
    class Shape:
        hidden: int = 8

    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path))
    for packs in (False, True):
        seen = []
        model = SimpleNamespace(cfg=Shape(), modules=lambda: [])
        runner = SimpleNamespace(model=model, dtype=torch.float32, device=torch.device("cpu"), packs_rows=packs,
                                 forward=lambda rows: seen.append([len(r.token_ids) for r in rows]),
                                 cache=SimpleNamespace(commit=lambda slots, num_accepted: None))
        cost = measure_verify_cost(runner, max_seqs=2, num_draft_tokens=2, reps=1)
        shapes = seen[1:]                                          # after the warm-up call
        if packs:
            assert [e for e, _ in cost[2]] == [0, 1, 2, 4]
            assert [s for s in shapes if len(s) == 2] == [[1, 1], [2, 1], [3, 1], [3, 3]]
        else:
            assert len(cost[2]) == 3
            assert [[1, 1], [2, 2], [3, 3]] == [s for s in shapes if len(s) == 2]


def test_calibration_times_every_shape_once_a_round(tmp_path, monkeypatch):
    """The shapes are timed in rounds, every shape once a round, and each keeps its best: a slow
    spell of the machine then weighs on one round of every shape rather than on every time of the
    few shapes measured during it (one shape after another, it had skewed the curve the controller
    reads)."""
    import dataclasses
    import time as clock
    from types import SimpleNamespace

    import torch

    from outpace.runner.calibrate import measure_verify_cost

    @dataclasses.dataclass
    class Shape:
        hidden: int = 8

    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path))
    seen, now = [], [0.0]
    monkeypatch.setattr(clock, "perf_counter", lambda: now[0])

    def forward(rows):
        seen.append(sum(len(r.token_ids) for r in rows))
        # calls 5 to 12 (the first round's tail, the second round's head) run 10 times slower
        now[0] += 10.0 * seen[-1] if 5 <= len(seen) <= 12 else seen[-1]

    runner = SimpleNamespace(model=SimpleNamespace(cfg=Shape(), modules=lambda: []), dtype=torch.float32,
                             device=torch.device("cpu"), packs_rows=False, forward=forward,
                             cache=SimpleNamespace(commit=lambda slots, num_accepted: None))
    cost = measure_verify_cost(runner, max_seqs=1, num_draft_tokens=8, reps=3)
    assert seen[1:] == [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3             # after the warm-up call
    assert cost[1] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]


def _timed_runner(monkeypatch, tmp_path, seconds):
    """A runner whose forward of rows holding t tokens in all takes seconds(t, call) by a mocked
    clock (call: how many forwards of t tokens ran before, the warm-up's included), with its
    calibration kept under tmp_path; and the token counts of its forwards."""
    import dataclasses
    import time as clock
    from types import SimpleNamespace

    import torch

    @dataclasses.dataclass
    class Shape:
        hidden: int = 8

    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path))
    now, seen = [0.0], []
    monkeypatch.setattr(clock, "perf_counter", lambda: now[0])

    def forward(rows):
        tokens = sum(len(r.token_ids) for r in rows)
        now[0] += seconds(tokens, seen.count(tokens))
        seen.append(tokens)

    runner = SimpleNamespace(model=SimpleNamespace(cfg=Shape(), modules=lambda: []), dtype=torch.float32,
                             device=torch.device("cpu"), packs_rows=False, forward=forward,
                             cache=SimpleNamespace(commit=lambda slots, num_accepted: None))
    return runner, seen


def test_a_shape_whose_best_no_second_round_repeats_is_measured_again(tmp_path, monkeypatch):
    """A forward of 5 tokens that reads slow in two of the three rounds (spells over its turns) and
    fast from then on is measured again until a second round repeats its least time, and only then
    is the curve kept. Regression: a kept curve whose one fast point priced the shorter drafts at it
    too made drafting look free on that machine for good."""
    from outpace.runner.calibrate import measure_verify_cost

    # 5 tokens: its first and third rounds slow, its others fast
    runner, seen = _timed_runner(monkeypatch, tmp_path, lambda t, call: 10.0 if t == 5 and call in (0, 2) else float(t))
    cost = measure_verify_cost(runner, max_seqs=1, num_draft_tokens=8, reps=3)
    assert seen[1:] == [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [5]
    assert cost[1] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    assert len(list(tmp_path.glob("calibration/*.json"))) == 1


def test_a_shape_never_settled_serves_its_run_at_the_others_level_and_is_not_kept(tmp_path, monkeypatch, capsys):
    """A forward of 5 tokens fast in the first round alone (every other time of it slow) is
    measured up to MAX_ROUNDS, then read at the least time two rounds reached, the level its
    neighbours were measured at, not at the lone fast one; the curve serves the run and is not
    kept, so the next start measures again. The notice goes to stderr: stdout may be a command's
    output (generate --json)."""
    from outpace.runner.calibrate import MAX_ROUNDS, measure_verify_cost

    runner, seen = _timed_runner(monkeypatch, tmp_path, lambda t, call: 2.0 if t == 5 and call == 0 else 3.0 * t)
    for start in range(2):
        del seen[:]
        cost = measure_verify_cost(runner, max_seqs=1, num_draft_tokens=8, reps=3)
        assert seen[1:] == [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [5] * (MAX_ROUNDS - 3), start
        assert cost[1] == [3.0, 6.0, 9.0, 12.0, 15.0, 18.0, 21.0, 24.0, 27.0]
        assert not list(tmp_path.glob("calibration/*.json"))
        out, err = capsys.readouterr()
        assert out == "" and "too busy to time its forwards steadily" in err


def test_a_single_shape_is_timed_until_a_second_timing_repeats_its_least():
    """calibrate.settle (a draft model's own costs): timings past reps until a second lies within
    10% of the least; never settled, the least two timings reached, and not settled."""
    from outpace.runner.calibrate import MAX_ROUNDS, settle

    times = [10.0, 5.0, 10.0, 5.2, 99.0]
    taken = iter(times)
    assert settle(lambda: next(taken), 3) == (5.0, True)
    assert next(taken) == 99.0                                  # four timings taken
    taken = iter([2.0] + [9.0] * 20)
    assert settle(lambda: next(taken), 3) == (9.0, False)
    assert len(list(taken)) == 21 - MAX_ROUNDS
    assert settle(lambda: 7.0, 1) == (7.0, True)


@pytest.mark.parametrize("packs", [False, True])
def test_a_calibrated_point_above_a_later_one_is_read_at_the_later(tmp_path, monkeypatch, packs):
    """A forward of 5 tokens a row that reads slower than those of 6 to 9 in every round (a slow
    spell each round met) is read at the least of them: the curve the controller gets never falls.
    Regression: a kept Qwen2.5-1.5B curve whose 5 and 6 drafts read above 8 priced drafting that
    deep on that machine for good. The measure kept on disk is the raw one."""
    import dataclasses
    import json
    import time as clock
    from types import SimpleNamespace

    import torch

    from outpace.runner.calibrate import measure_verify_cost

    @dataclasses.dataclass
    class Shape:
        hidden: int = 8

    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path))
    now = [0.0]
    monkeypatch.setattr(clock, "perf_counter", lambda: now[0])

    def forward(rows):
        tokens = sum(len(r.token_ids) for r in rows)
        now[0] += 8.0 if tokens == 5 else float(tokens)

    runner = SimpleNamespace(model=SimpleNamespace(cfg=Shape(), modules=lambda: []), dtype=torch.float32,
                             device=torch.device("cpu"), packs_rows=packs, forward=forward,
                             cache=SimpleNamespace(commit=lambda slots, num_accepted: None))
    for _ in range(2):          # measured, then read from the kept file
        cost = measure_verify_cost(runner, max_seqs=1, num_draft_tokens=8, reps=2)
        seconds = [t for _, t in cost[1]] if packs else cost[1]
        assert seconds == [1.0, 2.0, 3.0, 4.0, 6.0, 6.0, 7.0, 8.0, 9.0]
    kept = json.loads(next((tmp_path / "calibration").iterdir()).read_text())["1"]
    assert ([t for _, t in kept] if packs else kept)[4] == 8.0


def test_each_graph_steps_drafter_part_is_calibrated_apart(tmp_path, monkeypatch):
    """The calibration cache keeps one measure per drafter part of a graph step (its cost_key) and
    hidden layers: every measured forward runs that work, so an engine with a head's chains in its
    step must not read the costs an n-gram engine measured (regression: the key ignored it, and a
    head alone on the H200 priced its 8-deep chains at a chain step's 3 forwards). The same part
    reads its cached measure."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from outpace.runner.calibrate import measure_verify_cost

    @dataclasses.dataclass
    class Shape:
        hidden: int = 8

    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path))
    measured = []

    def runner(cost_key, layers=()):
        return SimpleNamespace(model=SimpleNamespace(cfg=Shape(), modules=lambda: []), dtype=torch.float32,
                               device=torch.device("cpu"), packs_rows=False, hidden_layers=layers,
                               extension=None if cost_key is None else SimpleNamespace(cost_key=cost_key),
                               forward=lambda rows: measured.append(cost_key),
                               cache=SimpleNamespace(commit=lambda slots, num_accepted: None))
    ran = []
    for key, layers in [("ngram", ()), ("head", (0, 1)), ("head", (0, 2)), (None, ()), ("ngram", ()), ("head", (0, 1))]:
        measured.clear()
        measure_verify_cost(runner(key, layers), max_seqs=1, num_draft_tokens=2, reps=1)
        ran.append(bool(measured))
    assert ran == [True, True, True, True, False, False]
    assert len(list(tmp_path.glob("calibration/*.json"))) == 4


def test_each_gpu_model_keeps_its_own_calibration(tmp_path, monkeypatch):
    """Two GPU models (an H100's steps and an H200's take other times) never read each other's
    kept costs, which a home folder shared by both would otherwise hand them; the same card reads
    its own."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from outpace.runner.calibrate import kept

    @dataclasses.dataclass
    class Shape:
        hidden: int = 8

    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path))
    card = ["NVIDIA H100 80GB HBM3"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: card[0])
    runner = SimpleNamespace(model=SimpleNamespace(cfg=Shape(), modules=lambda: []), dtype=torch.bfloat16,
                             device=torch.device("cuda", 0), packs_rows=False)
    got = []
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        card[0] = name
        got.append(kept(runner, ["costs"], lambda: ({"measured on": card[0]}, True)))
    assert got == [{"measured on": "NVIDIA H100 80GB HBM3"}, {"measured on": "NVIDIA H200"},
                   {"measured on": "NVIDIA H100 80GB HBM3"}]
    assert len(list(tmp_path.glob("calibration/*.json"))) == 2


def test_packed_rows_verify_only_their_promising_tokens():
    """Where rows are packed a step costs the tokens it holds, so one accepting row drafts among
    rejecting ones (which draft nothing), where padded rows would make it pay for all eight."""
    c = DraftController(8, {8: [[0, 1.0], [64, 1.0 + 64 * 0.05]]}, packed=True)    # a drafted token: 0.05
    for _ in range(10):
        c.observe(0, 8, 8, 8)
        for s in range(1, 8):
            c.observe(s, 8, 8, 0)
    assert c.draft_lengths(list(range(8)), 8, available=[8] * 8) == [8] + [0] * 7
    assert c.draft_lengths(list(range(8)), 8, available=[2] + [8] * 7) == [2] + [0] * 7


def test_long_matches_draft_where_short_ones_do_not():
    """Drafts found from a long match of the sequence's tail are accepted, from a one-token match
    rejected: the controller learns it across sequences and keeps the long-match drafts of a batch."""
    c = DraftController(8, {8: [[0, 1.0], [64, 1.0 + 64 * 0.08]]}, packed=True)
    for _ in range(40):
        for s in range(8):
            c.observe(s, 4, 4, 4, match_len=4)
            c.observe(s, 4, 4, 0, match_len=1)
    assert c.match_factor(4, 1) > 1.5 > 0.2 > c.match_factor(1, 1)
    assert c.match_factor(3, 1) == 1.0                                  # never seen: no evidence
    lengths = c.draft_lengths(list(range(8)), 8, available=[8] * 8, matches=[4, 1] * 4)
    assert all(n > 0 for n in lengths[0::2]) and not any(lengths[1::2])


def test_match_rates_shrink_toward_the_pool_on_little_evidence():
    """One accepted draft of a new match length moves its rate a fifth of the way from the pooled
    rate toward 1; twenty move it most of the way."""
    c = DraftController(4, {1: [1.0] * 5})
    for _ in range(50):
        c.observe(0, 4, 4, 0, match_len=2)

    def rate(match_len):            # P(first drafted token accepted | match length)
        pooled = (c.pool[0].accepted + 1.0) / (c.pool[0].reached + 2.0)
        return c.match_factor(match_len, 1) * pooled, pooled

    c.observe(0, 4, 4, 4, match_len=4)
    one, pooled = rate(4)
    assert abs(one - (pooled + (1 - pooled) / 5)) < 1e-9
    for _ in range(20):
        c.observe(0, 4, 4, 4, match_len=4)
    assert rate(4)[0] > 0.85 and rate(2)[0] < 0.1


def test_packed_drafting_overhead_is_charged_per_drafted_token():
    """Packed rows: steps measured 0.1 above the calibration, plus 0.02 per drafted token (attention
    over longer contexts than the calibration's), so a step of 40 drafted tokens is charged 0.8
    more and one of a single token 0.02, not the 0.2 a step of 10 showed."""
    c = DraftController(8, {8: [[0, 1.0], [64, 1.64]]}, packed=True)
    for i in range(200):
        drafted = (0, 5, 10, 20)[i % 4]
        c.observe_step(8, 8 + drafted, 1.0 + 0.01 * drafted + 0.1 + 0.02 * drafted)
    assert abs(c.step_cost(8, 8 + 40) - (1.4 + 0.1 + 0.8)) < 0.02
    assert abs(c.step_cost(8, 8 + 1) - (1.01 + 0.1 + 0.02)) < 0.01


def test_a_drafters_priced_forwards_are_charged_once_and_not_to_free_rows():
    """A draft model's forwards (0.05 s a drafted token, its own price) are in the step times the
    controller fits. Taken out of the fit, a paid drafted token costs its forward share plus that
    price once, and a free lookup token (a chain's n-gram rows) its forward share alone.
    Regression: left in, the fit's slope charged every drafted token about 0.05 more, paid (twice)
    or free."""
    c = DraftController(8, {8: [[0, 1.0], [64, 1.64]]}, packed=True, draft_cost=lambda batch_size: 0.05)
    for i in range(300):
        drafted = (4, 8, 12)[i % 3]
        paid = drafted if i % 2 else 0
        c.observe_step(8, 8 + drafted, 1.0 + 0.01 * drafted + 0.1 + 0.05 * paid, paid)
    free, paid = c._costs(8, paid=False), c._costs(8)
    assert abs(free(8 + 10) - (1.1 + 0.1)) < 0.01
    assert abs(paid(8 + 10) - (1.1 + 0.1 + 0.5)) < 0.01


def test_a_drafters_step_cost_is_charged_once_a_drafting_step():
    """A drafter whose steps cost 0.2 s once whenever they draft (a head's catch-up) beside 0.05 s
    a drafted token: a paid step of 10 drafted tokens costs both prices once, a plain step neither,
    a free lookup's step neither, and the fit, with both taken out, holds the steps' own
    overhead alone. With the step's cost folded into one price a token, a draft of 1 and one of
    4 tokens would cost the same a token."""
    c = DraftController(8, {8: [[0, 1.0], [64, 1.64]]}, packed=True, draft_cost=lambda batch_size: 0.05,
                        draft_step_cost=lambda batch_size: 0.2)
    for i in range(300):
        drafted = (4, 8, 12)[i % 3]
        paid = drafted if i % 2 else 0
        c.observe_step(8, 8 + drafted, 1.0 + 0.01 * drafted + 0.1 + (0.05 * paid + 0.2 if paid else 0.0), paid)
    free, paid = c._costs(8, paid=False), c._costs(8)
    assert abs(paid(8) - 1.1) < 0.01
    assert abs(free(8 + 10) - (1.1 + 0.1)) < 0.01
    assert abs(paid(8 + 1) - (1.01 + 0.1 + 0.05 + 0.2)) < 0.01
    assert abs(paid(8 + 10) - (1.1 + 0.1 + 0.5 + 0.2)) < 0.01


def test_drafting_measured_above_its_price_stays_out_of_the_fit():
    """Every step drafts 4 paid tokens whose drafting the host measured at 0.4 s, where the
    drafter's price (a lagging mean) says 0.05 a token. The measure is taken out, not the price:
    the fit keeps the steps' true overhead (0.1), so a plain step is not charged the difference.
    Regression: the 0.2 s the price missed went into the intercept, every plain step was charged
    it too, and drafting looked cheaper against plain than it was."""
    c = DraftController(8, {8: [[0, 1.0], [64, 1.64]]}, packed=True, draft_cost=lambda batch_size: 0.05)
    for _ in range(200):
        c.observe_step(8, 8 + 4, 1.0 + 0.04 + 0.1 + 0.4, 4, draft_seconds=0.4)
    assert abs(c.step_cost(8, 8) - 1.1) < 0.01


def test_a_calibration_slower_than_the_steps_does_not_raise_a_drafted_tokens_cost():
    """The calibration was timed 1.5x slower than the steps run (a busy machine at start), so
    plain steps took 0.5 s less than it says. A paid drafted token (0.1 s, its price) costs its
    calibrated forward share and its price, and the fit adds nothing to it. Regression: drafting
    steps' overhead was floored at nothing while plain steps' stood at -0.5, and the fit charged
    each drafted token about 0.1 s more (a draft of 4 priced 1.1 s above a plain step, not
    0.7)."""
    c = DraftController(8, {1: [[0, 1.5], [8, 1.5 + 8 * 0.075]]}, packed=True, draft_cost=lambda batch_size: 0.1)
    for i in range(300):
        drafted = (0, 2, 4, 6)[i % 4]
        c.observe_step(1, 1 + drafted, 1.0 + 0.05 * drafted + 0.1 * drafted, drafted)
    assert abs(c.step_cost(1, 1) - 1.0) < 0.01
    assert abs(c.step_cost(1, 1 + 4) - c.step_cost(1, 1) - (4 * 0.075 + 4 * 0.1)) < 0.03


def test_drafted_tokens_cost_what_they_cost_when_every_step_drafts():
    """Regression: plain steps' overhead was a mean of plain steps and the drafting overhead one of
    drafting steps beyond it. Where every step drafted (16 rows) the plain mean went stale (here:
    a slower phase before), the drafting one came out negative to make up, and drafted tokens
    looked far cheaper than they were. One fit of all steps gets each drafted token's cost."""
    c = DraftController(8, {8: [[0, 1.0], [64, 1.64]]}, packed=True)
    for _ in range(100):
        c.observe_step(8, 8, 1.0 + 0.5)                  # plain steps in a slow phase
    for i in range(200):
        drafted = 4 + i % 17
        c.observe_step(8, 8 + drafted, 1.0 + 0.01 * drafted + 0.1 + 0.02 * drafted)
    per_token = (c.step_cost(8, 8 + 20) - c.step_cost(8, 8 + 10)) / 10
    assert abs(per_token - 0.03) < 0.003
    assert abs(c.step_cost(8, 8 + 12) - (1.12 + 0.1 + 0.24)) < 0.02


def test_one_good_draft_among_many_rows_is_verified():
    """The margin drafting must clear is per drafted token, not per step: at 32 rows one row's draft
    that is nearly always accepted pays for its own cost (regression: a step-wide 3% margin asked
    for several such drafts in one step, and drafts accepted 94% of the time went unverified).
    A draft that gains a little less than its own cost's worth of plain tokens is not verified."""
    c = DraftController(8, {32: [[0, 1.0], [256, 1.0 + 256 * 0.02]]}, packed=True)   # a drafted token: 2% of a step
    rows = list(range(32))
    for _ in range(30):
        c.observe(0, 1, 1, 1)          # row 0: every draft accepted
        c.observe(1, 1, 1, 0)          # row 1: two in three accepted
        c.observe(1, 1, 1, 1)
        c.observe(1, 1, 1, 1)
    assert c.draft_lengths(rows, 32, available=[1] + [0] * 31) == [1] + [0] * 31
    # row 1's draft gains more than it costs (a plain step's 32 tokens a second against 1 / 0.02 per
    # accepted drafted token), but less than MIN_RETURN = 1.2 times that
    assert 32 < c.acceptance(1) / 0.02 < 1.2 * 32
    assert c.draft_lengths(rows, 32, available=[0, 1] + [0] * 30) == [0] * 32


def test_new_sequences_start_at_the_population_rate():
    """Where every sequence's drafts were mostly accepted, a new sequence's estimate starts there,
    not at the static prior of one half; where they were rejected, it keeps the static prior (so
    it is probed)."""
    c = DraftController(4, {1: [1.0] * 5})
    for s in range(20):
        for _ in range(5):
            c.observe(s, 4, 4, 4)
    assert c.acceptance(100) > 0.9 and c.follow_rate(100) > 0.9
    bad = DraftController(4, {1: [1.0] * 5})
    for _ in range(100):
        bad.observe(0, 4, 4, 0)
    assert bad.acceptance(100) == 0.5


def test_a_drafter_priced_out_by_the_priors_is_measured_first():
    """Drafted tokens that cost half a plain step never pay at the static prior (one half), so
    without probing no draft is ever verified and the drafter's real rate is never seen. The
    first steps (about PROBE_DRAFTS: the pool's counts decay) draft one token; a drafter accepted
    every time then drafts on its measured rate, one accepted 10% of the time stops."""
    costly = {1: [1.0 + 0.5 * k for k in range(9)]}
    assert DraftController(8, costly).acceptance(0) == 0.5
    for accepted, drafts_after in ((True, True), (False, False)):
        c = DraftController(8, costly)
        probes = 0
        while c.num_draft([probes], 1) > 0 and probes < 100:
            c.observe(probes, 8, 1, int(accepted or probes % 10 == 9))
            c.end(probes)
            probes += 1
        assert PROBE_DRAFTS <= probes < 2 * PROBE_DRAFTS if not accepted else probes == 100
        assert (c.num_draft([1000], 1) > 0) == drafts_after


def test_a_row_drafts_only_where_drafting_repays_its_setup():
    """A row that must first pay seconds of setup (a draft model reading the tokens it skipped)
    drafts where its remaining tokens' savings repay them, and not elsewhere; the batch's length
    stands for the others. Untimed, setups are not weighed."""
    c = DraftController(8, {2: [1.0 + 0.2 * k for k in range(9)]})
    for _ in range(10):
        for s in (0, 1):
            c.observe(s, 8, 8, 8)
    k = c.num_draft([0, 1], 2)
    assert k > 0
    # a plain step of 2 rows costs 1 s: a token saves under half a second
    assert c.row_lengths([0, 1], 2, [0.0, 1.0], [100, 100]) == [k, k]
    assert c.row_lengths([0, 1], 2, [0.0, 100.0], [100, 100]) == [k, 0]
    assert c.row_lengths([0, 1], 2, [0.0, 1.0], [1, 1]) == [k, 0]
    assert 0.0 < c.saving[2] < 0.5
    assert c.pays_setup(1.0, 100, 2, 7) and not c.pays_setup(100.0, 100, 2, 7)
    untimed = DraftController(8)
    assert untimed.row_lengths([0, 1], 1, [0.0, 1e9], [1, 1]) == [8, 8] and untimed.pays_setup(1e9, 1, 1, 7)


def test_a_setup_is_weighed_at_the_batch_about_to_run():
    """Two rows decode while two more cache their prompts (load 4): drafting pays at 2 rows and
    not at 4, so the row that would first pay a setup (a draft model reading its skipped tokens)
    is not set up, since its tokens will mostly come in the batch of 4; the row already set up
    still drafts. Without a larger load, or while the drafter is probed, the batch's own saving
    decides as before."""
    costs = {2: [1.0 + 0.02 * k for k in range(9)], 4: [1.0 + 1.0 * k for k in range(9)]}
    c = DraftController(8, costs)
    for _ in range(10):
        for s in (0, 1):
            c.observe(s, 8, 8, 8)
    assert not c.probing
    k = c.num_draft([0, 1], 2)
    assert k > 0 and c.num_draft([0, 1], 4) == 0
    assert c.row_lengths([0, 1], 2, [0.0, 0.1], [100, 100]) == [k, k]
    assert c.row_lengths([0, 1], 2, [0.0, 0.1], [100, 100], load=2) == [k, k]
    assert c.row_lengths([0, 1], 2, [0.0, 0.1], [100, 100], load=4) == [k, 0]
    probed = DraftController(8, costs)
    assert probed.probing
    assert probed.row_lengths([0, 1], 2, [0.0, 0.1], [100, 100], load=4) == \
        probed.row_lengths([0, 1], 2, [0.0, 0.1], [100, 100])


def test_a_load_not_run_yet_weighs_setups_at_the_pools_rates():
    """Before any decision at a batch size, while the drafter is probed, one sequence at a time is
    set up on trust (a server's first burst caches one prompt in the draft model, not every
    one); once drafts were measured, setups are weighed at the saving sequences at the pool's
    rates would see there: at a load where drafting cannot pay no prompt is cached."""
    c = DraftController(8, {1: [1.0 + 0.02 * k for k in range(9)], 4: [1.0 + 1.0 * k for k in range(9)]})
    assert c.pays_setup(1e9, 100, 4, 0)
    assert not c.pays_setup(1e-3, 100, 4, 1)        # another of the burst: priced, and it does not pay
    c.end(0, 50)
    assert c.pays_setup(1e9, 100, 4, 2)             # the probed sequence ended: the next is trusted
    for s in range(20):
        c.observe(s, 8, 4, 3)
    assert not c.probing and not c.saving
    assert not c.pays_setup(1e-3, 100, 4, 3)
    assert c.pays_setup(1e-3, 100, 1, 3) and not c.pays_setup(1e9, 100, 1, 3)


def test_a_row_that_does_not_pay_to_draft_pays_no_setup():
    """Where drafting loses (every draft rejected), a row's saving is nothing, so any setup is
    refused, a probe's included: a probe is for a row that is ready to draft."""
    c = DraftController(8, STEEP)
    for _ in range(20):
        c.observe(0, 8, 8, 0)
    assert c.row_lengths([0], 1, [1e-6], [1000]) == [0] and c.saving[1] == 0.0
    assert not c.pays_setup(1e-6, 1000, 1, 0)


def test_remaining_tokens_follow_finished_sequences():
    c = DraftController(8, FLAT)
    assert c.remaining(0, 500) == 500
    for s in range(20):
        c.end(s, 40)
    assert c.remaining(0, 500) == pytest.approx(40) and c.remaining(30, 500) == pytest.approx(10)
    assert c.remaining(100, 500) == pytest.approx(10) and c.remaining(0, 16) == 16


def test_sequences_cut_at_their_max_tokens_do_not_shorten_longer_ones():
    """A sequence that ended at its max_tokens says only that it would have gone on at least that
    long. Regression: a benchmark's two warm-up requests of 8 tokens made a 256-token request look
    8 tokens from its end, so a draft model's prompt setup was never repaid and it never drafted."""
    c = DraftController(8, FLAT)
    for s in range(2):
        c.end(s, 8, cut=True)
    assert c.remaining(0, 256) == 256
    c.end(2, 40)                    # one ended on its own: all their tokens over that one end
    assert c.remaining(0, 256) == pytest.approx((8 * 0.95 ** 2 + 8 * 0.95 + 40) / 1.0)


def test_drafting_overhead_is_not_charged_to_plain_steps():
    """Plain steps measured 0.1 above the calibration, the few drafting steps 0.2 more a drafted
    token. Regression: the fit's slope, shrunk toward none while drafting steps were few, left
    the rest in the intercept, so a plain step was charged about a third more than it cost and
    drafting looked that much better (a draft model on a 2-core CPU expected three times the
    saving it got)."""
    c = DraftController(8, {1: [[0, 1.0], [8, 1.8]]}, packed=True)
    for i in range(120):
        drafted = 0 if i % 4 else 1 + i % 3
        c.observe_step(1, 1 + drafted, 1.0 + 0.1 * drafted + 0.1 + 0.2 * drafted)
    assert abs(c.step_cost(1, 1) - 1.1) < 0.01
    assert c.step_cost(1, 3) - c.step_cost(1, 1) > 2 * 0.1 + 0.1      # the forward's share and part of the overhead


def test_trees_or_chains_whichever_yields_more_tokens_a_second():
    """A tree drafter's steps draft one shape per batch bucket, chains first, and try the other
    every 16 drafting steps; the other takes over only where its probes beat the drafted shape's
    neighbouring steps clearly, and one slow step decides nothing. Untimed, trees as asked."""
    assert DraftController(8, None, tree_width=3).step_tree_width(1) == 3
    assert DraftController(8, FLAT).step_tree_width(1) == 1

    def run(c, steps, tokens, seconds=lambda width: 0.01):
        widths = []
        for _ in range(steps):
            width = c.step_tree_width(1)
            widths.append(width)
            c.observe_shape(1, width, tokens(width), seconds(width))
        return widths
    c = DraftController(8, FLAT, tree_width=3)
    widths = run(c, 170, lambda width: 3 if width == 1 else 2)         # chains yield more
    assert widths[:17] == [1] * 16 + [3] and widths.count(3) == 10   # trees tried every 17th step
    widths = run(c, 170, lambda width: 3 if width == 1 else 3.3)       # trees 10% ahead: not clear
    assert widths.count(3) == 10
    widths = run(c, 100, lambda width: 3 if width == 1 else 4)         # trees 33% ahead: they take over
    assert widths[-30:].count(3) > 27
    slow = run(c, 1, lambda width: 4, lambda width: 10.0)              # one tree step 1000 times slower
    assert slow == [3] and run(c, 40, lambda width: 3 if width == 1 else 4)[-16:].count(3) >= 15
    assert c.shapes.keys() == {1}                                      # one bucket (FLAT's) for all sizes


def test_trees_drafted_every_step_are_sized_by_the_depths_they_reach():
    """Where every step drafts trees (tree_depth: a head's frontier of 4, depth 2 for 2-4 nodes, 3
    for 5-8, 4 for 9-12), no chains are tried, a tree's acceptance counts against the depth it
    reached, and budgets land where a node reaches a new depth. A tree of 4 nodes accepted 2 deep
    each step is a chain whose every position was accepted, not one rejected at positions 3 and
    4: the controller drafts deeper trees than a chain's positions would let it, and a tree that
    stops at depth 1 stays at one node."""
    from outpace.speculative.head_graphs import frontier_depth
    depth = lambda nodes: frontier_depth(nodes, 4)
    cost = {1: [1.0 + 0.05 * k for k in range(13)]}
    trees, chains = DraftController(12, cost, tree_width=4, tree_depth=depth), DraftController(12, cost)
    assert trees.step_tree_width(1) == 4
    for _ in range(20):
        for c in (trees, chains):
            c.observe(0, 4, 4, 2)
    # counted as a chain's 4 positions, 2 of them rejected, the same steps would give 2 nodes
    assert trees.num_draft([0], 1) == 9 > chains.num_draft([0], 1)
    shallow = DraftController(12, cost, tree_width=4, tree_depth=depth)
    for _ in range(20):
        shallow.observe(0, 4, 4, 1)
    assert shallow.num_draft([0], 1) <= 1


def test_decisions_asked_again_within_a_step_follow_new_evidence():
    """The controller answers a step's repeated questions from what it worked out for the first,
    until new evidence arrives: a controller asked between observations decides as one that was
    not."""
    asked, fresh = DraftController(8, STEEP), DraftController(8, STEEP)
    for step in range(12):
        assert asked.num_draft([0, 1], 2) == asked.num_draft([0, 1], 2)
        asked.row_lengths([0, 1], 2, [0.0, 0.5], [100.0, 100.0])
        for c in (asked, fresh):
            c.observe(0, 8, 8, 8 if step < 6 else 0, match_len=2)
            c.observe(1, 0, 0, 0)
        assert asked.num_draft([0, 1], 2) == fresh.num_draft([0, 1], 2)
        assert asked.draft_lengths([0, 1], 2, [3, 5], [2, 0]) == fresh.draft_lengths([0, 1], 2, [3, 5], [2, 0])
    c = DraftController(8, STEEP)
    for _ in range(30):
        c.observe(1, 8, 8, 8)                   # the pool accepts: a new sequence would draft
    for _ in range(20):
        c.observe(0, 8, 8, 0)
    assert c.num_draft([0], 1) == 0 < c.num_draft([99], 1)
    c.end(0)
    assert c.num_draft([0], 1) == c.num_draft([99], 1)     # an ended sequence starts afresh


def test_a_later_position_priced_out_by_the_prior_is_measured_too():
    """Each drafted token costs 0.7 of a plain step: a second one pays at a high follow rate but not
    at the prior's 0.7, so a controller that drafted only what its estimates paid for drafted one
    token a step for good and never saw its drafts' later rate. While fewer than PROBE_DRAFTS drafts
    reached the position past a step's length, the step drafts it too: a drafter accepted every
    time then works up to whole drafts, one whose second tokens are always rejected goes back to
    one token after about PROBE_DRAFTS probes."""
    costly = {1: [1.0 + 0.7 * k for k in range(9)]}
    for later_accepted in (True, False):
        c = DraftController(8, costly)
        lengths = []
        for step in range(60):
            k = c.num_draft([0], 1)
            lengths.append(k)
            c.observe(0, 8, k, k if later_accepted else min(k, 1))
        if later_accepted:
            assert lengths[-10:] == [8] * 10
        else:
            assert lengths[-10:] == [1] * 10
            assert PROBE_DRAFTS <= lengths.count(2) < 2 * PROBE_DRAFTS
