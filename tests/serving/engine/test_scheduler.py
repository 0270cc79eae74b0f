from __future__ import annotations

from serving.engine.kv_cache import BlockManager
from serving.engine.request import Request
from serving.engine.scheduler import Scheduler
from serving.engine.types import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                ignore_eos=True),
                   eos_token_ids=[], max_model_len=1024, tokenizer=None, default_seed=0)


def sample_all(sched: Scheduler, token: int = 7) -> None:
    out = sched.schedule()
    sched.update_from_output(out, {r.request_id: [token] for r in out.scheduled if out.samples(r)})


def test_prefill_is_chunked_under_the_token_budget() -> None:
    sched = Scheduler(BlockManager(64, 4), max_concurrency=8, max_batched_tokens=10)
    sched.add_request(make_request("a", 25))
    chunks, samples = [], []
    for _ in range(3):
        out = sched.schedule()
        chunks.append(out.num_scheduled_tokens["a"])
        samples.append(out.samples(out.scheduled[0]))
        sched.update_from_output(out, {"a": [7]} if samples[-1] else {})
    assert chunks == [10, 10, 5]
    assert samples == [False, False, True]  # only the last chunk produces a token
    assert sched.requests["a"].output_token_ids == [7]


def test_running_requests_decode_before_new_prefills_and_fcfs_holds() -> None:
    sched = Scheduler(BlockManager(64, 4), max_concurrency=8, max_batched_tokens=12)
    sched.add_request(make_request("a", 8))
    sample_all(sched)  # a prefilled, has its first token
    sched.add_request(make_request("b", 20))
    sched.add_request(make_request("c", 3))
    out = sched.schedule()
    assert [r.request_id for r in out.scheduled] == ["a", "b"]  # c waits behind b (FCFS)
    assert out.num_scheduled_tokens == {"a": 1, "b": 11}
    assert out.total_num_scheduled_tokens == 12


def test_max_concurrency_caps_the_running_set() -> None:
    sched = Scheduler(BlockManager(64, 4), max_concurrency=2, max_batched_tokens=100)
    for rid in "abc":
        sched.add_request(make_request(rid, 4))
    out = sched.schedule()
    assert [r.request_id for r in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_out_of_blocks_preempts_the_latest_arrival_by_recompute() -> None:
    blocks = BlockManager(4, 4)
    sched = Scheduler(blocks, max_concurrency=8, max_batched_tokens=100)
    sched.add_request(make_request("a", 8, max_tokens=20))
    sched.add_request(make_request("b", 8, max_tokens=20))
    sample_all(sched)  # both prefilled: 2 blocks each, pool full
    out = sched.schedule()  # a needs a third block for position 8... b gives way
    assert out.preempted_ids == ["b"]
    assert [r.request_id for r in out.scheduled] == ["a"]
    b = sched.waiting[0]
    assert b.request_id == "b" and b.num_computed_tokens == 0 and b.num_output_tokens == 1
    assert blocks.num_used == 3


def test_finished_and_aborted_requests_free_their_blocks() -> None:
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, max_concurrency=8, max_batched_tokens=100)
    sched.add_request(make_request("a", 5, max_tokens=2))
    sched.add_request(make_request("b", 5, max_tokens=50))
    sample_all(sched)
    sample_all(sched)  # a reaches max_tokens
    assert "a" not in sched.requests and sched.requests["b"]
    assert sched.finish_request("b") is not None
    assert blocks.num_used == 0 and not sched.has_unfinished()


def test_verify_step_keeps_accepted_drafts_and_rolls_back_the_rest() -> None:
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, max_concurrency=8, max_batched_tokens=100)
    sched.add_request(make_request("a", 6, max_tokens=50))
    sample_all(sched)  # 7 tokens, 6 computed
    req = sched.requests["a"]
    req.spec_token_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()
    assert out.num_scheduled_tokens["a"] == 6 and out.spec_token_ids["a"] == [1, 2, 3, 4, 5]
    assert len(blocks.block_table("a")) == 3  # 12 positions held during verification
    sched.update_from_output(out, {"a": [1, 2, 9]})  # two drafts accepted, then a correction
    assert req.output_token_ids == [7, 1, 2, 9]
    assert req.num_computed_tokens == req.num_tokens - 1 == 9
    assert len(blocks.block_table("a")) == 3  # 9 computed tokens need 3 blocks of 4
