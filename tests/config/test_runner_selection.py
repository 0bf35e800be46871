import pytest

from omnistage.config import (
    ModelCapabilities,
    UnsupportedConfigError,
    resolve_stage_runner,
    validate_pipeline,
)
from omnistage.models.registry import load_pipeline_config

PLAIN = {p: ModelCapabilities() for p in ("thinker", "talker", "code2wav")}
NATIVE = {p: ModelCapabilities(supports_native_data_plane=True) for p in ("thinker", "talker", "code2wav")}


def test_stage_override_and_deployment_default():
    p = load_pipeline_config("qwen3_omni", overrides={"stages": {"talker": {"runner": "v2"}}})
    assert [resolve_stage_runner(p.stage(n), p) for n in p.order] == ["eager", "cuda_graph", "eager"]
    assert validate_pipeline(p, PLAIN) == {"thinker": "eager", "talker": "cuda_graph", "code2wav": "eager"}
    p = load_pipeline_config(
        "qwen3_omni", overrides={"runner": "v2", "stages": {"thinker": {"runner": "v1"}}}
    )
    assert validate_pipeline(p, PLAIN) == {"thinker": "eager", "talker": "cuda_graph", "code2wav": "cuda_graph"}


def test_accepted_native_combination():
    p = load_pipeline_config(
        "qwen3_omni",
        overrides={
            "runner": "v2",
            "stages": {"talker": {"data_plane": "native"}, "thinker": {"data_plane": "native"}},
        },
    )
    # A source stage may use multi_turn: it receives no upstream input.
    p2 = load_pipeline_config(
        "qwen3_omni",
        overrides={
            "runner": "v2",
            "stages": {"thinker": {"data_plane": "native", "session_mode": "multi_turn"}},
        },
    )
    assert validate_pipeline(p, NATIVE)["talker"] == "cuda_graph"
    assert validate_pipeline(p2, NATIVE)["thinker"] == "cuda_graph"


def _reject(overrides, caps, stage, field, match):
    p = load_pipeline_config("qwen3_omni", overrides=overrides)
    with pytest.raises(UnsupportedConfigError, match=match) as info:
        validate_pipeline(p, caps)
    assert (info.value.stage, info.value.field) == (stage, field)
    assert f"stage {stage!r}" in str(info.value)


def test_native_data_plane_without_capability():
    caps = dict(NATIVE, talker=ModelCapabilities(supports_native_data_plane=False))
    _reject(
        {"runner": "v2", "stages": {"talker": {"data_plane": "native"}}},
        caps,
        "talker",
        "data_plane",
        "does not declare supports_native_data_plane",
    )


def test_native_data_plane_needs_the_graph_runner_even_when_only_the_default_is_eager():
    _reject(
        {"stages": {"talker": {"data_plane": "native"}}}, NATIVE, "talker", "data_plane", "only in the cuda_graph"
    )


def test_native_v2_stage_with_upstream_input_must_be_single_turn():
    _reject(
        {"stages": {"code2wav": {"runner": "v2", "data_plane": "native", "session_mode": "multi_turn"}}},
        NATIVE,
        "code2wav",
        "session_mode",
        "single_turn",
    )


def test_multi_turn_allowed_with_inproc_data_plane():
    p = load_pipeline_config(
        "qwen3_omni", overrides={"stages": {"talker": {"runner": "v2", "session_mode": "multi_turn"}}}
    )
    assert validate_pipeline(p, PLAIN)["talker"] == "cuda_graph"


def test_missing_capabilities_for_model_part():
    caps = {"thinker": ModelCapabilities(), "talker": ModelCapabilities()}
    _reject({}, caps, "code2wav", "model_part", "no capabilities declared")


def test_unknown_runner_version_rejected_before_any_request():
    from omnistage.config import ConfigError

    with pytest.raises(ConfigError, match="unknown runner 'v3'") as info:
        load_pipeline_config("qwen3_omni", overrides={"stages": {"talker": {"runner": "v3"}}})
    assert (info.value.stage, info.value.field) == ("talker", "runner")
    with pytest.raises(ConfigError, match="unknown runner 'v0'"):
        load_pipeline_config("qwen3_omni", overrides={"runner": "v0"})


def test_capabilities_validate_types():
    with pytest.raises(ValueError):
        ModelCapabilities(supports_native_data_plane="yes")
