"""Scheduler unit tests with exact block ids, and a property test over random workloads."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from serve.core.config import SchedulerConfig
from serve.core.request import FinishReason, Request, RequestStatus
from serve.core.sampling_params import SamplingParams
from serve.core.scheduler import Scheduler, SchedulerOutput

EOS = 1


def scheduler(
    num_blocks: int = 16, budget: int = 64, seqs: int = 8, max_len: int = 512
) -> Scheduler:
    config = SchedulerConfig(seqs, budget, max_len)
    return Scheduler(config, num_blocks=num_blocks, block_size=4)


def req(rid: str, n: int, max_tokens: int = 4, first: int = 10) -> Request:
    tokens = list(range(first, first + n))
    return Request(
        rid, tokens, SamplingParams(max_tokens=max_tokens), eos_token_ids=frozenset({EOS})
    )


def fake_tokens(out: SchedulerOutput, token: int = 7) -> dict[str, int]:
    return {c.request_id: token for c in out.chunks if c.sample}


def shape(out: SchedulerOutput) -> list[tuple[str, int, int, list[int]]]:
    return [(c.request_id, c.start_pos, len(c.token_ids), c.block_ids) for c in out.chunks]


def test_prefill_then_decode_with_exact_blocks() -> None:
    s = scheduler()
    s.add_request(req("a", 6))
    s.add_request(req("b", 3))
    out = s.schedule()
    assert shape(out) == [("a", 0, 6, [1, 2]), ("b", 0, 3, [3])]  # block 0: the null block
    s.update(out, fake_tokens(out))
    out = s.schedule()
    assert shape(out) == [("a", 6, 1, [1, 2]), ("b", 3, 1, [3])]
    s.update(out, fake_tokens(out))
    out = s.schedule()  # a reaches 8 tokens -> still 2 blocks; b reaches 5 -> a second block
    assert shape(out) == [("a", 7, 1, [1, 2]), ("b", 4, 1, [3, 4])]


def test_token_budget_chunks_a_long_prompt() -> None:
    s = scheduler(budget=8)
    s.add_request(req("a", 20))
    outs = []
    while not outs or not outs[-1].chunks[0].sample:
        outs.append(s.schedule())
        s.update(outs[-1], fake_tokens(outs[-1]))
    assert [shape(o)[0][1:3] for o in outs] == [(0, 8), (8, 8), (16, 4)]
    assert outs[-1].chunks[0].block_ids == [1, 2, 3, 4, 5]


def test_running_requests_come_before_new_ones() -> None:
    s = scheduler(budget=10)
    s.add_request(req("a", 8))
    out = s.schedule()
    s.update(out, fake_tokens(out))
    s.add_request(req("b", 20, first=100))
    out = s.schedule()
    assert shape(out) == [("a", 8, 1, [1, 2, 3]), ("b", 0, 9, [4, 5, 6])]


def test_max_num_seqs_caps_admission() -> None:
    s = scheduler(seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 2))
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["a", "b"] and [
        r.request_id for r in s.waiting
    ] == ["c"]


def test_newest_running_request_is_preempted_and_recomputed() -> None:
    s = scheduler(num_blocks=4)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8))
    out = s.schedule()
    assert shape(out) == [("a", 0, 8, [1, 2]), ("b", 0, 8, [3, 4])]
    s.update(out, fake_tokens(out))
    out = s.schedule()  # a needs a 3rd block: b (newest) is preempted, its blocks go to a
    assert out.preempted_ids == ["b"]
    assert shape(out) == [("a", 8, 1, [1, 2, 4])]
    b = s.waiting[0]
    assert (b.request_id, b.num_computed_tokens, b.output_token_ids) == ("b", 0, [7])
    assert b.status is RequestStatus.WAITING and s.num_preemptions == 1
    s.pool.check_integrity()


def test_abort_frees_blocks_at_once() -> None:
    s = scheduler()
    s.add_request(req("a", 9))
    s.add_request(req("b", 3))
    out = s.schedule()
    s.update(out, fake_tokens(out))
    s.finish("a", FinishReason.ABORT)
    assert s.pool.num_free_blocks == 16 - 1
    s.finish("b", FinishReason.ABORT)
    assert s.pool.num_free_blocks == 16 and not s.running
    assert s.finish("b", FinishReason.ABORT) is None


def test_stops_on_eos_stop_ids_max_tokens_and_max_model_len() -> None:
    s = scheduler(max_len=12)
    s.add_request(req("eos", 3))
    s.add_request(Request("ids", [5, 6], SamplingParams(max_tokens=9, stop_token_ids=(42,))))
    s.add_request(req("len", 3, max_tokens=1))
    s.add_request(req("ctx", 10, max_tokens=50))
    out = s.schedule()
    tokens = {"eos": EOS, "ids": 42, "len": 3, "ctx": 3}
    finished = {r.request_id: r.finish_reason for r in s.update(out, tokens)}
    assert finished == {
        "eos": FinishReason.STOP,
        "ids": FinishReason.STOP,
        "len": FinishReason.LENGTH,
    }
    out = s.schedule()
    finished = {r.request_id: r.finish_reason for r in s.update(out, {"ctx": 3})}
    assert finished == {"ctx": FinishReason.LENGTH} and not s.has_unfinished()


# Property: any sequence of add / abort / step keeps the pool consistent, the token budget and
# seat cap hold, every request's blocks cover its computed tokens, and once everything has
# finished, every block is free.
ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("step"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


def check_invariants(s: Scheduler, out: SchedulerOutput) -> None:
    s.pool.check_integrity()
    assert out.num_tokens <= s.config.max_num_batched_tokens
    assert len(s.running) <= s.config.max_num_seqs
    for r in s.running:
        assert len(s.kv.blocks[r.request_id]) * 4 >= r.num_computed_tokens
    for r in s.waiting:
        assert r.request_id not in s.kv.blocks or not s.kv.blocks[r.request_id]
    owned = sum(len(b) for b in s.kv.blocks.values())
    assert owned >= s.pool.num_blocks - s.pool.num_free_blocks


@settings(max_examples=150, deadline=None)
@given(
    actions=ACTIONS,
    num_blocks=st.integers(12, 40),
    budget=st.integers(4, 64),
    seqs=st.integers(1, 6),
)
def test_random_workloads_keep_invariants(
    actions: list[tuple[str, int, int]], num_blocks: int, budget: int, seqs: int
) -> None:
    s = Scheduler(SchedulerConfig(seqs, budget, 64), num_blocks=num_blocks, block_size=4)
    added = 0
    for kind, a, b in actions + [("step", 0, 0)] * 400:
        if kind == "add":
            if a + b > num_blocks * 4:  # the engine refuses what can never fit the whole cache
                continue
            # prompts share prefixes (first token 10 for all) so the prefix cache is exercised
            s.add_request(req(str(added), a, max_tokens=b, first=10 + added % 2))
            added += 1
        elif kind == "abort":
            s.finish(str(a), FinishReason.ABORT)
        elif s.has_unfinished():
            out = s.schedule()
            check_invariants(s, out)
            s.update(out, {c.request_id: 3 + len(c.token_ids) % 5 for c in out.chunks if c.sample})
    assert not s.has_unfinished()
    assert s.pool.num_free_blocks == num_blocks and not s.kv.blocks
    s.pool.check_integrity()


def test_async_scheduling_schedules_placeholders_and_applies_tokens_a_step_late() -> None:
    s = scheduler()
    s.add_request(req("a", 5, max_tokens=2))
    s.add_request(req("b", 3, max_tokens=8))
    first = s.schedule()
    s.advance(first)  # both sample at step 1: a placeholder each, counters already moved
    second = s.schedule()
    assert [(c.request_id, c.start_pos, c.token_ids, c.placeholder) for c in second.chunks] == [
        ("a", 5, [0], True),
        ("b", 3, [0], True),
    ]
    s.advance(second)
    assert s.update(first, {"a": 50, "b": 60}, advanced=True) == []
    a = s.requests["a"]
    assert (a.output_token_ids, a.num_output_placeholders, a.num_computed_tokens) == ([50], 1, 6)
    # a's placeholder is its 2nd and last token: it is not scheduled again
    third = s.schedule()
    assert [(c.request_id, c.token_ids) for c in third.chunks] == [("b", [0])]
    s.advance(third)
    finished = s.update(second, {"a": 51, "b": EOS}, advanced=True)
    assert [(r.request_id, r.finish_reason) for r in finished] == [
        ("a", FinishReason.LENGTH),
        ("b", FinishReason.STOP),
    ]
    assert s.update(third, {"b": 61}, advanced=True) == []  # b's extra token is dropped
    assert not s.requests and s.pool.num_free_blocks == 16
    s.pool.check_integrity()
