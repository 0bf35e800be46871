"""Qwen2.5-Omni hears and sees as transformers does (float32, tiny checkpoint with towers): prompt ids, features
and pixels, audio and vision encoder outputs, TMRoPE positions and rope delta, greedy Thinker tokens alone,
batched with a text request and with prefill chunks cutting every media span; Talker codes and waveform with
audio and images in the prompt; encoder outputs freed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from q25_media_reference import (
    AUDIO_2S,
    AUDIO_5S,
    AUDIO_HALF,
    EOS,
    IMAGE_A,
    IMAGE_B,
    MEDIA,
    SCENARIOS,
    SEED,
    USE_AUDIO_IN_VIDEO,
    VIDEO,
    media_kwargs,
    noise,
    ours,
    random_image,
    reference_inputs,
    reference_speech,
    reference_talker_logits,
    reference_tokens,
)
from q25_reference import PagedKV, loaded

from omnistage import Omni
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.loader import load_into
from omnistage.models.qwen2_5_omni.audio_encoder import AudioEncoder
from omnistage.models.qwen2_5_omni.tmrope import talker_positions
from omnistage.models.qwen2_5_omni.vision_encoder import VisionEncoder
from omnistage.models.qwen3_omni.mrope import mrope_cos_sin
from omnistage.models.qwen3_omni.processor import thinker_media
from omnistage.models.registry import load_pipeline_config
from omnistage.testing.qwen2_5_omni.reference import tiny_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOL = 1e-4
NEW_TOKENS = 6
TEXT_TOKENS, CODES = 8, 40
ONE_SHOT = {"chunk_blocks": 10_000, "past_blocks": 0, "future_blocks": 0}


def _ours(name: str):
    return ours()(SCENARIOS[name], use_audio_in_video=name in USE_AUDIO_IN_VIDEO)


def _ref(name: str):
    return reference_inputs(SCENARIOS[name], name in USE_AUDIO_IN_VIDEO)


@pytest.mark.parametrize("name", MEDIA)
def test_prompt_ids_and_features_equal_transformers(name):
    """Including the placeholder order of a video with its track: 2-second chunks, video tokens first."""
    ref = _ref(name)
    got = _ours(name)
    assert got.token_ids == ref["input_ids"][0].tolist()
    items = sorted(thinker_media(got.data).items, key=lambda i: int(i.rows[0]))
    audio = [i for i in items if i.kind == "audio"]
    if audio:
        lengths = ref["feature_attention_mask"].sum(-1).tolist()
        assert [i.features.shape[1] for i in audio] == lengths
        for item, feat, n in zip(audio, ref["input_features"], lengths):
            assert torch.equal(item.features, feat[:, :n])
    images = [i for i in items if i.kind == "image"]
    if images:
        assert torch.equal(torch.cat([i.pixels for i in images]), ref["pixel_values"].float())
        assert [list(i.grid) for i in images] == ref["image_grid_thw"].tolist()
    videos = [i for i in items if i.kind == "video"]
    if videos:
        assert [list(i.grid) for i in videos] == ref["video_grid_thw"].tolist()
    # The placeholder rows are where the processor put <|AUDIO|> / <|IMAGE|> / <|VIDEO|>.
    audio = sorted(audio, key=lambda i: int(i.rows[0]))
    for kind, items_of in (("audio", audio), ("image", images), ("video", videos)):
        rows = torch.cat([i.rows for i in items_of]).sort().values if items_of else torch.zeros(0, dtype=torch.long)
        assert torch.equal(rows, (ref["input_ids"][0] == ours().ids[f"{kind}_pad"]).nonzero().flatten())


@pytest.mark.parametrize("size", [(90, 150), (28, 28), (20, 30), (300, 41)])
def test_image_resizing_equals_transformers(size):
    """Sizes that round to 28-pixel blocks, a single block, one upscaled to min_pixels, a tall thin one."""
    messages = [{"role": "user", "content": [{"type": "image", "image": random_image(*size)}]}]
    ref = reference_inputs(messages)
    got = ours()(messages)
    assert got.token_ids == ref["input_ids"][0].tolist()
    (item,) = thinker_media(got.data).items
    assert list(item.grid) == ref["image_grid_thw"][0].tolist()
    assert torch.equal(item.pixels, ref["pixel_values"].float())


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


def _tower(cls, cfg, prefix: str):
    """One of our towers, loaded from the shared tiny checkpoint."""
    tower = cls(cfg).eval()
    load_into(tower, tiny_checkpoint(), prefix)
    return tower


@torch.no_grad()
def test_audio_encoder_matches_transformers_batched_across_clips():
    cfg = loaded().config.thinker_config
    tower = _tower(AudioEncoder, cfg.audio_config, "thinker.audio_tower.")
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


@torch.no_grad()
def test_vision_encoder_matches_transformers_batched_across_images_and_a_video():
    cfg = loaded().config.thinker_config
    tower = _tower(VisionEncoder, cfg.vision_config, "thinker.visual.")
    messages = [{"role": "user", "content": [
        *({"type": "image", "image": im} for im in (IMAGE_A, IMAGE_B, random_image(400, 260))),
        {"type": "video", "video": VIDEO, "fps": 1.5}]}]
    ref = reference_inputs(messages)
    hf = loaded().hf.thinker.model
    want = [hf.get_image_features(ref["pixel_values"], ref["image_grid_thw"]).pooler_output,
            hf.get_video_features(ref["pixel_values_videos"], ref["video_grid_thw"]).pooler_output]
    want = torch.cat([torch.cat(list(w)) if isinstance(w, (list, tuple)) else w for w in want])
    items = thinker_media(ours()(messages).data).items
    got, deepstack = tower(torch.cat([i.pixels for i in items]), [i.grid for i in items])
    alone = torch.cat([tower(i.pixels, [i.grid])[0] for i in items])
    assert deepstack is None and got.shape == want.shape == (sum(i.num_tokens for i in items), cfg.vision_config.out_hidden_size)
    diff = (got - want).abs().max().item()
    print(f"vision encoder max |diff| {diff:.2e} (alone {(alone - want).abs().max().item():.2e})")
    assert diff <= TOL and (alone - want).abs().max().item() <= TOL
    assert got.std(0).mean() > 0.1 * got.abs().mean()


@pytest.mark.parametrize("name", MEDIA)
def test_positions_and_rope_delta_equal_transformers(name):
    """Audio without images: transformers gives plain sequential ids and delta 0 (TMRoPE's time axis only
    separates the streams once a picture is in the prompt); with images, 3-D ids and a negative delta."""
    ref = _ref(name)
    thinker = loaded().hf.thinker
    fam = ref.get("feature_attention_mask")
    spg = ref.get("video_second_per_grid")
    pos, delta = thinker.get_rope_index(
        ref["input_ids"], ref.get("image_grid_thw"), ref.get("video_grid_thw"), ref["attention_mask"],
        name in USE_AUDIO_IN_VIDEO, None if fam is None else fam.sum(-1), None if spg is None else torch.as_tensor(spg))
    media = thinker_media(_ours(name).data)
    assert torch.equal(media.positions, pos[:, 0].t().float())
    assert media.rope_delta == float(delta)
    pictures = "image" in name or "video" in name
    assert (media.prompt_positions is None) == (not pictures) == (delta == 0)
    # The rotary tables from those ids equal transformers' (contiguous T/H/W frequency sections).
    rotary = thinker.model.language_model.rotary_emb
    cos, sin = rotary(torch.zeros(1), pos)
    ours_thinker = loaded().thinker
    ours_cos, ours_sin = mrope_cos_sin(media.positions, ours_thinker.model.rotary, ours_thinker.mrope_axis,
                                       torch.float32)
    assert torch.equal(ours_cos, cos[0]) and torch.equal(ours_sin, sin[0])


def test_talker_positions_equal_transformers():
    """The Talker's get_rope_index over the prompt ids + speaker bos + first answer token, with the grids."""
    for name in ("audio+image", "video+audio"):
        ref = _ref(name)
        ids = torch.cat([ref["input_ids"], torch.tensor([[loaded().hf.speaker_map["Chelsie"]["bos_token"], 5]])], 1)
        spg = ref.get("video_second_per_grid")
        pos, delta = loaded().hf.talker.get_rope_index(
            ids, ref.get("image_grid_thw"), ref.get("video_grid_thw"), torch.ones_like(ids),
            name in USE_AUDIO_IN_VIDEO, ref["feature_attention_mask"].sum(-1), None if spg is None else torch.as_tensor(spg))
        got = talker_positions(thinker_media(_ours(name).data).prompt_positions)
        assert torch.equal(got.table, pos[:, 0].t().float()) and got.delta == float(delta), name


