"""The paged attention path (FlexAttention over the block table, no gathered copy) equals gather + SDPA.

FlexAttention runs on CPU under torch.compile, so the comparison runs here too; each new shape compiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.batch import SequenceInput


@pytest.mark.slow
def test_paged_attention_equals_gathered(llama_dir: Path, kit: Any) -> None:
    runner = kit.PagedRunner(llama_dir)
    prompts = kit.random_prompts([40, 23], seed=3)
    blocks = runner.blocks
    for sid, n in ((0, 37), (1, 20)):
        blocks.allocate(str(sid), n + 3)
    table0, table1 = blocks.block_table("0"), blocks.block_table("1")

    # prefill of unequal lengths: one padded (non-uniform) group
    gathered, paged = kit.both_attention_paths(runner, [SequenceInput(prompts[0][:37], 0, table0, list(range(37))),
                                          SequenceInput(prompts[1][:20], 0, table1, list(range(20)))])
    torch.testing.assert_close(paged, gathered, atol=1e-5, rtol=1e-5)

    # verify-shaped step (3 tokens each), plus a sequence that shares sequence 0's first two blocks, as
    # prefix caching shares them, and computes only its own tail
    blocks.allocate("2", 40)
    shared = table0[:2] + blocks.block_table("2")[2:]
    tail = prompts[0][:32] + [5, 6, 7]
    gathered, paged = kit.both_attention_paths(runner, [SequenceInput(prompts[0][37:40], 37, table0, [0, 1, 2]),
                                          SequenceInput(prompts[1][20:23], 20, table1, [0, 1, 2]),
                                          SequenceInput(tail[32:35], 32, shared, [0, 1, 2])])
    torch.testing.assert_close(paged, gathered, atol=1e-5, rtol=1e-5)
    assert gathered.shape[0] == 9
