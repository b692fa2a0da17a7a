"""Prefill -> decode handoffs: copying and zero-copy, acknowledgement, expiry
reclaimed by the node agent, with real processes in plain and simulator modes."""
from __future__ import annotations

import time

import numpy as np
import pytest

from agents import RunningAgent
from index_check import check_index
from procs import Worker
from tract_cli.core.errors import HandoffError
from tract_cli.core.handoff import Ticket
from tract_cli.core.locks import LOCK_ALLOCATOR
from tract_cli.core.native import lib
from tract_cli.core.pool import Pool


@pytest.fixture
def region(region_path):
    Pool.create(region_path, 8 << 20, "tiny", nodes=4, index_stripes=8,
                transfer_entries=16).close()
    return region_path


def pins_and_records(path: str) -> tuple[int, int]:
    """(total pins in the index, transfer records in use)."""
    with Pool.attach(path, readonly=True) as p:
        pins = p.info.section("pins")
        total = int(np.frombuffer(p.observe(pins.offset, pins.length), np.uint16).sum())
        tr = p.info.section("transfer")
        raw = p.observe(tr.offset, tr.length)
        used = sum(1 for i in range(tr.count) if int.from_bytes(raw[i * 128:i * 128 + 4], "little"))
    return total, used


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
@pytest.mark.parametrize("zero_copy", [False, True], ids=["copying", "zero-copy"])
def test_handoffs_between_processes(region, simulate, zero_copy):
    chains = [(5, 3, 40 + i, 9) for i in range(4)]      # shared 3-block prefix
    with RunningAgent(region, 0, manager=True, simulate=simulate):
        with Worker(region, 1, simulate) as prefill, Worker(region, 2, simulate) as decode:
            for i, chain in enumerate(chains):
                ticket = prefill.call("handoff_publish", chain=list(chain), request=f"req-{i}")
                assert ticket["blocks"] == 9 and ticket["tokens"] == 9 * 16 + 8
                assert pins_and_records(region) == (9, 1)       # pinned while in flight
                got = decode.call("handoff_receive", ticket=ticket, chain=list(chain),
                                  request=f"req-{i}", zero_copy=zero_copy)
                assert got == 9
                assert pins_and_records(region) == (0, 0)       # released on ack
    check_index(region)


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_a_handoff_is_found_by_its_name_from_another_node(region, simulate):
    """A paired decode finds its prefill's record by the name both were given
    (Handoffs.find: one pass over the table, no lock, from another node): a
    PUBLISHED record and a RESERVED one (its publish to come) are found, a
    name asked for twice is answered twice; a record acknowledged, or a name
    no record holds, is not found."""
    with RunningAgent(region, 0, manager=True, simulate=simulate):
        with Worker(region, 1, simulate) as prefill, Worker(region, 2, simulate) as decode:
            names = ["published", "reserved", "acked", "never", "published"]
            assert decode.call("handoff_find", requests=names) == [-1] * 5
            pub = prefill.call("handoff_publish", chain=[5, 0, 50, 4], request="published")
            reserved = prefill.call("handoff_reserve", request="reserved")
            acked = prefill.call("handoff_publish", chain=[6, 0, 60, 4], request="acked")
            assert len({pub["record"], reserved, acked["record"]}) == 3
            assert decode.call("handoff_receive", ticket=acked, chain=[6, 0, 60, 4],
                               request="acked") == 4
            assert decode.call("handoff_find", requests=names) == \
                [pub["record"], reserved, -1, -1, pub["record"]]
            assert decode.call("handoff_receive", ticket=pub, chain=[5, 0, 50, 4],
                               request="published") == 4
            assert prefill.call("handoff_unreserve", record=reserved, request="reserved")
            assert decode.call("handoff_find", requests=names) == [-1] * 5
            assert pins_and_records(region) == (0, 0)
    check_index(region)


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_a_lost_handoff_is_a_record_of_no_blocks_its_decode_finds_and_gives_back(region,
                                                                               simulate):
    """What a prefill whose handoff will not be published leaves under the
    pair's name (Handoffs.publish_lost): found by that name from another node,
    opened as lost (never as blocks to load, whatever the decode expects), and
    given back by the decode's acknowledgement: no pin and no record left."""
    with RunningAgent(region, 0, manager=True, simulate=simulate):
        with Worker(region, 1, simulate) as prefill, Worker(region, 2, simulate) as decode:
            lost = prefill.call("handoff_publish_lost", request="pair-lost")
            assert (lost["blocks"], lost["tokens"]) == (0, 0)
            assert decode.call("handoff_find", requests=["pair-lost"]) == [lost["record"]]
            pub = prefill.call("handoff_publish", chain=[5, 0, 50, 4], request="pair-kept")
            # a record that holds blocks is not lost; the lost one is, and is given back
            assert decode.call("handoff_open", record=pub["record"], request="pair-kept",
                               blocks=pub["blocks"], tokens=pub["tokens"]) == "ok"
            assert decode.call("handoff_open", record=lost["record"], request="pair-lost",
                               blocks=9, tokens=144, ack_lost=True) == "lost"
            assert decode.call("handoff_find", requests=["pair-lost", "pair-kept"]) == \
                [-1, pub["record"]]
            assert decode.call("handoff_receive", ticket=pub, chain=[5, 0, 50, 4],
                               request="pair-kept") == 4
            assert pins_and_records(region) == (0, 0)
    check_index(region)


