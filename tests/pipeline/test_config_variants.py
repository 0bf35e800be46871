"""Configs beyond the released model's, against transformers in the default configuration: other activations than
SiLU (transformers' ``ACT2FN`` names) in every part, and scaled rotary embeddings (``rope_type`` linear / yarn /
llama3 in ``rope_parameters``) in every transformer that reads them: Qwen3-Omni's Thinker (MRoPE), Talker, code
predictor and Code2Wav, Qwen2.5-Omni's Thinker, Talker and DiT. Neither changes a weight, so each test takes a
built checkpoint and sets them in config.json; text, codes and audio must equal transformers' generate. Rope
types whose frequencies follow the forward's length (dynamic NTK, longrope) too, each row rotated as transformers'
generate rotates it. The releases' own way of
writing the rope settings (transformers 4.5x: ``rope_scaling`` + ``rope_theta``) answers as the v5 form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_pipeline_parity import (
    PROMPTS,
    assert_all_free,
    assert_matches_reference,
    make_engine,
    reference,
    run,
)

from omnistage import Omni
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.qwen3_omni.code2wav import Code2WavConfig, Code2WavTransformer
from omnistage.models.qwen3_omni.config import load_config
from omnistage.models.qwen3_omni.mrope import mrope_cos_sin
from omnistage.models.qwen3_omni.talker import Talker
from omnistage.models.qwen3_omni.thinker import Thinker
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.testing.qwen2_5_omni.reference import reference_speech
from omnistage.testing.reference import fresh_rotaries, load_hf_reference
from omnistage.testing.variants import checkpoint_variant, qk_norms, scaled_variant

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
LINEAR = {"rope_type": "linear", "factor": 3.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
# the config sections holding each family's rotary settings
QWEN3_ROPE_PARTS = [("thinker_config", "text_config"), ("talker_config", "text_config"),
                    ("talker_config", "code_predictor_config"), ("code2wav_config",)]
QWEN2_5_ROPE_PARTS = [("thinker_config", "text_config"), ("talker_config",), ("token2wav_config", "dit_config")]


def _answers_differ(ckpt, other) -> bool:
    """Whether transformers' text or codes for some prompt differ between the two checkpoints."""
    def answer(path, i):
        tokens, codes, _ = reference(str(path), i)
        return tokens, codes

    return any(answer(ckpt, i)[0] != answer(other, i)[0] or not torch.equal(answer(ckpt, i)[1], answer(other, i)[1])
               for i in range(len(PROMPTS)))


def _with_rope(src: Path, dst: Path, parts, scaling: dict) -> Path:
    def edit(cfg):
        for keys, extra in zip(parts, scaling):
            part = cfg
            for key in keys:
                part = part[key]
            part["rope_parameters"] = {**part.get("rope_parameters", {}), **extra}

    return checkpoint_variant(src, dst, edit)


@pytest.fixture(scope="module")
def scaled(tiny_ckpt, tmp_path_factory):
    return _with_rope(tiny_ckpt, tmp_path_factory.mktemp("rope") / "ckpt", QWEN3_ROPE_PARTS, [YARN, LINEAR, LLAMA3, YARN])


def test_qwen3_scaled_rope_equals_transformers(scaled, tiny_ckpt):
    engine = make_engine(scaled)
    got = run(engine, {0: [1], 1: [0], 3: [2]})
    assert_all_free(engine)
    assert_matches_reference(scaled, got)
    # the scaling changes the answers
    assert _answers_differ(scaled, tiny_ckpt)


