"""Behaviour under load through real HTTP: disconnects free KV blocks, overload is refused cleanly,
SIGTERM drains. Clients are async httpx streams against a `specdeploy serve` process."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx

GENERATED = "specdeploy_generation_tokens_total"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG_CHAT_TOKENS = 1000
LONG_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "tell me everything"}],
             "max_tokens": LONG_CHAT_TOKENS, "ignore_eos": True, "stream": True}


async def _until(condition: Callable[[], bool], timeout_s: float) -> None:
    """Poll ``condition`` every 20 ms until it holds or ``timeout_s`` passes (the caller asserts)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def _client(server: Any, api_keys: dict[str, str], timeout: float = 60) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {api_keys['alice']}"},
                             timeout=timeout, limits=httpx.Limits(max_connections=100))


def test_fifty_clients_disconnecting_mid_stream_free_their_blocks_without_finishing(
    server: Any, api_keys: dict[str, str]
) -> None:
    idle = server.metric("specdeploy_kv_blocks_used")
    tokens_at_start = server.metric(GENERATED)
    streaming = asyncio.Barrier(51)
    closed = asyncio.Event()

    async def client_that_leaves(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", CHAT, json=LONG_CHAT) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break
            await streaming.wait()
            await closed.wait()
        # leaving the block closes the connection mid-stream

    async def main() -> tuple[float, float]:
        async with _client(server, api_keys) as client:
            tasks = [asyncio.create_task(client_that_leaves(client)) for _ in range(50)]
            await asyncio.wait_for(streaming.wait(), timeout=120)
            busy = server.metric("specdeploy_kv_blocks_used")
            tokens_when_leaving = server.metric(GENERATED)
            closed.set()
            await asyncio.gather(*tasks)
        await _until(lambda: server.metric("specdeploy_kv_blocks_used") == idle, timeout_s=60)
        return busy, tokens_when_leaving

    busy, tokens_when_leaving = asyncio.run(main())
    assert busy > idle
    assert server.metric("specdeploy_kv_blocks_used") == idle
    assert server.metric("specdeploy_requests_running") == 0
    # Timing belongs to the benchmarks; here the fact is that the streams were cut, not run out:
    # after the clients left, the server generated a small share of what finishing them would take.
    still_owed = 50 * LONG_CHAT_TOKENS - (tokens_when_leaving - tokens_at_start)
    generated_after = server.metric(GENERATED) - tokens_when_leaving
    assert generated_after < still_owed / 2, (generated_after, still_owed)


def test_non_streaming_client_that_gives_up_frees_its_blocks(server: Any, api_keys: dict[str, str]) -> None:
    idle = server.metric("specdeploy_kv_blocks_used")
    tokens_at_start = server.metric(GENERATED)
    body = {"model": "tiny", "prompt": "long", "max_tokens": 1000, "ignore_eos": True}
    with server.client(timeout=0.3) as client:
        try:
            client.post(COMPLETIONS, json=body)
        except httpx.TimeoutException:
            pass
        else:
            raise AssertionError("expected the client to give up first")
    asyncio.run(_until(lambda: server.metric("specdeploy_requests_running") == 0, timeout_s=60))
    assert server.metric("specdeploy_kv_blocks_used") == idle
    assert server.metric(GENERATED) - tokens_at_start < body["max_tokens"]  # cut short, not run to the end


def test_overload_four_times_capacity_completes_or_refuses_with_retry_after(
    capacity_server: Any, api_keys: dict[str, str]
) -> None:
    capacity = 2 + 2  # max_concurrency + max_queue
    body = {"model": "tiny", "prompt": "load", "max_tokens": 48, "ignore_eos": True}

    async def one(client: httpx.AsyncClient) -> tuple[int, str | None, float]:
        started = time.monotonic()
        response = await client.post(COMPLETIONS, json=body)
        return response.status_code, response.headers.get("retry-after"), time.monotonic() - started

    async def readiness(client: httpx.AsyncClient, stop: asyncio.Event) -> list[int]:
        seen = []
        while not stop.is_set():
            seen.append((await client.get("/ready")).status_code)
            await asyncio.sleep(0.05)
        return seen

    async def main() -> tuple[list[tuple[int, str | None, float]], list[int]]:
        async with _client(capacity_server, api_keys, timeout=60) as client:
            stop = asyncio.Event()
            probe = asyncio.create_task(readiness(client, stop))
            results = await asyncio.gather(*(one(client) for _ in range(4 * capacity)))
            stop.set()
            return list(results), await probe

    results, ready_statuses = asyncio.run(main())
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429, 503}, statuses
    assert statuses.count(200) >= 2  # at least the queue's worth is served, whatever the arrival order
    refused = [(s, retry, took) for s, retry, took in results if s != 200]
    assert refused, "4x capacity must be refused in part"
    assert all(retry is not None and int(retry) >= 1 for _, retry, _ in refused)
    # Refusals are immediate: none waited for a generation to end (the slowest served request waited
    # in the queue for one, then ran its own).
    slowest_served = max(took for s, _, took in results if s == 200)
    assert all(took < slowest_served for _, _, took in refused), (refused, slowest_served)
    assert ready_statuses and set(ready_statuses) == {200}
    assert capacity_server.metric("specdeploy_kv_blocks_used") == 0