def test_wrong_ticket_and_double_ack_are_errors(region):
    with RunningAgent(region, 0, manager=True):
        with Worker(region, 1) as prefill, Pool.attach(region, node=2) as decode:
            ticket = Ticket.from_dict(prefill.call("handoff_publish", chain=[1, 0, 2, 4],
                                                   request="r"))
            forged = Ticket(ticket.record, "00" * 16, ticket.blocks, ticket.tokens)
            with pytest.raises(HandoffError, match="not published"):
                decode.handoffs.open(forged)
            # the lockless check a load's proof rests on: published for this
            # request only, and no longer once acknowledged
            assert decode.handoffs.still_published(ticket)
            assert not decode.handoffs.still_published(forged)
            decode.handoffs.ack(ticket)
            assert not decode.handoffs.still_published(ticket)
            with pytest.raises(HandoffError, match="no longer published"):
                decode.handoffs.ack(ticket)
    with pytest.raises(Exception, match="malformed"):
        Ticket.from_dict({"record": "x"})


def test_expired_handoffs_are_reclaimed(region):
    with RunningAgent(region, 0, manager=True):
        with Worker(region, 1) as prefill, Pool.attach(region, node=2) as p:
            prefill.call("handoff_publish", chain=[7, 0, 8, 5], request="a", ttl=3600)
            assert pins_and_records(region) == (5, 1)
            # not expired yet: nothing to reclaim
            assert p.handoffs.reclaim(now_ns=time.time_ns()) == 0
            # an hour later, the decode side never came: pins and slots come back
            assert p.handoffs.reclaim(now_ns=time.time_ns() + 3601 * 10**9) == 1
            assert pins_and_records(region) == (0, 0)
    check_index(region)


def test_a_reclaim_that_timed_out_on_a_busy_lock_is_resumed_by_the_next(region):
    """Reclaiming frees the record's slots, which are another node's: that
    needs the allocator lock. A reclaim that times out waiting for it leaves
    the record RECLAIMING, in its own name; the next reclaim of the same
    process resumes it (it used to stay RECLAIMING for good, with its slots)."""
    from tract_cli.core.errors import LockTimeout
    with RunningAgent(region, 0, manager=True):
        with Worker(region, 1) as prefill, Worker(region, 3) as holder, \
                Pool.attach(region, node=2) as p:
            prefill.call("handoff_publish", chain=[7, 0, 8, 5], request="a", ttl=3600)
            later = time.time_ns() + 3601 * 10**9
            holder.call("lock_acquire", lock_id=LOCK_ALLOCATOR)
            with pytest.raises(LockTimeout):
                p.handoffs.reclaim(now_ns=later, timeout=0.5)
            assert pins_and_records(region)[1] == 1, "the record waits, RECLAIMING"
            holder.call("lock_release", lock_id=LOCK_ALLOCATOR)
            assert p.handoffs.reclaim(now_ns=later) == 1
            assert pins_and_records(region) == (0, 0)
    check_index(region)


