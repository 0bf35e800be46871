"""A checkpoint that does not speak (``enable_audio_output: false``, how a thinker-only checkpoint such as
Qwen3-Omni's Thinking release is marked; Qwen2.5-Omni's config has the same switch), here without any Talker or
vocoder weights: it loads in the default configuration with the Thinker alone, as transformers builds it, answers
text as transformers does, and refuses audio naming the modality, over HTTP too. So does transformers' Thinker
saved alone (``...ThinkerForConditionalGeneration.save_pretrained``, e.g. a fine-tuned Thinker: its config is
the thinker_config, its tensors lack ``thinker.``), which also answers media prompts as the whole checkpoint."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
from server_thread import ServerThread

from omnistage import AsyncOmni, Omni
from omnistage.core.sampling_params import SamplingParams
from omnistage.entrypoints.server import create_app
from omnistage.testing.qwen2_5_omni.reference import load_hf_reference as load_q25_reference
from omnistage.testing.reference import load_hf_reference
from omnistage.testing.variants import checkpoint_variant

PROMPTS = ["Hi", "Tell me a short story about the sea and a small boat."]
TOKENS = 7


def _hf(ckpt):
    """transformers' model of the checkpoint's family."""
    family = json.loads((ckpt / "config.json").read_text())["model_type"]
    return (load_q25_reference if family == "qwen2_5_omni" else load_hf_reference)(ckpt)


def _hf_thinker(ckpt):
    """transformers' Thinker of the checkpoint: of the whole model, or the Thinker class alone."""
    model_type = json.loads((ckpt / "config.json").read_text())["model_type"]
    if not model_type.endswith("_thinker"):
        return _hf(ckpt).thinker
    import transformers

    cls = (transformers.Qwen2_5OmniThinkerForConditionalGeneration if model_type.startswith("qwen2_5")
           else transformers.Qwen3OmniMoeThinkerForConditionalGeneration)
    return cls.from_pretrained(str(ckpt), dtype=torch.float32).eval()


def _thinker_alone(src, dst):
    """The whole model's Thinker saved alone by transformers, with the checkpoint's tokenizer and processor
    files."""
    _hf(src).thinker.save_pretrained(str(dst))
    kept = {"config.json", "generation_config.json", "model.safetensors.index.json", "spk_dict.pt"}
    for extra in src.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in kept:
            (dst / extra.name).write_bytes(extra.read_bytes())
    assert "thinker" in json.loads((dst / "config.json").read_text())["model_type"]
    return dst


def _without_speech(src, dst, speech_prefixes: tuple[str, ...]):
    checkpoint_variant(src, dst, lambda cfg: cfg.update(enable_audio_output=False),
                       lambda name: name.startswith(speech_prefixes))
    assert not hasattr(_hf(dst), "talker")  # transformers builds the Thinker alone
    return dst


@pytest.fixture(scope="module")
def text_only(tiny_ckpt, tmp_path_factory):
    return _without_speech(tiny_ckpt, tmp_path_factory.mktemp("text-only") / "ckpt", ("talker.", "code2wav."))


@pytest.fixture(scope="module")
def q25_text_only(q25_ckpt, tmp_path_factory):
    return _without_speech(q25_ckpt, tmp_path_factory.mktemp("q25-text-only") / "ckpt", ("talker.", "token2wav."))


@pytest.fixture(scope="module")
def thinker_alone(tiny_ckpt, tmp_path_factory):
    return _thinker_alone(tiny_ckpt, tmp_path_factory.mktemp("thinker-alone") / "ckpt")


@pytest.fixture(scope="module")
def q25_thinker_alone(q25_ckpt, tmp_path_factory):
    return _thinker_alone(q25_ckpt, tmp_path_factory.mktemp("q25-thinker-alone") / "ckpt")


def _reference(ckpt, prompt_ids: list[int]) -> list[int]:
    with torch.no_grad():
        seq = _hf_thinker(ckpt).generate(torch.tensor([prompt_ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                                  do_sample=False)
    return seq[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("which", ["text_only", "q25_text_only", "thinker_alone", "q25_thinker_alone"])
def test_serves_text_as_transformers_and_refuses_audio(which, request):
    ckpt = request.getfixturevalue(which)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, min_tokens=TOKENS)
    with Omni(ckpt) as o:
        assert o.engine.pipeline.order == ("thinker",)
        assert o.info.output_modalities == ("text",) and o.info.voices == ()
        assert [m.stage for m in o.engine.memory_plan] == ["thinker"]
        outs = o.generate(PROMPTS, ["text"], params)
        assert [out.token_ids for out in outs] == [_reference(ckpt, out.prompt_token_ids) for out in outs]
        with pytest.raises(ValueError, match="no stage producing 'audio'"):
            o.generate(PROMPTS[:1], ["text", "audio"], params)


def test_http_answers_text_and_refuses_audio_with_a_400(text_only):
    omni = AsyncOmni(text_only)
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0,
            "max_tokens": TOKENS}
    with ServerThread(create_app(omni, "m")) as srv:
        ok = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
        spoken = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                            json={**body, "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}})
        assert spoken.status_code == 400, spoken.text
        assert spoken.json()["error"]["param"] == "modalities" and "audio" in spoken.json()["error"]["message"]
        speech = httpx.post(srv.url + "/v1/audio/speech", json={"model": "m", "input": "Hello", "voice": "ethan"},
                            timeout=60)
        assert speech.status_code == 400 and speech.json()["error"]["param"] == "modalities", speech.text
        models = httpx.get(srv.url + "/v1/models", timeout=10)
        assert models.status_code == 200
    omni.shutdown()


@pytest.mark.parametrize(("alone", "whole"), [("thinker_alone", "tiny_ckpt"), ("q25_thinker_alone", "q25_ckpt")])
def test_thinker_alone_answers_media_as_the_whole_checkpoint(alone, whole, request):
    """Its towers load from their own names: audio and image prompts get the whole checkpoint's tokens (whose media
    tokens equal transformers', tests/models)."""
    rng = np.random.default_rng(3)
    messages = [{"role": "user", "content": [
        {"type": "audio", "audio": (rng.standard_normal(20000) * 0.1).astype(np.float32)},
        {"type": "image", "image": rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)},
        {"type": "text", "text": "What is this?"}]}]
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, min_tokens=TOKENS)
    answers = []
    for ckpt in (request.getfixturevalue(alone), request.getfixturevalue(whole)):
        with Omni(ckpt) as o:
            assert {"audio", "image", "video"} <= set(o.info.input_modalities)
            answers.append(o.generate([messages], ["text"], params)[0].token_ids)
    assert answers[0] == answers[1] and len(answers[0]) == TOKENS
