"""The ``omnistage serve`` arguments (server, media and realtime limits, engine options shared with
``generate``) and serving from them."""

from __future__ import annotations

import argparse

from omnistage.config.quantization import QUANT_METHODS
from omnistage.config.stage_config import EXECUTOR_BACKENDS
from omnistage.entrypoints.limits import (
    BODY_BYTES_EXTRA,
    BODY_BYTES_PER_PROMPT_CHAR,
    PROMPT_CHARS_PER_TOKEN,
    ServerLimits,
)
from omnistage.entrypoints.media_input import (
    DEFAULT_MAX_AUDIO_SECONDS,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_ITEMS,
    DEFAULT_MAX_VIDEO_FRAMES,
    DEFAULT_MAX_VIDEO_PIXELS,
    DEFAULT_MAX_VIDEO_SECONDS,
    MediaLimits,
)
from omnistage.entrypoints.realtime.config import RealtimeLimits
from omnistage.entrypoints.server import serve
from omnistage.entrypoints.speech_to_text import DEFAULT_MAX_TOKENS
from omnistage.entrypoints.voices import parse_voice_map


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--stage-config", default=None,
                   help="pipeline preset name or YAML path (default: the checkpoint family's preset)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-waiting", type=int, default=None, help="reject (429) beyond this many waiting requests")
    p.add_argument("--served-model-name", default=None, help="name clients pass as `model` (default: dir name)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help=f"reject (413) larger request bodies (default: {BODY_BYTES_PER_PROMPT_CHAR} bytes per prompt "
                        f"character + {BODY_BYTES_EXTRA >> 20} MiB)")
    p.add_argument("--voice-map", type=parse_voice_map, default=None, metavar="NAME=VOICE,...",
                   help="voice names clients may use, mapped to the model's voices, e.g. alloy=ethan,echo=chelsie "
                        "(default: OpenAI's ten voice names cycle over the model's voices; entries given override)")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help=f"reject prompts with more characters, before tokenizing (default: {PROMPT_CHARS_PER_TOKEN} "
                        "per token of context)")
    p.add_argument("--max-transcript-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="tokens of one transcript (/v1/audio/transcriptions, realtime input transcription) "
                        "(default: %(default)s)")
    m = p.add_argument_group("media input (per request)")
    m.add_argument("--allowed-media-dir", default=None,
                   help="let media parts name local files (paths or file:// URLs) inside this directory "
                        "(default: none; data: URLs only)")
    m.add_argument("--max-media-items", type=int, default=DEFAULT_MAX_ITEMS, help="media parts per request (default: %(default)s)")
    m.add_argument("--max-media-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help="encoded media bytes per request, all parts together (default: %(default)s)")
    m.add_argument("--max-audio-seconds", type=float, default=DEFAULT_MAX_AUDIO_SECONDS,
                   help="seconds of audio per request, all clips and video tracks together (default: %(default)s)")
    m.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="pixels per image and per video frame (default: %(default)s)")
    m.add_argument("--max-video-seconds", type=float, default=DEFAULT_MAX_VIDEO_SECONDS, help="seconds per video (default: %(default)s)")
    m.add_argument("--max-video-frames", type=int, default=DEFAULT_MAX_VIDEO_FRAMES,
                   help="frames decoded per video file (before sampling) (default: %(default)s)")
    m.add_argument("--max-video-pixels", type=int, default=DEFAULT_MAX_VIDEO_PIXELS,
                   help="pixels of all frames sampled from one video (default: %(default)s)")
    r = p.add_argument_group("realtime sessions (WS /v1/realtime)")
    d = RealtimeLimits()
    r.add_argument("--realtime-max-sessions", type=int, default=d.max_sessions,
                   help="open sessions at once; more are refused (default: %(default)s)")
    r.add_argument("--realtime-max-buffered-audio-s", type=int, default=d.max_buffered_audio_s,
                   help="seconds of input audio in one uncommitted turn (default: %(default)s)")
    r.add_argument("--realtime-max-history-items", type=int, default=d.max_history_items,
                   help="conversation items kept; older ones are dropped (default: %(default)s)")
    r.add_argument("--realtime-max-history-audio-s", type=int, default=d.max_history_audio_s,
                   help="seconds of user audio kept in the conversation (default: %(default)s)")
    r.add_argument("--realtime-max-event-bytes", type=int, default=d.max_event_bytes,
                   help="bytes of one client event (default: %(default)s)")
    r.add_argument("--realtime-idle-timeout-s", type=float, default=d.idle_timeout_s,
                   help="close a session that sends nothing this long while no response runs (default: %(default)s)")
    add_engine_arguments(p)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Engine options shared by ``serve`` and ``generate``."""
    p.add_argument("--distributed-executor-backend", choices=list(EXECUTOR_BACKENDS), default=None,
                   help="inproc: every stage in this process; mp: one worker process per stage; ray: one Ray actor "
                        "per stage (default: the stage config's, else inproc)")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU kernels: oneDNN on weights packed at load and a fused code-predictor frame (default); "
                        "--no-fast: the reference's kernels, bit-identical to transformers' float32 arithmetic. The "
                        "fast kernels round differently: a near-tie may pick another greedy token")
    p.add_argument("--quantization", choices=list(QUANT_METHODS), default="none",
                   help="weight-only quantization while loading: int4 = the Thinker's and Talker's decoder layers "
                        "in int4 (symmetric, grouped), the code predictor's and the towers' layers in int8; int8 = "
                        "all of these in int8; embeddings, heads, the towers' convolutions and Code2Wav stay in "
                        "--dtype (a stage's `quantization:` in the stage config overrides; default: %(default)s)")
    p.add_argument("--quantization-group-size", type=int, default=None,
                   help="inputs per scale: int4's groups (default 128); with int8, groups instead of one scale "
                        "per output channel (the default)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="AR stages reuse the KV of prompt prefixes they have computed before (a conversation's "
                        "history, a shared system prompt); outputs are identical either way (default: on)")


def serve_from_args(args: argparse.Namespace) -> int:
    media = MediaLimits(max_items=args.max_media_items, max_bytes=args.max_media_bytes,
                        max_audio_seconds=args.max_audio_seconds, max_image_pixels=args.max_image_pixels,
                        max_video_seconds=args.max_video_seconds, max_video_frames=args.max_video_frames,
                        max_video_pixels=args.max_video_pixels, allowed_dir=args.allowed_media_dir)
    realtime = RealtimeLimits(max_sessions=args.realtime_max_sessions,
                              max_buffered_audio_s=args.realtime_max_buffered_audio_s,
                              max_history_items=args.realtime_max_history_items,
                              max_history_audio_s=args.realtime_max_history_audio_s,
                              max_event_bytes=args.realtime_max_event_bytes,
                              idle_timeout_s=args.realtime_idle_timeout_s)
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars, media=media,
                          realtime=realtime, max_transcript_tokens=args.max_transcript_tokens)
    serve(args.model, args.stage_config, args.host, args.port, args.max_waiting, args.served_model_name,
          args.dtype, args.device, limits=limits, distributed_executor_backend=args.distributed_executor_backend,
          fast=args.fast, voice_map=args.voice_map, quantization=args.quantization,
          quantization_group_size=args.quantization_group_size, enable_prefix_caching=args.enable_prefix_caching)
    return 0
