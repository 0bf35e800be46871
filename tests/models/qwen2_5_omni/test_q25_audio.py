"""Qwen2.5-Omni hears as transformers does (float32, tiny checkpoint with towers): prompt ids and features,
audio encoder outputs, positions, greedy Thinker tokens alone, batched with a text request and with prefill
chunks cutting the audio spans; Talker codes and waveform with audio in the prompt; encoder outputs freed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from q25_media_reference import (
    AUDIO_2S,
    AUDIO_5S,
    AUDIO_HALF,
    EOS,
    MEDIA,
    SCENARIOS,
    SEED,
    noise,
    ours,
    reference_inputs,
    reference_speech,
    reference_tokens,
)
from q25_reference import loaded

from omnistage import Omni
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.loader import load_into
from omnistage.models.qwen2_5_omni.audio_encoder import AudioEncoder
from omnistage.models.qwen3_omni.processor import thinker_media
from omnistage.models.registry import load_pipeline_config
from omnistage.testing.qwen2_5_omni.reference import tiny_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOL = 1e-4
NEW_TOKENS = 6
TEXT_TOKENS, CODES = 8, 40
ONE_SHOT = {"chunk_blocks": 10_000, "past_blocks": 0, "future_blocks": 0}


@pytest.mark.parametrize("name", MEDIA)
def test_prompt_ids_and_features_equal_transformers(name):
    ref = reference_inputs(SCENARIOS[name])
    got = ours()(SCENARIOS[name])
    assert got.token_ids == ref["input_ids"][0].tolist()
    items = sorted(thinker_media(got.data).items, key=lambda i: int(i.rows[0]))
    lengths = ref["feature_attention_mask"].sum(-1).tolist()
    assert [i.features.shape[1] for i in items] == lengths
    for item, feat, n in zip(items, ref["input_features"], lengths):
        assert torch.equal(item.features, feat[:, :n])
    # The placeholder rows are where the processor put <|AUDIO|>.
    rows = torch.cat([i.rows for i in items])
    audio_id = ours().ids["audio_pad"]
    assert torch.equal(rows, (ref["input_ids"][0] == audio_id).nonzero().flatten())


@pytest.mark.parametrize("samples", [400, 799, 16000 * 3 + 5])
def test_short_and_odd_clips_equal_the_processors_features(samples):
    """The shortest clip (one STFT window), an odd frame count and a clip past one second: the features of a
    clip padded only as far as its frames reach equal those of the processor's 300 s padding."""
    clip = noise(samples)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": clip}]}]
    ref = reference_inputs(messages)
    (item,) = thinker_media(ours()(messages).data).items
    n = int(ref["feature_attention_mask"].sum())
    assert torch.equal(item.features, ref["input_features"][0, :, :n])


@torch.no_grad()
def test_audio_encoder_matches_transformers_batched_across_clips():
    ckpt = tiny_checkpoint()
    cfg = loaded().config.thinker_config
    tower = AudioEncoder(cfg.audio_config).eval()
    load_into(tower, ckpt, "thinker.audio_tower.")
    hf = loaded().hf.thinker.model
    clips = [AUDIO_5S, AUDIO_HALF, AUDIO_2S, noise(400)]
    messages = [{"role": "user", "content": [{"type": "audio", "audio": c} for c in clips]}]
    ref = reference_inputs(messages)
    want = hf.get_audio_features(ref["input_features"], ref["feature_attention_mask"]).last_hidden_state
    items = sorted(thinker_media(ours()(messages).data).items, key=lambda i: int(i.rows[0]))
    together = torch.cat(tower([i.features for i in items]))
    alone = torch.cat([tower([i.features])[0] for i in items])
    assert together.shape == want.shape == (sum(i.num_tokens for i in items), cfg.audio_config.output_dim)
    diff = (together - want).abs().max().item()
    print(f"audio encoder max |diff| {diff:.2e} (alone {(alone - want).abs().max().item():.2e})")
    assert diff <= TOL and (alone - want).abs().max().item() <= TOL
    assert together.std(0).mean() > 0.1 * together.abs().mean()  # rows differ: not degenerate


@pytest.mark.parametrize("name", MEDIA)
def test_positions_and_rope_delta_equal_transformers(name):
    """Audio without images or videos: transformers gives plain sequential ids and delta 0 (TMRoPE's time axis
    only separates the streams once a picture is in the prompt)."""
    ref = reference_inputs(SCENARIOS[name])
    thinker = loaded().hf.thinker
    pos, delta = thinker.get_rope_index(ref["input_ids"], None, None, ref["attention_mask"], False,
                                        ref["feature_attention_mask"].sum(-1), None)
    media = thinker_media(ours()(SCENARIOS[name]).data)
    assert torch.equal(media.positions, pos[:, 0].t().float())
    assert media.rope_delta == float(delta) == 0.0 and media.prompt_positions is None


