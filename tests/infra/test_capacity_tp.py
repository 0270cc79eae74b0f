"""Tensor parallelism in the capacity plan and the config (#19), against the example stacks in docs/examples/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from infra.capacity import GIB, CapacityError, estimate_memory, plan
from infra.config import StackConfig, load_stack, render_server_config
from serving.engine.config import EngineConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def _example(name: str) -> StackConfig:
    return load_stack(name, EXAMPLES).config


def _with(config: StackConfig, section: str, **changes: Any) -> StackConfig:
    return config.model_copy(update={section: getattr(config, section).model_copy(update=changes)})


def test_70b_with_tp8_picks_an_8_gpu_instance_and_shows_per_gpu_memory() -> None:
    result = plan(_example("llama70b-example"))
    assert result.instance.gpus == 8 and result.instance.name == "p4d.24xlarge"
    e = result.estimate
    # embedding and lm_head (128256 x 8192, untied, bf16: 3.9 GiB) are whole on every GPU; the layers split 8 ways
    tables = 2 * 128256 * 8192 * 2
    assert e.target.table_bytes == tables
    assert e.weights_per_gpu == pytest.approx((e.weights - tables) / 8 + tables)
    assert e.kv_peak_per_gpu == pytest.approx(e.kv_peak / 8)
    text = result.render()
    assert (f"per GPU weights {(e.weights - tables) / GIB:.1f}/8 (layers) + {tables / GIB:.1f} (embedding and "
            f"lm_head, on every GPU) = {e.weights_per_gpu / GIB:.1f} GiB") in text
    assert "tensor parallel: the server starts 8 processes, one per GPU" in text
    assert result.as_dict()["tensor_parallel_size"] == 8


def test_70b_at_tp1_suggests_the_smallest_tp_that_fits() -> None:
    with pytest.raises(CapacityError, match=r"model.tensor_parallel_size 1 -> 4 \(cheapest that fits: p5.48xlarge"):
        plan(_with(_example("llama70b-example"), "model", tensor_parallel_size=1))


def test_a_tp_larger_than_the_instance_gpu_count_is_refused() -> None:
    with pytest.raises(CapacityError, match="1 GPU\\(s\\), model.tensor_parallel_size 8 needs 8"):
        plan(_with(_example("llama70b-example"), "fleet", instance_type="p5.4xlarge"))


def test_int8_8b_picks_a_smaller_instance_than_bf16() -> None:
    int8 = _example("llama8b-int8-example")
    bf16 = plan(_with(int8, "model", quantization="none"))
    quantized = plan(int8)
    assert quantized.instance.gpu_memory_gib < bf16.instance.gpu_memory_gib
    assert quantized.instance.price_per_hour < bf16.instance.price_per_hour


def test_kv_heads_that_do_not_divide_by_tp_are_refused_with_the_numbers() -> None:
    odd = _with(_example("llama70b-example"), "model", num_kv_heads=6)
    with pytest.raises(CapacityError, match="6 KV heads.*tensor_parallel_size 8 \\(6 % 8 = 6\\)"):
        estimate_memory(odd)


def test_kubernetes_gpus_per_pod_must_cover_tp() -> None:
    k8s = load_stack("k8s-dev").config
    data = k8s.model_dump(exclude_none=True)
    data["model"]["tensor_parallel_size"] = 2
    data["kubernetes"]["gpus_per_pod"] = 1
    with pytest.raises(ValueError, match=r"kubernetes.gpus_per_pod \(1\).*model.tensor_parallel_size \(2\)"):
        StackConfig.model_validate(data)
    data["kubernetes"]["gpus_per_pod"] = 2
    assert StackConfig.model_validate(data).model.tensor_parallel_size == 2


def test_the_server_runs_the_stacks_tp() -> None:
    config = _example("llama70b-example")
    server = render_server_config(config)
    assert server.model.tensor_parallel_size == 8  # rendered into the server's config...
    assert EngineConfig.from_server_config(server).tensor_parallel_size == 8  # ...and where the engine is built
