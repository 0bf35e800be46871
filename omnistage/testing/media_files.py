"""Write video files for tests and benchmarks: lossless frames (FFV1), optionally with a 16 kHz audio track, so a
file decodes back to exactly the frames it was written from."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_video(path: str | Path, frames: np.ndarray, fps: int, audio: np.ndarray | None = None) -> Path:
    """frames: uint8 [T, H, W, 3]; audio: float32 mono at 16 kHz in [-1, 1] (stored as 16-bit PCM)."""
    import av

    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
    with av.open(str(path), "w") as container:
        video = container.add_stream("ffv1", rate=fps)
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        sound = None if audio is None else container.add_stream("pcm_s16le", rate=16000, layout="mono")
        for f in frames:
            for packet in video.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if sound is not None:
            pcm = (np.clip(audio, -1, 1) * 32767).round().astype(np.int16)[None, :]
            frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
            frame.sample_rate = 16000
            for packet in sound.encode(frame):
                container.mux(packet)
            for packet in sound.encode():
                container.mux(packet)
    return Path(path)
