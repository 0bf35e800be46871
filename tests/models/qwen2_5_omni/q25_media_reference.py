"""transformers' side of the Qwen2.5-Omni media tests: ``Qwen2_5OmniProcessor`` (tokenizer, feature extractor,
image processor, placeholder expansion) and the model, on the tiny checkpoint with towers. ``generate`` gets
the attention mask the processor returns (its Talker then gets the mask ``explicit_talker_mask`` gives).

The processor is built from its parts: its video processor class needs torchvision, which does not import
with this torch build, so a stand-in returns our video patches (``_video``: the torchvision CPU ops done in
torch, checked against the image processor's steps in Qwen3-Omni's tests); all else (tokenizer, feature
extractor, image processor, placeholder expansion including audio-in-video chunking, the model) is
transformers'.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import torch
from PIL import Image
from q25_reference import loaded
from transformers import (
    AutoFeatureExtractor,
    AutoImageProcessor,
    AutoTokenizer,
    BatchFeature,
    Qwen2_5OmniProcessor,
)

from omnistage.models.media import load_video
from omnistage.models.qwen2_5_omni.loading import load_config
from omnistage.models.qwen2_5_omni.processor import Qwen25OmniInputProcessor
from omnistage.models.qwen2_5_omni.prompt import with_speech_system_prompt
from omnistage.testing.qwen2_5_omni.reference import explicit_talker_mask, tiny_checkpoint
from omnistage.testing.reference import lenient_processor_components

_rng = np.random.default_rng(11)


def noise(samples: int) -> np.ndarray:
    return (_rng.standard_normal(samples) * 0.1).astype(np.float32)


AUDIO_2S = noise(32555)  # 204 frames: chunks of 200 + 4 -> 51 placeholders
AUDIO_HALF = noise(8077)  # 51 frames -> 13 placeholders
AUDIO_5S = noise(80000)  # 500 frames: three chunks -> 125 placeholders


def random_image(h: int, w: int) -> np.ndarray:
    return _rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


IMAGE_A = random_image(90, 150)  # 3 x 5 merge blocks (28 px each, rounded)
IMAGE_B = random_image(200, 130)  # 7 x 5 blocks: two windows of 4 a side, ragged
VIDEO = random_image(3 * 56, 84).reshape(3, 56, 84, 3)  # 3 frames: the last repeats to a multiple of 2
LONG_VIDEO = random_image(8 * 28, 56).reshape(8, 28, 56, 3)  # 4 s at 2 fps: two 2-second chunks
TRACK = noise(16000 * 4 + 300)  # its audio: 101 placeholders, three chunks (50, 50, 1)

SCENARIOS = {
    "audio": [{"role": "user", "content": [{"type": "audio", "audio": AUDIO_2S},
                                           {"type": "text", "text": "What do you hear?"}]}],
    "two audios": [{"role": "user", "content": [
        {"type": "audio", "audio": AUDIO_5S}, {"type": "text", "text": "and"}, {"type": "audio", "audio": AUDIO_HALF},
        {"type": "text", "text": "Which one?"}]}],
    "multi-turn": [
        {"role": "system", "content": "You are a helpful voice assistant."},
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": [{"type": "audio", "audio": AUDIO_HALF}]},
    ],
    "image": [{"role": "user", "content": [{"type": "image", "image": IMAGE_A},
                                           {"type": "text", "text": "What is this?"}]}],
    "audio+image": [{"role": "user", "content": [
        {"type": "audio", "audio": AUDIO_2S}, {"type": "text", "text": "and"}, {"type": "image", "image": IMAGE_B},
        {"type": "audio", "audio": AUDIO_HALF}, {"type": "text", "text": "Which one?"}]}],
    "images, multi-turn": [
        {"role": "user", "content": [{"type": "image", "image": IMAGE_B}, {"type": "text", "text": "Look."}]},
        {"role": "assistant", "content": "I see it."},
        {"role": "user", "content": [{"type": "image", "image": IMAGE_A}, {"type": "audio", "audio": AUDIO_HALF},
                                     {"type": "text", "text": "And now?"}]},
    ],
    "video": [{"role": "user", "content": [{"type": "video", "video": VIDEO, "fps": 1.5},
                                           {"type": "text", "text": "What happens?"}]}],
    "video+audio": [{"role": "user", "content": [
        {"type": "audio", "audio": AUDIO_HALF},
        {"type": "video", "video": LONG_VIDEO, "fps": 2.0, "audio": TRACK},
        {"type": "text", "text": "What happens?"}]}],
    "text": [{"role": "user", "content": "Tell me a story about the sea."}],
}
USE_AUDIO_IN_VIDEO = {"video+audio"}
MEDIA = [k for k in SCENARIOS if k != "text"]
EOS = tuple(json.loads((tiny_checkpoint() / "generation_config.json").read_text())["eos_token_id"])
SEED = 5


@functools.cache
def ours() -> Qwen25OmniInputProcessor:
    ckpt = tiny_checkpoint()
    return Qwen25OmniInputProcessor(ckpt, AutoTokenizer.from_pretrained(ckpt), load_config(ckpt))


@functools.cache
def reference_processor() -> Qwen2_5OmniProcessor:
    ckpt = tiny_checkpoint()
    tok = AutoTokenizer.from_pretrained(ckpt)
    with lenient_processor_components():
        return Qwen2_5OmniProcessor(image_processor=AutoImageProcessor.from_pretrained(ckpt), video_processor=None,
                                    feature_extractor=AutoFeatureExtractor.from_pretrained(ckpt), tokenizer=tok,
                                    chat_template=tok.chat_template)


class _OurVideoPatches:
    """Stand-in for transformers' (torchvision-only) Qwen2-VL video processor."""

    temporal_patch_size = 2
    merge_size = 2

    def __init__(self, fps: list[float]) -> None:
        self.fps = fps

    def __call__(self, videos, **_kwargs) -> BatchFeature:
        pixels, grids = [], []
        for frames, fps in zip(videos, self.fps):
            p, g = ours()._video(load_video(np.asarray(frames), fps))
            pixels.append(p)
            grids.append(g)
        return BatchFeature({"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids)})


def reference_inputs(messages, use_audio_in_video: bool = False) -> BatchFeature:
    """What transformers' processor gives for these messages (with the speech system turn the family adds)."""
    messages = with_speech_system_prompt(messages)
    parts = [p for m in messages if not isinstance(m["content"], str) for p in m["content"]]
    audio = [p["audio"] for p in parts if p["type"] == "audio"]
    images = [Image.fromarray(p["image"]) for p in parts if p["type"] == "image"]
    videos = [p for p in parts if p["type"] == "video"]
    proc = reference_processor()
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kwargs: dict = {"text": text, "images": images or None, "return_tensors": "pt"}
    if videos:
        fps = sorted({float(v["fps"]) for v in videos})
        if len(fps) > 1:
            raise ValueError("the reference processor takes one fps per call")
        proc.video_processor = _OurVideoPatches([float(v["fps"]) for v in videos])
        kwargs.update(videos=[v["video"] for v in videos], videos_kwargs={"fps": fps[0]})
    if use_audio_in_video:
        # One audio slot per clip in prompt order; a video's slot points at the video.
        slots, clips, v = [], [], 0
        for p in parts:
            if p["type"] == "audio":
                slots.append(None)
                clips.append(p["audio"])
            elif p["type"] == "video":
                slots.append(v)
                clips.append(p["audio"])
                v += 1
        kwargs.update(audio=clips, audio_from_video_indices=slots, load_audio_from_video=True)
    else:
        kwargs["audio"] = audio or None
    return proc(**kwargs)


def media_kwargs(inputs: BatchFeature) -> dict:
    """The processor outputs the model takes besides the ids (the attention mask too: without it transformers
    cannot compute 3-D positions)."""
    names = ("attention_mask", "input_features", "feature_attention_mask", "pixel_values", "image_grid_thw",
             "pixel_values_videos", "video_grid_thw", "video_second_per_grid")
    out = {k: inputs[k] for k in names if k in inputs}
    if "video_second_per_grid" in out:
        out["video_second_per_grid"] = torch.as_tensor(out["video_second_per_grid"])
    return out


@functools.cache
def reference_tokens(name: str, num_tokens: int) -> list[int]:
    """Greedy Thinker tokens from transformers, exactly ``num_tokens`` (EOS banned until then)."""
    uav = name in USE_AUDIO_IN_VIDEO
    inputs = reference_inputs(SCENARIOS[name], uav)
    with torch.no_grad():
        seq = loaded().hf.thinker.generate(
            input_ids=inputs["input_ids"], **media_kwargs(inputs), use_audio_in_video=uav,
            max_new_tokens=num_tokens, min_new_tokens=num_tokens, eos_token_id=list(EOS), do_sample=False,
        )
    return seq[0, inputs["input_ids"].shape[1] :].tolist()


@functools.cache
def reference_speech(name: str, text_tokens: int, codes: int) -> tuple[list[int], list[int], torch.Tensor]:
    """transformers' greedy generate(return_audio) with the request's media: text tokens, codes, waveform (the
    ODE noise seeded with SEED, as our Token2Wav seeds a request's)."""
    tokens, talker_codes, wav, _ = _speech(name, text_tokens, codes)
    return tokens, talker_codes, wav


def reference_talker_logits(name: str, text_tokens: int, codes: int) -> torch.Tensor:
    """[steps, V] the reference Talker's logits of every step of that run (before its logits processors)."""
    return _speech(name, text_tokens, codes)[3]


@functools.cache
def _speech(name: str, text_tokens: int, codes: int):
    ld = loaded()
    logits: list[torch.Tensor] = []
    forward = ld.hf.talker.forward

    @functools.wraps(forward)
    def record(*args, **kwargs):
        out = forward(*args, **kwargs)
        logits.append(out.logits[0, -1].clone())
        return out

    tc = ld.config.talker_config
    uav = name in USE_AUDIO_IN_VIDEO
    inputs = reference_inputs(SCENARIOS[name], uav)
    ids = inputs["input_ids"]
    kwargs = media_kwargs(inputs)
    for key in ("pixel_values", "pixel_values_videos"):
        # Only the Thinker takes pixels (generate hands unprefixed kwargs to the Talker too, which refuses them);
        # generate still zeroes the image/video rows' embeddings for the Talker, and the grids reach both.
        if key in kwargs:
            kwargs[f"thinker_{key}"] = kwargs.pop(key)
    torch.manual_seed(SEED)
    ld.hf.talker.forward = record  # explicit_talker_mask wraps it and removes both on leaving
    with torch.no_grad(), explicit_talker_mask(ld.hf):
        seq, wav = ld.hf.generate(
            ids, **kwargs, use_audio_in_video=uav, speaker="Chelsie", thinker_max_new_tokens=text_tokens,
            thinker_eos_token_id=list(EOS), thinker_do_sample=False, talker_do_sample=False,
            talker_max_new_tokens=codes, talker_eos_token_id=[tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id],
        )
    talker = ld.cap.talker_result[0, ids.shape[1] + 2 :].tolist()
    stops = [i for i, c in enumerate(talker) if c in (tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id)]
    return seq[0, ids.shape[1] :].tolist(), talker[: stops[0] if stops else None], wav.reshape(-1), torch.stack(logits)
