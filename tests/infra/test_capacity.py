"""The capacity plan against the guides' worked examples and the stacks in stacks/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from infra import capacity
from infra.capacity import GIB, MIB, CapacityError, plan
from infra.catalog import CATALOG, instance_type
from infra.config import StackConfig, load_stack


def _with(config: StackConfig, section: str, **changes: Any) -> StackConfig:
    return config.model_copy(update={section: getattr(config, section).model_copy(update=changes)})


@pytest.fixture(scope="module")
def dev() -> StackConfig:
    return load_stack("dev").config


# --- the guide's numbers (section 3) ---------------------------------------------------------

@pytest.mark.parametrize(("dtype", "expected_gb"), [("fp16", 14), ("bf16", 14), ("int8", 7), ("int4", 3.5)])
def test_weights_of_a_7b_model_match_the_guide_table(dtype: str, expected_gb: float) -> None:
    assert capacity.weight_bytes(7e9, dtype) == pytest.approx(expected_gb * 1e9)


@pytest.mark.parametrize(("params_b", "expected_gb"), [(13, 26), (70, 140)])
def test_fp16_weights_of_larger_models_match_the_guide_table(params_b: float, expected_gb: float) -> None:
    assert capacity.weight_bytes(params_b * 1e9, "fp16") == pytest.approx(expected_gb * 1e9)


def test_kv_per_token_of_the_guide_example_is_half_a_megabyte() -> None:
    # 32 layers, KV dim 4096 (32 heads x 128), fp16: 2 x 32 x 4096 x 2 bytes
    assert capacity.kv_bytes_per_token(32, 32, 128, "fp16") == 0.5 * MIB


def test_a_4096_token_request_of_the_guide_example_holds_2_gb_of_kv() -> None:
    assert capacity.kv_bytes_per_token(32, 32, 128, "fp16") * 4096 == 2 * GIB


def test_eight_such_requests_need_16_gb_of_kv() -> None:
    assert capacity.kv_bytes_per_token(32, 32, 128, "fp16") * 4096 * 8 == 16 * GIB


def test_decode_ceiling_of_7b_fp16_at_1_tb_s_is_about_70_tokens_per_second() -> None:
    assert capacity.decode_ceiling_tokens_per_s(1000, 14e9) == pytest.approx(71.4, abs=0.1)


# --- the estimate -------------------------------------------------------------------------------

def test_kv_peak_is_per_token_times_peak_context_times_concurrency(dev: StackConfig) -> None:
    e = capacity.estimate_memory(dev)
    context = dev.scheduler.max_input_len + dev.scheduler.max_output_len + dev.speculative.num_draft_tokens
    assert (e.context_tokens, e.kv_peak) == (context, e.kv_per_token * context * dev.scheduler.max_concurrency)


def test_draft_model_adds_its_weights_and_its_kv_cache(dev: StackConfig) -> None:
    e = capacity.estimate_memory(dev)
    assert e.draft_weights == 0.49e9 * 2
    assert e.kv_per_token == 2 * 28 * 4 * 128 * 2 + 2 * 24 * 2 * 64 * 2


def test_ngram_speculation_carries_no_draft(dev: StackConfig) -> None:
    e = capacity.estimate_memory(_with(dev, "speculative", method="ngram"))
    assert e.draft is None and e.draft_weights == 0


def test_required_memory_adds_the_guides_headroom(dev: StackConfig) -> None:
    e = capacity.estimate_memory(dev)
    assert e.required == pytest.approx(e.total * 1.15)
    assert 0.15 <= capacity.HEADROOM <= 0.20


def test_dimensions_come_from_config_json_when_readable(dev: StackConfig, tmp_path: Path) -> None:
    hf = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
          "intermediate_size": 11008, "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model = dev.model.model_copy(update={"source": f"file://{tmp_path}", "params_b": None, "num_layers": None})
    dims = capacity.model_dims(model, "model")
    assert (dims.source, dims.num_layers, dims.kv_bytes_per_token) == ("config.json", 32, 2 * 32 * 32 * 128 * 2)
    assert dims.params == pytest.approx(6.74e9, rel=0.01)  # Llama-2-7B


def test_missing_dimensions_name_the_stack_keys(dev: StackConfig) -> None:
    model = dev.model.model_copy(update={"num_layers": None, "hidden_size": None})
    with pytest.raises(CapacityError, match=r"model\.num_layers, model\.hidden_size"):
        capacity.model_dims(model, "model")


# --- instance selection -------------------------------------------------------------------------

def test_catalog_covers_the_five_families() -> None:
    assert {item.family for item in CATALOG} == {"g5", "g6", "g6e", "p4d", "p5"}


def test_auto_picks_the_cheapest_type_that_fits(dev: StackConfig) -> None:
    result = plan(dev)
    fitting = [f.instance.price_per_hour for f in result.candidates if f.fits]
    assert result.fit.fits and result.instance.price_per_hour == min(fitting)


def test_dev_lands_on_one_l40s(dev: StackConfig) -> None:
    assert plan(dev).instance.name == "g6e.xlarge"


def test_a_given_type_that_fits_is_kept(dev: StackConfig) -> None:
    assert plan(_with(dev, "fleet", instance_type="g6e.4xlarge")).instance.name == "g6e.4xlarge"


def test_a_given_type_that_is_too_small_fails_with_numbers_and_fixes(dev: StackConfig) -> None:
    with pytest.raises(CapacityError) as info:
        plan(_with(dev, "fleet", instance_type="g5.2xlarge"))
    message = str(info.value)
    assert "does not fit fleet.instance_type g5.2xlarge" in message
    assert "GPU has 24.0 GiB" in message
    assert "scheduler.max_concurrency 16 ->" in message
    assert "fleet.instance_type auto (cheapest that fits: g6e.xlarge)" in message


def test_an_unknown_type_is_an_error_listing_the_catalog(dev: StackConfig) -> None:
    with pytest.raises(CapacityError, match="not in the instance catalog.*g6e.xlarge"):
        plan(_with(dev, "fleet", instance_type="m5.large"))


def test_a_70b_bf16_model_fits_nothing_and_says_why(dev: StackConfig) -> None:
    big = _with(dev, "model", params_b=70.0, num_layers=80, hidden_size=8192, num_kv_heads=8, vocab_size=128256)
    with pytest.raises(CapacityError) as info:
        plan(big)
    assert "does not fit any catalogued type" in str(info.value)
    # dev's context and concurrency: 4 GPUs' shares fit an 80 GiB GPU; no 4-GPU type has them, so the 8-GPU one
    assert "model.tensor_parallel_size 1 -> 4 (cheapest that fits: p5.48xlarge, 8 GPUs" in str(info.value)

    # without the vocabulary the per-GPU share of a sharded model is unknown (the tables are on every GPU)
    with pytest.raises(CapacityError, match=r"set model.vocab_size .*embedding and lm_head"):
        plan(_with(big, "model", vocab_size=None))
    with pytest.raises(CapacityError, match=r"tensor_parallel_size 4 needs the vocabulary size"):
        plan(_with(big, "model", vocab_size=None, tensor_parallel_size=4))


def test_spot_pools_are_other_sizes_of_the_same_gpu(dev: StackConfig) -> None:
    assert plan(dev).same_gpu_alternatives(3) == ["g6e.2xlarge", "g6e.4xlarge", "g6e.8xlarge"]


def test_the_server_budget_is_checked_separately(dev: StackConfig) -> None:
    tight = _with(dev, "service", max_memory_utilization=0.2)
    fit = capacity.check_fit(capacity.estimate_memory(tight), instance_type("g6e.xlarge"), 0.2)  # type: ignore[arg-type]
    assert any("max_memory_utilization 0.2" in problem for problem in fit.problems)


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
def test_every_aws_stack_has_a_plan(stack: str) -> None:
    result = plan(load_stack(stack).config)
    assert result.fit.fits and result.estimate.required <= result.instance.gpu_memory_gib * GIB


def test_plan_command_prints_the_instance(capsys: pytest.CaptureFixture[str]) -> None:
    from infra.ops.cli.main import main

    assert main(["plan", "--stack", "dev"]) == 0
    assert "g6e.xlarge (cheapest that fits)" in capsys.readouterr().out


def test_plan_command_lists_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    from infra.ops.cli.main import main

    assert main(["plan", "--stack", "dev", "--candidates"]) == 0
    out = capsys.readouterr().out
    assert "g6e.xlarge     NVIDIA L40S" in out and "g5.xlarge" in out and "no: " in out


def test_plan_command_reports_a_misfit_as_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from infra.config import project_stacks_dir
    from infra.ops.cli.main import main

    text = (project_stacks_dir() / "Pulumi.dev.yaml").read_text()
    text = text.replace("instance_type: auto", "instance_type: g5.xlarge")
    (tmp_path / "Pulumi.dev.yaml").write_text(text)
    assert main(["plan", "--stack", "dev", "--stacks-dir", str(tmp_path)]) == 2
    assert "does not fit fleet.instance_type g5.xlarge" in capsys.readouterr().err


# --- quantized weights (#19) -----------------------------------------------------------------

def test_int8_weights_take_one_byte_per_parameter_and_kv_stays_in_dtype(dev: StackConfig) -> None:
    bf16, int8 = capacity.estimate_memory(dev), capacity.estimate_memory(_with(dev, "model", quantization="int8"))
    assert int8.weights == pytest.approx(bf16.weights / 2)
    assert int8.kv_per_token == bf16.kv_per_token


def test_an_int8_8b_stack_lands_on_a_cheaper_instance_than_bf16(dev: StackConfig) -> None:
    bf16, int8 = plan(dev), plan(_with(dev, "model", quantization="int8"))
    assert int8.instance.price_per_hour < bf16.instance.price_per_hour
    assert "bf16, int8 weights" in int8.render()


def test_the_server_config_carries_the_stacks_quantization(dev: StackConfig) -> None:
    from infra.config import render_server_config

    assert render_server_config(dev).model.quantization == "none"
    assert render_server_config(_with(dev, "model", quantization="int8")).model.quantization == "int8"


def test_a_quantized_draft_is_refused_by_name(dev: StackConfig) -> None:
    data = dev.model_dump()
    data["draft"]["quantization"] = "int8"
    with pytest.raises(ValueError, match="draft.quantization"):
        StackConfig.model_validate(data)
