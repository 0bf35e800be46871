"""The Thinker hears and sees as transformers does (float32, tiny checkpoint with towers): prompt ids and
processor outputs, encoder outputs, 3-D positions, and greedy tokens alone, batched with text requests and
with prefill chunks cutting through every kind of media span; encoder outputs are freed."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from media_reference import (
    AUDIO_1S,
    AUDIO_2S,
    AUDIO_HALF,
    IMAGE_A,
    IMAGE_B,
    SCENARIOS,
    VIDEO,
    ckpt_str,
    noise,
    ours,
    random_image,
    reference_inputs,
    reference_tokens,
)
from transformers import AutoTokenizer

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.loader import load_into
from omnistage.models.qwen3_omni.audio_encoder import AudioEncoder
from omnistage.models.qwen3_omni.config import load_config
from omnistage.models.qwen3_omni.mrope import mrope_cos_sin
from omnistage.models.qwen3_omni.processor import thinker_media
from omnistage.models.qwen3_omni.vision_encoder import VisionEncoder
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.testing.reference import load_hf_reference
from omnistage.testing.variants import checkpoint_variant, qk_norms, scaled_variant

# transformers' processor warns about numpy copy semantics of its own tensors; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOL = 1e-4
NEW_TOKENS = 6
MEDIA = [k for k in SCENARIOS if not k.startswith("text")]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return ckpt_str(tiny_ckpt)


@functools.cache
def _reference_tokens(ckpt: str, name: str) -> list[int]:
    messages, uav = SCENARIOS[name]
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return reference_tokens(ckpt, messages, NEW_TOKENS, uav)


@pytest.mark.parametrize("name", MEDIA)
def test_prompt_ids_and_processor_outputs_equal_transformers(ckpt, name):
    messages, uav = SCENARIOS[name]
    ref = reference_inputs(ckpt, messages, uav)
    got = ours(ckpt)(messages, uav)
    assert got.token_ids == ref["input_ids"][0].tolist()
    items = thinker_media(got.data).items
    if "feature_attention_mask" in ref:
        lengths = ref["feature_attention_mask"].sum(-1).tolist()
        audio = [i for i in sorted(items, key=lambda i: int(i.rows[0])) if i.kind == "audio"]
        assert [a.features.shape[1] for a in audio] == lengths
        for a, feat, n in zip(audio, ref["input_features"], lengths):
            assert torch.equal(a.features, feat[:, :n])
    images = [i for i in items if i.kind == "image"]
    if images:
        assert torch.equal(torch.cat([i.pixels for i in images]), ref["pixel_values"].float())
        assert [list(i.grid) for i in images] == ref["image_grid_thw"].tolist()
    videos = [i for i in items if i.kind == "video"]
    if videos:
        assert [list(i.grid) for i in videos] == ref["video_grid_thw"].tolist()


@pytest.mark.parametrize("size", [(80, 112), (48, 48), (33, 100), (200, 170), (20, 30)])
def test_image_resizing_equals_transformers(ckpt, size):
    """Sizes that round half to even (2.5 -> 2, 3.5 -> 4), upscale to min_pixels, or keep their size."""
    image = random_image(*size)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "?"}]}]
    ref = reference_inputs(ckpt, messages)
    got = ours(ckpt)(messages)
    assert got.token_ids == ref["input_ids"][0].tolist()
    (item,) = thinker_media(got.data).items
    assert list(item.grid) == ref["image_grid_thw"][0].tolist()
    assert torch.equal(item.pixels, ref["pixel_values"].float())


def _towers(ckpt: str) -> tuple[AudioEncoder, VisionEncoder]:
    cfg = load_config(ckpt).thinker_config
    audio, vision = AudioEncoder(cfg.audio_config).eval(), VisionEncoder(cfg.vision_config).eval()
    load_into(audio, ckpt, "thinker.audio_tower.")
    load_into(vision, ckpt, "thinker.visual.")
    return audio, vision


@pytest.mark.parametrize("which", ["tiny_ckpt", "act_ckpt", "fp8_ckpt"])  # act_ckpt: ReLU audio tower, QuickGELU
# vision; fp8_ckpt: the towers in transformers' FP8 format
@torch.no_grad()
def test_encoder_outputs_match_transformers(which, request):
    ckpt = ckpt_str(request.getfixturevalue(which))
    hf = load_hf_reference(ckpt).thinker.model
    audio_enc, vision_enc = _towers(ckpt)
    diffs = {}
    # Audio: a request whose clips include a full chunk (pad 100) and one whose clips are all short (pad 80).
    for name, clips in (("audio pad 100", [AUDIO_2S, AUDIO_HALF]), ("audio pad 80", [AUDIO_HALF, noise(12800)])):
        messages = [{"role": "user", "content": [{"type": "audio", "audio": c} for c in clips]}]
        ref_in = reference_inputs(ckpt, messages)
        want = hf.get_audio_features(ref_in["input_features"], ref_in["feature_attention_mask"]).last_hidden_state
        items = thinker_media(ours(ckpt)(messages).data).items
        got = torch.cat(audio_enc([i.features for i in items], [i.pad_frames for i in items]))
        assert got.shape == want.shape
        diffs[name] = (got - want).abs().max().item()
        # Not degenerate: rows differ from each other and from the mean.
        assert got.std(0).mean() > 0.1 * got.abs().mean()
    # Vision: two images and a video in one batched call (frames of different sizes).
    messages = [{"role": "user", "content": [{"type": "image", "image": IMAGE_A}, {"type": "image", "image": IMAGE_B},
                                             {"type": "video", "video": VIDEO, "fps": 1.5}]}]
    ref_in = reference_inputs(ckpt, messages)
    items = thinker_media(ours(ckpt)(messages).data).items
    tokens, deepstack = vision_enc(torch.cat([i.pixels for i in items]), [i.grid for i in items])
    img = hf.get_image_features(ref_in["pixel_values"], ref_in["image_grid_thw"])
    vid = hf.get_video_features(ref_in["pixel_values_videos"], ref_in["video_grid_thw"])
    want_tokens = torch.cat([*img.pooler_output, *vid.pooler_output])
    want_deep = torch.stack([torch.cat([*a, *b]) for a, b in zip(img.deepstack_features, vid.deepstack_features)])
    assert deepstack.shape == want_deep.shape and deepstack.shape[0] == 2
    diffs["vision tokens"] = (tokens - want_tokens).abs().max().item()
    diffs["vision deepstack"] = (deepstack - want_deep).abs().max().item()
    assert tokens.std(0).mean() > 0.1 * tokens.abs().mean()
    print("encoder max |diff|:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize("name", MEDIA)
def test_positions_and_rope_delta_equal_transformers(ckpt, name):
    messages, uav = SCENARIOS[name]
    ref = reference_inputs(ckpt, messages, uav)
    thinker = load_hf_reference(ckpt).thinker
    fam = ref.get("feature_attention_mask")
    pos, delta = thinker.get_rope_index(
        ref["input_ids"], ref.get("image_grid_thw"), ref.get("video_grid_thw"), ref["attention_mask"], uav,
        None if fam is None else fam.sum(-1), ref.get("video_second_per_grid"),
    )
    media = thinker_media(ours(ckpt)(messages, uav).data)
    assert torch.equal(media.positions, pos[:, 0].t().float())
    assert media.rope_delta == float(delta)
    # The rotary tables from those ids equal transformers' (interleaved T/H/W frequency sections).
    rotary = thinker.model.language_model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, pos.float())
    ours_cos, ours_sin = mrope_cos_sin(media.positions, *_thinker_rope(ckpt), torch.float32)
    assert torch.equal(ours_cos, cos[0]) and torch.equal(ours_sin, sin[0])


@functools.cache
def _thinker_rope(ckpt: str):
    """Our Thinker's rotary tables and each frequency's MRoPE axis."""
    from omnistage.models.qwen3_omni.thinker import Thinker

    thinker = Thinker(load_config(ckpt))
    return thinker.model.rotary, thinker.mrope_axis


def _engine(ckpt: str, **thinker_sched) -> OmniEngine:
    overrides = {"stages": {"thinker": {"scheduler": thinker_sched}}} if thinker_sched else {}
    return OmniEngine(EngineArgs(ckpt), load_pipeline_config("qwen3_omni", overrides))


def _thinker(engine: OmniEngine):
    return engine.orchestrator.stages["thinker"].model


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def _run(engine: OmniEngine, names: list[str]) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Tokens per scenario name, and the request id -> name map."""
    ids = {}
    for name in names:
        messages, uav = SCENARIOS[name]
        ids[engine.add_request(engine.render_prompt(messages, use_audio_in_video=uav), ["text"], _params())] = name
    tokens: dict[str, list[int]] = {name: [] for name in names}
    done: set[str] = set()
    while len(done) < len(ids):
        for d in engine.step():
            tokens[ids[d.req_id]].extend(d.new_token_ids)
            if d.finished:
                done.add(d.req_id)
    return tokens, ids


