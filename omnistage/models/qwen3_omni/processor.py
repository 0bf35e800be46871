"""Turn chat messages with audio / image / video parts into the Thinker's prompt ids and media inputs,
exactly as transformers' ``Qwen3OmniMoeProcessor`` does.

- Audio: the checkpoint's Whisper feature extractor over all clips of the request at once (16 kHz, padded to
  the longest clip, so a shorter clip's last frames see zeros, as in the reference); placeholder count from
  the frame count (about 13 per second).
- Images: the checkpoint's image processor (``preprocessor_config.json``): smart resize to multiples of 32,
  bicubic, normalise, patches in merge-block order; ``t*h*w / 4`` placeholders.
- Videos: the Qwen2-VL video processor's steps done here in torch (its transformers class needs
  torchvision): smart resize with the Qwen3-Omni processor's frame-size limits, bicubic antialiased uint8
  resize (the op torchvision runs on CPU), fused rescale+normalise, last frame repeated to a multiple of the
  temporal patch, patches; ``seconds_per_grid = temporal_patch / fps``. With ``use_audio_in_video`` the
  video's audio track joins the audio clips and its placeholder becomes ``<|audio_start|>`` + video and audio
  tokens interleaved by time + ``<|audio_end|>``.

The result (a ``PreparedPrompt`` whose data holds a ``ThinkerMedia``) carries, per media item, the encoder
input, the prompt rows its outputs fill and a content key (identical inputs share one encoder run), plus the
prompt's 3-D positions and rope delta.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from omnistage.models.family import PreparedPrompt
from omnistage.models.loader import checkpoint_files
from omnistage.models.media import MediaError, Video, load_audio, load_image, load_video
from omnistage.models.qwen3_omni.audio_encoder import audio_token_count
from omnistage.models.qwen3_omni.mrope import MediaSpan, PromptPositions, interleaved_order, prompt_positions

# Qwen3OmniMoeProcessor's own defaults (class attributes, not read from any file).
VIDEO_MIN_PIXELS = 128 * 32 * 32
VIDEO_MAX_PIXELS = 768 * 32 * 32
PROCESSOR_POSITION_ID_PER_SECONDS = 13.0  # orders video vs audio tokens in the placeholder
_MEDIA_KEY = "media"  # where a ThinkerMedia lives in a prepared prompt's data and the Thinker's request state


@dataclass(frozen=True)
class MediaItem:
    """One encoder input and the prompt rows its output fills (increasing; interleaved for a video that
    shares its span with its audio track)."""

    kind: str  # "audio" | "image" | "video"
    key: str  # content hash of the encoder input: identical items share one encoder run
    rows: torch.Tensor  # [n] long prompt positions
    features: torch.Tensor | None = None  # audio: [mel, frames]
    pad_frames: int = 0  # audio: length its 100-frame chunks are padded to
    pixels: torch.Tensor | None = None  # image/video: [patches, C*T*P*P]
    grid: tuple[int, int, int] | None = None  # image/video: (t, h, w) patches

    @property
    def num_tokens(self) -> int:
        return int(self.rows.numel())

    @property
    def is_visual(self) -> bool:
        return self.kind != "audio"


@dataclass(frozen=True)
class ThinkerMedia:
    """Everything the Thinker needs per request besides the prompt ids."""

    items: tuple[MediaItem, ...]
    positions: torch.Tensor  # [P, 3] float32 MRoPE ids of the prompt rows
    rope_delta: float  # decode position = index + rope_delta
    flat: bool  # no image/video: positions are the plain indices on every axis
    spans: tuple[MediaSpan, ...]  # the position rules' view of the items (the Talker's positions need it)

    @property
    def prompt_positions(self) -> PromptPositions | None:
        """The prompt's 3-D ids for ``mrope.step_positions`` (None: plain indices)."""
        return None if self.flat else PromptPositions(self.positions, self.rope_delta)


def media_modalities(model_dir: str | Path, thinker: str = "thinker.") -> tuple[str, ...]:
    """What prompts to a checkpoint may hold: text, plus audio and image + video for the Thinker towers it holds
    (``thinker.audio_tower.*``, ``thinker.visual.*``; ``thinker``: the Thinker's prefix), when it has its processor
    files."""
    model_dir = Path(model_dir)
    if not (model_dir / "preprocessor_config.json").is_file():
        return ("text",)
    names = checkpoint_files(model_dir)
    audio = any(n.startswith(thinker + "audio_tower.") for n in names)
    vision = any(n.startswith(thinker + "visual.") for n in names)
    return ("text",) + (("audio",) if audio else ()) + (("image", "video") if vision else ())