@torch.no_grad()
def test_qwen3_rotary_tables_equal_transformers(scaled):
    """Each decoder's cos / sin (frequencies and yarn's scale) equal transformers' rotary modules' at 3-D and 1-D
    positions, Code2Wav's (read from config.json) too."""
    hf = load_hf_reference(scaled)
    config = load_config(scaled)
    thinker, talker = Thinker(config), Talker(config)
    assert thinker.model.rotary.scale > 1.1  # yarn's: 0.1 ln(4) + 1
    pos = torch.stack([torch.arange(40), torch.arange(40) // 3, torch.arange(40) % 5])  # [3, N] T, H, W ids
    x = torch.zeros(1)
    for ours, theirs in ((mrope_cos_sin(pos.t(), thinker.model.rotary, thinker.mrope_axis, torch.float32),
                          hf.thinker.model.language_model.rotary_emb(x, pos[:, None].float())),
                         (talker.model.rotary(pos.t(), torch.float32), hf.talker.model.rotary_emb(x, pos[:, None]))):
        assert torch.equal(ours[0], theirs[0][0]) and torch.equal(ours[1], theirs[1][0])
    cp, q = talker.code_predictor.model, talker.num_code_groups
    cos, sin = hf.talker.code_predictor.model.rotary_emb(x, torch.arange(q)[None])
    assert torch.equal(cp.rope_cos, cos[0]) and torch.equal(cp.rope_sin, sin[0])
    code2wav = Code2WavTransformer(Code2WavConfig.from_checkpoint(scaled))
    assert code2wav.rotary_emb.scale > 1.1
    cos, sin = hf.code2wav.pre_transformer.rotary_emb(x, torch.arange(50)[None])
    ours = code2wav.rotary_emb(torch.arange(50), torch.float32)
    assert torch.equal(ours[0], cos[0]) and torch.equal(ours[1], sin[0])


def test_other_activations_equal_transformers(act_ckpt, tiny_ckpt):
    """GELU Thinker, GELU-new Talker, ReLU code predictor, QuickGELU Code2Wav (``act_ckpt``): the fused SiLU
    kernels step aside."""
    engine = make_engine(act_ckpt)
    got = run(engine, {0: [1], 1: [0], 3: [2]})
    assert_all_free(engine)
    assert_matches_reference(act_ckpt, got)
    # the activations change the answers (the same weights under SiLU answer otherwise)
    assert any(reference(str(act_ckpt), i)[0] != reference(str(tiny_ckpt), i)[0] for i in range(len(PROMPTS)))
    assert not torch.equal(got[1]["codes"], reference(str(tiny_ckpt), 1)[1])


@pytest.mark.parametrize("stored", [False, True], ids=["head-not-stored", "head-stored"])
def test_tied_output_head_equals_transformers(tiny_ckpt, tmp_path, stored):
    """``tie_word_embeddings``: as transformers loads it, the Thinker's output head is its token embedding where
    the checkpoint stores no head, and the stored head where it does."""
    def tie(cfg):
        cfg["thinker_config"]["tie_word_embeddings"] = True

    ckpt = checkpoint_variant(tiny_ckpt, tmp_path / "ckpt", tie,
                              None if stored else lambda name: name == "thinker.lm_head.weight")
    hf = load_hf_reference(ckpt).thinker
    assert (hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()) == (not stored)
    engine = make_engine(ckpt)
    assert_matches_reference(ckpt, run(engine, {0: [1], 1: [0], 3: [2]}))
    assert_all_free(engine)
    assert _answers_differ(ckpt, tiny_ckpt) == (not stored)  # the tied head answers otherwise; a stored one not


def _release_style(src: Path, dst: Path, parts, legacy: dict | None = None) -> Path:
    """The checkpoint's config as the releases write it (transformers 4.5x): each part's rope in ``rope_scaling``,
    the legacy ``type`` beside ``rope_type``, and ``rope_theta`` beside it, not v5's ``rope_parameters``;
    ``legacy``: a part's rope given the oldest way instead (``type`` alone, e.g. a yarn scaling)."""
    def edit(cfg):
        for keys in parts:
            part = cfg
            for key in keys:
                part = part[key]
            rope = dict(part.pop("rope_parameters"))
            part["rope_theta"] = rope.pop("rope_theta")
            rope.pop("mrope_interleaved", None)  # (not in the releases' files)
            part["rope_scaling"] = {**rope, "type": rope["rope_type"]}
            if legacy and keys in legacy:
                part["rope_scaling"] = {k: v for k, v in part["rope_scaling"].items() if k != "rope_type"} | legacy[keys]

    return checkpoint_variant(src, dst, edit)


def test_release_style_rope_configs_equal_transformers(tiny_ckpt, tmp_path):
    """Qwen3-Omni's released config.json keeps each part's rope in ``rope_scaling`` + ``rope_theta``: the same
    answers as the v5 form, equal to transformers'; a legacy ``type: yarn`` (no ``rope_type``) scales as yarn."""
    release = _release_style(tiny_ckpt, tmp_path / "release", QWEN3_ROPE_PARTS)
    got = run(make_engine(release), {0: [1], 1: [0], 3: [2]})
    assert_matches_reference(release, got)
    assert not _answers_differ(release, tiny_ckpt)
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    legacy = _release_style(tiny_ckpt, tmp_path / "legacy", QWEN3_ROPE_PARTS, {QWEN3_ROPE_PARTS[1]: yarn})
    assert_matches_reference(legacy, run(make_engine(legacy), {0: [1], 1: [0], 3: [2]}))
    assert Talker(load_config(legacy)).model.rotary.scale > 1.1  # (yarn's attention scale: read, not dropped)


# Rope types whose frequencies follow the forward's length: the Thinker's prompts are 10, 25 and 50 rows long and
# answer 6-9 tokens, so at 28 one answer crosses the original length while decoding, one prompt is past it; each
# Talker prompt is longer than the Thinker's and answers 24 codes, so at 40 they cross or start past it; a code
# predictor frame crosses 6 from its 7th position. Code2Wav's original length is the released one.
QWEN3_LENGTH_ROPES = [
    {"rope_type": "dynamic", "factor": 4.0, "max_position_embeddings": 28},
    {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 40,
     "short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0], "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0]},
    {"rope_type": "dynamic", "factor": 3.0, "max_position_embeddings": 6},
    {"rope_type": "dynamic", "factor": 2.0},
]


def _with_length_rope(src: Path, dst: Path, parts, ropes) -> Path:
    """``_with_rope``, a part's ``max_position_embeddings`` (dynamic's original length) set where given."""
    split = [({k: v for k, v in r.items() if k != "max_position_embeddings"}, r.get("max_position_embeddings"))
             for r in ropes]

    def edit(cfg):
        for keys, (_, mpe) in zip(parts, split):
            part = cfg
            for key in keys:
                part = part[key]
            if mpe is not None:
                part["max_position_embeddings"] = mpe

    return checkpoint_variant(_with_rope(src, dst.with_name(dst.name + "-rope"), parts, [r for r, _ in split]), dst,
                              edit)


@pytest.fixture(scope="module")
def sharp(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint with its q / k norm weights x4: its random weights attend almost uniformly, where
    rotary frequencies hardly change an answer; sharper attention shows them."""
    return scaled_variant(tiny_ckpt, tmp_path_factory.mktemp("sharp") / "ckpt", qk_norms, 4.0)


@pytest.fixture(scope="module")
def length_scaled(sharp, tmp_path_factory):
    return _with_length_rope(sharp, tmp_path_factory.mktemp("rope-len") / "ckpt", QWEN3_ROPE_PARTS,
                             QWEN3_LENGTH_ROPES)


@pytest.mark.parametrize("scheduler", [{}, {"max_num_batched_tokens": 7, "max_num_seqs": 4, "block_size": 4}],
                         ids=["whole", "chunked"])
def test_qwen3_rope_following_the_length_equals_transformers(length_scaled, sharp, scheduler):
    """dynamic NTK and longrope in every part: each row rotated with the frequencies of the forward transformers'
    generate computes it in (prompt rows: the prompt's length, however the prefill is chunked; decode rows: their
    own), for requests that cross the original length while decoding and ones whose prompt is past it, batched
    together; asked again, they take the cached blocks before the original length and answer the same."""
    engine = make_engine(length_scaled, thinker={"scheduler": scheduler}, talker={"scheduler": scheduler})
    got = run(engine, {0: [1, 2], 1: [0]})
    assert_all_free(engine)
    again = run(engine, {0: [0, 1, 2]})
    assert engine.resource_stats()["thinker"]["prefix_cache_hits"] > 0
    for i in range(len(PROMPTS)):
        assert again[i]["tokens"] == got[i]["tokens"] and torch.equal(again[i]["codes"], got[i]["codes"])
    assert_matches_reference(length_scaled, got)
    # past their original lengths the frequencies change the answers (the first prompt's text never gets there)
    assert [got[i]["tokens"] != reference(str(sharp), i)[0] for i in range(len(PROMPTS))] == [False, True, True]
    assert not any(torch.equal(got[i]["codes"], reference(str(sharp), i)[1]) for i in range(len(PROMPTS)))


def test_qwen3_rope_following_the_length_on_the_graph_runner_and_after_preemption(length_scaled):
    """The CUDA-graph runner's static decode steps take each row's frequencies as a row-aligned input; Talker
    requests preempted and recomputed rotate their decode rows as when they were decoded."""
    from omnistage.runner.graph_runner import CUDAGraphARRunner

    small_pool = {"scheduler": {"block_size": 4, "num_blocks": 24, "max_model_len": 80}, "sampling": {"max_tokens": 32}}
    eng = OmniEngine(EngineArgs(str(length_scaled)), load_pipeline_config(
        "qwen3_omni", {"runner": "cuda_graph", "stages": {"talker": small_pool}}))
    assert isinstance(eng.orchestrator.stages["talker"].runner, CUDAGraphARRunner)
    sched = eng.orchestrator.stages["talker"].scheduler
    preempted, original = [], sched._preempt
    sched._preempt = lambda request: preempted.append(request.req_id) or original(request)
    got = run(eng, {0: [0, 1, 2]})
    assert preempted, "the pool was meant to be too small for three talkers at once"
    assert eng.orchestrator.stages["talker"].runner.stats.static_steps > 0
    assert_all_free(eng)
    assert_matches_reference(length_scaled, got)


@torch.no_grad()
def test_rope_following_the_length_tables_equal_transformers(length_scaled):
    """A row's cos / sin for a forward of a given length equal transformers' rotary module's after a forward that
    long (the base ones at or below the original length), 3-D and 1-D positions."""
    hf = load_hf_reference(length_scaled)
    config = load_config(length_scaled)
    thinker, talker = Thinker(config), Talker(config)
    x = torch.zeros(1)
    for length in (5, 28, 29, 41, 60):
        pos = torch.stack([torch.arange(length), torch.arange(length) // 3, torch.arange(length) % 5])
        for rotary, theirs, ours in (
            (thinker.model.rotary, hf.thinker.model.language_model.rotary_emb,
             lambda p, f: mrope_cos_sin(p, thinker.model.rotary, thinker.mrope_axis, torch.float32, f)),
            (talker.model.rotary, hf.talker.model.rotary_emb,
             lambda p, f: talker.model.rotary(p, torch.float32, f)),
        ):
            fresh_rotaries(hf)
            cos, sin = theirs(x, pos[:, None].float())
            got = ours(pos.t().float(), rotary.row_frequencies([float(length)] * length))
            assert torch.equal(got[0], cos[0]) and torch.equal(got[1], sin[0])
    # the code predictor's frame: rows 0-1 one prefill forward, each later row a forward of its own
    cp, q = talker.code_predictor.model, talker.num_code_groups
    rotary = hf.talker.code_predictor.model.rotary_emb
    for p in range(q):
        fresh_rotaries(hf)
        cos, sin = rotary(x, torch.arange(max(p + 1, 2))[None])
        assert torch.equal(cp.rope_cos[p], cos[0, p]) and torch.equal(cp.rope_sin[p], sin[0, p])


def test_rope_parameters_transformers_cannot_compute_are_refused_naming_them(tiny_ckpt, tmp_path):
    """A longrope whose original length is 1 divides by log(1) in transformers' own load: refused at load with the
    rope's parameters, not a ZeroDivisionError from inside."""
    bad = {"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 1,
           "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    ckpt = _with_rope(tiny_ckpt, tmp_path / "ckpt", [QWEN3_ROPE_PARTS[2]], [bad])
    with pytest.raises(ValueError, match="rope_type 'longrope': its parameters give no frequencies.*"
                                         "'original_max_position_embeddings': 1"):
        Talker(load_config(ckpt))


def test_rope_following_the_length_keeps_rows_past_it_out_of_the_prefix_cache(length_scaled):
    """Rows rotated past the original length depend on their forward's length, not on the rows: no block holding
    one is registered or reused; blocks before it are, as for any rope."""
    from omnistage.core.request import Request
    from omnistage.models.qwen3_omni.stage_models import ThinkerStageModel

    model = ThinkerStageModel(Thinker(load_config(length_scaled)))
    short, long_ = Request("a", list(range(20)), SamplingParams()), Request("b", list(range(30)), SamplingParams())
    assert model.block_extra_key({}, short, 0, 16) == b""
    assert model.block_extra_key({}, short, 16, 28) == b""  # decode rows up to position 27: length 28
    assert model.block_extra_key({}, short, 16, 32) is None
    assert model.block_extra_key({}, long_, 0, 16) is None  # a prompt of 30 rows: its prefill is past 28


TEXT_TOKENS, CODES, SEED = 8, 24, 5


@pytest.fixture(scope="module")
def q25_scaled(q25_ckpt, tmp_path_factory):
    return _with_rope(q25_ckpt, tmp_path_factory.mktemp("q25-rope") / "ckpt", QWEN2_5_ROPE_PARTS, [YARN, LINEAR, LINEAR])


def assert_q25_speech_matches_reference(ckpt: Path):
    """A Qwen2.5-Omni checkpoint's greedy text and one-shot speech equal transformers' generate (audio within
    1e-4); returns omnistage's output."""
    params = {"thinker": SamplingParams(temperature=0.0, max_tokens=TEXT_TOKENS),
              "talker": SamplingParams(temperature=0.0, max_tokens=CODES, repetition_penalty=1.05, seed=SEED)}
    one_shot = {"stages": {"token2wav": {"bridge_args": {"chunk_blocks": 10_000, "past_blocks": 0,
                                                         "future_blocks": 0}}}}
    with Omni(ckpt, pipeline=load_pipeline_config("qwen2_5_omni", one_shot)) as o:
        out = o.generate(["Tell me a short story about the sea and a small boat."], ["text", "audio"], params)[0]
    eos = json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"]
    tokens, wav = reference_speech(ckpt, out.prompt_token_ids, TEXT_TOKENS, CODES, SEED)
    assert out.token_ids == (tokens[:-1] if tokens[-1] in eos else tokens)
    assert out.audio.shape == wav.shape and (out.audio - wav).abs().max().item() <= 1e-4
    return out


def test_qwen2_5_scaled_rope_equals_transformers(q25_scaled):
    assert_q25_speech_matches_reference(q25_scaled)


def test_qwen2_5_release_style_rope_config_equals_transformers(q25_ckpt, tmp_path):
    assert_q25_speech_matches_reference(_release_style(q25_ckpt, tmp_path / "release", QWEN2_5_ROPE_PARTS))


# The spoken prompt is 123 rows, past the Thinker's 100 (Qwen3-Omni's test crosses it while decoding);
# the Talker's prompt is 125 rows and answers 24 codes: at 135 they cross it; the DiT's one forward over 48 mel
# frames is past 16.
QWEN2_5_LENGTH_ROPES = [
    {"rope_type": "dynamic", "factor": 4.0, "max_position_embeddings": 100},
    {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 135,
     "short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0], "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0]},
    {"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 16,
     "short_factor": [1.0] * 8, "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0]},
]


def test_qwen2_5_rope_following_the_length_equals_transformers(q25_ckpt, tmp_path):
    """Qwen2.5-Omni's Thinker (dynamic NTK), Talker and DiT (longrope) as transformers' generate rotates them."""
    # (queries x4: attention peaks enough for the frequencies to show)
    sharp = scaled_variant(q25_ckpt, tmp_path / "sharp", lambda name: ".self_attn.q_proj." in name, 4.0)
    ckpt = _with_length_rope(sharp, tmp_path / "ckpt", QWEN2_5_ROPE_PARTS, QWEN2_5_LENGTH_ROPES)
    out = assert_q25_speech_matches_reference(ckpt)
    # past their original lengths the frequencies change the answers
    tokens, wav = reference_speech(sharp, out.prompt_token_ids, TEXT_TOKENS, CODES, SEED)
    assert out.token_ids != tokens[: len(out.token_ids)]
    assert out.audio.shape != wav.shape or (out.audio - wav).abs().max().item() > 1e-2