def _record_chunks(engine: OmniEngine) -> dict[str, list[tuple[int, int]]]:
    """Wrap the Thinker's prepare_inputs to record each request's prompt rows per step."""
    model = _thinker(engine)
    chunks: dict[str, list[tuple[int, int]]] = {}
    original = model.prepare_inputs

    def prepare(ctx, input_ids, positions):
        for req in ctx.requests:
            s, e = ctx.spans[req.req_id]
            lo = ctx.num_computed[ctx.index(req.req_id)]
            chunks.setdefault(req.req_id, []).append((lo, lo + e - s))
        return original(ctx, input_ids, positions)

    model.prepare_inputs = prepare
    return chunks


def test_greedy_tokens_equal_transformers_alone_batched_and_chunked(ckpt):
    want = {name: _reference_tokens(ckpt, name) for name in SCENARIOS}
    names = list(SCENARIOS)
    # Every prompt alone is what transformers ran; here all run together (media and text requests), once
    # with whole-prompt prefill and once with chunks of at most 7 rows cutting through every span.
    whole = _engine(ckpt)
    got, _ = _run(whole, names)
    assert got == want
    chunked = _engine(ckpt, max_num_batched_tokens=7, max_num_seqs=4)
    chunks = _record_chunks(chunked)
    got, ids = _run(chunked, names)
    assert got == want
    # Every kind of media span was cut by a chunk boundary of its own request.
    cut_kinds = set()
    for req_id, name in ids.items():
        if name not in MEDIA:
            continue
        bounds = {hi for _, hi in chunks[req_id]}
        for item in thinker_media(ours(ckpt)(*SCENARIOS[name]).data).items:
            if any(int(item.rows[0]) < b <= int(item.rows[-1]) for b in bounds):
                cut_kinds.add(item.kind)
    assert cut_kinds == {"audio", "image", "video"}
    for engine in (whole, chunked):
        assert len(_thinker(engine).encoders) == 0 and not _thinker(engine).encoders.held


