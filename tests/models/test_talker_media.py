"""Spoken answers to prompts with audio, images and video, as transformers' generate(return_audio=True) gives
them (float32, tiny checkpoint with towers): the Talker's prefill rows (accept-layer rows projected for media
rows), its own 3-D positions, exact codec codes and the waveform, for each prompt alone against the reference,
then all of them batched with a text-only and a text+audio request, and again with prefill chunks of a few
rows in both the Thinker and the Talker."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import pytest
import torch
from media_reference import (
    IMAGE_B,
    SCENARIOS,
    TRACK,
    VIDEO,
    ckpt_str,
    ours,
    reference_inputs,
    reference_tokens,
)

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.qwen3_omni.mrope import PromptPositions, step_positions
from omnistage.models.qwen3_omni.processor import thinker_media
from omnistage.models.qwen3_omni.talker_inputs import TalkerTokenIds, talker_media_spans
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.testing.reference import load_hf_reference

# transformers' processor warns about numpy copy semantics of its own tensors; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

THINKER_TOKENS = 5
TALKER_TOKENS = 14
# Random weights often put codec_eos first, which leaves nothing to compare (transformers then fails on an
# empty frame list): the Talker speaks at least this many frames, in both implementations.
TALKER_MIN_TOKENS = 8
WAVE_TOL = 1e-4
PREFILL_TOL = 1e-4

# A video with its audio track and an image after it: transformers' Talker then reads the video span as video
# and audio interleaved (without an image ahead, as in "video+audio", it gives those rows plain ids).
PROMPTS = {
    **{name: SCENARIOS[name] for name in ("audio", "image", "audio+image", "video+audio", "multi-turn")},
    "video+audio, image": ([{"role": "user", "content": [
        {"type": "video", "video": VIDEO, "fps": 1.5, "audio": TRACK}, {"type": "text", "text": "and"},
        {"type": "image", "image": IMAGE_B}, {"type": "text", "text": "What happens?"}]}], True),
    "text": SCENARIOS["text"],
}
SPOKEN = list(PROMPTS)
TEXT_ONLY = "text 2"  # a companion request that asks for text only


def _messages(name: str):
    messages, uav = PROMPTS[name] if name in PROMPTS else SCENARIOS[name]
    return ([{"role": "user", "content": messages}] if isinstance(messages, str) else messages), uav


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return ckpt_str(tiny_ckpt)


@dataclass(frozen=True)
class Spoken:
    tokens: list[int]
    codes: torch.Tensor  # [Q, T] what the reference decoded
    audio: torch.Tensor
    prefill: torch.Tensor  # [L, H] the Talker's prefill rows
    positions: torch.Tensor  # [L, 3] the Talker's prefill position ids (T, H, W)


@contextlib.contextmanager
def _capturing(hf, captured: dict):
    """Record the Talker's prefill rows and positions and the codes handed to Code2Wav; give the Talker's config
    the Thinker's audio config (transformers 5.24 reads ``talker_config.audio_config.n_window`` in its rope
    index for prompts with audio and an image or video, and the Talker config has none)."""

    def talker_pre(_module, _args, kwargs):
        if "prefill" not in captured:
            captured["prefill"] = (kwargs["inputs_embeds"][0].clone(), kwargs["position_ids"][1:, 0].t().clone())

    original = hf.code2wav.chunked_decode

    def decode(codes, **kw):
        captured["codes"] = codes[0].clone()
        return original(codes, **kw)

    handle = hf.talker.register_forward_pre_hook(talker_pre, with_kwargs=True)
    hf.code2wav.chunked_decode = decode
    hf.talker.config.audio_config = hf.config.thinker_config.audio_config
    try:
        yield
    finally:
        del hf.talker.config.audio_config
        hf.code2wav.chunked_decode = original
        handle.remove()


@functools.cache
def _reference(ckpt: str, name: str) -> Spoken:
    messages, uav = _messages(name)
    hf = load_hf_reference(ckpt)
    inputs = dict(reference_inputs(ckpt, messages, uav))
    input_ids = inputs.pop("input_ids")
    captured: dict = {}
    with _capturing(hf, captured), torch.no_grad():
        seq, wave = hf.generate(
            input_ids, **inputs, use_audio_in_video=uav, speaker="ethan", return_audio=True,
            thinker_max_new_tokens=THINKER_TOKENS, thinker_min_new_tokens=THINKER_TOKENS,
            thinker_eos_token_id=hf.config.im_end_token_id, talker_max_new_tokens=TALKER_TOKENS,
            talker_min_new_tokens=TALKER_MIN_TOKENS,
            talker_do_sample=False, talker_repetition_penalty=1.0,
        )
    prefill, positions = captured["prefill"]
    return Spoken(seq[0, input_ids.shape[1] :].tolist(), captured["codes"], wave.reshape(-1), prefill, positions)


def _engine(ckpt: str, thinker_tokens_per_step: int | None = None, talker_tokens_per_step: int | None = None):
    stages: dict = {}
    for stage, budget in (("thinker", thinker_tokens_per_step), ("talker", talker_tokens_per_step)):
        if budget:
            stages[stage] = {"scheduler": {"max_num_batched_tokens": budget, "max_num_seqs": min(budget, 4)}}
    return OmniEngine(EngineArgs(ckpt), load_pipeline_config("qwen3_omni", {"stages": stages}))


@dataclass
class Got:
    tokens: list[int]
    codes: list[torch.Tensor]
    audio: list[torch.Tensor]
    prefill: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # [L, 3], or None: plain indices
    talker_chunks: list[tuple[int, int]] | None = None  # (first row, end row) of each Talker step


def _run(engine: OmniEngine, spoken: list[str] = SPOKEN, text_only: tuple[str, ...] = (TEXT_ONLY,)) -> dict[str, Got]:
    """Spoken prompts and text-only companions, submitted together; per name what came back."""
    talker = engine.orchestrator.stages["talker"].model
    params = {
        "thinker": SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, min_tokens=THINKER_TOKENS),
        "talker": SamplingParams(temperature=0.0, max_tokens=TALKER_TOKENS, min_tokens=TALKER_MIN_TOKENS,
                                 repetition_penalty=1.0),
    }
    names, got, by_prompt = {}, {}, {}
    for name in [*spoken, *text_only]:
        messages, uav = _messages(name)
        modalities = ["text"] if name in text_only else ["text", "audio"]
        prompt = engine.render_prompt(messages, use_audio_in_video=uav)
        names[engine.add_request(prompt, modalities, params)] = name
        by_prompt[tuple(prompt.token_ids)] = name  # each prompt differs
        got[name] = Got([], [], [], talker_chunks=[])
    build, prepare = talker.build_prefill, talker.prepare_inputs

    def build_prefill(prompt_ids, *args):
        prefill, ids, positions = build(prompt_ids, *args)
        g = got[by_prompt[tuple(prompt_ids)]]
        g.prefill, g.positions = prefill.clone(), None if positions is None else positions.table
        return prefill, ids, positions

    def prepare_inputs(ctx, input_ids, positions):
        for i, rid in enumerate(ctx.req_ids):
            s, e = ctx.spans[rid]
            got[names[rid]].talker_chunks.append((ctx.num_computed[i], ctx.num_computed[i] + e - s))
        return prepare(ctx, input_ids, positions)

    talker.build_prefill, talker.prepare_inputs = build_prefill, prepare_inputs
    try:
        while engine.has_work():
            for d in engine.step():
                g = got[names[d.req_id]]
                g.tokens.extend(d.new_token_ids)
                if d.codes is not None:
                    g.codes.append(d.codes)
                if d.audio is not None:
                    g.audio.append(d.audio)
    finally:
        del talker.build_prefill, talker.prepare_inputs
    stats = engine.resource_stats()
    for stage in ("thinker", "talker"):
        assert stats[stage]["kv_free_blocks"] == stats[stage]["kv_blocks"] and stats[stage]["records"] == 0
    assert len(engine.orchestrator.stages["thinker"].model.encoders) == 0
    return got


@pytest.fixture(scope="module")
def whole(ckpt):
    return _run(_engine(ckpt))


@pytest.fixture(scope="module")
def chunked(ckpt):
    return _run(_engine(ckpt, thinker_tokens_per_step=7, talker_tokens_per_step=5))


@pytest.fixture(scope="module")
def diffs():
    out: dict[str, dict[str, float]] = {}
    yield out
    print("\nTalker media max |diff| vs transformers:",
          {k: {m: f"{v:.1e}" for m, v in d.items()} for k, d in out.items()})


@pytest.mark.parametrize("name", SPOKEN)
def test_spoken_answer_equals_transformers_batched_with_other_requests(ckpt, whole, diffs, name):
    ref, got = _reference(ckpt, name), whole[name]
    assert got.tokens == ref.tokens
    # The Talker's prompt: accept-layer rows projected on media rows, embeddings projected elsewhere.
    assert got.prefill.shape == ref.prefill.shape
    prefill_diff = (got.prefill - ref.prefill).abs().max().item()
    assert prefill_diff <= PREFILL_TOL
    # Its own 3-D positions over its own prompt (None: plain indices, what transformers gives without visuals).
    plain = torch.arange(ref.positions.shape[0], dtype=torch.float32)[:, None].expand(-1, 3)
    assert torch.equal(plain if got.positions is None else got.positions, ref.positions.float())
    codes = torch.cat(got.codes, dim=1)
    assert codes.shape == ref.codes.shape and torch.equal(codes, ref.codes)
    audio = torch.cat(got.audio)
    assert audio.shape == ref.audio.shape
    wave_diff = (audio - ref.audio).abs().max().item()
    diffs[name] = {"prefill": prefill_diff, "wave": wave_diff}
    assert wave_diff <= WAVE_TOL


def test_the_talker_positions_cover_every_rule(ckpt):
    """The prompts above reach each position rule of the Talker's prompt: media spans re-indexed past dropped
    turns, images, a video with its audio track read as interleaved (an image ahead) and as plain (none)."""
    ids = TalkerTokenIds.from_config(load_hf_reference(ckpt).config)
    kinds = {}
    for name in SPOKEN[:-1]:
        messages, uav = _messages(name)
        prompt = ours(ckpt)(messages, uav)
        spans = thinker_media(prompt.data).spans
        kinds[name] = [s.kind for s in talker_media_spans(spans, prompt.token_ids, ids)], [s.kind for s in spans]
    assert kinds["video+audio"] == (["audio"], ["audio", "video+audio"])
    assert kinds["video+audio, image"] == (["video+audio", "image"], ["video+audio", "image"])
    messages, _ = _messages("multi-turn")
    prompt = ours(ckpt)(messages)
    (image, audio) = talker_media_spans(thinker_media(prompt.data).spans, prompt.token_ids, ids)
    (thinker_image, _) = thinker_media(prompt.data).spans
    assert image.start < thinker_image.start  # the system and earlier turns are not in the Talker's prompt


def test_chunked_prefill_in_both_stages_gives_identical_speech(ckpt, whole, chunked):
    for name in SPOKEN:
        assert chunked[name].tokens == whole[name].tokens, name
        assert torch.equal(torch.cat(chunked[name].codes, dim=1), torch.cat(whole[name].codes, dim=1)), name
        assert (torch.cat(chunked[name].audio) - torch.cat(whole[name].audio)).abs().max().item() <= 1e-5
    assert chunked[TEXT_ONLY].tokens == whole[TEXT_ONLY].tokens
    assert not whole[TEXT_ONLY].codes and not whole[TEXT_ONLY].audio and not whole[TEXT_ONLY].talker_chunks
    assert whole[TEXT_ONLY].tokens == reference_tokens(ckpt, _messages(TEXT_ONLY)[0], THINKER_TOKENS)
    # The Talker's prefill chunks cut through the rows of its image and video spans.
    cut = set()
    for name in SPOKEN:
        got = chunked[name]
        if got.positions is None:
            continue
        visual = torch.nonzero(got.positions[:, 1] != got.positions[:, 0]).flatten()  # rows with own H ids
        lo, hi = int(visual.min()), int(visual.max())
        if any(lo < end <= hi for _, end in got.talker_chunks):
            cut.add(name)
    assert "video+audio, image" in cut and len(cut) >= 2, cut  # the interleaved span and an image span


def test_cuda_graph_runner_decodes_spoken_media_answers_at_the_talker_rope_delta(ckpt, whole):
    """Decode steps on the static (graph) path carry float positions index + delta in the Talker too."""
    config = load_pipeline_config("qwen3_omni", {"runner": "cuda_graph"})
    engine = OmniEngine(EngineArgs(ckpt), config)
    got = _run(engine, ["video+audio, image", "text"], ())
    for name in got:
        assert got[name].tokens == whole[name].tokens
        assert torch.equal(torch.cat(got[name].codes, dim=1), torch.cat(whole[name].codes, dim=1)), name
    runner = engine.orchestrator.stages["talker"].runner
    assert runner.stats.static_steps > 0


def test_step_positions_take_prompt_rows_from_tables_and_later_rows_at_index_plus_delta():
    a = PromptPositions(torch.arange(18, dtype=torch.float32).view(6, 3) * 10, 2.5)
    c = PromptPositions(-torch.arange(12, dtype=torch.float32).view(4, 3), -3.0)
    # a: prompt rows 2..5 (a chunk cutting into its table); b: plain rows 3, 4; c: its last prompt row, then
    # two rows past its prompt; two padding rows keep the runner's value.
    positions = torch.tensor([2, 3, 4, 5, 3, 4, 3, 4, 5, 0, 0])
    spans = [(0, 4), (4, 6), (6, 9)]
    got = step_positions(positions, [2, 3, 3], spans, [a, None, c])
    want = torch.cat([a.table[2:6], torch.tensor([[3.0] * 3, [4.0] * 3]), c.table[3:4],
                      torch.tensor([[1.0] * 3, [2.0] * 3, [0.0] * 3, [0.0] * 3])])
    assert torch.equal(got, want)
    # Decode only: one id per row (index + delta), no table read.
    got = step_positions(torch.tensor([6, 3, 7]), [6, 3, 7], [(0, 1), (1, 2), (2, 3)], [a, None, c])
    assert got.dim() == 1 and got.tolist() == [8.5, 3.0, 4.0]
    assert step_positions(torch.tensor([4, 5]), [4, 5], [(0, 1), (1, 2)], [None, None]).dtype == torch.float32