@pytest.mark.parametrize("name", ["audio+image", "images, multi-turn", "video+audio"])
@torch.no_grad()
def test_thinker_prompt_logits_equal_transformers(name):
    """Our Thinker over the whole prompt (encoder rows scattered in, 3-D positions) against transformers'
    forward: every row's logits, not just the argmax the tiny model's greedy tokens depend on."""
    ckpt = tiny_checkpoint()
    cfg = loaded().config.thinker_config
    audio, vision = AudioEncoder(cfg.audio_config).eval(), VisionEncoder(cfg.vision_config).eval()
    load_into(audio, ckpt, "thinker.audio_tower.")
    load_into(vision, ckpt, "thinker.visual.")
    got = _ours(name)
    media = thinker_media(got.data)
    rows, embeds = [], []
    for item in media.items:
        rows.append(item.rows)
        embeds.append(audio([item.features])[0] if item.kind == "audio" else vision(item.pixels, [item.grid])[0])
    th = loaded().thinker
    kv = PagedKV(th.cfg.num_layers, th.cfg.num_kv_heads, th.cfg.head_dim, num_blocks=256)
    ids = torch.tensor(got.token_ids)
    out = th(ids, media.positions, kv.kv, kv.meta(["r"], [ids.numel()]), torch.cat(rows), torch.cat(embeds))
    ref = _ref(name)
    want = loaded().hf.thinker(input_ids=ref["input_ids"], **media_kwargs(ref),
                               use_audio_in_video=name in USE_AUDIO_IN_VIDEO).logits[0]
    diff = (th.compute_logits(out.hidden) - want).abs().max().item()
    print(f"{name}: prompt logits max |diff| {diff:.2e}")
    assert diff <= TOL


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