def test_the_agent_reclaims_a_handoff_whose_decode_side_died(region):
    with RunningAgent(region, 0, manager=True):
        with Worker(region, 1) as prefill:
            # the decode process is up before the record is published: its
            # receive is one call inside the record's lifetime, whatever the
            # load (a process started after the publish could miss a short one)
            decode = Worker(region, 2)
            ticket = prefill.call("handoff_publish", chain=[9, 0, 10, 4], request="b", ttl=3.0)
            decode.call("handoff_receive", ticket=ticket, chain=[9, 0, 10, 4], request="b",
                        ack=False)
            decode.kill()                                       # dies without acknowledging
            decode.close()
            deadline = time.monotonic() + 30
            while pins_and_records(region) != (0, 0):
                assert time.monotonic() < deadline, "the agent did not reclaim within 30 s"
                time.sleep(0.05)      # waiting for a timer-based expiry, bounded
    check_index(region)


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_publish_takes_the_next_free_record_and_scans_wrap_around(region_path, simulate):
    """Publish is next fit over the transfer table (the record after the one it
    wrote last, wrapping); its scan and the agent's passes read the table in
    batches (64 records), so a table of 70 crosses a batch boundary."""
    Pool.create(region_path, 8 << 20, "tiny", nodes=2, transfer_entries=70).close()
    with RunningAgent(region_path, 0, manager=True, simulate=simulate), \
            Pool.attach(region_path, node=1, simulate=simulate) as p:
        keys = np.arange(2 * 16, dtype=np.uint8).reshape(2, 16)
        p.index.put(keys, np.zeros((2, p.info.block_bytes), np.uint8))
        pub = lambda rid: p.handoffs.publish(rid, keys, 32, ttl=3600)
        tickets = [pub(f"r{i}") for i in range(70)]
        assert [t.record for t in tickets] == list(range(70))
        with pytest.raises(HandoffError, match="transfer table is full"):
            pub("one too many")
        p.handoffs.ack(tickets[66])
        p.handoffs.ack(tickets[3])
        # the scan starts after record 69: it wraps and takes 3, then goes on to 66
        assert pub("a").record == 3
        assert pub("b").record == 66
        p.handoffs.ack(tickets[67])
        assert pub("c").record == 67
        assert pins_and_records(region_path) == (2 * 70, 70)
        # nothing has expired: a pass over the whole table reclaims nothing
        assert p.handoffs.reclaim(now_ns=time.time_ns()) == 0
        assert p.handoffs.recover() == 0
        # an hour later every record, on both sides of the batch boundary, is reclaimed
        assert p.handoffs.reclaim(now_ns=time.time_ns() + 3601 * 10**9) == 70
        assert pins_and_records(region_path) == (0, 0)
    check_index(region_path)


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
@pytest.mark.parametrize("point", ["RELEASE_INTENT", "RELEASE_PINS", "RELEASE_MARKED"])
def test_an_ack_killed_inside_a_release_gives_back_exactly_its_pins(region, simulate, point):
    """Two handoffs of one chain pin each block twice for the publisher. The
    first one's acknowledger is killed inside its release: with the stripe
    group's intent on the device and its pins not given back (RELEASE_INTENT),
    or given back but not marked in the entries nor the record (RELEASE_PINS),
    or marked in the record, its stripe not yet left (RELEASE_MARKED: the
    resumption skips the group, and no intent is left on its anchor -- `tract
    check` reports one). Its node's
    recovery takes the stripe lock over (its repair finishes the group from
    the intent: each count set to what it was when the group began, minus
    one) and resumes the release: the publisher then holds exactly the second
    handoff's pins -- none given back twice (the resumption skips the entries
    the repair gave back) and none left behind. Without the repair's redo the
    resumption reads the counts afresh, already lowered, and gives the second
    handoff's pins back too."""
    from tract_cli.core.recovery import recover_node
    chain = [3, 0, 21, 12]
    with RunningAgent(region, 0, manager=True, simulate=simulate):
        with Worker(region, 1, simulate) as prefill:
            first = prefill.call("handoff_publish", chain=chain, request="first", ttl=3600)
            second = prefill.call("handoff_publish", chain=chain, request="second", ttl=3600)
            assert pins_and_records(region) == (24, 2)
            dying = Worker(region, 2, simulate,
                           env={"TRACT_DIE_AT": str(getattr(lib, f"TRACT_DIE_{point}"))})
            dying.send("handoff_receive", ticket=first, chain=chain, request="first")
            assert dying.proc.wait(timeout=60) == -9, "the release gave nothing back"
            dying.close()
            if point == "RELEASE_MARKED":
                # marked: the region (before any repair) names no release on
                # any anchor, or a resumption that skips the group could free
                # the key list under a repair still to come
                with Pool.attach(region, readonly=True, prefault=False, local=False) as p:
                    from tract_cli.core.media import ANCHOR_DTYPE
                    ls = p.info.section("lru")
                    anchors = np.frombuffer(p.observe(ls.offset, p.info.index_stripes * 64),
                                            ANCHOR_DTYPE)
                    assert not anchors["release_keys"].any(), anchors["release_keys"]
            with Pool.attach(region, node=2, simulate=simulate) as p:
                got = recover_node(p, orphans=False, timeout=30)
                assert got.locks >= 1 and got.handoffs == 1 and not got.errors, got
            assert pins_and_records(region) == (12, 1)
            with Worker(region, 3, simulate) as decode:
                assert decode.call("handoff_receive", ticket=second, chain=chain,
                                   request="second") == 12
            assert pins_and_records(region) == (0, 0)
    assert check_index(region)["ready"] == 12
    from tract_cli.inspect import check
    with Pool.attach(region, readonly=True, prefault=False, local=False) as p:
        assert check.verify(p, data=True)[0] == []


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_a_handoff_published_with_the_puts_own_pins_pins_nothing_twice(region, simulate):
    """The vLLM connector's in-step publish: the prefill claims its blocks with
    pins (a block already READY, another request's, pinned as it is), commits
    them pinned and publishes the record with those pins, taking none more.
    The record then holds each block once; its acknowledgement leaves nothing
    pinned.  The prefill process dying after the publish gives back nothing:
    its journal forgot the pins when the record took them (recovery giving
    them back would leave the record naming unpinned blocks)."""
    from tract_cli.core.recovery import recover_node
    chain, ready = [5, 3, 61, 9], [5, 3, 60, 4]      # 3 shared blocks READY first
    with RunningAgent(region, 0, manager=True, simulate=simulate):
        prefill = Worker(region, 1, simulate)
        ticket = prefill.call("handoff_publish_pinned", chain=chain, request="pinned",
                              ready=ready)
        assert ticket["blocks"] == 9
        assert pins_and_records(region) == (9, 1)        # one pin a block: the record's
        prefill.proc.kill()
        prefill.proc.wait(timeout=60)
        prefill.close()
        with Pool.attach(region, node=1, simulate=simulate) as p:
            recover_node(p, orphans=False, timeout=30)
        assert pins_and_records(region) == (9, 1)        # the dead publisher's journal: none
        with Worker(region, 2, simulate) as decode:
            assert decode.call("handoff_receive", ticket=ticket, chain=chain,
                               request="pinned") == 9
        assert pins_and_records(region) == (0, 0)
    assert check_index(region)["ready"] == 10