def test_other_activations_give_transformers_tokens(act_ckpt, ckpt):
    """Every tower and the Thinker on activations other than the released ones (GELU text, ReLU audio,
    QuickGELU vision): greedy tokens equal transformers' and differ from the released activations'."""
    act = ckpt_str(act_ckpt)
    names = ["audio+image", "video+audio"]
    got, _ = _run(_engine(act), names)
    assert got == {name: _reference_tokens(act, name) for name in names}
    assert got != {name: _reference_tokens(ckpt, name) for name in names}


def test_rope_following_the_length_gives_transformers_tokens(tiny_ckpt, ckpt, tmp_path):
    """A Thinker whose rope follows the forward's length (dynamic NTK from 8): a media prompt's rows rotate for
    its largest 3-D position + 1 (fewer than its rows: vision rows share positions), batched and chunked; its
    decode rows for their own position (``index + rope_delta``)."""
    def dynamic(cfg):
        text = cfg["thinker_config"]["text_config"]
        text["rope_parameters"] = {**text["rope_parameters"], "rope_type": "dynamic", "factor": 4.0}
        text["max_position_embeddings"] = 8

    sharp = scaled_variant(tiny_ckpt, tmp_path / "sharp", qk_norms, 4.0)  # (frequencies show in the answers)
    scaled = ckpt_str(checkpoint_variant(sharp, tmp_path / "dynamic", dynamic))
    names = ["audio+image", "video+audio", "image"]
    want = {name: _reference_tokens(scaled, name) for name in names}
    assert want != {name: _reference_tokens(ckpt_str(sharp), name) for name in names}
    for engine in (_engine(scaled), _engine(scaled, max_num_batched_tokens=7, max_num_seqs=4)):
        assert _run(engine, names)[0] == want


