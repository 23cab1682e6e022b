"""At-least-once bookkeeping without a broker: OffsetTracker, QuestionLedger and Watermarks on exact offsets."""

import pytest

from consumers.intake.backpressure import Watermarks
from consumers.intake.ledger import Admission, QuestionLedger
from consumers.messages import Partition, Position, QuestionKey
from consumers.intake.offsets import OffsetRegression, OffsetTracker
from schemas.principal import ANONYMOUS, Principal

P0 = Partition("kev.questions", 0)
P1 = Partition("kev.questions", 1)


def tracked(*offsets: int, partition: Partition = P0) -> OffsetTracker:
    tracker = OffsetTracker()
    for offset in offsets:
        tracker.track(partition, offset)
    return tracker


def test_nothing_is_committable_until_an_outcome_is_acked():
    tracker = tracked(0, 1, 2)
    assert tracker.committable() == {}
    assert tracker.in_flight() == 3


def test_in_flight_at_counts_one_partition_s_unacked_records_done_out_of_order_or_not():
    tracker = tracked(0, 1, 2)
    tracker.track(P1, 5)
    tracker.done(P0, 2)  # behind unfinished 0 and 1: not committable, but no longer in flight
    assert (tracker.in_flight_at(P0), tracker.in_flight_at(P1)) == (2, 1)
    assert tracker.in_flight_at(Partition("kev.questions", 7)) == 0


def test_commit_position_is_offset_plus_one_of_the_last_contiguous_done():
    tracker = tracked(0, 1, 2)
    tracker.done(P0, 0)
    assert tracker.committable() == {P0: 1}
    tracker.done(P0, 1)
    assert tracker.committable() == {P0: 2}


def test_a_later_offset_finishing_first_does_not_move_the_position():
    tracker = tracked(10, 11, 12, 13)
    tracker.done(P0, 12)
    tracker.done(P0, 13)
    assert tracker.committable() == {}
    tracker.done(P0, 10)
    assert tracker.committable() == {P0: 11}
    tracker.done(P0, 11)
    assert tracker.committable() == {P0: 14}
    assert tracker.in_flight() == 0


def test_gaps_between_offsets_are_fine():
    tracker = tracked(3, 7, 20)  # compacted topics and control records leave holes
    for offset in (20, 3, 7):
        tracker.done(P0, offset)
    assert tracker.committable() == {P0: 21}


def test_partitions_are_independent():
    tracker = tracked(0, 1)
    tracker.track(P1, 5)
    tracker.done(P1, 5)
    tracker.done(P0, 1)
    assert tracker.committable() == {P1: 6}


def test_committed_positions_are_not_offered_again():
    tracker = tracked(0, 1)
    tracker.done(P0, 0)
    tracker.mark_committed(tracker.committable())
    assert tracker.committable() == {}
    tracker.done(P0, 1)
    assert tracker.committable() == {P0: 2}


def test_a_smaller_commit_position_raises():
    tracker = tracked(0, 1, 2)
    for offset in (0, 1, 2):
        tracker.done(P0, offset)
    tracker.mark_committed({P0: 3})
    with pytest.raises(OffsetRegression, match="commit 2 after 3"):
        tracker.mark_committed({P0: 2})


def test_tracking_an_offset_that_is_not_newer_raises():
    tracker = tracked(4, 5)
    with pytest.raises(OffsetRegression):
        tracker.track(P0, 5)
    with pytest.raises(OffsetRegression):
        tracker.track(P0, 3)


def test_tracking_behind_the_commit_position_raises():
    tracker = tracked(4)
    tracker.done(P0, 4)
    with pytest.raises(OffsetRegression):
        tracker.track(P0, 4)


def test_done_is_false_for_unknown_or_repeated_offsets():
    tracker = tracked(0)
    assert tracker.done(P0, 0) is True
    assert tracker.done(P0, 0) is False
    assert tracker.done(P0, 99) is False
    assert tracker.done(P1, 0) is False
    assert tracker.committable() == {P0: 1}