def _omni(**thinker_sched) -> Omni:
    overrides: dict = {"stages": {"token2wav": {"bridge_args": ONE_SHOT}}}
    if thinker_sched:
        overrides["stages"]["thinker"] = {"scheduler": thinker_sched}
    return Omni(tiny_checkpoint(), pipeline=load_pipeline_config("qwen2_5_omni", overrides))


def _thinker_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def _assert_free(o: Omni) -> None:
    stats = o.engine.resource_stats()
    assert stats["requests"] == 0
    thinker = o.engine.orchestrator.stages["thinker"].model
    assert len(thinker.encoders) == 0 and not thinker.encoders.held
    for name in ("thinker", "talker"):
        s = stats[name]
        assert s["kv_free_blocks"] == s["kv_blocks"] and s["records"] == 0 and s["bridge_entries"] == 0, s


def test_greedy_tokens_equal_transformers_alone_batched_and_chunked():
    names = list(SCENARIOS)
    want = {n: reference_tokens(n, NEW_TOKENS) for n in names}
    whole = _omni()
    got = whole.generate([SCENARIOS[n] for n in names], ["text"], _thinker_params())
    assert {n: g.token_ids for n, g in zip(names, got)} == want
    # Chunks of at most 7 rows: every audio span is cut by its own request's chunk boundaries.
    chunked = _omni(max_num_batched_tokens=7, max_num_seqs=4)
    model = chunked.engine.orchestrator.stages["thinker"].model
    bounds: dict[str, set[int]] = {}
    original = model.prepare_inputs

    def record(ctx, input_ids, positions):
        for i, req_id in enumerate(ctx.req_ids):
            s, e = ctx.spans[req_id]
            bounds.setdefault(req_id, set()).add(ctx.num_computed[i] + e - s)
        return original(ctx, input_ids, positions)

    model.prepare_inputs = record
    got = chunked.generate([SCENARIOS[n] for n in names], ["text"], _thinker_params())
    assert {n: g.token_ids for n, g in zip(names, got)} == want
    cut = 0
    for name, out in zip(names, got):
        for item in [] if name == "text" else thinker_media(ours()(SCENARIOS[name]).data).items:
            cut += any(int(item.rows[0]) < b <= int(item.rows[-1]) for b in bounds[out.request_id])
    assert cut >= len(MEDIA)
    for o in (whole, chunked):
        _assert_free(o)


@pytest.fixture(scope="module")
def spoken():
    """The audio question and a text request, both spoken, in one batch."""
    o = _omni()
    names = ["audio", "text"]
    params = {"thinker": SamplingParams(temperature=0.0, max_tokens=TEXT_TOKENS),
              "talker": SamplingParams(temperature=0.0, max_tokens=CODES, repetition_penalty=1.05, seed=SEED)}
    outs = o.generate([SCENARIOS[n] for n in names], ["text", "audio"], params, speaker="chelsie")
    _assert_free(o)
    return dict(zip(names, outs))


@pytest.mark.parametrize("name", ["audio", "text"])
def test_talker_codes_and_waveform_equal_transformers_with_audio_in_the_prompt(spoken, name):
    """The Talker reads the prompt's audio rows as transformers hands them over (final hidden state, embedding
    zeroed): same codes, and the same waveform from one-shot Token2Wav with the same seed."""
    out = spoken[name]
    tokens, codes, wav = reference_speech(name, TEXT_TOKENS, CODES)
    assert out.token_ids == (tokens[:-1] if tokens[-1] in EOS else tokens)
    assert out.codes[0].tolist() == codes and len(codes) > 0
    diff = (out.audio - wav).abs().max().item()
    print(f"{name}: {len(codes)} codes equal; waveform max |diff| {diff:.1e}")
    assert out.audio.shape == wav.shape and diff <= TOL


def test_zeroed_media_embeddings_change_the_talker(monkeypatch):
    """The Talker's media rows matter: with the audio rows' embeddings kept (not zeroed) the codes differ, so
    the equality above checks the zeroing."""
    from omnistage.models.qwen2_5_omni import stage_models

    o = _omni()
    params = {"thinker": SamplingParams(temperature=0.0, max_tokens=TEXT_TOKENS),
              "talker": SamplingParams(temperature=0.0, max_tokens=CODES, repetition_penalty=1.05, seed=SEED)}
    monkeypatch.setattr(stage_models, "MEDIA_ROWS_KEY", "absent")  # the stage model no longer finds the rows
    (out,) = o.generate([SCENARIOS["audio"]], ["text", "audio"], params, speaker="chelsie")
    _, codes, _ = reference_speech("audio", TEXT_TOKENS, CODES)
    assert out.codes[0].tolist() != codes


def test_bad_audio_parts_are_rejected_naming_the_part():
    o = _omni()
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: audio has 100 samples; at least 400"):
        o.engine.render_prompt([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                             {"type": "audio", "audio": AUDIO_2S[:100]}]}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: this model takes no image input"):
        o.engine.render_prompt([{"role": "user", "content": [{"type": "image", "image": np.zeros((28, 28, 3),
                                                                                                  np.uint8)}]}])
    assert o.info.input_modalities == ("text", "audio")
