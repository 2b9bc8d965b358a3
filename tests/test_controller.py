"""The draft controller: drafts when it pays, stops when it does not, and probes again later."""
from outpace.spec.controller import DraftController

FLAT = {1: [1.0] * 9}
STEEP = {1: [1.0 + 0.2 * k for k in range(9)]}     # each drafted token costs a fifth of a plain step


def test_drafts_the_most_when_verification_is_free():
    assert DraftController(8, FLAT).num_draft([0], 1) == 8


def test_no_draft_when_acceptance_cannot_pay_for_it():
    c = DraftController(8, STEEP)
    for _ in range(20):
        c.observe(0, 8, 0)
    assert c.num_draft([0], 1) == 0


def test_accepting_sequences_draft_more_than_rejecting_ones():
    c = DraftController(8, {1: [1.0 + 0.1 * k for k in range(9)]})
    for _ in range(10):
        c.observe(1, 8, 8)
        c.observe(2, 8, 1)
    assert c.num_draft([1], 1) > c.num_draft([2], 1)


def test_switched_off_sequence_is_probed_again():
    """Regression: once a sequence's estimate fell to zero drafts, no draft meant no new evidence,
    and speculation stayed off for the rest of the sequence."""
    c = DraftController(8, STEEP)
    for _ in range(20):
        c.observe(0, 8, 0)
    assert c.num_draft([0], 1) == 0
    steps = 0
    while c.num_draft([0], 1) == 0 and steps < 100:
        c.observe(0, 0, 0)
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
        c.observe(0, 8, 2)
        for s in range(1, 8):
            c.observe(s, 8, 0)
    assert c.num_draft([0], 1) >= 6
    assert c.num_draft(list(range(8)), 8) <= 1
    for s in range(1, 8):
        for _ in range(10):
            c.observe(s, 8, 8)
    assert c.num_draft(list(range(8)), 8) == 8