def test_forget_returns_the_revoked_partitions_positions_and_drops_their_state():
    tracker = tracked(0, 1, 2)
    tracker.track(P1, 0)
    tracker.done(P0, 0)
    tracker.done(P1, 0)
    assert tracker.forget([P0]) == {P0: 1}
    assert tracker.partitions() == {P1}
    assert tracker.done(P0, 1) is False  # an ack arriving after the revocation changes nothing
    tracker.track(P0, 1)  # reassigned: fetching restarts at the commit point
    tracker.done(P0, 1)
    assert tracker.committable() == {P0: 2, P1: 1}


def test_forget_leaves_out_positions_already_committed():
    tracker = tracked(0)
    tracker.done(P0, 0)
    tracker.mark_committed({P0: 1})
    assert tracker.forget([P0, P1]) == {}


def key(question_id: str, principal: Principal = ANONYMOUS) -> QuestionKey:
    return QuestionKey(principal, question_id)


def test_ledger_answers_a_question_once():
    ledger = QuestionLedger()
    first, redelivered, retried = Position("q", 0, 5), Position("q", 0, 5), Position("q", 1, 9)
    assert ledger.admit(key("a"), b"same", first) is Admission.NEW
    assert ledger.admit(key("a"), b"same", redelivered) is Admission.IN_FLIGHT
    assert ledger.admit(key("a"), b"same", retried) is Admission.IN_FLIGHT
    assert ledger.finish(key("a")) == [redelivered, retried]
    assert ledger.admit(key("a"), b"same", Position("q", 0, 12)) is Admission.ANSWERED
    assert ledger.in_flight() == 0


def test_ledger_keys_on_who_asked_and_tells_a_changed_question_from_a_redelivery():
    ledger = QuestionLedger()
    tenant = Principal("gw", "acme")
    assert ledger.admit(key("order-42"), b"attacker", Position("q", 0, 0)) is Admission.NEW
    assert ledger.admit(key("order-42", tenant), b"tenant", Position("q", 0, 1)) is Admission.NEW  # not a duplicate
    assert ledger.admit(key("order-42", Principal("gw", "other")), b"tenant", Position("q", 0, 2)) is Admission.NEW
    # The same principal and id with other bytes: a conflict, before and after the first is answered; the
    # first keeps its waiting redeliveries and its digest.
    assert ledger.admit(key("order-42", tenant), b"changed", Position("q", 0, 3)) is Admission.CONFLICT
    assert ledger.waiting(key("order-42", tenant)) == []
    assert ledger.finish(key("order-42", tenant)) == []
    assert ledger.admit(key("order-42", tenant), b"changed", Position("q", 0, 4)) is Admission.CONFLICT
    assert ledger.admit(key("order-42", tenant), b"tenant", Position("q", 0, 5)) is Admission.ANSWERED
    assert ledger.admit(QuestionKey(tenant, "order-42", sample=1), b"tenant", Position("q", 0, 6)) is Admission.NEW


def test_ledger_forgets_the_least_recently_seen_beyond_capacity():
    ledger = QuestionLedger(capacity=2)
    for question_id in ("a", "b"):
        ledger.admit(key(question_id), b"v", Position("q", 0, 0))
        ledger.finish(key(question_id))
    assert ledger.admit(key("a"), b"v", Position("q", 0, 1)) is Admission.ANSWERED  # "a" is now the most recent
    ledger.admit(key("c"), b"v", Position("q", 0, 2))
    ledger.finish(key("c"))
    assert ledger.answered() == 2
    assert ledger.admit(key("b"), b"v", Position("q", 0, 3)) is Admission.NEW
    assert ledger.admit(key("a"), b"v", Position("q", 0, 4)) is Admission.ANSWERED


def test_watermarks_pause_at_high_and_resume_only_at_low():
    marks = Watermarks(high=8, low=4)
    assert [marks.update(used) for used in (0, 7, 8, 6, 5, 4, 5, 8)] == [
        False, False, True, True, True, False, False, True]


def test_watermarks_default_to_full_and_half_of_the_buffer():
    marks = Watermarks.for_buffer(16)
    assert (marks.high, marks.low) == (16, 8)
    unbuffered = Watermarks.for_buffer(0)  # a rendezvous stream: the blocking send is the backpressure
    assert unbuffered.update(0) is False
    with pytest.raises(ValueError, match="bounded"):
        Watermarks.for_buffer(float("inf"))
