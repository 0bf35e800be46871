"""Decoding user media: audio files and arrays to 16 kHz mono, images, video files (frames + audio track)."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile
import soxr
from PIL import Image

from omnistage.models.media import MediaError, load_audio, load_image, load_video
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
