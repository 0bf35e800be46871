"""``Omni.generate`` with audio, image and video parts in every form the offline API takes, answered in speech:
the same media as arrays, as (array, rate) / PIL / frame lists, and as files give the same spoken answer."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from omnistage import Omni, SamplingParams
from omnistage.models.qwen3_omni.config import load_config
from omnistage.testing.media_files import write_video

_rng = np.random.default_rng(3)
_t = np.arange(24000) / 16000
CLIP = (0.3 * np.sin(2 * np.pi * 330 * _t) + 0.05 * _rng.standard_normal(_t.size)).astype(np.float32)  # 1.5 s
IMAGE = _rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)
FRAMES = _rng.integers(0, 256, (4, 40, 56, 3), dtype=np.uint8)  # 2 s at 2 fps
FPS = 2
TRACK = (0.2 * np.sin(2 * np.pi * 220 * np.arange(32000) / 16000)).astype(np.float32)  # the video's 2 s
PARAMS = {
    "thinker": SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4),
    "talker": SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, repetition_penalty=1.0),
}


def _message(audio, image, video, fps=None) -> list[dict]:
    video_part = {"type": "video", "video": video} | ({} if fps is None else {"fps": fps})
    return [{"role": "user", "content": [{"type": "audio", "audio": audio}, {"type": "image", "image": image},
                                         video_part, {"type": "text", "text": "What is going on?"}]}]


@pytest.fixture(scope="module")
def omni(tiny_ckpt):
    return Omni(tiny_ckpt)


def test_every_media_form_gives_the_same_spoken_answer(tmp_path, omni, tiny_ckpt):
    wav, png = tmp_path / "q.wav", tmp_path / "p.png"
    soundfile.write(str(wav), CLIP, 16000, subtype="FLOAT")
    Image.fromarray(IMAGE).save(png)
    mkv = write_video(tmp_path / "v.mkv", FRAMES, FPS)  # lossless: decodes to FRAMES, 2 per second by default
    clip_24k = (0.3 * np.sin(2 * np.pi * 330 * np.arange(36000) / 24000)).astype(np.float32)
    prompts = {
        "arrays": _message(CLIP, IMAGE, FRAMES, FPS),  # a bare array is taken at 16 kHz
        "tuple, PIL, frame list": _message((CLIP, 16000), Image.fromarray(IMAGE), list(FRAMES), FPS),
        "paths": _message(str(wav), png, mkv),
        "24 kHz, bytes": _message((clip_24k, 24000), png.read_bytes(), mkv.read_bytes()),
    }
    outs = dict(zip(prompts, omni.generate(list(prompts.values()), modalities=["text", "audio"],
                                           sampling_params=PARAMS)))
    thinker = load_config(tiny_ckpt).thinker_config
    for name, out in outs.items():
        assert out.finish_reason == "length" and len(out.token_ids) == 4, name
        ids = out.prompt_token_ids
        assert {thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id} <= set(ids), name
        assert out.codes.shape[1] >= 3 and out.audio.numel() > (out.codes.shape[1] - 1) * 1920, name
        assert out.sample_rate == 24000 and out.audio.abs().max() > 0, name
    want = outs["arrays"]
    for name in ("tuple, PIL, frame list", "paths"):
        got = outs[name]
        assert got.prompt_token_ids == want.prompt_token_ids and got.token_ids == want.token_ids, name
        assert torch.equal(got.codes, want.codes), name
        assert (got.audio - want.audio).abs().max().item() <= 1e-5, name
    # 1.5 s resampled from 24 kHz is 1.5 s at 16 kHz: as many audio tokens as the 16 kHz clip.
    count = [o.prompt_token_ids.count(thinker.audio_token_id) for o in (want, outs["24 kHz, bytes"])]
    assert count[0] == count[1]


def test_a_video_file_with_its_audio_track_is_answered_in_speech(tmp_path, omni, tiny_ckpt):
    mkv = write_video(tmp_path / "talk.mkv", FRAMES, FPS, audio=TRACK)
    message = [{"role": "user", "content": [{"type": "video", "video": str(mkv)},
                                            {"type": "text", "text": "What is said?"}]}]
    (out,) = omni.generate(message, modalities=["text", "audio"], sampling_params=PARAMS, use_audio_in_video=True)
    thinker = load_config(tiny_ckpt).thinker_config
    assert thinker.audio_token_id in out.prompt_token_ids and thinker.video_token_id in out.prompt_token_ids
    assert out.codes.shape[1] >= 3 and out.audio.numel() > (out.codes.shape[1] - 1) * 1920