def _prompts(o: Omni, names: list[str]) -> list:
    return [o.engine.render_prompt(SCENARIOS[n], use_audio_in_video=n in USE_AUDIO_IN_VIDEO) for n in names]


def test_greedy_tokens_equal_transformers_alone_batched_and_chunked():
    names = list(SCENARIOS)
    want = {n: reference_tokens(n, NEW_TOKENS) for n in names}
    whole = _omni()
    got = whole.generate(_prompts(whole, names), ["text"], _thinker_params())
    assert {n: g.token_ids for n, g in zip(names, got)} == want
    # Chunks of at most 7 rows: every kind of media span is cut by its own request's chunk boundaries.
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
    got = chunked.generate(_prompts(chunked, names), ["text"], _thinker_params())
    assert {n: g.token_ids for n, g in zip(names, got)} == want
    cut_kinds = set()
    for name, out in zip(names, got):
        for item in [] if name == "text" else thinker_media(_ours(name).data).items:
            if any(int(item.rows[0]) < b <= int(item.rows[-1]) for b in bounds[out.request_id]):
                cut_kinds.add(item.kind)
    assert cut_kinds == {"audio", "image", "video"}
    for o in (whole, chunked):
        _assert_free(o)


@pytest.fixture(scope="module")
def spoken():
    """Audio, image, video and text requests, all spoken, in one batch."""
    o = _omni()
    names = ["audio", "audio+image", "video+audio", "text"]
    params = {"thinker": SamplingParams(temperature=0.0, max_tokens=TEXT_TOKENS),
              "talker": SamplingParams(temperature=0.0, max_tokens=CODES, repetition_penalty=1.05, seed=SEED)}
    outs = o.generate(_prompts(o, names), ["text", "audio"], params, speaker="chelsie")
    _assert_free(o)
    return dict(zip(names, outs))


