"""Scheduler: token budget, chunked prefill, preemption newest-first, stalls, every request finishes."""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.kv_blocks import BlockPool
from policies.scheduler import Scheduler
from policies.sequence import UNKNOWN_TOKEN, Sequence, SequenceStatus, make_sequences


def drive(sched: Scheduler, max_steps: int = 100_000) -> list:
    """Run a length-only workload (as a simulator does) to completion; returns the batches."""
    batches = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch.step == sched.num_steps - 1  # steps are numbered 0, 1, 2, ... one after another
        assert not batches or batch.step == batches[-1].step + 1
        assert batch.is_empty == (not batch.entries)
        assert all(e.num_new_tokens >= 1 for e in batch.entries)  # a spent budget schedules no empty entries
        assert batch.num_tokens <= sched.max_num_batched_tokens
        assert len(batch.entries) <= sched.max_num_seqs
        assert len({id(e.seq) for e in batch.entries}) == len(batch.entries)
        sched.pool.check_invariants()
        for e in batch.entries:  # every scheduled token has a slot
            assert sched.pool.num_tokens(e.seq.seq_id) >= e.start + e.num_new_tokens
        sched.postprocess(batch, None)
        batches.append(batch)
        assert len(batches) < max_steps, "scheduler did not finish"
    return batches


def test_chunked_prefill_splits_long_prompt_within_budget():
    sched = Scheduler(BlockPool(64, 16), max_num_seqs=4, max_num_batched_tokens=32)
    seq = Sequence("a", prompt_len=100, max_tokens=2)
    sched.add(seq)
    sizes = []
    for _ in range(6):
        b = sched.schedule()
        sizes.append([(e.num_new_tokens, e.start, e.sample) for e in b.entries])
        sched.postprocess(b, None)
    assert sizes[:4] == [[(32, 0, False)], [(32, 32, False)], [(32, 64, False)], [(4, 96, True)]]
    assert sizes[4] == [(1, 100, True)]
    assert seq.is_finished and seq.finish_reason == "length" and seq.output_token_ids == [UNKNOWN_TOKEN] * 2
    assert sched.pool.num_free == 64


def test_decodes_and_prefill_chunks_share_the_budget():
    sched = Scheduler(BlockPool(64, 16), max_num_seqs=8, max_num_batched_tokens=20)
    a = Sequence("a", prompt_len=10, max_tokens=50)
    sched.add(a)
    sched.postprocess(sched.schedule(), None)  # a prefilled, sampled its first token
    b = Sequence("b", prompt_len=40, max_tokens=5)
    sched.add(b)
    batch = sched.schedule()
    assert [(e.seq.seq_id, e.num_new_tokens, e.is_decode) for e in batch.entries] == [("a", 1, True), ("b", 19, False)]
    assert batch.num_decode_tokens == 1 and batch.num_prefill_tokens == 19


def test_a_prompt_s_last_one_token_chunk_is_prefill_not_decode():
    """A 9-token prompt under an 8-token budget: its second chunk is one token and samples, but it is the prompt's
    last token, not a decode (no output yet): the cost model and the decode-only paths must not take it for one."""
    sched = Scheduler(BlockPool(16, 4), max_num_seqs=4, max_num_batched_tokens=8)
    sched.add(Sequence("a", prompt_len=9, max_tokens=3))
    sched.postprocess(sched.schedule(), None)
    b = sched.schedule()
    assert [(e.num_new_tokens, e.sample, e.is_decode) for e in b.entries] == [(1, True, False)]
    assert b.num_prefill_tokens == 1 and b.num_decode_tokens == 0
    sched.postprocess(b, None)
    assert sched.schedule().entries[0].is_decode   # now it has an output: its next token is a decode


def test_a_stalled_running_sequence_keeps_its_turn():
    """First come, first served: while the oldest running sequence cannot get the blocks of its next chunk, nobody
    new is admitted, even where a free block would hold the newcomer (it would be preempted again at once)."""
    sched = Scheduler(BlockPool(3, 4), max_num_seqs=4, max_num_batched_tokens=8, stall_limit=1)
    a, b = Sequence("a", prompt_len=20, max_tokens=2), Sequence("b", prompt_len=2, max_tokens=2)
    sched.add(a)
    sched.postprocess(sched.schedule(), None)          # a's first chunk: 8 tokens in 2 of the 3 blocks
    sched.add(b)
    batch = sched.schedule()                            # a's next chunk needs 4 blocks: a stalls
    assert batch.entries == () and batch.stalled and list(sched.waiting) == [b] and sched.pool.num_free == 1
    batches = drive(sched)
    assert a.finish_reason == "kv_capacity" and b.finish_reason == "length" and b.num_preemptions == 0
    assert batches[0].entries == () and batches[0].aborted == (a,)   # a gave up before b ran