def test_a_pinned_publish_into_a_taken_record_leaves_the_pins_to_give_back(region):
    """The record a pinned publish names is chosen without the lock: taken by
    the time the lock is held, nothing is written and the caller still holds
    its pins (journaled: a death now gives them back); a key not READY is
    refused before anything is written."""
    from procs_child import _chain_keys, handoff_publish_pinned
    from tract_cli.core.errors import BlocksPending, TransferTableFull
    with RunningAgent(region, 0, manager=True), Pool.attach(region, node=1) as p:
        taken = Ticket.from_dict(handoff_publish_pinned(p, [7, 0, 70, 4], "first"))
        assert p.handoffs.peek_free(taken.record) != taken.record
        assert p.handoffs.peek_free(0, skip=range(16)) is None
        with pytest.raises(TransferTableFull, match=f"record {taken.record} is taken"):
            handoff_publish_pinned(p, [8, 0, 80, 4], "second", record=taken.record)
        assert pins_and_records(region) == (8, 1)        # the 4 of "second" still held
        keys = _chain_keys(p, 8, 0, 80, 4)
        p.index.unpin(keys)
        assert pins_and_records(region) == (4, 1)
        status, slots = p.index.reserve(_chain_keys(p, 9, 0, 90, 2), pin=True)
        with pytest.raises(BlocksPending):
            p.handoffs.publish_pinned(p.handoffs.peek_free(), "third",
                                      _chain_keys(p, 9, 0, 90, 2), 32)
        p.index.commit(_chain_keys(p, 9, 0, 90, 2), status, slots, publish=False)
        p.handoffs.ack(taken)
    assert pins_and_records(region) == (0, 0)