def test_identical_items_encode_once_and_abort_mid_prefill_frees(ckpt):
    engine = _engine(ckpt, max_num_batched_tokens=7, max_num_seqs=4)
    encoders = _thinker(engine).encoders
    messages, _ = SCENARIOS["image"]
    a = engine.add_request(engine.render_prompt(messages), ["text"], _params())
    b = engine.add_request(engine.render_prompt(messages), ["text"], _params())
    video = engine.add_request(engine.render_prompt(SCENARIOS["video"][0]), ["text"], _params())
    tokens: dict[str, list[int]] = {a: [], b: [], video: []}
    while video not in encoders.held:  # step until the video's first chunk has encoded it
        for d in engine.step():
            tokens[d.req_id].extend(d.new_token_ids)
    assert not tokens[video]
    assert encoders.held[video] and all(video in encoders.entries[k].holders for k in encoders.held[video])
    engine.abort(video)
    assert video not in encoders.held
    assert all(video not in e.holders for e in encoders.entries.values())
    while engine.has_work():
        for d in engine.step():
            tokens[d.req_id].extend(d.new_token_ids)
    want = _reference_tokens(ckpt, "image")
    assert tokens[a] == want and tokens[b] == want
    # The shared image ran through the vision tower once for both requests (plus the video's own run).
    assert encoders.stats.items_encoded == 2
    assert len(encoders) == 0 and not encoders.held


def test_bad_media_parts_are_rejected_with_the_part_named(ckpt):
    engine = _engine(ckpt)
    bad = [{"role": "user", "content": [{"type": "image", "image": np.zeros((4, 4), dtype=np.float32)}]}]
    with pytest.raises(ValueError, match=r"content\[0\].*uint8"):
        engine.render_prompt(bad)
    with pytest.raises(ValueError, match=r"content\[0\]: audio has 100 samples; at least 400"):
        engine.render_prompt([{"role": "user", "content": [{"type": "audio", "audio": AUDIO_1S[:100]}]}])
    with pytest.raises(ValueError, match="unknown part type 'smell'"):
        engine.render_prompt([{"role": "user", "content": [{"type": "smell", "smell": 1}]}])
    literal = [{"role": "user", "content": [{"type": "text", "text": "<|image_pad|>"}]}]
    with pytest.raises(ValueError, match="placeholders"):
        engine.render_prompt([{"role": "user", "content": [*literal[0]["content"],
                                                            {"type": "audio", "audio": AUDIO_1S}]}])
    with pytest.raises(ValueError, match="audio track"):
        engine.render_prompt([{"role": "user", "content": [{"type": "video", "video": VIDEO}]}], use_audio_in_video=True)
    # Text-only parts need no processor work: the chat template's ids, as for string content.
    got = engine.render_prompt(literal)
    assert thinker_media(got.data) is None
    assert got.token_ids == AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        literal, add_generation_prompt=True, tokenize=True)["input_ids"]


