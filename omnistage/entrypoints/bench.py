"""Serving benchmark client (``omnistage bench``): streams chat completions from a running server with N
requests in flight and prints TTFT, TPOT, ITL, end-to-end latency, time to first audio and real-time
factor percentiles. Timings are taken on the client, from sending the request to receiving SSE chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

DEFAULT_PROMPTS = (
    "Hi, how are you today?",
    "Tell me a short story about the sea.",
    "What is the weather like in spring?",
    "Explain what a neural network is in one sentence.",
)
SAMPLE_RATE = 24000


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    ttft: float | None = None
    ttfa: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    audio_seconds: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    @property
    def rtf(self) -> float | None:
        return self.e2e / self.audio_seconds if self.audio_seconds > 0 else None


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last_text: float | None = None
    audio_bytes = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                delta = chunk["choices"][0]["delta"]
                if delta.get("content"):
                    if last_text is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last_text)
                    last_text = now
                data = (delta.get("audio") or {}).get("data")
                if data:
                    if res.ttfa is None:
                        res.ttfa = now - start
                    audio_bytes += len(base64.b64decode(data))
        res.e2e = time.perf_counter() - start
        res.audio_seconds = audio_bytes / 2 / SAMPLE_RATE
        res.ok = True
    except httpx.HTTPError as exc:
        res.error = repr(exc)
    return res


async def run_benchmark(url: str, model: str | None, num_requests: int, concurrency: int, audio: bool,
                        max_tokens: int, prompts: tuple[str, ...] = DEFAULT_PROMPTS,
                        voice: str | None = None) -> tuple[list[RequestResult], float]:
    base = url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        if model is None:
            model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)

        async def limited(i: int) -> RequestResult:
            body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                          "max_tokens": max_tokens,
                          "messages": [{"role": "user", "content": prompts[i % len(prompts)]}]}
            if audio:
                body["modalities"] = ["text", "audio"]
                body["audio"] = {"format": "pcm16", **({"voice": voice} if voice else {})}
            async with sem:
                return await _one(client, base + "/v1/chat/completions", body)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i) for i in range(num_requests)))
        return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], elapsed: float) -> str:
    ok = [r for r in results if r.ok]
    lines = [f"requests: {len(ok)} ok / {len(results)} total in {elapsed:.2f} s "
             f"({len(ok) / max(elapsed, 1e-9):.2f} req/s, "
             f"{sum(r.completion_tokens for r in ok) / max(elapsed, 1e-9):.1f} output tok/s)"]
    for r in results:
        if not r.ok:
            lines.append(f"  failed: {r.error}")
            break
    series = {
        "TTFT (ms)": [r.ttft * 1e3 for r in ok if r.ttft is not None],
        "TPOT (ms)": [r.tpot * 1e3 for r in ok if r.tpot is not None],
        "ITL (ms)": [x * 1e3 for r in ok for x in r.itl],
        "E2E (ms)": [r.e2e * 1e3 for r in ok],
        "TTFA (ms)": [r.ttfa * 1e3 for r in ok if r.ttfa is not None],
        "RTF": [r.rtf for r in ok if r.rtf is not None],
    }
    lines.append(f"{'metric':<12}{'n':>6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, values in series.items():
        if not values:
            continue
        v = np.asarray(values)
        p50, p90, p99 = np.percentile(v, [50, 90, 99])
        lines.append(f"{name:<12}{len(v):>6}{v.mean():>10.2f}{p50:>10.2f}{p90:>10.2f}{p99:>10.2f}")
    return "\n".join(lines)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--audio", action="store_true", help="request text + audio")
    p.add_argument("--voice", default=None)


def run_from_args(args: argparse.Namespace) -> int:
    if args.concurrency < 1 or args.num_requests < 1:
        raise SystemExit("--concurrency and --num-requests must be >= 1")
    results, elapsed = asyncio.run(run_benchmark(args.url, args.model, args.num_requests, args.concurrency,
                                                 args.audio, args.max_tokens, voice=args.voice))
    print(summarize(results, elapsed))
    return 0 if all(r.ok for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    add_bench_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
