"""`model.device: cuda` is a promise, not a preference: without a CUDA device the engine refuses to
start and says why, instead of serving on the CPU (GPU stacks render `device: cuda`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


def test_cuda_without_a_device_refuses_to_start_and_names_why(
        kit: Any, llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a driver/toolkit mismatch looks like this
    with pytest.raises(RuntimeError, match=r"model.device is cuda but torch .* finds no CUDA device"):
        kit.make_engine(llama_dir, device="cuda")


def test_auto_still_falls_back_to_the_cpu(kit: Any, llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kit.make_engine(llama_dir, device="auto").device.type == "cpu"
