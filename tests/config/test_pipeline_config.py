import copy
import textwrap

import pytest

from omnistage.config import ConfigError, ExecutionType, PipelineConfig, StageConfig
from omnistage.core.sampling_params import SamplingParams
from omnistage.core.scheduler_config import DEFAULT_KV_CACHE_BYTES, SchedulerConfig
from omnistage.models.qwen3_omni.family import Qwen3OmniFamily
from omnistage.models.registry import available_presets, load_pipeline_config


def raw_pipeline() -> dict:
    return {
        "family": "qwen3_omni",
        "stages": [
            {"name": "thinker", "execution": "ar", "model_part": "thinker", "final_output": "text"},
            {
                "name": "talker",
                "execution": "ar",
                "model_part": "talker",
                "inputs": ["thinker"],
                "bridge": "thinker2talker",
            },
            {
                "name": "code2wav",
                "execution": "generation",
                "model_part": "code2wav",
                "inputs": ["talker"],
                "bridge": "talker2code2wav",
                "final_output": "audio",
            },
        ],
    }


def test_preset_loads_with_documented_values():
    assert "qwen3_omni" in available_presets()
    p = load_pipeline_config("qwen3_omni")
    assert p.family == "qwen3_omni" and p.runner == "eager"
    assert p.order == ("thinker", "talker", "code2wav")
    thinker, talker, c2w = (p.stage(n) for n in p.order)
    assert thinker.execution is ExecutionType.AR and thinker.final_output == "text" and not thinker.inputs
    assert thinker.sampling.greedy and thinker.sampling.max_tokens == 256
    assert talker.inputs == ("thinker",) and talker.bridge == "thinker2talker"
    assert talker.final_output is None
    assert (talker.sampling.temperature, talker.sampling.top_k, talker.sampling.top_p) == (0.9, 50, 1.0)
    assert talker.sampling.repetition_penalty == 1.05 and talker.sampling.max_tokens == 4096
    assert c2w.execution is ExecutionType.GENERATION and c2w.final_output == "audio"
    assert dict(c2w.bridge_args) == {"first_chunk_frames": 4, "chunk_frames": 25}
    assert [s.name for s in p.final_stages] == ["thinker", "code2wav"]
    assert p.downstream("thinker") == ("talker",) and p.downstream("code2wav") == ()
    with pytest.raises(TypeError):
        c2w.bridge_args["chunk_frames"] = 1  # frozen
    assert hash(p) == hash(load_pipeline_config("qwen3_omni")) and {c2w: 1}[c2w] == 1


def test_overrides_merge_nested_and_keep_siblings():
    p = load_pipeline_config(
        "qwen3_omni",
        overrides={
            "runner": "v2",  # the seed's name for the CUDA-graph runner
            "stages": {
                "talker": {"sampling": {"temperature": 0.0}, "runner": "v1"},
                "code2wav": {"processor_args": {"first_chunk_frames": 300}},  # older key name
            },
        },
    )
    assert p.runner == "cuda_graph"
    talker = p.stage("talker")
    assert talker.sampling.temperature == 0.0 and talker.sampling.top_k == 50  # sibling kept
    assert talker.runner == "eager"
    assert p.stage("code2wav").bridge_args["first_chunk_frames"] == 300
    with pytest.raises(ConfigError, match="unknown stage 'talkr'"):
        load_pipeline_config("qwen3_omni", overrides={"stages": {"talkr": {"runner": "v2"}}})


def test_user_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        textwrap.dedent(
            """
            family: qwen3_omni
            runner: cuda_graph
            stages:
              - name: t
                execution: AR
                model_part: thinker
                final_output: text
                sampling: {temperature: 0.0, max_tokens: 8, stop_token_ids: [3, 4]}
                scheduler: {max_num_seqs: 2, max_num_batched_tokens: 64, max_model_len: 128, block_size: 4}
            """
        )
    )
    p = load_pipeline_config(path)
    assert p.order == ("t",) and p.runner == "cuda_graph"
    s = p.stage("t")
    assert s.sampling == SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(3, 4))
    assert s.scheduler == SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128, block_size=4
    )
    assert load_pipeline_config(str(path)) == p
    with pytest.raises(ConfigError, match="does not exist"):
        load_pipeline_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="unknown preset"):
        load_pipeline_config("qwen4_omni")


