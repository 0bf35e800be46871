"""transformers' side of the Qwen2.5-Omni media tests: ``Qwen2_5OmniProcessor`` (tokenizer, feature extractor,
image processor, placeholder expansion) and the model, on the tiny checkpoint with towers.

The processor is built from its parts: its video processor class needs torchvision, which does not import
with this torch build (no video part goes through it here).
"""

from __future__ import annotations

import contextlib
import functools
import json

import numpy as np
import torch
from q25_reference import loaded
from transformers import (
    AutoFeatureExtractor,
    AutoImageProcessor,
    AutoTokenizer,
    BatchFeature,
    Qwen2_5OmniProcessor,
)
from transformers.processing_utils import ProcessorMixin

from omnistage.models.qwen2_5_omni.loading import load_config
from omnistage.models.qwen2_5_omni.processor import Qwen25OmniInputProcessor
from omnistage.models.qwen2_5_omni.prompt import with_speech_system_prompt
from omnistage.testing.qwen2_5_omni.reference import explicit_talker_mask, tiny_checkpoint

_rng = np.random.default_rng(11)


def noise(samples: int) -> np.ndarray:
    return (_rng.standard_normal(samples) * 0.1).astype(np.float32)


AUDIO_2S = noise(32555)  # 204 frames: chunks of 200 + 4 -> 51 placeholders
AUDIO_HALF = noise(8077)  # 51 frames -> 13 placeholders
AUDIO_5S = noise(80000)  # 500 frames: three chunks -> 125 placeholders

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
    "text": [{"role": "user", "content": "Tell me a story about the sea."}],
}
MEDIA = [k for k in SCENARIOS if k != "text"]
EOS = tuple(json.loads((tiny_checkpoint() / "generation_config.json").read_text())["eos_token_id"])
SEED = 5


@contextlib.contextmanager
def _lenient_components():
    original = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: type(arg)
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = original


@functools.cache
def ours() -> Qwen25OmniInputProcessor:
    ckpt = tiny_checkpoint()
    return Qwen25OmniInputProcessor(ckpt, AutoTokenizer.from_pretrained(ckpt), load_config(ckpt))


@functools.cache
def reference_processor() -> Qwen2_5OmniProcessor:
    ckpt = tiny_checkpoint()
    tok = AutoTokenizer.from_pretrained(ckpt)
    with _lenient_components():
        return Qwen2_5OmniProcessor(image_processor=AutoImageProcessor.from_pretrained(ckpt), video_processor=None,
                                    feature_extractor=AutoFeatureExtractor.from_pretrained(ckpt), tokenizer=tok,
                                    chat_template=tok.chat_template)


def reference_inputs(messages) -> BatchFeature:
    """What transformers' processor gives for these messages (with the speech system turn the family adds)."""
    messages = with_speech_system_prompt(messages)
    audio = [p["audio"] for m in messages if not isinstance(m["content"], str)
             for p in m["content"] if p["type"] == "audio"]
    proc = reference_processor()
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return proc(text=text, audio=audio or None, return_tensors="pt")


def _media_kwargs(inputs: BatchFeature) -> dict:
    return {k: inputs[k] for k in ("input_features", "feature_attention_mask") if k in inputs}


@functools.cache
def reference_tokens(name: str, num_tokens: int) -> list[int]:
    """Greedy Thinker tokens from transformers, exactly ``num_tokens`` (EOS banned until then)."""
    inputs = reference_inputs(SCENARIOS[name])
    with torch.no_grad():
        seq = loaded().hf.thinker.generate(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **_media_kwargs(inputs),
            max_new_tokens=num_tokens, min_new_tokens=num_tokens, eos_token_id=list(EOS), do_sample=False,
        )
    return seq[0, inputs["input_ids"].shape[1] :].tolist()


@functools.cache
def reference_speech(name: str, text_tokens: int, codes: int) -> tuple[list[int], list[int], torch.Tensor]:
    """transformers' greedy generate(return_audio) with the request's media: text tokens, codes, waveform (the
    ODE noise seeded with SEED, as our Token2Wav seeds a request's)."""
    ld = loaded()
    tc = ld.config.talker_config
    inputs = reference_inputs(SCENARIOS[name])
    ids = inputs["input_ids"]
    torch.manual_seed(SEED)
    with torch.no_grad(), explicit_talker_mask(ld.hf):
        seq, wav = ld.hf.generate(
            ids, **_media_kwargs(inputs), speaker="Chelsie", thinker_max_new_tokens=text_tokens,
            thinker_eos_token_id=list(EOS), thinker_do_sample=False, talker_do_sample=False,
            talker_max_new_tokens=codes, talker_eos_token_id=[tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id],
        )
    talker = ld.cap.talker_result[0, ids.shape[1] + 2 :].tolist()
    stops = [i for i, c in enumerate(talker) if c in (tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id)]
    return seq[0, ids.shape[1] :].tolist(), talker[: stops[0] if stops else None], wav.reshape(-1)
