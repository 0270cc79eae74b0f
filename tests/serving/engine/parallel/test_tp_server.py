"""`specdeploy serve` with tensor_parallel_size 2 on loopback: a rank SIGKILLed mid-stream fails the stream
with an error event (never a wrong or truncated "answer"), /ready turns 503, and shutdown leaves no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from serving.net import free_port, wait_until_ready

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[4]
KEY = "tp-test-key-0123456789abcdef"


def spawned_descendants(pid: int) -> list[int]:
    """The server's worker ranks: processes under it started by multiprocessing's spawn."""
    out = subprocess.run(["ps", "-ww", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True,
                         check=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines() if len(line.split(None, 2)) == 3]
    tree, found = {pid}, []
    for _ in range(4):  # the server may run under a launcher process: look a few generations down
        for child, parent, args in rows:
            if int(parent) in tree and int(child) not in tree:
                tree.add(int(child))
                if "spawn_main" in args:
                    found.append(int(child))
    return found


def running(pids: list[int]) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-p", ",".join(map(str, pids))], capture_output=True,
                         text=True, check=False).stdout
    return [int(line.split()[0]) for line in out.splitlines() if line.split() and "Z" not in line.split()[1]]


def test_a_killed_rank_makes_the_server_not_ready_and_fails_the_stream(
    tmp_path: Path, tiny_chat_model: Path
) -> None:
    from serving.weights import push

    store = f"file://{tmp_path / 'store' / 'tiny' / 'v1'}"
    push(tiny_chat_model, store)
    port = free_port()
    config = {
        "service": {"host": "127.0.0.1", "port": port, "served_model_name": "tiny", "weights_uri": store},
        "model": {"path": str(tmp_path / "cache"), "dtype": "fp32", "device": "cpu", "kv_cache_bytes": 4 * 2**20,
                  "tensor_parallel_size": 2},
        "scheduler": {"max_output_len": 1024, "request_timeout_s": 120},
    }
    (tmp_path / "server.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEPLOY")}
    env["SPECDEPLOY_API_KEYS"] = f"alice:{KEY}"
    log = (tmp_path / "server.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "serving", "--config", str(tmp_path / "server.yaml")],
                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    workers: list[int] = []
    try:
        wait_until_ready(base, 180, server, poll_s=0.5)
        workers = spawned_descendants(server.pid)
        assert len(workers) == 1, (tmp_path / "server.log").read_text()
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 1000, "ignore_eos": True, "stream": True,
                "temperature": 0}
        events: list[str] = []
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client, \
                client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 5:  # mid-stream: tokens are flowing
                    os.kill(workers[0], signal.SIGKILL)
        assert len(events) > 5
        assert events[-1] != "[DONE]", "the stream finished as if nothing happened"
        error = json.loads(events[-1])["error"]
        assert error["code"] == "engine_unavailable" and "tensor-parallel" in error["message"], error
        finished = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-1]]
        assert not any(finished), "no chunk may claim the generation finished"
        ready = httpx.get(f"{base}/ready", timeout=10)
        assert ready.status_code == 503 and "tensor-parallel rank 1" in ready.text, ready.text
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    assert server.returncode == 0, (tmp_path / "server.log").read_text()[-3000:]
    assert workers and running(workers) == []