def test_sigterm_finishes_in_flight_refuses_new_work_and_exits_zero(
    capacity_server: Any, api_keys: dict[str, str]
) -> None:
    async def in_flight(client: httpx.AsyncClient, started: asyncio.Event) -> tuple[str | None, bool]:
        body = {**LONG_CHAT, "max_tokens": 400}
        finish, done = None, False
        async with client.stream("POST", CHAT, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                started.set()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    finish = choices[0].get("finish_reason") or finish
        return finish, done

    async def main() -> tuple[list[tuple[str | None, bool]], int, int, str]:
        async with _client(capacity_server, api_keys) as client:
            events = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.create_task(in_flight(client, e)) for e in events]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=60)
            capacity_server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            async with httpx.AsyncClient(base_url=capacity_server.base_url, timeout=10,
                                         headers={"Authorization": f"Bearer {api_keys['alice']}"}) as fresh:
                new = await fresh.post(COMPLETIONS, json={"model": "tiny", "prompt": "late", "max_tokens": 4})
                ready = await fresh.get("/ready")
            return list(await asyncio.gather(*streams)), new.status_code, ready.status_code, new.text

    finished, new_status, ready_status, new_body = asyncio.run(main())
    assert new_status == 503, new_body
    assert json.loads(new_body)["error"]["code"] == "draining"
    assert ready_status == 503
    assert finished == [("length", True), ("length", True)]
    assert capacity_server.proc.wait(timeout=30) == 0


def test_streams_past_their_deadline_end_with_a_timeout_and_none_hangs(
    small_server: Any, api_keys: dict[str, str]
) -> None:
    """small_server: 0.5 s timeout, 4 running + 4 queued. Streams that got tokens end with an error event
    (no [DONE]); those that never got a token are refused with a plain 504 (the headers wait for the
    first token); everything is over within seconds and the KV cache is empty afterwards."""
    body = {"model": "tiny", "prompt": "stream", "max_tokens": 1500, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> tuple[int, str]:
        async with client.stream("POST", COMPLETIONS, json=body) as response:
            text = "".join([line + "\n" async for line in response.aiter_lines()])
            return response.status_code, text

    async def main() -> list[tuple[int, str]]:
        async with _client(small_server, api_keys, timeout=30) as client:
            return list(await asyncio.gather(*(one(client) for _ in range(8))))

    started = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - started < 15
    for status, text in results:
        if status == 200:
            assert '"code":"request_timeout"' in text and "[DONE]" not in text
        else:
            assert status in (429, 504), (status, text)
            assert json.loads(text)["error"]["code"] in ("request_timeout", "queue_full")
    assert any(status == 200 for status, _ in results)
    assert small_server.metric("specdeploy_kv_blocks_used") == 0
    assert small_server.metric("specdeploy_requests_running") == 0
