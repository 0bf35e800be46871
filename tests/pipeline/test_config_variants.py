"""Configs beyond the released model's, against transformers in the default configuration: other activations than
SiLU (transformers' ``ACT2FN`` names) in every part, and scaled rotary embeddings (``rope_type`` linear / yarn /
llama3 in ``rope_parameters``) in every transformer that reads them: Qwen3-Omni's Thinker (MRoPE), Talker, code
predictor and Code2Wav, Qwen2.5-Omni's Thinker, Talker and DiT. Neither changes a weight, so each test takes a
built checkpoint and sets them in config.json; text, codes and audio must equal transformers' generate. Rope
types whose frequencies follow the sequence length are refused at load, naming the type. The releases' own way of
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
from omnistage.testing.qwen2_5_omni.reference import reference_speech
from omnistage.testing.reference import load_hf_reference
from omnistage.testing.variants import checkpoint_variant

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


@pytest.mark.parametrize("kind", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                   "original_max_position_embeddings": 16}])
def test_rope_types_that_follow_the_sequence_length_are_refused(tiny_ckpt, tmp_path, kind):
    ckpt = _with_rope(tiny_ckpt, tmp_path / "ckpt", [("thinker_config", "text_config")], [kind])
    with pytest.raises(ValueError, match=f"rope_type '{kind['rope_type']}' changes its frequencies"):
        Thinker(load_config(ckpt))


TEXT_TOKENS, CODES, SEED = 8, 24, 5


@pytest.fixture(scope="module")
def q25_scaled(q25_ckpt, tmp_path_factory):
    return _with_rope(q25_ckpt, tmp_path_factory.mktemp("q25-rope") / "ckpt", QWEN2_5_ROPE_PARTS, [YARN, LINEAR, LINEAR])


def assert_q25_speech_matches_reference(ckpt: Path) -> None:
    """A Qwen2.5-Omni checkpoint's greedy text and one-shot speech equal transformers' generate (audio within
    1e-4)."""
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


def test_qwen2_5_scaled_rope_equals_transformers(q25_scaled):
    assert_q25_speech_matches_reference(q25_scaled)


def test_qwen2_5_release_style_rope_config_equals_transformers(q25_ckpt, tmp_path):
    assert_q25_speech_matches_reference(_release_style(q25_ckpt, tmp_path / "release", QWEN2_5_ROPE_PARTS))