def test_a_handoff_naming_a_block_twice_is_refused(region):
    """A release gives one pin back per key-list entry, each counted from the
    owner's count when its stripe section began: a list naming a block twice
    would give back one pin of the two. Chained block hashes never repeat
    within a request, so a publish that names one twice is refused, before
    anything is pinned."""
    from procs_child import _chain_keys, index_put_chains
    from tract_cli.core.errors import UsageError
    with RunningAgent(region, 0, manager=True), Pool.attach(region, node=1) as p:
        index_put_chains(p, [[4, 0, 31, 4]])
        keys = _chain_keys(p, 4, 0, 31, 4)
        twice = np.concatenate([keys, keys[:1]])
        with pytest.raises(UsageError, match="names a block twice"):
            p.handoffs.publish("dup", twice, len(twice) * 16)
        assert pins_and_records(region) == (0, 0)
        t = p.handoffs.publish("once", keys, len(keys) * 16)
        assert pins_and_records(region) == (4, 1)
        p.handoffs.ack(t)
    assert pins_and_records(region) == (0, 0)


def test_an_ack_that_timed_out_partway_is_finished_by_the_same_ack_again(region):
    """An acknowledgement that moved its record to ACKED and then timed out on a
    busy lock (freeing the key list's slot needs the allocator lock) is finished by
    the acknowledging process's retry of it (`resume=True`), from where it stopped
    (it used to answer 'not published' and leave the record, its pins and slots
    until the process died: the vLLM connector retries an ack that timed out); a
    plain ack is never taken for that retry (it proves a load outlived nothing)."""
    from tract_cli.core.errors import LockTimeout
    with RunningAgent(region, 0, manager=True):
        with Worker(region, 1) as prefill, Worker(region, 3) as holder, \
                Pool.attach(region, node=2) as p:
            ticket = Ticket.from_dict(prefill.call("handoff_publish", chain=[7, 0, 8, 5],
                                                   request="a", ttl=3600))
            holder.call("lock_acquire", lock_id=LOCK_ALLOCATOR)
            with pytest.raises(LockTimeout):
                p.handoffs.ack(ticket, timeout=0.5)
            assert pins_and_records(region)[1] == 1, "the record waits, ACKED"
            holder.call("lock_release", lock_id=LOCK_ALLOCATOR)
            with pytest.raises(HandoffError):        # a plain ack is no resumption
                p.handoffs.ack(ticket)
            assert pins_and_records(region)[1] == 1
            p.handoffs.ack(ticket, resume=True)
            assert pins_and_records(region) == (0, 0)
            with pytest.raises(HandoffError):        # done: a third ack finds nothing
                p.handoffs.ack(ticket, resume=True)
    check_index(region)


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_a_reserved_record_is_pending_until_its_owner_publishes_it(region, simulate):
    """The vLLM connector's P/D prefill reserves its record in the step and
    publishes it after an off-step commit: its ticket goes out first, so a
    decode side may open the record before the publish.  It is told "pending"
    (never "not published", which would make it compute the prompt), the
    reservation holds no pins and no key list (`tract check` finds nothing
    wrong), and once published the handoff is whole."""
    from tract_cli.core.errors import HandoffPending
    from tract_cli.core.handoff import request_key
    from tract_cli.inspect.check import verify
    chain = [5, 3, 62, 9]
    with RunningAgent(region, 0, manager=True, simulate=simulate):
        with Worker(region, 1, simulate) as prefill, Worker(region, 2, simulate) as decode, \
                Pool.attach(region, node=3, simulate=simulate) as other:
            rec = prefill.call("handoff_reserve", request="r")
            early = Ticket(rec, request_key("r").hex(), 9, 9 * 16)
            with pytest.raises(HandoffPending, match="reserved, not yet published"):
                other.handoffs.open(early)
            assert not other.handoffs.still_published(early)   # no load may stand on it
            assert pins_and_records(region) == (0, 1)
            assert other.handoffs.peek_free(rec, skip=[]) != rec  # nobody else takes it
            with Pool.attach(region, readonly=True) as ro:
                violations, _ = verify(ro, data=False)
            assert not violations, violations
            ticket = prefill.call("handoff_publish_pinned", chain=chain, request="r",
                                  record=rec, reserved=True)
            assert ticket["record"] == rec and ticket["blocks"] == 9
            assert decode.call("handoff_receive", ticket=ticket, chain=chain, request="r") == 9
            assert pins_and_records(region) == (0, 0)
    check_index(region)


