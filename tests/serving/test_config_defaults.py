"""One definition per limit: the engine's defaults and bounds are the server config's."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.config import ModelSection, ServerConfig, SpeculativeSection
from serving.engine.config import EngineConfig, SpeculativeConfig

# The engine's own settings: the server config has no key for them.
ENGINE_ONLY = {"tokenizer", "seed"}


def test_engine_defaults_equal_the_server_configs() -> None:
    from_server = EngineConfig.from_server_config(ServerConfig(model=ModelSection(path="/m")))
    bare = EngineConfig(model="/m")
    shared = set(EngineConfig.model_fields) - ENGINE_ONLY
    assert {f: getattr(bare, f) for f in shared} == {f: getattr(from_server, f) for f in shared}


def test_engine_speculates_with_the_servers_defaults() -> None:
    assert SpeculativeConfig() == SpeculativeSection()
    assert EngineConfig(model="/m").speculative.method == "draft"


def test_engine_bounds_are_the_server_configs() -> None:
    with pytest.raises(ValidationError, match="max_memory_utilization"):
        EngineConfig(model="/m", max_memory_utilization=0.99)  # the server allows at most 0.95
    with pytest.raises(ValidationError, match="max_batched_tokens \\(16\\) is below max_concurrency \\(64\\)"):
        EngineConfig(model="/m", max_batched_tokens=16)


def test_the_rollout_wrapper_reaches_the_engine_and_the_bench_flag_spells_its_choices() -> None:
    from typing import get_args

    from infra.ops.cli.main import build_parser
    from serving.config import RolloutWrapper

    def server(**wrapper: str) -> ServerConfig:
        return ServerConfig.model_validate({"model": {"path": "/m"}, "speculative": {
            "enabled": True, "method": "draft", "draft_model": "/d", **wrapper}})

    assert server().speculative.draft_rollout_wrapper == "cpp"
    engine = EngineConfig.from_server_config(server(draft_rollout_wrapper="python"))
    assert engine.speculative.draft_rollout_wrapper == "python"
    with pytest.raises(ValidationError, match="draft_rollout_wrapper"):
        server(draft_rollout_wrapper="c")
    for value in get_args(RolloutWrapper):  # the bench flag offers exactly the config's choices
        assert build_parser().parse_args(["bench", "spec", "--draft-rollout-wrapper", value]).draft_rollout_wrapper \
            == value
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "spec", "--draft-rollout-wrapper", "c"])


@pytest.mark.parametrize("section, key, flag", [
    ("model", "cpu_weight_packing", "_PACKING_ARG"),
    ("model", "cpu_decode_attention", "_ATTENTION_ARG"),
    ("speculative", "draft_rollout", None),
])
def test_start_up_choice_keys_reach_the_engine_and_bad_values_are_refused(section: str, key: str,
                                                                          flag: str | None) -> None:
    """The keys the engine measures at start-up (auto | on | off): a server value reaches the engine, the default
    is auto, anything else is refused by name, and a bench flag for it spells the same choices."""
    from typing import get_args

    from infra.ops.cli import bench_cmd

    extra = {"enabled": True, "method": "draft", "draft_model": "/d"} if section == "speculative" else {}

    def server(value: str | None) -> ServerConfig:
        data: dict[str, object] = {"model": {"path": "/m"}}
        if value is not None or extra:
            entries = {**extra, **({key: value} if value is not None else {})}
            data[section] = {**data.get(section, {}), **entries}  # type: ignore[dict-item]
        return ServerConfig.model_validate(data)

    assert getattr(getattr(server(None), section), key) == "auto"
    engine = EngineConfig.from_server_config(server("off"))
    assert getattr(engine.speculative if section == "speculative" else engine, key) == "off"
    with pytest.raises(ValidationError, match=key):
        server("sometimes")
    field = (SpeculativeSection if section == "speculative" else ModelSection).model_fields[key]
    assert get_args(field.annotation) == ("auto", "on", "off")
    if flag is not None:
        assert tuple(getattr(bench_cmd, flag)["choices"]) == ("auto", "on", "off")