def test_pending_blocks_are_what_the_next_step_allocates_within_its_budget():
    """The planner's view of the next step's KV demand: the running sequences' growth within the token budget, and
    the next waiting request's first chunk only where budget is left (here: 3, then 2 with the budget spent on a's
    second chunk, then a's decode and b's prompt)."""
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(Sequence("a", prompt_len=20, max_tokens=2))
    sched.add(Sequence("b", prompt_len=8, max_tokens=2))
    pending = []
    for _ in range(3):
        pending.append(sched.pending_blocks())
        free = sched.pool.num_free
        batch = sched.schedule()
        assert free - sched.pool.num_free == pending[-1]
        sched.postprocess(batch, None)
    assert pending == [3, 2, 3]


def test_pending_blocks_of_a_long_prefill_count_only_its_next_chunk():
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(Sequence("a", prompt_len=40, max_tokens=2))
    for _ in range(3):
        pending, free = sched.pending_blocks(), sched.pool.num_free
        sched.postprocess(sched.schedule(), None)
        assert pending == free - sched.pool.num_free and pending <= 3  # 10 tokens: at most 3 new blocks of 4


def test_pending_blocks_leave_out_a_waiting_request_no_seat_is_free_for():
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=1, max_num_batched_tokens=10)
    sched.add(Sequence("a", prompt_len=4, max_tokens=5))
    sched.add(Sequence("b", prompt_len=8, max_tokens=2))
    sched.postprocess(sched.schedule(), None)
    pending, free = sched.pending_blocks(), sched.pool.num_free
    assert pending == 1  # a's fifth token; b cannot be admitted while a holds the one seat
    sched.schedule()
    assert free - sched.pool.num_free == pending


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockPool(64, 16), max_num_seqs=2, max_num_batched_tokens=1000)
    for s in make_sequences([5, 5, 5], [3, 3, 3]):
        sched.add(s)
    batch = sched.schedule()
    assert [e.seq.seq_id for e in batch.entries] == [0, 1] and batch.num_waiting == 1


def test_preemption_takes_newest_and_keeps_outputs():
    # 3 blocks of 4 tokens; three sequences of 4-token prompts fill them and then need to grow
    sched = Scheduler(BlockPool(3, 4), max_num_seqs=8, max_num_batched_tokens=64)
    seqs = make_sequences([4, 4, 4], [6, 6, 6])
    for s in seqs:
        sched.add(s)
    sched.postprocess(sched.schedule(), None)  # all three prefill (3 blocks) and sample a token
    assert [s.num_output_tokens for s in seqs] == [1, 1, 1]
    batch = sched.schedule()  # each needs a second block: none is free
    assert [s.seq_id for s in batch.preempted] == [2, 1]  # newest first (1 gives way to the older 0)
    assert [e.seq.seq_id for e in batch.entries] == [0]
    assert list(sched.waiting) == [seqs[1], seqs[2]]  # back at the head, in arrival order
    assert seqs[2].output_token_ids == [UNKNOWN_TOKEN] and seqs[2].num_computed_tokens == 0
    assert seqs[2].status == SequenceStatus.WAITING and seqs[2].num_preemptions == 1
    assert not sched.pool.has(1) and not sched.pool.has(2)
    sched.postprocess(batch, None)
    drive(sched)
    assert all(s.finish_reason == "length" and s.num_output_tokens == 6 for s in seqs)
    assert sched.num_preemptions >= 2