def test_a_reservation_given_back_expired_or_orphaned_is_never_pending(region):
    """A decode side waits on a reservation only while its owner may still
    publish it: given back (by the decode side that stopped waiting, then the
    owner's publish is refused and its pins stay its own to give back),
    expired (and reclaimed), or its owner dead (once the owner node's agent
    freed it; the decode side judges no pid), it is "not published"; and a
    ticket whose counts are not the reservation's is refused at once."""
    from procs_child import _chain_keys, handoff_publish_pinned
    from tract_cli.core.errors import HandoffPending, TransferTableFull
    from tract_cli.core.handoff import request_key
    from tract_cli.core.recovery import recover_node

    def ticket(rec, request):
        return Ticket(rec, request_key(request).hex(), 4, 64)

    with RunningAgent(region, 0, manager=True), Pool.attach(region, node=1) as owner, \
            Pool.attach(region, node=2) as decode:
        # given back by a decode side that stopped waiting: the publish is refused
        rec = owner.handoffs.peek_free()
        assert owner.handoffs.reserve_record(rec, "gone", 4, 64) == ticket(rec, "gone")
        with pytest.raises(TransferTableFull, match=f"record {rec} is taken"):
            decode.handoffs.reserve_record(rec, "another", 4, 64)
        # a ticket of other counts: refused, not waited for
        with pytest.raises(HandoffError, match="reserved for 4 blocks and 64 tokens") as got:
            decode.handoffs.open(Ticket(rec, request_key("gone").hex(), 4, 70))
        assert not isinstance(got.value, HandoffPending)
        with pytest.raises(HandoffPending):
            decode.handoffs.open(ticket(rec, "gone"))
        assert decode.handoffs.unreserve(rec, "gone")
        assert not decode.handoffs.unreserve(rec, "gone")
        with pytest.raises(HandoffError, match="not published"):
            decode.handoffs.open(ticket(rec, "gone"))
        with pytest.raises(HandoffError, match="no longer reserved"):
            handoff_publish_pinned(owner, [7, 0, 71, 4], "gone", record=rec, reserved=True)
        assert pins_and_records(region) == (4, 0)         # the caller's, to give back
        owner.index.unpin(_chain_keys(owner, 7, 0, 71, 4))
        # expired: not pending, and reclaimed (by this call, or by the manager's
        # agent first: it reclaims every 0.5 s)
        owner.handoffs.reserve_record(rec, "late", 4, 64, ttl=1e-9)
        with pytest.raises(HandoffError, match="not published"):
            decode.handoffs.open(ticket(rec, "late"))
        assert decode.handoffs.reclaim(now_ns=time.time_ns() + 10**9) in (0, 1)
        assert pins_and_records(region) == (0, 0)
        # its owner dead: pending until the owner node's agent frees it (here its
        # recovery pass, run by hand: no agent runs for node 1)
        prefill = Worker(region, 1)
        rec = prefill.call("handoff_reserve", request="dead", blocks=4, tokens=64)
        with pytest.raises(HandoffPending):
            decode.handoffs.open(ticket(rec, "dead"))
        prefill.kill()
        prefill.close()
        with pytest.raises(HandoffPending):
            decode.handoffs.open(ticket(rec, "dead"))
        recover_node(owner, orphans=False, timeout=30)
        with pytest.raises(HandoffError, match="not published"):
            decode.handoffs.open(ticket(rec, "dead"))
        assert pins_and_records(region) == (0, 0)
    check_index(region)
