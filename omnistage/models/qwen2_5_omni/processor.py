"""Chat messages with audio / image / video parts -> Qwen2.5-Omni's prompt ids and media inputs, as
transformers' ``Qwen2_5OmniProcessor`` does.

The steps are Qwen3-Omni's (``qwen3_omni.processor``: part decoding and limits, the checkpoint's image processor,
the video patches done in torch, content keys, ``ThinkerMedia``); what differs is supplied here:

- the speech system turn when the conversation has none (``prompt``);
- placeholder and marker tokens: ``<|AUDIO|>``, ``<|IMAGE|>``, ``<|VIDEO|>``, ``<|audio_bos|>`` ... ;
- audio features: the processor pads every clip to the feature extractor's ``n_samples`` (300 s) and the model
  reads only a clip's own frames. Those frames depend only on the clip and on zeros after it (the STFT window
  of a frame reaches ``n_fft / 2`` samples past it; the log-mel floor is taken from the maximum, which padding
  zeros never raise), so a clip is padded here only far enough for every frame to see zeros: the same values at
  a fraction of the work; longer clips are cut at ``n_samples`` as the processor truncates them;
- placeholder count ``((frames - 1) // 2 + 1 - 2) // 2 + 1``;
- video frame limits 128 .. 768 blocks of 28 x 28 pixels; a video's ``seconds_per_grid`` is ``2 / fps``;
- a video with its audio track: chunks of ``seconds_per_chunk``, and TMRoPE's integer ids (``tmrope``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.models.qwen2_5_omni import tmrope
from omnistage.models.qwen2_5_omni.audio_encoder import audio_token_count
from omnistage.models.qwen2_5_omni.prompt import with_speech_system_prompt
from omnistage.models.qwen3_omni.mrope import MediaSpan
from omnistage.models.qwen3_omni.processor import Qwen3OmniInputProcessor

# Below about 50 frames the mel projection's GEMM takes another path and rounds the last bit differently from
# the processor's 30000-frame one; from one second on the values are the processor's exactly.
_MIN_PADDED_SAMPLES = 16000


class Qwen25OmniInputProcessor(Qwen3OmniInputProcessor):
    tokens = (
        ("audio_pad", "<|AUDIO|>"),
        ("image_pad", "<|IMAGE|>"),
        ("video_pad", "<|VIDEO|>"),
        ("audio_start", "<|audio_bos|>"),
        ("audio_end", "<|audio_eos|>"),
        ("vision_start", "<|vision_bos|>"),
    )
    # Qwen2_5OmniProcessor's video size defaults (class attributes of the processor, not in any file).
    video_min_pixels = 128 * 28 * 28
    video_max_pixels = 768 * 28 * 28

    def __init__(self, model_dir: str | Path, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, tokenizer, config)
        thinker = config.thinker_config
        self.position_id_per_seconds = int(thinker.position_id_per_seconds)
        self.seconds_per_chunk = float(thinker.seconds_per_chunk)
        fe = self.feature_extractor
        self.hop, self.max_samples = int(fe.hop_length), int(fe.n_samples)

    def _audio_features(self, clips: list[np.ndarray]) -> tuple[list[torch.Tensor], int]:
        feats = []
        for clip in clips:
            clip = clip[: self.max_samples]
            frames = -(-clip.shape[0] // self.hop)  # the processor's valid frames: ceil(samples / hop)
            # Zeros past the clip for every valid frame's window; a multiple of the hop keeps the frame grid.
            length = -(-(clip.shape[0] + self.min_samples) // self.hop) * self.hop
            length = min(self.max_samples, max(length, _MIN_PADDED_SAMPLES))
            out = self.feature_extractor(
                clip, sampling_rate=self.sampling_rate, padding="max_length", max_length=length, truncation=True,
                return_tensors="pt",
            )
            feats.append(out["input_features"][0, :, :frames].clone())
        return feats, 0  # this tower pads its chunks itself

    def chat_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        # The speech system turn joins here, not in the messages handed over: errors keep naming the caller's
        # message indices.
        return super().chat_text(with_speech_system_prompt(messages))

    def audio_tokens(self, frames: int) -> int:
        return audio_token_count(frames)

    def video_audio_order(self, grid: tuple[int, int, int], seconds_per_grid: float, n_aud: int) -> list[bool]:
        return tmrope.video_audio_order(grid, self.merge, seconds_per_grid, n_aud, self.position_id_per_seconds,
                                        self.seconds_per_chunk)

    def positions(self, num_tokens: int, spans: Sequence[MediaSpan]) -> tuple[torch.Tensor, float]:
        return tmrope.prompt_positions(num_tokens, spans, self.merge, self.position_id_per_seconds,
                                       self.seconds_per_chunk)
