"""Realtime sessions: time from the end of user speech to the first answer audio, at N concurrent sessions.

One process: the engine (AsyncOmni) behind the real server (uvicorn on 127.0.0.1), the official openai SDK's
realtime client as N users. Each user streams a spoken turn in real time (100 ms pcm16 chunks: silence,
speech, silence) with server VAD; measured per session, on the client: ``input_audio_buffer.speech_stopped``
received -> first ``response.output_audio.delta`` received (the end of speech is where the server's VAD
decides it; the silence that decides it is not counted).

Beside it, the same figure for the HTTP API: the committed clip of each session as a streamed chat request
with ``input_audio`` (WAV), N at once, each sent as far after the first as its user stopped speaking after
the first user (request sent -> first audio chunk). A second table: a typed turn (``response.create``) ->
first audio delta, beside a streamed HTTP chat request with the same text -> first audio chunk.

    python benchmarks/realtime_bench.py --preset small --sessions 1 8 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import socket
import statistics
import threading
import time

import numpy as np
import torch

from benchmarks.thinker_throughput import resolve_model

RATE = 24000
CHUNK_MS = 100


def speech_like(seconds: float, seed: int) -> np.ndarray:
    """A voiced signal the WebRTC VAD takes for speech (pitch glide, harmonics, syllable envelope)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    phase = 2 * np.pi * np.cumsum(140 + 30 * np.sin(2 * np.pi * 0.7 * t)) / RATE
    sig = sum(np.sin(k * phase) / k for k in range(1, 30))
    sig = sig * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)) + 0.05 * rng.standard_normal(t.size)
    return (sig / np.abs(sig).max() * 0.5 * 32767).astype(np.int16)


def committed(audio: np.ndarray) -> tuple[np.ndarray, int]:
    """The span server VAD commits from ``audio`` (the same detector the server runs) and where it ends (ms)."""
    from omnistage.entrypoints.realtime.config import TurnDetection
    from omnistage.entrypoints.realtime.vad import SpeechDetector

    start, stop = (e.ms for e in SpeechDetector(TurnDetection()).feed(audio))
    return audio[start * 24:stop * 24], stop


def turn_audio(seed: int) -> np.ndarray:
    z = np.zeros(int(0.3 * RATE), np.int16)
    return np.concatenate([z, speech_like(1.5, seed), np.zeros(int(0.8 * RATE), np.int16)])


class Server:
    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def session_settings(args) -> dict:
    return {"type": "realtime", "max_output_tokens": args.thinker_tokens,
            "sampling": {"temperature": 0, "min_tokens": args.thinker_tokens,
                         "talker": {"temperature": 0, "repetition_penalty": 1.0, "max_tokens": args.talker_tokens}}}


async def recv(conn) -> dict:
    """The next server event as a dict. The SDK's typed parsing (a pydantic union of ~45 event types) would run
    in this process beside the engine and take its time from it; the HTTP client only scans lines."""
    ev = json.loads(await conn.recv_bytes())
    if ev["type"] == "error":
        raise RuntimeError(ev["error"]["message"])
    return ev


async def spoken_turn(url: str, model: str, args, seed: int, t_start: float) -> tuple[float, np.ndarray]:
    """One session, one spoken turn in real time from ``t_start`` (a moment every session of a round shares,
    so N users stop speaking together, as the HTTP side's N requests arrive together): (speech end -> first
    answer audio, the committed clip)."""
    import openai

    audio = turn_audio(seed)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    async with client.realtime.connect(model=model) as conn:
        await conn.session.update(session=session_settings(args))
        step = RATE * CHUNK_MS // 1000
        sent, stop_at, start_ms, clip = 0, None, 0, None

        async def feed() -> None:
            nonlocal sent
            for i in range(0, audio.size, step):
                await asyncio.sleep(max(0.0, t_start + i / RATE - time.perf_counter()))  # real time
                await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i:i + step].tobytes()).decode())

        feeder = asyncio.create_task(feed())
        while True:
            ev = await recv(conn)
            if ev["type"] == "input_audio_buffer.speech_started":
                start_ms = ev["audio_start_ms"]
            elif ev["type"] == "input_audio_buffer.speech_stopped":
                stop_at = time.perf_counter()
                clip = audio[start_ms * 24:ev["audio_end_ms"] * 24]
            elif ev["type"] == "response.output_audio.delta" and stop_at is not None:
                latency = time.perf_counter() - stop_at
                await feeder
                return latency, clip


async def http_audio_turn(url: str, model: str, args, clip: np.ndarray, delay: float) -> float:
    """The same clip as a streamed HTTP chat request with ``input_audio``, sent ``delay`` s after the first user
    of its round stopped speaking: request sent -> first audio chunk."""
    from omnistage.entrypoints.audio_format import encode_wav

    await asyncio.sleep(delay)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(encode_wav(clip, RATE)).decode(),
                                                   "format": "wav"}}
    return await first_http_audio(url, chat_body(model, args, [part]))


async def typed_turn(url: str, model: str, args, text: str) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    async with client.realtime.connect(model=model) as conn:
        await conn.session.update(session=session_settings(args))
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": text}]})
        t0 = time.perf_counter()
        await conn.response.create()
        while (await recv(conn))["type"] != "response.output_audio.delta":
            pass
        latency = time.perf_counter() - t0
        await conn.response.cancel()
        return latency


