"""shm:// pieces without a consumer: size classes, slot reuse and retirement, the acknowledgement seam."""

from __future__ import annotations

import os
import socket

import msgpack
import pytest

from tensorbus.ledger import Ledger
from tensorbus.transports import shm_control as control
from tensorbus.transports.base import Delivered
from tensorbus.transports.shm_control import URGENT_BYTES, URGENT_COUNT, Acknowledgements
from tensorbus.transports.shm_segments import MIB, MIN_SLOT, Slots, slot_size

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd segments are Linux's")


def nothing(size: int) -> None:
    """A `reclaim` that gives nothing back."""


def test_size_classes() -> None:
    assert slot_size(1) == MIN_SLOT and slot_size(4097) == 8192 and slot_size(MIB) == MIB
    assert slot_size(MIB + 1) == 2 * MIB and slot_size(256 * MIB + 300) == 257 * MIB


def test_a_slot_given_back_is_reused_and_a_retired_segment_is_dropped_once_idle() -> None:
    slots = Slots(pooled_bytes=1 << 30)
    first = slots.take(5000, nothing)
    first.segment.array[first.offset] = 7  # (writable on the producer's side)
    slots.give_back(first)
    again = slots.take(5000, nothing)
    assert (again.segment, again.offset) == (first.segment, first.offset)
    other = slots.take(5000, nothing)
    slots.retire(again.segment)
    assert slots.take(5000, nothing).segment is not again.segment  # never written again
    slots.give_back(again)
    assert again.segment.seg_id in slots.segments  # `other` still uses it
    slots.give_back(other)
    assert again.segment.seg_id not in slots.segments and again.segment.fd == -1
    assert slots.dropped == [again.segment.seg_id]
    slots.close()


def test_idle_segments_past_the_pool_bound_are_dropped() -> None:
    slots = Slots(pooled_bytes=0)
    big = slots.take(2 * MIB, nothing)
    slots.give_back(big)
    assert slots.segments == {} and slots.dropped == [big.segment.seg_id]


def test_the_run_ahead_of_the_size_sent_last_is_kept_past_the_pool_bound() -> None:
    slots = Slots(pooled_bytes=4 * MIB, run_ahead=4)  # 3 MiB frames: one slot (a 3 MiB segment) each
    burst = [slots.take(3 * MIB, nothing) for _ in range(5)]
    for slot in burst:
        slots.give_back(slot)
    assert len(slots.segments) == 4  # the fifth is past the run-ahead: dropped
    kept = set(slots.segments)
    again = [slots.take(3 * MIB, nothing) for _ in range(4)]  # the next burst makes no segment
    assert {slot.segment.seg_id for slot in again} == kept and len(slots.dropped) == 1
    for slot in again:
        slots.give_back(slot)
    other = slots.take(MIB, nothing)  # another size sent last: the idle ones past the bound go
    slots.give_back(other)
    assert sum(s.size for s in slots.segments.values()) <= 4 * MIB
    slots.close()


def test_reclaim_is_asked_before_a_new_segment_is_made() -> None:
    slots = Slots(pooled_bytes=1 << 30)
    whole = slots.take(3 * MIB, nothing)  # one slot per segment at this size
    asked: list[int] = []
    slots.take(3 * MIB, lambda size: (asked.append(size), slots.give_back(whole)))
    assert asked == [3 * MIB] and len(slots.segments) == 1  # what reclaim gave back was taken
    slots.close()


def test_acknowledgements_turn_the_ledger_and_the_views_into_control_messages() -> None:
    pokes: list[int] = []
    acks = Acknowledgements(Ledger("take"), lambda: pokes.append(1))
    acks.viewed(1, 100)
    acks.record(1, Delivered(("p", 1), True, admitted=True), 100)
    acks.record(2, Delivered(("p", 2), False), 100)  # chunks missing: not received
    assert acks.pending() == [["ack", 2, [], []]]  # cumulative: position 1 is in the table, 2 is not
    assert acks.pending() == []  # nothing new
    assert acks.pinned.total == 0  # viewed, in the table: max_buffered_bytes counts it, not max_pinned_bytes
    acks.stream._ledger.taken(("p", 1))
    assert acks.pinned.total == 100  # the application has it
    acks.unviewed(1, 100)
    assert acks.pinned.total == 0 and acks.owed() and pokes == []  # batched: nothing urgent yet
    assert not acks.urgent()
    unsent = acks.pending()
    assert unsent == [["ack", 2, [1], [1]]] and acks.owed()  # owed until the thread says it sent them
    acks.requeue(unsent)  # (the producer's socket was full)
    acks.sent()
    assert acks.owed() and acks.pending() == unsent
    acks.sent()
    assert not acks.owed()
    for pos in range(3, 3 + URGENT_COUNT):
        acks.unviewed(pos, 0)
    assert pokes and acks.urgent()  # enough frees wake the thread, and go with its next step


def test_a_closed_connections_viewed_frames_count_from_its_end_and_each_view_once() -> None:
    acks = Acknowledgements(Ledger("take"), lambda: None)
    for pos, nbytes in ((1, 10), (2, 20), (3, 40)):
        acks.viewed(pos, nbytes)
        acks.record_admitted(pos, ("p", pos), nbytes)
    acks.stream._ledger.taken(("p", 1))
    acks.unviewed(2, 20)  # dropped untaken (a duplicate, say): never counted
    assert acks.pinned.total == 10
    acks.close()  # the ledger will release nothing more of this connection: what is still viewed counts now
    assert acks.pinned.total == 50
    acks.stream._ledger.taken(("p", 3))  # (a take after the end releases nothing)
    acks.unviewed(3, 40)
    acks.unviewed(1, 10)
    assert acks.pinned.total == 0


def test_a_megabyte_received_makes_the_ack_urgent() -> None:
    acks = Acknowledgements(Ledger("take"), lambda: None)
    acks.record_admitted(1, ("p", 1), URGENT_BYTES - 1)  # (the C delivery's frame: booked as `record` books it)
    assert not acks.urgent() and acks.pending() == [["ack", 2, [], []]]
    acks.record_admitted(2, ("p", 2), URGENT_BYTES // 2)
    acks.record_admitted(3, ("p", 3), URGENT_BYTES // 2)
    assert acks.urgent()  # the producer's credit: a megabyte since the last answer goes at the next step
    assert acks.pending() == [["ack", 4, [], []]] and not acks.urgent()


def test_a_kept_packer_sends_the_bytes_a_fresh_one_does_message_after_message() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        kept = control.packer()
        for message in (["frame", 1, 2, 0, 4096], ["frame", 2**40, 7, 1 << 30, 64], ["drop", 3]):
            control.send(a, *message)
            control.send(a, *message, by=kept)
            fresh, reused = b.recv(1 << 16), b.recv(1 << 16)
            assert fresh == reused and msgpack.unpackb(reused) == message