def test_cuda_graph_runner_decodes_media_requests_at_their_rope_delta(ckpt):
    """Decode steps on the static (graph) path carry float positions index + delta: same tokens."""
    engine = OmniEngine(EngineArgs(ckpt), load_pipeline_config("qwen3_omni", {"runner": "cuda_graph"}))
    got, _ = _run(engine, ["video", "image", "text"])
    assert got == {n: _reference_tokens(ckpt, n) for n in ("video", "image", "text")}
    runner = engine.orchestrator.stages["thinker"].runner
    assert runner.stats.static_steps > 0 and runner.stats.replays > 0


@torch.no_grad()
def test_encoder_budget_splits_calls_without_changing_outputs(ckpt):
    """Items of a step go through the towers in calls of at most max_rows_per_call output rows."""
    from omnistage.models.qwen3_omni.encoder_cache import MediaEncoders

    audio, vision = _towers(ckpt)
    media = thinker_media(ours(ckpt)(*SCENARIOS["audio+image"]).data)
    needs = [("r", item) for item in media.items]
    one_call, split = MediaEncoders(audio, vision), MediaEncoders(audio, vision, max_rows_per_call=8)
    one_call.acquire(needs)
    split.acquire(needs)
    assert (one_call.stats.audio_calls, one_call.stats.vision_calls) == (1, 1)
    assert (split.stats.audio_calls, split.stats.vision_calls) == (2, 1)  # 27 and 7 rows: apart
    for item in media.items:  # batch composition only changes the last bits of the matmuls
        diff = (one_call.entries[item.key].embeds - split.entries[item.key].embeds).abs().max().item()
        assert diff <= 1e-5
    split.release("r")
    assert len(split) == 0


def test_encoder_outputs_outlive_their_request_within_a_byte_budget(ckpt):
    """A finished request's encoder outputs stay (unheld) for later requests with the same content: the same
    image again is not encoded again (prefix caching off, so the Thinker needs those rows again), with the
    reference's tokens; the store keeps at most cache_bytes, dropping the least recently used first."""
    from omnistage.models.qwen3_omni.encoder_cache import MediaEncoders

    engine = OmniEngine(EngineArgs(ckpt, enable_prefix_caching=False), load_pipeline_config("qwen3_omni"))
    encoders = _thinker(engine).encoders
    want = _reference_tokens(ckpt, "image")
    assert _run(engine, ["image"])[0]["image"] == want
    assert len(encoders) == 0 and len(encoders.kept) == 1 and encoders.stats.items_encoded == 1
    assert _run(engine, ["image"])[0]["image"] == want
    assert encoders.stats.items_encoded == 1 and encoders.stats.items_reused == 1
    assert engine.resource_stats()["thinker"]["encoder_kept_bytes"] == encoders.kept_bytes > 0

    audio, vision = _towers(ckpt)
    items = thinker_media(ours(ckpt)(*SCENARIOS["audio+image"]).data).items
    probe = MediaEncoders(audio, vision)
    probe.acquire([("r", item) for item in items])
    sizes = {item.key: probe.entries[item.key].nbytes for item in items}
    first, second = items[0], items[1]
    small = MediaEncoders(audio, vision, cache_bytes=max(sizes.values()))  # room for one of the two
    for item in (first, second):
        small.acquire([(item.key, item)])
        small.release(item.key)
    assert list(small.kept) == [second.key] and small.kept_bytes == sizes[second.key]
    small.acquire([("again", first)])  # evicted: encoded again
    assert small.stats.items_encoded == 3 and small.stats.items_reused == 0
    none = MediaEncoders(audio, vision, cache_bytes=0)
    none.acquire([("r", first)])
    none.release("r")
    assert not none.kept