@pytest.mark.parametrize("name", ["audio", "audio+image", "video+audio", "text"])
def test_talker_codes_and_waveform_equal_transformers_with_media_in_the_prompt(spoken, name):
    """The Talker reads the prompt's media rows as transformers hands them over (final hidden state, embedding
    zeroed) at its own 3-D positions: same codes, and the same waveform from one-shot Token2Wav, same seed."""
    out = spoken[name]
    tokens, codes, wav = reference_speech(name, TEXT_TOKENS, CODES)
    assert out.token_ids == (tokens[:-1] if tokens[-1] in EOS else tokens)
    assert out.codes[0].tolist() == codes and len(codes) > 0
    diff = (out.audio - wav).abs().max().item()
    print(f"{name}: {len(codes)} codes equal; waveform max |diff| {diff:.1e}")
    assert out.audio.shape == wav.shape and diff <= TOL


@pytest.mark.parametrize("name", ["audio+image", "video+audio"])
def test_talker_logits_equal_transformers_at_its_3d_positions(name):
    """Greedy codes of the tiny Talker survive wrong positions, its logits do not: every step's logits of an
    image / video request equal the reference Talker's (prefill at its TMRoPE ids, decode at index + delta)."""
    o = _omni()
    model = o.engine.orchestrator.stages["talker"].model
    seen: list[torch.Tensor] = []
    compute = model.compute_logits
    model.compute_logits = lambda h: (seen.append(compute(h)), seen[-1])[1]
    params = {"thinker": SamplingParams(temperature=0.0, max_tokens=TEXT_TOKENS),
              "talker": SamplingParams(temperature=0.0, max_tokens=CODES, repetition_penalty=1.05, seed=SEED)}
    (out,) = o.generate(_prompts(o, [name]), ["text", "audio"], params, speaker="chelsie")
    want = reference_talker_logits(name, TEXT_TOKENS, CODES)
    got = torch.cat(seen)
    n = got.shape[0]  # one row per step: every spoken code (and the step that ended the speech, if any)
    assert out.codes.shape[1] <= n <= out.codes.shape[1] + 1 and want.shape[0] >= n
    finite = torch.isfinite(got)  # codec_bos is suppressed here, by a logits processor there
    diff = (got - want[:n])[finite].abs().max().item()
    print(f"talker logits max |diff| {diff:.2e} over {n} steps")
    assert diff <= TOL


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
    with pytest.raises(ValueError, match="audio track"):
        o.engine.render_prompt(SCENARIOS["video"], use_audio_in_video=True)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\].*uint8"):
        o.engine.render_prompt([{"role": "user", "content": [{"type": "image", "image": np.zeros((4, 4), np.float32)}]}])
    assert o.info.input_modalities == ("text", "audio", "image", "video")


def test_cuda_graph_runner_decodes_media_requests_at_their_rope_delta():
    """Decode steps on the static (graph) runner path carry positions index + delta: the same tokens."""
    o = Omni(tiny_checkpoint(), pipeline=load_pipeline_config("qwen2_5_omni", {"runner": "cuda_graph"}))
    names = ["video+audio", "image", "text"]
    got = o.generate(_prompts(o, names), ["text"], _thinker_params())
    assert {n: g.token_ids for n, g in zip(names, got)} == {n: reference_tokens(n, NEW_TOKENS) for n in names}
    runner = o.engine.orchestrator.stages["thinker"].runner
    assert runner.stats.static_steps > 0 and runner.stats.replays > 0
