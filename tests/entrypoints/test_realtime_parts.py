"""The realtime session's parts alone: server VAD, the input buffer, tool-call scanning and the prompt the
conversation renders (Qwen's tool format, as its chat template writes it)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from realtime_audio import RATE, silence, speech_like

from omnistage.entrypoints.realtime.config import FunctionTool, TurnDetection
from omnistage.entrypoints.realtime.conversation import (
    AssistantMessage,
    Conversation,
    FunctionCall,
    FunctionCallOutput,
    UserMessage,
)
from omnistage.entrypoints.realtime.input_buffer import InputAudioBuffer
from omnistage.entrypoints.realtime.noise import DELAY, NoiseReducer
from omnistage.entrypoints.realtime.vad import SpeechDetector
from omnistage.models.tool_calls import QWEN_TOOL_CALLS, ToolCallScanner, parse_call
from omnistage.testing.speech_turns import Turn, measure, snr_db, turns, with_noise


def _events(samples: np.ndarray, config: TurnDetection, chunk: int = 2400):
    det = SpeechDetector(config)
    out = []
    for i in range(0, samples.size, chunk):
        out += [(e.kind, e.ms) for e in det.feed(samples[i:i + chunk])]
    return out


@pytest.mark.parametrize("chunk", [2400, 777])
def test_vad_finds_the_speech_with_padding_and_trailing_silence(chunk):
    clip = np.concatenate([silence(1.0), speech_like(1.5), silence(1.5)])
    cfg = TurnDetection(prefix_padding_ms=300, silence_duration_ms=500)
    (start, t0), (stop, t1) = _events(clip, cfg, chunk)
    assert (start, stop) == ("started", "stopped")
    assert 1000 - 300 - 40 <= t0 <= 1000 - 300 + 60  # first voiced frame minus the padding
    assert 2500 + 500 <= t1 <= 2500 + 500 + 300  # the silence that ends the turn is part of it
    assert t0 % 20 == 0 and t1 % 20 == 0  # whole 20 ms frames: exact sample offsets at 24 kHz
    # A longer silence requirement ends the turn later by as much.
    (_, u0), (_, u1) = _events(clip, TurnDetection(prefix_padding_ms=300, silence_duration_ms=900), chunk)
    assert u0 == t0 and u1 == t1 + 400


def test_vad_ignores_silence_faint_noise_and_short_clicks():
    rng = np.random.default_rng(0)
    faint = (rng.standard_normal(3 * RATE) * 30).astype(np.int16)  # -61 dBFS: under the level floor
    assert _events(np.concatenate([silence(1.0), faint]), TurnDetection()) == []
    click = np.concatenate([silence(0.5), speech_like(0.04), silence(1.0)])  # 40 ms: fewer than 3 voiced frames
    assert _events(click, TurnDetection()) == []


def test_vad_threshold_sets_aggressiveness_and_level_floor():
    assert [TurnDetection(threshold=t).aggressiveness for t in (0.0, 0.3, 0.5, 0.8, 1.0)] == [0, 1, 2, 3, 3]
    quiet = np.concatenate([silence(0.5), (speech_like(1.0) * 0.02).astype(np.int16), silence(1.0)])  # ~ -40 dBFS
    assert _events(quiet, TurnDetection(threshold=0.2))  # floor -54 dBFS: heard
    assert _events(quiet, TurnDetection(threshold=0.9)) == []  # floor -33 dBFS: too quiet
    with pytest.raises(ValueError):
        TurnDetection(threshold=1.5)


def test_semantic_vad_waits_out_hesitations_and_ends_trailing_speech_sooner_than_server_vad():
    """On synthetic turns (hesitation pauses of 300-1000 ms held at full level, the last phrase trailing off):
    semantic VAD ends no turn at a hesitation and ends them sooner than the server VAD that also waits them out
    (1000 ms); the default server VAD (500 ms) cuts most of them. ``benchmarks/turn_detection.py`` has the table."""
    data = turns(16, seed=1)

    def stats(**kw):
        return measure(lambda: SpeechDetector(TurnDetection(**kw)), data)

    server, patient = stats(), stats(silence_duration_ms=1000)
    assert server.false_ends >= len(data) // 2 and patient.false_ends == 0
    by = {e: stats(type="semantic_vad", eagerness=e) for e in ("low", "medium", "high", "auto")}
    assert by["medium"].false_ends == by["low"].false_ends == 0 and by["medium"].missed == 0
    assert by["medium"].mean_latency_ms <= patient.mean_latency_ms - 400
    assert by["high"].mean_latency_ms < by["medium"].mean_latency_ms < by["low"].mean_latency_ms
    assert by["auto"] == by["medium"]
    # A single held phrase ends after the long silence of its eagerness (1200 ms for medium), not the short one.
    held = np.concatenate([silence(0.5), speech_like(1.0), silence(2.0)])
    (_, t0), (_, t1) = _events(held, TurnDetection(type="semantic_vad", eagerness="medium"))
    assert 1500 + 1200 <= t1 <= 1500 + 1200 + 100
    assert TurnDetection(type="semantic_vad").to_api() == {"type": "semantic_vad", "eagerness": "auto",
                                                           "create_response": True, "interrupt_response": True}


def _denoised(kind: str, audio: np.ndarray, chunk: int = 2400) -> np.ndarray:
    nr = NoiseReducer(kind)
    return np.concatenate([nr.process(audio[i:i + chunk]) for i in range(0, audio.size, chunk)])


@pytest.mark.parametrize("kind,gain_db", [("near_field", 4.5), ("far_field", 4.0)])
def test_noise_reduction_raises_the_snr_of_noisy_speech_and_leaves_clean_speech_alone(kind, gain_db):
    clean = np.concatenate([t.audio for t in turns(2, seed=2, tail_s=0.5)])
    noisy = with_noise(clean, 5.0, seed=1)
    out = _denoised(kind, noisy)
    n = out.size - DELAY  # the output lags by DELAY samples
    assert snr_db(clean[:n], out[DELAY:]) >= snr_db(clean[:n], noisy[:n]) + gain_db
    assert snr_db(clean[:n], _denoised(kind, clean)[DELAY:]) >= 40  # no noise: (almost) untouched
    # Streaming: the chunking of the input does not change the output.
    other = _denoised(kind, noisy, chunk=777)
    m = min(other.size, out.size)
    np.testing.assert_array_equal(other[:m], out[:m])


def test_noise_reduction_lets_the_vad_end_turns_spoken_over_noise():
    class Denoised:
        def __init__(self) -> None:
            self.nr, self.vad = NoiseReducer("near_field"), SpeechDetector(TurnDetection(silence_duration_ms=1000))

        def feed(self, samples):
            return self.vad.feed(self.nr.process(samples))

    data = [Turn(with_noise(t.audio, 5.0, seed=i), t.speech_end_ms, t.pauses_ms) for i, t in enumerate(turns(6, 3))]
    raw = measure(lambda: SpeechDetector(TurnDetection(silence_duration_ms=1000)), data)
    assert raw.missed == len(data)  # the noise keeps the VAD in speech: no turn ever ends
    filtered = measure(Denoised, data)
    assert filtered.missed == filtered.false_ends == 0 and filtered.max_latency_ms <= 2500


def test_input_buffer_takes_exact_ranges_and_drops_beyond_its_limit():
    buf = InputAudioBuffer(max_samples=1000)
    a = np.arange(600, dtype=np.int16)
    assert buf.append(a) == 0
    assert buf.append(a) == 200  # only 400 of the second chunk fit
    assert buf.append(a) == 600  # later audio would leave a gap: dropped whole
    got = buf.take(100, 700)
    assert np.array_equal(got, np.concatenate([a[100:], a[:100]]))
    assert buf.stored == 300 and buf.start == 700  # what follows the range stays
    buf.clear()
    assert buf.stored == 0 and buf.start == buf.total == 1800
    buf.append(a)
    buf.keep_last(50)
    assert np.array_equal(buf.take(), a[-50:])


@pytest.mark.parametrize("pieces", [
    ['Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'],
    ["Sure. <to", "ol_c", "all>\n{\"name\": \"f\", ", "\"arguments\": {\"x\": 1}}\n</tool", "_call>"],
    list('Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'),
])
def test_tool_call_scanner_splits_text_and_calls_across_pieces(pieces):
    sc = ToolCallScanner()
    plain, bodies = "", []
    for p in pieces:
        t, b = sc.feed(p)
        plain += t
        bodies += b
        assert "<" not in t  # a possible tag start is never released as text
    assert plain == "Sure. " and sc.started_call and not sc.in_call
    assert bodies == ['{"name": "f", "arguments": {"x": 1}}']
    tools = [FunctionTool("f")]
    assert parse_call(bodies[0], tools).arguments == '{"x": 1}'
    assert parse_call('{"name": "g", "arguments": {}}', tools) is None  # unknown tool
    assert parse_call("{not json", tools) is None
    assert parse_call('{"name": "f", "arguments": "{\\"x\\": 2}"}', tools).arguments == '{"x": 2}'


def test_tool_call_scanner_releases_a_lone_angle_bracket_and_reports_an_open_call():
    sc = ToolCallScanner()
    assert sc.feed("a <") == ("a ", [])
    assert sc.feed("b") == ("<b", [])
    assert sc.feed("<tool_call>{") == ("", [])
    assert sc.flush() == ("", "{")


def test_conversation_renders_tools_calls_and_outputs_as_qwen_template_does():
    tool = FunctionTool("get_weather", "Weather in a city",
                        json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))
    conv = Conversation(max_items=100, max_audio_samples=10 * RATE, tool_calls=QWEN_TOOL_CALLS)
    clip = speech_like(0.5)
    conv.add(UserMessage("u1", [("text", "Weather? "), ("audio", clip)]))
    conv.add(AssistantMessage("a1", text="Let me check.", status="completed"))
    conv.add(FunctionCall("c1", call_id="call_1", name="get_weather", arguments='{"city": "Paris"}'))
    conv.add(FunctionCall("c2", call_id="call_2", name="get_weather", arguments='{"city": "Rome"}'))
    conv.add(FunctionCallOutput("o1", call_id="call_1", output='{"temp": 21}'))
    conv.add(FunctionCallOutput("o2", call_id="call_2", output='{"temp": 25}'))
    msgs = conv.messages("Be brief.", [tool])
    tool_json = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", '
                 '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}')
    assert msgs[0] == {"role": "system", "content": (
        "Be brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + tool_json +
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call>")}
    assert msgs[1]["role"] == "user" and msgs[1]["content"][0] == {"type": "text", "text": "Weather? "}
    audio, rate = msgs[1]["content"][1]["audio"]
    assert rate == RATE and np.array_equal(audio, clip.astype(np.float32) / 32768)
    assert msgs[2] == {"role": "assistant", "content": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')}
    assert msgs[3] == {"role": "user", "content": ('<tool_response>\n{"temp": 21}\n</tool_response>\n'
                                                   '<tool_response>\n{"temp": 25}\n</tool_response>')}
    assert len(msgs) == 4
    assert conv.messages("", []) [0]["role"] == "user"  # no instructions, no tools: no system message


def test_conversation_history_is_bounded_in_items_and_audio():
    conv = Conversation(max_items=3, max_audio_samples=RATE)
    for i in range(5):
        conv.add(UserMessage(f"t{i}", [("text", str(i))]))
    assert [it.id for it in conv.items] == ["t2", "t3", "t4"]
    conv.add(UserMessage("a0", [("audio", silence(0.6))]))
    conv.add(UserMessage("a1", [("audio", silence(0.6))]))  # 1.2 s of audio > 1 s: the oldest items go
    assert [it.id for it in conv.items] == ["a1"]
