"""The built-in model's first impression: with the packaged default sampling, answers are words, most end
on their own after tens of tokens, and are spoken for a few seconds (omnistage/checkpoints/shaping.py)."""

from __future__ import annotations

import re
import statistics

import torch

from omnistage.checkpoints.corpus import training_corpus
from omnistage.checkpoints.shaping import PUNCTUATION
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs

SAMPLES_PER_FRAME = 1920

PROMPTS = [
    "Tell me about the sea.",
    "Hi",
    "What is the weather like?",
    "Tell me a short story about a cat.",
    "How do birds fly?",
    "What is your name?",
    "Why is the sky blue?",
    "Can you help me write a letter?",
    "Sing me a song.",
]


def _answers(ckpt):
    """Every prompt at once with the stage defaults of the packaged preset; the Talker (which samples) gets a
    fixed seed per prompt so the test is reproducible."""
    engine = OmniEngine(EngineArgs(str(ckpt)))
    defaults = engine.stage_params(None)
    out = {}
    for i, prompt in enumerate(PROMPTS):
        params = {"thinker": defaults["thinker"], "talker": defaults["talker"].replace(seed=i)}
        rid = engine.add_request(prompt, ["text", "audio"], params, speaker="ethan")
        out[rid] = {"tokens": [], "samples": 0, "finish": None}
    while engine.has_work():
        for d in engine.step():
            r = out[d.req_id]
            r["tokens"] += d.new_token_ids
            if d.audio is not None:
                r["samples"] += d.audio.numel()
            if d.finished:
                r["finish"] = d.finish_reason
    return engine, list(out.values())


def test_default_sampling_answers_end_and_speak_for_seconds(tiny_ckpt):
    engine, answers = _answers(tiny_ckpt)
    assert engine.stage_params(None)["thinker"].max_tokens == 256  # the packaged limit the answers must beat
    finishes = [a["finish"] for a in answers]
    seconds = [a["samples"] / engine.info.sample_rate for a in answers]
    tokens = [a["tokens"] for a in answers]
    assert sum(f == "stop" for f in finishes) > len(answers) / 2, finishes
    assert 10 <= statistics.median(map(len, tokens)) <= 100, tokens
    assert 1.0 <= statistics.median(seconds) <= 10.0, seconds
    # Speech covers the text: most answers are spoken for about as many frames as they have tokens (the
    # Talker reads one text row per frame) plus a short tail. (The Talker samples: it may still end early.)
    frames = [s * engine.info.sample_rate / SAMPLES_PER_FRAME for s in seconds]
    spoken = [len(t) - 3 <= f <= len(t) + 40 for t, f in zip(tokens, frames)]
    assert sum(spoken) > len(answers) / 2, list(zip(tokens, frames))
    # Whole words of the corpus and punctuation, not byte soup.
    words = {w for text in training_corpus() for w in re.findall(r"[A-Za-z]+", text)}
    for a in answers:
        text = engine.tokenizer.decode(a["tokens"], skip_special_tokens=True)
        for piece in text.split():
            assert piece.rstrip("".join(PUNCTUATION)) in words | {""}, text


def test_voices_differ(tiny_ckpt):
    """The speaker rows were scaled with the pad rows they share the prefill with: voices stay distinct."""
    engine = OmniEngine(EngineArgs(str(tiny_ckpt)))
    defaults = engine.stage_params(None)
    greedy = {"thinker": defaults["thinker"].replace(max_tokens=12, ignore_eos=True),
              "talker": defaults["talker"].replace(temperature=0.0, max_tokens=12, min_tokens=12)}
    codes = {}
    for voice in sorted(engine.info.voices):
        rid = engine.add_request("Tell me about the sea.", ["text", "audio"], greedy, speaker=voice)
        got = []
        while engine.has_work():
            got += [d.codes for d in engine.step() if d.req_id == rid and d.codes is not None]
        codes[voice] = torch.cat(got, dim=1)
    voices = sorted(codes)
    for a, b in zip(voices, voices[1:]):
        assert (codes[a] != codes[b]).float().mean() > 0.5, (a, b)