def chat_body(model: str, args, content) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "stream": True, "temperature": 0,
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
            "max_tokens": args.thinker_tokens, "min_tokens": args.thinker_tokens,
            "talker": {"temperature": 0, "repetition_penalty": 1.0, "max_tokens": args.talker_tokens}}


async def http_turn(url: str, model: str, args, text: str) -> float:
    return await first_http_audio(url, chat_body(model, args, text))


async def first_http_audio(url: str, body: dict) -> float:
    """Streamed chat request -> its first audio chunk (closing the stream then aborts the request)."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as http:
        t0 = time.perf_counter()
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if '"audio"' in line and '"data":""' not in line and '"data":"' in line:
                    return time.perf_counter() - t0
    raise RuntimeError("no audio")


def stats(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):6.3f} {xs[min(len(xs) - 1, int(0.9 * len(xs)))]:6.3f}"


async def bench(args, url: str, model: str) -> None:
    text = "tell me about the sea and the boat"
    # Warm-up of every path (the first audio features, the first speech) before anything is timed.
    top = max(args.sessions)
    warm = await asyncio.gather(*[spoken_turn(url, model, args, 90 + i, time.perf_counter() + 1.0) for i in range(top)])
    await asyncio.gather(*[http_audio_turn(url, model, args, clip, 0.0) for _, clip in warm])
    await asyncio.gather(*[typed_turn(url, model, args, text) for _ in range(top)])
    await asyncio.gather(*[http_turn(url, model, args, text) for _ in range(top)])
    print(f"\nspoken turn, speech end -> first audio; seconds, median p90 over sessions x {args.rounds} rounds "
          "(the two sides alternate which goes first)")
    print(f"{'N':>3} | {'realtime (VAD stop)':>19} | {'HTTP input_audio':>18} | ratio")
    for n in args.sessions:
        rt, eng = [], []
        for r in range(args.rounds):
            # The clips the realtime side commits (same VAD, same audio) and when each user stops speaking.
            spans = [committed(turn_audio(100 * r + i)) for i in range(n)]
            first_end = min(end for _, end in spans)
            http_side = [http_audio_turn(url, model, args, clip, (end - first_end) / 1000) for clip, end in spans]
            if r % 2:  # alternate which side goes first
                eng += await asyncio.gather(*http_side)
                await asyncio.sleep(0.5)
            t_start = time.perf_counter() + 1.0  # after every session has connected
            results = await asyncio.gather(*[spoken_turn(url, model, args, 100 * r + i, t_start) for i in range(n)])
            rt += [lat for lat, _ in results]
            assert all(np.array_equal(clip, c) for (_, clip), (c, _) in zip(results, spans))
            await asyncio.sleep(0.5)
            if not r % 2:
                eng += await asyncio.gather(*http_side)
                await asyncio.sleep(0.5)
        print(f"{n:>3} | {stats(rt):>19} | {stats(eng):>18} | {statistics.median(rt) / statistics.median(eng):5.2f}",
              flush=True)
    print("\ntyped turn -> first audio; seconds, median p90 (the two sides alternate which goes first)")
    print(f"{'N':>3} | {'realtime response.create':>24} | {'HTTP chat (stream)':>18} | ratio")
    for n in args.sessions:
        rt, http = [], []
        for r in range(args.rounds):
            sides = [(rt, typed_turn), (http, http_turn)]
            for out, fn in (sides if r % 2 == 0 else sides[::-1]):
                out += await asyncio.gather(*[fn(url, model, args, text) for _ in range(n)])
                await asyncio.sleep(0.5)
        print(f"{n:>3} | {stats(rt):>24} | {stats(http):>18} | {statistics.median(rt) / statistics.median(http):5.2f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--thinker-tokens", type=int, default=16)
    ap.add_argument("--talker-tokens", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from omnistage.entrypoints.metrics import ServerMetrics
    from omnistage.entrypoints.realtime import RealtimeLimits
    from omnistage.entrypoints.server import create_app
    from omnistage.models.registry import load_pipeline_config
    from omnistage.pipeline.omni import AsyncOmni

    model = resolve_model(args.model, args.preset)
    top = max(args.sessions)
    sched = {"max_num_seqs": top}
    pipeline = load_pipeline_config("qwen3_omni", {"stages": {
        "thinker": {"scheduler": sched}, "talker": {"scheduler": sched}, "code2wav": {"scheduler": sched}}})
    metrics = ServerMetrics()
    omni = AsyncOmni(model, pipeline=pipeline, device=args.device, on_step=metrics.observe_step)
    name = "bench"
    print(f"threads={args.threads} device={args.device} model={args.preset if args.model is None else args.model} "
          f"thinker_tokens={args.thinker_tokens} talker_tokens={args.talker_tokens} "
          f"(first audio chunk: {dict(pipeline.stage('code2wav').bridge_args)})")
    try:
        with Server(create_app(omni, name, metrics, realtime_limits=RealtimeLimits(max_sessions=top))) as srv:
            asyncio.run(bench(args, srv.url, name))
    finally:
        omni.shutdown()


if __name__ == "__main__":
    main()