def _err(raw: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        PipelineConfig.from_dict(raw)
    return info.value


def test_unknown_stage_reference():
    raw = raw_pipeline()
    raw["stages"][1]["inputs"] = ["thinkr"]
    e = _err(raw)
    assert (e.stage, e.field) == ("talker", "inputs") and "'thinkr'" in str(e)


def test_input_declared_after_consumer_is_fine_and_order_is_topological():
    raw = raw_pipeline()
    raw["stages"].reverse()
    p = PipelineConfig.from_dict(raw)
    assert p.order == ("thinker", "talker", "code2wav")


def _family_err(raw: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        Qwen3OmniFamily.validate_pipeline(PipelineConfig.from_dict(raw))
    return info.value


def test_unknown_bridge_and_part_are_rejected_against_the_family():
    raw = raw_pipeline()
    raw["stages"][1]["bridge"] = "thinker2talkr"
    e = _family_err(raw)
    assert e.stage == "talker" and e.field == "bridge" and "thinker2talkr" in str(e)
    raw = raw_pipeline()
    raw["stages"][0]["model_part"] = "vision"
    e = _family_err(raw)
    assert (e.stage, e.field) == ("thinker", "model_part") and "vision" in str(e)
    raw = raw_pipeline()
    raw["stages"][2]["execution"] = "ar"
    e = _family_err(raw)
    assert (e.stage, e.field) == ("code2wav", "execution")


def test_stage_with_inputs_needs_bridge_and_source_must_not_have_one():
    raw = raw_pipeline()
    del raw["stages"][1]["bridge"]
    assert (_err(raw).stage, _err(raw).field) == ("talker", "bridge")
    raw = raw_pipeline()
    raw["stages"][0]["bridge"] = "thinker2talker"
    assert (_err(raw).stage, _err(raw).field) == ("thinker", "bridge")


def test_cycle():
    raw = raw_pipeline()
    raw["stages"][1]["inputs"] = ["code2wav"]
    e = _err(raw)
    assert "cycle" in str(e) and e.field == "inputs"
    raw = raw_pipeline()
    raw["stages"][1]["inputs"] = ["talker"]
    assert "own output" in str(_err(raw))


def test_bad_sampling_value():
    raw = raw_pipeline()
    raw["stages"][1]["sampling"] = {"top_p": 1.5}
    e = _err(raw)
    assert (e.stage, e.field) == ("talker", "sampling") and "top_p" in str(e)
    raw["stages"][1]["sampling"] = {"temprature": 0.5}
    e = _err(raw)
    assert e.stage == "talker" and "temprature" in str(e)


@pytest.mark.parametrize(
    "args, match",
    [
        ({"chunk_frames": 0}, "chunk_frames"),
        ({"first_chunk_frames": -1}, "first_chunk_frames"),
        ({"chunk_frames": 2.5}, "chunk_frames"),
        ({"chunk_frames": True}, "chunk_frames"),
        ({"left_context_frames": 25}, "left_context_frames"),  # gone: the stream carries its own context
        ({"chunk_size": 300}, "chunk_size"),
    ],
)
def test_bad_chunk_args(args, match):
    raw = raw_pipeline()
    raw["stages"][2]["bridge_args"] = args
    e = _family_err(raw)
    assert (e.stage, e.field) == ("code2wav", "bridge_args") and match in str(e)


def test_bridge_args_defaults_and_no_args_bridge():
    raw = raw_pipeline()
    raw["stages"][2]["bridge_args"] = {"chunk_frames": 50}
    p = Qwen3OmniFamily.validate_pipeline(PipelineConfig.from_dict(raw))
    assert dict(p.stage("code2wav").bridge_args) == {"first_chunk_frames": 4, "chunk_frames": 50}
    raw["stages"][1]["bridge_args"] = {"x": 1}
    assert (_family_err(raw).stage, _family_err(raw).field) == ("talker", "bridge_args")


@pytest.mark.parametrize("where", ["top", "stage", "scheduler"])
def test_unknown_key(where):
    raw = raw_pipeline()
    if where == "top":
        raw["runnr"] = "v2"
    elif where == "stage":
        raw["stages"][0]["final_ouput"] = "text"
    else:
        raw["stages"][0]["scheduler"] = {"max_num_seq": 4}
    with pytest.raises(ConfigError, match="unknown key"):
        PipelineConfig.from_dict(raw)


def test_duplicate_name():
    raw = raw_pipeline()
    raw["stages"].append(copy.deepcopy(raw["stages"][0]))
    e = _err(raw)
    assert (e.stage, e.field) == ("thinker", "name") and "duplicate" in str(e)


def test_other_field_errors():
    cases = [
        (lambda r: r["stages"][0].update(execution="diffusion"), ("thinker", "execution")),
        (lambda r: r["stages"][0].update(model_part=""), ("thinker", "model_part")),
        (lambda r: r["stages"][0].update(final_output="video"), ("thinker", "final_output")),
        (lambda r: r["stages"][0].update(runner="v3"), ("thinker", "runner")),
        (lambda r: r["stages"][0].update(data_plane="shm"), ("thinker", "data_plane")),
        (lambda r: r["stages"][0].update(session_mode="streaming"), ("thinker", "session_mode")),
        (lambda r: r["stages"][0].update(scheduler={"block_size": 0}), ("thinker", "scheduler")),
        (
            lambda r: r["stages"][0].update(scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 4}),
            ("thinker", "scheduler.max_num_batched_tokens"),
        ),
        (lambda r: r["stages"][0].update(sampling={"max_tokens": 4096}), ("thinker", "sampling.max_tokens")),
        (
            lambda r: r["stages"][0].update(scheduler={"num_blocks": 4, "kv_cache_bytes": 4}),
            ("thinker", "scheduler"),
        ),
        (lambda r: r["stages"][0].pop("model_part"), ("thinker", "model_part")),
        (lambda r: r.update(runner="v9"), (None, "runner")),
        (lambda r: r.update(family=""), (None, "family")),
        (lambda r: r["stages"][2].update(final_output="text"), (None, "final_output")),
        (lambda r: [st.update(final_output=None) for st in r["stages"]], (None, "stages")),
    ]
    for mutate, (stage, field) in cases:
        raw = raw_pipeline()
        mutate(raw)
        e = _err(raw)
        assert (e.stage, e.field) == (stage, field), (str(e), stage, field)
        if stage is not None:
            assert f"stage {stage!r}" in str(e)


def test_generation_stage_ignores_token_limits():
    raw = raw_pipeline()
    raw["stages"][2]["scheduler"] = {"max_num_seqs": 16, "max_num_batched_tokens": 1}
    assert PipelineConfig.from_dict(raw).stage("code2wav").scheduler.max_num_seqs == 16


def test_direct_construction_normalises_and_stays_frozen():
    s = StageConfig(name="a", execution="AR", model_part="thinker", inputs=[], final_output="text")
    assert s.execution is ExecutionType.AR and s.inputs == ()
    p = PipelineConfig(family="qwen3_omni", stages=[s])
    assert p.stages == (s,) and p.order == ("a",)
    with pytest.raises(AttributeError):
        s.name = "b"
    with pytest.raises(ConfigError, match="SamplingParams"):
        StageConfig(name="a", execution="ar", model_part="thinker", sampling={"temperature": 0.0})


def test_resolve_num_blocks_respects_the_budget_and_names_what_one_request_needs():
    sched = SchedulerConfig(max_num_seqs=2, max_model_len=100, block_size=16)
    assert sched.resolve_num_blocks(bytes_per_block=1) == 7 * 2  # default budget: capped at 2 full sequences
    assert sched.resolve_num_blocks(bytes_per_block=DEFAULT_KV_CACHE_BYTES // 10) == 10  # default budget binds
    assert SchedulerConfig(num_blocks=9, max_model_len=64, block_size=16).resolve_num_blocks(bytes_per_block=1) == 9
    sched = SchedulerConfig(max_model_len=64, block_size=16, kv_cache_bytes=1000)
    assert sched.resolve_num_blocks(bytes_per_block=100) == 10
    with pytest.raises(ValueError, match=r"needs 4 blocks \(2000 bytes\)"):
        sched.resolve_num_blocks(bytes_per_block=500)
    with pytest.raises(ValueError, match="must cover max_model_len"):
        SchedulerConfig(num_blocks=3, max_model_len=64, block_size=16)