def media_data(media: ThinkerMedia | None) -> dict[str, Any]:
    """The plain per-request data that carries a request's media (prepared prompt -> Thinker request)."""
    return {} if media is None else {_MEDIA_KEY: media}


def thinker_media(data: Mapping[str, Any]) -> ThinkerMedia | None:
    """The media in a prepared prompt's data or a Thinker request's state (None: text only)."""
    return data.get(_MEDIA_KEY)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: multiples of ``factor`` (Python ``round``: half to even), pixel count within
    [min_pixels, max_pixels], aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"image aspect ratio must be below 200, got {height}x{width}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _hash(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, torch.Tensor):
            h.update(str((p.dtype, tuple(p.shape))).encode())
            h.update(p.contiguous().numpy().tobytes())
        else:
            h.update(repr(p).encode())
    return h.hexdigest()


@dataclass
class _Part:
    kind: str  # "audio" | "image" | "video"
    value: Any  # decoded: np audio, PIL image, Video


class Qwen3OmniInputProcessor:
    """Built from a checkpoint directory (``preprocessor_config.json``) and its tokenizer and config.

    A family whose processor differs only in its token names, audio features, placeholder counts, video frame
    limits, audio-in-video order and position rules (Qwen2.5-Omni) overrides those class attributes and hooks.
    """

    # (name, token) of the placeholders and markers, as this family's tokenizer spells them.
    tokens: tuple[tuple[str, str], ...] = (
        ("audio_pad", "<|audio_pad|>"),
        ("image_pad", "<|image_pad|>"),
        ("video_pad", "<|video_pad|>"),
        ("audio_start", "<|audio_start|>"),
        ("audio_end", "<|audio_end|>"),
        ("vision_start", "<|vision_start|>"),
    )
    video_min_pixels = VIDEO_MIN_PIXELS
    video_max_pixels = VIDEO_MAX_PIXELS

    def __init__(self, model_dir: str | Path, tokenizer: Any, config: Any) -> None:
        from transformers import AutoFeatureExtractor, AutoImageProcessor

        model_dir = Path(model_dir)
        if not (model_dir / "preprocessor_config.json").is_file():
            raise ValueError(f"{model_dir} has no preprocessor_config.json: audio/image/video input is unavailable")
        self.tokenizer = tokenizer
        self.feature_extractor = AutoFeatureExtractor.from_pretrained(model_dir)
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        self.sampling_rate = int(self.feature_extractor.sampling_rate)
        self.min_samples = int(self.feature_extractor.n_fft)  # one STFT window
        thinker = config.thinker_config
        vision = thinker.vision_config
        self.n_window = int(thinker.audio_config.n_window)
        self.merge = int(vision.spatial_merge_size)
        self.patch = int(vision.patch_size)
        self.temporal = int(vision.temporal_patch_size)
        self.position_id_per_seconds = float(thinker.position_id_per_seconds)
        mean = getattr(self.image_processor, "image_mean", None) or [0.5, 0.5, 0.5]
        std = getattr(self.image_processor, "image_std", None) or [0.5, 0.5, 0.5]
        self.video_mean, self.video_std = list(mean), list(std)
        self.rescale = float(getattr(self.image_processor, "rescale_factor", 1 / 255))
        self.ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in self.tokens}
        expect = {
            "audio_pad": thinker.audio_token_id,
            "image_pad": thinker.image_token_id,
            "video_pad": thinker.video_token_id,
            "audio_start": thinker.audio_start_token_id,
        }
        for name, tid in expect.items():
            if self.ids[name] != tid:
                raise ValueError(f"tokenizer id of {name} ({self.ids[name]}) differs from the config's ({tid})")

    # ---- messages -> parts ------------------------------------------------------------------------
    def _parts(self, messages: Sequence[Mapping[str, Any]], use_audio_in_video: bool) -> list[_Part]:
        parts: list[_Part] = []
        for mi, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, str):
                continue
            if not isinstance(content, (list, tuple)):
                raise MediaError(f"messages[{mi}].content must be a string or a list of parts")
            for pi, part in enumerate(content):
                where = f"messages[{mi}].content[{pi}]"
                if not isinstance(part, Mapping) or "type" not in part:
                    raise MediaError(f"{where} must be a mapping with a 'type'")
                kind = part["type"]
                try:
                    if kind == "text":
                        if not isinstance(part.get("text"), str):
                            raise MediaError("a text part needs a string 'text'")
                    elif kind == "audio":
                        parts.append(_Part("audio", self._clip(load_audio(_field(part, "audio"), self.sampling_rate))))
                    elif kind == "image":
                        parts.append(_Part("image", load_image(_field(part, "image"))))
                    elif kind == "video":
                        video = load_video(
                            _field(part, "video"), part.get("fps"), with_audio=use_audio_in_video,
                            audio=part.get("audio"), audio_rate=self.sampling_rate,
                        )
                        if use_audio_in_video and video.audio is None:
                            raise MediaError("use_audio_in_video needs the video's audio track, and it has none")
                        if use_audio_in_video:
                            self._clip(video.audio)
                        parts.append(_Part("video", video))
                    else:
                        raise MediaError(f"unknown part type {kind!r} (audio, image, video or text)")
                except MediaError as e:
                    raise MediaError(f"{where}: {e}") from None
        return parts

    def _clip(self, audio: np.ndarray) -> np.ndarray:
        if audio.shape[0] < self.min_samples:  # the feature extractor's STFT needs one window
            raise MediaError(f"audio has {audio.shape[0]} samples; at least {self.min_samples} "
                             f"({1000 * self.min_samples // self.sampling_rate} ms) are needed")
        return audio

    # ---- per modality ---------------------------------------------------------------------------
    def _audio_features(self, clips: list[np.ndarray]) -> tuple[list[torch.Tensor], int]:
        """Features per clip (transformers pads the request's clips together) and their chunk pad length."""
        out = self.feature_extractor(
            clips, sampling_rate=self.sampling_rate, padding=True, truncation=False,
            return_attention_mask=True, return_tensors="pt",
        )
        lengths = out["attention_mask"].sum(-1).tolist()
        feats = [out["input_features"][i, :, :n].clone() for i, n in enumerate(lengths)]
        chunk = 2 * self.n_window
        pad = chunk if max(lengths) >= chunk else max(lengths)
        return feats, int(pad)

    def _image(self, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        out = self.image_processor(images=[image], return_tensors="pt")
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        return out["pixel_values"].float(), grid

    def _video(self, video: Video) -> tuple[torch.Tensor, tuple[int, int, int]]:
        frames = torch.from_numpy(video.frames).permute(0, 3, 1, 2).contiguous()  # [T, 3, H, W] uint8
        height, width = frames.shape[-2:]
        factor = self.patch * self.merge
        h, w = smart_resize(height, width, factor, self.video_min_pixels, self.video_max_pixels)
        if (h, w) != (height, width):
            frames = F.interpolate(frames, size=[h, w], mode="bicubic", align_corners=False, antialias=True)
        mean = torch.tensor(self.video_mean) * (1.0 / self.rescale)
        std = torch.tensor(self.video_std) * (1.0 / self.rescale)
        x = frames.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        if pad := -x.shape[0] % self.temporal:
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        t, p, m = x.shape[0] // self.temporal, self.patch, self.merge
        gh, gw = h // p, w // p
        x = x.view(t, self.temporal, 3, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, block row, block col, in row, in col, C, T, P, P)
        return x.reshape(t * gh * gw, -1).contiguous(), (t, gh, gw)

    def chat_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The conversation through the chat template, assistant header appended."""
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)

    def audio_tokens(self, frames: int) -> int:
        """Placeholder count of a clip of ``frames`` feature frames."""
        return audio_token_count(frames, self.n_window)

    def video_audio_order(self, grid: tuple[int, int, int], seconds_per_grid: float, n_aud: int) -> list[bool]:
        """Placeholder order of a video with its audio track (True = video token)."""
        per_frame = (grid[1] // self.merge) * (grid[2] // self.merge)
        video_t = [g * seconds_per_grid * PROCESSOR_POSITION_ID_PER_SECONDS
                   for g in range(grid[0]) for _ in range(per_frame)]
        return interleaved_order(grid[0] * per_frame, video_t, n_aud)

    def positions(self, num_tokens: int, spans: Sequence[MediaSpan]) -> tuple[torch.Tensor, float]:
        """The prompt's [P, 3] float32 position ids and rope delta."""
        return prompt_positions(num_tokens, spans, self.merge, self.position_id_per_seconds)

    # ---- the prompt -------------------------------------------------------------------------------
    def __call__(self, messages: Sequence[Mapping[str, Any]], use_audio_in_video: bool = False,
                 answer_prefix: str = "") -> PreparedPrompt:
        """``answer_prefix``: text after the assistant header that the answer continues (its positions follow
        the prompt's)."""
        parts = self._parts(messages, use_audio_in_video)
        text = self.chat_text(messages) + answer_prefix
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not parts:
            return PreparedPrompt(list(ids))
        # Audio clips in prompt order (a video's own track at the video's place).
        clips = [p.value if p.kind == "audio" else p.value.audio for p in parts
                 if p.kind == "audio" or (p.kind == "video" and use_audio_in_video)]
        feats, pad_frames = self._audio_features(clips) if clips else ([], 0)
        return self._expand(ids, parts, feats, pad_frames, use_audio_in_video)

    def _expand(self, ids: list[int], parts: list[_Part], feats: list[torch.Tensor], pad_frames: int,
                use_audio_in_video: bool) -> PreparedPrompt:
        pad_kind = {self.ids["audio_pad"]: "audio", self.ids["image_pad"]: "image", self.ids["video_pad"]: "video"}
        placeholders = [(i, pad_kind[t]) for i, t in enumerate(ids) if t in pad_kind]
        if [k for _, k in placeholders] != [p.kind for p in parts]:
            raise MediaError(
                f"the prompt's media placeholders {[k for _, k in placeholders]} do not match its media parts "
                f"{[p.kind for p in parts]} (is a placeholder token written in a text part?)"
            )
        out: list[int] = []
        items: list[MediaItem] = []
        spans: list[MediaSpan] = []
        audio_iter = iter(feats)
        cursor = 0
        for (at, kind), part in zip(placeholders, parts):
            out.extend(ids[cursor:at])
            cursor = at + 1
            start = len(out) - 1  # the opening special token just before the placeholder
            if kind == "audio":
                feat = next(audio_iter)
                n = self.audio_tokens(feat.shape[1])
                items.append(self._audio_item(feat, pad_frames, torch.arange(len(out), len(out) + n)))
                out.extend([self.ids["audio_pad"]] * n)
                spans.append(MediaSpan("audio", start, num_audio=n))
                continue
            pixels, grid = self._image(part.value) if kind == "image" else self._video(part.value)
            n_vis = grid[0] * grid[1] * grid[2] // self.merge**2
            key = _hash(kind, pixels, grid)
            if kind == "image":
                items.append(MediaItem("image", key, torch.arange(len(out), len(out) + n_vis), pixels=pixels,
                                       grid=grid))
                out.extend([self.ids["image_pad"]] * n_vis)
                spans.append(MediaSpan("image", start, grid_thw=grid))
                continue
            seconds_per_grid = self.temporal / part.value.fps
            if not use_audio_in_video:
                items.append(MediaItem("video", key, torch.arange(len(out), len(out) + n_vis), pixels=pixels,
                                       grid=grid))
                out.extend([self.ids["video_pad"]] * n_vis)
                spans.append(MediaSpan("video", start, grid_thw=grid, seconds_per_grid=seconds_per_grid))
                continue
            feat = next(audio_iter)
            n_aud = self.audio_tokens(feat.shape[1])
            order = torch.tensor(self.video_audio_order(grid, seconds_per_grid, n_aud))
            body = len(out) + 1  # after <|audio_start|>
            rows = torch.arange(body, body + order.numel())
            out.append(self.ids["audio_start"])
            out.extend(torch.where(order, self.ids["video_pad"], self.ids["audio_pad"]).tolist())
            out.append(self.ids["audio_end"])
            items.append(MediaItem("video", key, rows[order], pixels=pixels, grid=grid))
            items.append(self._audio_item(feat, pad_frames, rows[~order]))
            spans.append(MediaSpan("video+audio", start, grid_thw=grid, num_audio=n_aud,
                                   seconds_per_grid=seconds_per_grid))
        out.extend(ids[cursor:])
        positions, delta = self.positions(len(out), spans)
        flat = all(s.kind == "audio" for s in spans)
        return PreparedPrompt(out, media_data(ThinkerMedia(tuple(items), positions, delta, flat, tuple(spans))))

    @staticmethod
    def _audio_item(feat: torch.Tensor, pad_frames: int, rows: torch.Tensor) -> MediaItem:
        return MediaItem("audio", _hash("audio", feat, pad_frames), rows, features=feat, pad_frames=pad_frames)


def _field(part: Mapping[str, Any], name: str) -> Any:
    value = part.get(name)
    if value is None:
        raise MediaError(f"a {part['type']} part needs its data under {name!r}")
    return value