def test_a_step_that_preempts_admits_nobody():
    """Rule 2: waiting sequences are admitted only in a step without preemption, even where the blocks a preemption
    freed would hold the head's first chunk (re-admitting the sequence just preempted would undo it)."""
    sched = Scheduler(BlockPool(5, 2), max_num_seqs=3, max_num_batched_tokens=5)
    seqs = make_sequences([2, 2, 4, 2], [4, 1, 3, 3])
    for s in seqs:
        sched.add(s)
    for _ in range(3):
        sched.postprocess(sched.schedule(), None)
    batch = sched.schedule()
    assert [s.seq_id for s in batch.preempted] == [2] and [e.seq.seq_id for e in batch.entries] == [0]
    assert list(sched.waiting) == [seqs[2], seqs[3]] and sched.pool.num_free == 2
    sched.postprocess(batch, None)
    assert [e.seq.seq_id for e in sched.schedule().entries] == [2]  # its turn comes at the next step


def test_recompute_covers_prompt_and_outputs():
    sched = Scheduler(BlockPool(3, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_sequences([4, 4], [8, 8])
    sched.add(a)
    sched.add(b)
    sched.postprocess(sched.schedule(), [11, 21])
    batch = sched.schedule()  # a takes the last free block; b (newest) gives way
    assert batch.preempted == (b,) and b.output_token_ids == [21]
    sched.postprocess(batch, [12])
    readmit = None
    while readmit is None:
        batch = sched.schedule()
        readmit = next((e for e in batch.entries if e.seq is b), None)
        sched.postprocess(batch, [7] * batch.num_sampled)
    # b recomputes its prompt and its kept output in one prefill, then samples its second token
    assert (readmit.start, readmit.num_new_tokens, readmit.sample) == (0, 5, True)
    assert a.is_finished and b.output_token_ids[:2] == [21, 7]


def test_stall_then_kv_capacity_finish():
    sched = Scheduler(BlockPool(2, 4), max_num_seqs=4, max_num_batched_tokens=64, stall_limit=3)
    big = Sequence("big", prompt_len=6, max_tokens=10)  # needs 4 blocks eventually; pool has 2
    small = Sequence("small", prompt_len=2, max_tokens=2)
    sched.add(big)
    sched.add(small)
    batches = drive(sched)
    assert big.finish_reason == "kv_capacity" and big.num_output_tokens >= 1
    assert small.finish_reason == "length" and small.num_output_tokens == 2
    stalls = [b for b in batches if b.stalled]
    assert len(stalls) == 4 and any(b.aborted == (big,) for b in batches)
    assert sched.pool.num_free == 2


def test_only_consecutive_stalls_count_toward_the_stall_limit():
    """A step that schedules something ends a run of stalls: a later request gets its own stall_limit tries."""
    sched = Scheduler(BlockPool(1, 4), max_num_seqs=4, max_num_batched_tokens=64, stall_limit=1)
    a, b = Sequence("a", prompt_len=8, max_tokens=1), Sequence("b", prompt_len=12, max_tokens=1)
    sched.add(a)
    assert sched.schedule().stalled
    sched.pool.grow(1)  # as a planner would
    sched.postprocess(sched.schedule(), None)
    assert a.finish_reason == "length"
    sched.add(b)
    batch = sched.schedule()
    assert batch.stalled and batch.aborted == ()
    sched.pool.grow(1)
    sched.postprocess(sched.schedule(), None)
    assert b.finish_reason == "length"


@pytest.mark.parametrize("make", [lambda: Sequence("a", prompt_len=0), lambda: Sequence("a", []),
                                  lambda: Sequence("a", prompt_len=3, max_tokens=0)])
def test_a_sequence_needs_a_prompt_token_and_room_for_an_output(make):
    with pytest.raises(ValueError):
        make()


def test_sequence_token_views():
    """A length-only sequence knows no token ids; `token_ids` spans the prompt, the outputs, or both; lengths and
    output budgets of `make_sequences` must pair up."""
    assert Sequence("a", prompt_len=3).num_known_tokens == 0
    s = Sequence("b", prompt_token_ids=[1, 2, 3], max_tokens=4)
    s.output_token_ids += [7, UNKNOWN_TOKEN]
    assert s.num_known_tokens == 4
    assert (s.token_ids(0, 3), s.token_ids(3, 4), s.token_ids(2, 4)) == ([1, 2, 3], [7], [3, 7])
    with pytest.raises(ValueError, match="length-only"):
        Sequence("c", prompt_len=3).token_ids(0, 1)
    with pytest.raises(ValueError):
        make_sequences([4, 4], [8])


def test_add_takes_only_fresh_waiting_sequences():
    sched = Scheduler(BlockPool(4, 4))
    started = Sequence("a", prompt_len=4)
    started.num_computed_tokens = 2
    with pytest.raises(ValueError, match="fresh waiting"):
        sched.add(started)
    done = Sequence("b", prompt_len=4)
    done.status = SequenceStatus.FINISHED
    with pytest.raises(ValueError, match="fresh waiting"):
        sched.add(done)


@pytest.mark.parametrize("limits", [dict(max_num_seqs=0), dict(max_num_batched_tokens=0)])
def test_each_limit_must_be_at_least_one(limits):
    with pytest.raises(ValueError, match="must be >= 1"):
        Scheduler(BlockPool(4, 4), **limits)


def test_aborting_a_waiting_sequence_takes_it_off_the_queue():
    sched = Scheduler(BlockPool(16, 4), max_num_seqs=1)
    a, b = Sequence("a", prompt_len=4, max_tokens=4), Sequence("b", prompt_len=4, max_tokens=4)
    sched.add(a)
    sched.add(b)
    sched.postprocess(sched.schedule(), None)  # a runs, b waits for a seat
    assert b.status == SequenceStatus.WAITING
    assert sched.abort("b") is b and b.finish_reason == "abort"
    assert list(sched.waiting) == [] and list(sched.running) == [a]
    assert sched.abort("nobody") is None
    drive(sched)
    assert a.finish_reason == "length" and sched.pool.num_free == 16


def test_prompt_larger_than_pool_is_not_lost():
    sched = Scheduler(BlockPool(2, 4), max_num_batched_tokens=4, stall_limit=0)
    s = Sequence(0, prompt_len=20, max_tokens=3)
    sched.add(s)
    drive(sched)
    assert s.finish_reason == "kv_capacity"


def test_stop_callback_and_eos_and_abort():
    sched = Scheduler(BlockPool(16, 4))
    a = Sequence("a", prompt_token_ids=[5, 6], max_tokens=10, eos_token_id=2)
    b = Sequence("b", prompt_token_ids=[5], max_tokens=10)
    c = Sequence("c", prompt_token_ids=[7], max_tokens=10)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    done = sched.postprocess(batch, [2, 9, 9], stop=lambda s: "stop" if s.seq_id == "b" else None)
    assert done == [a, b] and a.finish_reason == "stop" and b.finish_reason == "stop"
    assert sched.abort("c") is c and c.finish_reason == "abort" and not sched.has_unfinished()
    assert sched.pool.num_free == 16
    assert c.token_ids(0, 2) == [7, 9]
    with pytest.raises(ValueError):
        sched.postprocess(batch, [1, 1, 1])


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 30)), min_size=1, max_size=12),
    blocks=st.integers(3, 40),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(1, 96),
    max_seqs=st.integers(1, 6),
)
def test_every_request_finishes(lens, blocks, block_size, budget, max_seqs):
    pool = BlockPool(blocks, block_size)
    sched = Scheduler(pool, max_num_seqs=max_seqs, max_num_batched_tokens=budget, stall_limit=2)
    seqs = make_sequences([p for p, _ in lens], [m for _, m in lens])
    for s in seqs:
        sched.add(s)
    drive(sched)
    cap_tokens = blocks * block_size
    for s in seqs:
        assert s.is_finished
        if s.prompt_len + s.max_tokens - 1 <= cap_tokens:
            assert s.finish_reason == "length" and s.num_output_tokens == s.max_tokens
        else:
            assert s.finish_reason in ("length", "kv_capacity")
    assert pool.num_free == pool.capacity == blocks


def test_deterministic_schedule():
    def run():
        sched = Scheduler(BlockPool(12, 4), max_num_seqs=3, max_num_batched_tokens=24)
        for s in make_sequences([9, 30, 3, 17, 8], [12, 4, 20, 9, 7]):
            sched.add(s)
        return [tuple((e.seq.seq_id, e.num_new_tokens, e.start) for e in b.entries) + tuple(p.seq_id for p in b.preempted)
                for b in drive(sched)]
    first = run()
    assert first == run()
    assert any(len(step) > 1 for step in first)


def test_policies_import_without_torch():
    code = ("import sys, policies, policies.kv_blocks, policies.scheduler, policies.sequence, "
            "policies.observe, policies.loop; "
            "bad = [m for m in ('torch', 'cupy', 'simpy') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
