"""transformers' side of the media tests: its processor and model on the tiny checkpoint with towers.

transformers' ``Qwen3OmniMoeProcessor`` needs torchvision for its video processor, which does not import with
this torch build. The reference processor is therefore built from its parts, with a stand-in video processor
that returns our video patches (``Qwen3OmniInputProcessor._video``: the torchvision CPU ops done in torch); all
else — tokenizer, feature extractor, image processor, placeholder expansion (including audio-in-video
interleaving), the model — is transformers'.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoFeatureExtractor,
    AutoImageProcessor,
    AutoTokenizer,
    BatchFeature,
    Qwen3OmniMoeProcessor,
)

from omnistage.checkpoints.tokenizer import CHAT_TEMPLATE
from omnistage.models.media import load_video
from omnistage.models.qwen3_omni.config import load_config
from omnistage.models.qwen3_omni.processor import Qwen3OmniInputProcessor
from omnistage.testing.reference import lenient_processor_components, load_hf_reference


class _OurVideoPatches:
    """Stand-in for transformers' (torchvision-only) Qwen2-VL video processor."""

    temporal_patch_size = 2
    merge_size = 2

    def __init__(self, ours: Qwen3OmniInputProcessor, fps: list[float]) -> None:
        self.ours, self.fps = ours, fps

    def __call__(self, videos, **_kwargs) -> BatchFeature:
        pixels, grids = [], []
        for frames, fps in zip(videos, self.fps):
            p, g = self.ours._video(load_video(np.asarray(frames), fps))
            pixels.append(p)
            grids.append(g)
        return BatchFeature({"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids)})


# Media and prompts shared by the Thinker and Talker media tests (the same inputs, so each side is checked on
# what the other was checked on).
_rng = np.random.default_rng(7)


def noise(samples: int) -> np.ndarray:
    return (_rng.standard_normal(samples) * 0.1).astype(np.float32)


def random_image(h: int, w: int) -> np.ndarray:
    return _rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


AUDIO_2S = noise(32555)  # 203 frames: chunks of 100, 100, 3
AUDIO_HALF = noise(8077)  # 50.5 frames: padded with the longer clip it gets 51 (transformers' rounding)
AUDIO_1S = noise(16000)  # exactly one chunk
IMAGE_A = random_image(80, 112)  # 80/32 = 2.5 -> 2, 112/32 = 3.5 -> 4: Python's round, half to even
IMAGE_B = random_image(100, 60)
VIDEO = random_image(3 * 48, 64).reshape(3, 48, 64, 3)  # 3 frames: the last repeats to a multiple of 2
TRACK = noise(16000 * 2 + 300)

SCENARIOS = {
    "audio": ([{"role": "user", "content": [{"type": "audio", "audio": AUDIO_2S},
                                            {"type": "text", "text": "What do you hear?"}]}], False),
    "image": ([{"role": "user", "content": [{"type": "image", "image": IMAGE_A},
                                            {"type": "text", "text": "What is this?"}]}], False),
    "audio+image": ([{"role": "user", "content": [
        {"type": "audio", "audio": AUDIO_2S}, {"type": "text", "text": "and"}, {"type": "image", "image": IMAGE_A},
        {"type": "audio", "audio": AUDIO_HALF}, {"type": "text", "text": "Which one?"}]}], False),
    "images": ([{"role": "user", "content": [{"type": "image", "image": IMAGE_A}, {"type": "image", "image": IMAGE_B},
                                             {"type": "text", "text": "Compare them."}]}], False),
    "multi-turn": ([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": [{"type": "image", "image": IMAGE_B}, {"type": "audio", "audio": AUDIO_1S},
                                     {"type": "text", "text": "Tell me about these."}]},
    ], False),
    "video": ([{"role": "user", "content": [{"type": "video", "video": VIDEO, "fps": 1.5},
                                            {"type": "text", "text": "What happens?"}]}], False),
    "video+audio": ([{"role": "user", "content": [
        {"type": "audio", "audio": AUDIO_HALF},
        {"type": "video", "video": VIDEO, "fps": 1.5, "audio": TRACK},
        {"type": "text", "text": "What happens?"}]}], True),
    "text": ("Tell me a story about the sea.", False),
    "text 2": ([{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "friend."}]},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "How are you?"}], False),
}


@functools.cache
def ours(ckpt: str) -> Qwen3OmniInputProcessor:
    return Qwen3OmniInputProcessor(ckpt, AutoTokenizer.from_pretrained(ckpt), load_config(ckpt))


def reference_processor(ckpt: str, video_fps: list[float] = ()) -> Qwen3OmniMoeProcessor:
    with lenient_processor_components():
        return Qwen3OmniMoeProcessor(
            image_processor=AutoImageProcessor.from_pretrained(ckpt),
            video_processor=_OurVideoPatches(ours(ckpt), list(video_fps)),
            feature_extractor=AutoFeatureExtractor.from_pretrained(ckpt),
            tokenizer=AutoTokenizer.from_pretrained(ckpt),
            chat_template=CHAT_TEMPLATE,
        )


def media_of(messages) -> tuple[list, list, list, list[float], list]:
    """(audio, images, videos, video fps, video audio tracks) in prompt order, as the reference takes them."""
    audio, images, videos, fps, tracks = [], [], [], [], []
    for m in messages:
        if isinstance(m["content"], str):
            continue
        for part in m["content"]:
            if part["type"] == "audio":
                audio.append(part["audio"])
            elif part["type"] == "image":
                images.append(Image.fromarray(part["image"]))
            elif part["type"] == "video":
                videos.append(part["video"])
                fps.append(float(part.get("fps", 1.0)))
                tracks.append(part.get("audio"))
    return audio, images, videos, fps, tracks


def reference_inputs(ckpt: str, messages, use_audio_in_video: bool = False) -> BatchFeature:
    """What transformers' processor gives for these messages (audio arrays at 16 kHz, uint8 images/frames)."""
    audio, images, videos, fps, tracks = media_of(messages)
    proc = reference_processor(ckpt, fps)
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kwargs: dict = {"text": text, "return_tensors": "pt"}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = videos
        if len(set(fps)) > 1:
            raise ValueError("the reference processor takes one fps per call")
        kwargs["videos_kwargs"] = {"fps": fps[0]}
    if use_audio_in_video and videos:
        # One audio slot per clip in prompt order; a video's slot points at the video.
        slots, clips, v = [], [], 0
        for m in messages:
            for part in [] if isinstance(m["content"], str) else m["content"]:
                if part["type"] == "audio":
                    slots.append(None)
                    clips.append(part["audio"])
                elif part["type"] == "video":
                    slots.append(v)
                    clips.append(tracks[v])
                    v += 1
        kwargs.update(audio=clips, audio_from_video_indices=slots, load_audio_from_video=True)
    elif audio:
        kwargs["audio"] = audio
    return proc(**kwargs)


def reference_tokens(ckpt: str, messages, num_tokens: int, use_audio_in_video: bool = False) -> list[int]:
    """Greedy Thinker tokens from transformers, exactly ``num_tokens`` of them (EOS ids banned until then)."""
    hf = load_hf_reference(ckpt)
    inputs = reference_inputs(ckpt, messages, use_audio_in_video)
    tok = ours(ckpt).tokenizer
    eos = [hf.config.im_end_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    with torch.no_grad():
        seq = hf.thinker.generate(
            **inputs, use_audio_in_video=use_audio_in_video, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
            eos_token_id=eos, do_sample=False,
        )
    return seq[0, inputs["input_ids"].shape[1] :].tolist()


def ckpt_str(path: Path) -> str:
    return str(Path(path).resolve())
