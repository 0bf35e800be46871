"""Decoding user media: audio files and arrays to 16 kHz mono, images, video files (frames + audio track)."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile
import soxr
from PIL import Image

from omnistage.models.media import (
    DecodeLimits,
    MediaError,
    MediaLimitError,
    load_audio,
    load_image,
    load_video,
)
from omnistage.testing.media_files import write_video

RATE = 22050


def _tone(seconds: float = 0.5, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.4 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1234 * t)).astype(np.float32)


@pytest.mark.parametrize("fmt, lossless", [("wav", True), ("flac", True), ("ogg", False), ("mp3", False)])
def test_audio_files_decode_to_16k_mono(tmp_path, fmt, lossless):
    tone = _tone()
    stereo = np.stack([tone, tone], axis=1)
    path = tmp_path / f"clip.{fmt}"
    soundfile.write(str(path), stereo, RATE)
    want = soxr.resample(tone, RATE, 16000, quality="HQ")
    for src in (path, str(path), path.read_bytes()):
        got = load_audio(src)
        assert got.dtype == np.float32
        if lossless:
            assert got.shape == want.shape
            assert np.abs(got - want).max() < 2e-4  # 16-bit quantisation only
        else:
            assert abs(got.shape[0] - want.shape[0]) < 0.1 * 16000  # codec delay/padding
            n = min(got.shape[0], want.shape[0]) - 2000
            best = max(np.corrcoef(got[k : k + n], want[:n])[0, 1] for k in range(0, 1200, 1))
            assert best > 0.95


def test_audio_arrays_tuples_and_errors(tmp_path):
    tone = _tone(rate=16000)
    assert np.array_equal(load_audio(tone), tone)  # a bare array is taken at 16 kHz
    resampled = load_audio((_tone(), RATE))
    assert np.allclose(resampled, soxr.resample(_tone(), RATE, 16000, quality="HQ"))
    with pytest.raises(MediaError, match="sample rate"):
        load_audio((tone, 0))
    with pytest.raises(MediaError, match="no such file"):
        load_audio(tmp_path / "missing.wav")
    (tmp_path / "junk.wav").write_bytes(b"not audio at all")
    with pytest.raises(MediaError, match="cannot decode"):
        load_audio(tmp_path / "junk.wav")


def test_images_from_pil_arrays_paths_and_bytes(tmp_path):
    arr = np.random.default_rng(0).integers(0, 256, (9, 7, 3), dtype=np.uint8)
    path = tmp_path / "x.png"
    Image.fromarray(arr).save(path)
    rgba = np.concatenate([arr, np.full((9, 7, 1), 255, np.uint8)], axis=2)
    for src in (arr, Image.fromarray(arr), path, str(path), path.read_bytes(), rgba):
        image = load_image(src)
        assert image.mode == "RGB" and np.array_equal(np.asarray(image), arr)
    with pytest.raises(MediaError, match="uint8"):
        load_image(arr.astype(np.float32))
    with pytest.raises(MediaError, match="cannot decode image"):
        load_image(b"nope")


def test_video_file_frames_fps_and_audio_track(tmp_path):
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (20, 24, 32, 3), dtype=np.uint8)  # 2 s at 10 fps
    track = _tone(2.0, 16000)
    path = tmp_path / "clip.mkv"
    write_video(path, frames, 10, track)
    video = load_video(path, fps=2.0, with_audio=True)
    index = np.linspace(0, 19, 4).round().astype(int)
    assert np.array_equal(video.frames, frames[index]) and video.fps == pytest.approx(2.0)
    assert video.audio.shape == track.shape and np.abs(video.audio - track).max() < 1e-4
    silent = tmp_path / "silent.mkv"
    write_video(silent, frames, 10, None)
    assert load_video(silent, with_audio=True).audio is None
    assert load_video(path).frames.shape[0] == 4  # default: 2 frames per second


def test_video_arrays_and_errors():
    frames = np.zeros((3, 8, 8, 3), dtype=np.uint8)
    video = load_video(frames, fps=3, audio=(_tone(), RATE))
    assert video.fps == 3.0 and video.frames.shape == (3, 8, 8, 3) and video.audio.dtype == np.float32
    assert load_video(frames).fps == 1.0  # transformers' processor default for frame arrays
    with pytest.raises(MediaError, match=r"uint8 \[T, H, W, 3\]"):
        load_video(frames[0])
    with pytest.raises(MediaError, match="fps"):
        load_video(frames, fps=0)


def _bound(exc_info) -> str:
    return exc_info.value.bound


def test_decode_limits_bound_audio_images_and_videos(tmp_path):
    """Over a limit -> MediaLimitError naming the bound (from the header when it says, else while decoding);
    at the limit -> the same result as without limits."""
    flac = tmp_path / "three.flac"
    soundfile.write(str(flac), _tone(3.0, 16000), 16000)
    with pytest.raises(MediaLimitError, match="lasts 3.00 s; at most 2 s") as e:
        load_audio(flac, limits=DecodeLimits(max_audio_seconds=2))
    assert _bound(e) == "max_audio_seconds"
    assert np.array_equal(load_audio(flac, limits=DecodeLimits(max_audio_seconds=3)), load_audio(flac))
    with pytest.raises(MediaLimitError):  # arrays too
        load_audio(_tone(3.0, 16000), limits=DecodeLimits(max_audio_seconds=2))
    frames = np.random.default_rng(2).integers(0, 256, (20, 24, 32, 3), dtype=np.uint8)  # 2 s at 10 fps
    mkv = tmp_path / "clip.mkv"
    write_video(mkv, frames, 10, _tone(2.0, 16000))
    with pytest.raises(MediaLimitError) as e:  # the track, through PyAV (libsndfile cannot read Matroska)
        load_audio(mkv, limits=DecodeLimits(max_audio_seconds=1))
    assert _bound(e) == "max_audio_seconds"
    with pytest.raises(MediaLimitError) as e:
        load_video(mkv, with_audio=True, limits=DecodeLimits(max_audio_seconds=1))
    assert _bound(e) == "max_audio_seconds"
    for limits, bound in ((DecodeLimits(max_video_frames=19), "max_video_frames"),
                          (DecodeLimits(max_video_seconds=1.5), "max_video_seconds"),
                          (DecodeLimits(max_image_pixels=24 * 32 - 1), "max_image_pixels"),
                          (DecodeLimits(max_video_pixels=4 * 24 * 32 - 1), "max_video_pixels")):  # 4 sampled
        with pytest.raises(MediaLimitError) as e:
            load_video(mkv, limits=limits)
        assert _bound(e) == bound
    at_limit = DecodeLimits(max_video_frames=20, max_video_seconds=2, max_image_pixels=24 * 32, max_audio_seconds=2,
                            max_video_pixels=10 * 24 * 32)  # 10 frames sampled at 5 fps
    bounded, free = load_video(mkv, 5, True, limits=at_limit), load_video(mkv, 5, True)
    assert np.array_equal(bounded.frames, free.frames) and bounded.fps == free.fps
    assert np.array_equal(bounded.audio, free.audio)
    png = tmp_path / "x.png"
    Image.fromarray(frames[0]).save(png)
    with pytest.raises(MediaLimitError, match="32x24") as e:
        load_image(png, limits=DecodeLimits(max_image_pixels=700))
    assert _bound(e) == "max_image_pixels"
    assert np.array_equal(np.asarray(load_image(png, limits=DecodeLimits(max_image_pixels=768))), frames[0])
