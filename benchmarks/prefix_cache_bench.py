"""Prefix caching, on vs off, on one engine configuration (same checkpoint, threads and prompts in one process).

1. A spoken multi-turn conversation: a ~330-word system prompt, ~120-word user turns, spoken answers; every
   turn re-sends the whole history (as chat clients do). Per turn: prompt tokens, Thinker tokens served from
   the cache, time to first token and to first audio, on and off.
2. 16 concurrent requests sharing a ~1000-token system prompt (text answers), once with the prompt already seen
   (an earlier request) and once cold (all 16 arrive together: only blocks computed in an earlier step can be
   shared): the fraction of their prefill rows served from the cache and TTFT p50, on and off.
3. Overhead when nothing is shared: 16 concurrent distinct prompts, wall time and TTFT p50 on and off.

    python -m benchmarks.prefix_cache_bench --preset small --threads 2 --turns 10

Reports the CPU and torch.set_num_threads; latencies are wall-clock on whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from benchmarks.thinker_throughput import resolve_model

WORDS = ("sea boat harbour light tide wind sail rope deck chart north south east west storm calm wave shore "
         "island gull fish net anchor mast cabin captain crew morning evening star moon cloud rain fog bell "
         "lighthouse keeper window door stone path hill village market bread salt water river bridge").split()


SYSTEM_WORDS = 345  # ~1000 tokens with the built checkpoints' tokenizer (about 2.9 tokens per word of this list)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


@dataclass
class Timing:
    submitted: float
    first_token: float | None = None
    first_audio: float | None = None
    tokens: list[int] = field(default_factory=list)
    done: bool = False


def drive(engine, requests: list[tuple[list[dict], list[str], dict]]) -> list[Timing]:
    """Submit every request at once and step until all are done; per request: latencies and tokens."""
    timings: dict[str, Timing] = {}
    order = []
    for messages, modalities, params in requests:
        t = time.perf_counter()
        rid = engine.add_request(messages, modalities, params, speaker=None)
        timings[rid] = Timing(t)
        order.append(rid)
    while engine.has_work():
        for d in engine.step():
            t = timings[d.req_id]
            now = time.perf_counter()
            if d.new_token_ids and t.first_token is None:
                t.first_token = now - t.submitted
            if d.audio is not None and d.audio.numel() and t.first_audio is None:
                t.first_audio = now - t.submitted
            t.tokens += d.new_token_ids
            t.done = t.done or d.finished
    return [timings[r] for r in order]


def thinker_stats(engine) -> dict:
    return engine.resource_stats()["thinker"]


def params_for(speech: bool, thinker_tokens: int, talker_tokens: int) -> dict:
    from omnistage import SamplingParams

    p = {"thinker": SamplingParams(temperature=0.0, max_tokens=thinker_tokens, min_tokens=thinker_tokens)}
    if speech:
        p["talker"] = SamplingParams(temperature=0.0, max_tokens=talker_tokens, min_tokens=talker_tokens,
                                     repetition_penalty=1.0)
    return p


def both(engines: dict[bool, object], k: int) -> list[tuple[bool, object]]:
    """The two engines, the one that goes first alternating with k (neither always runs on a warmer machine)."""
    pair = list(engines.items())
    return pair if k % 2 == 0 else pair[::-1]


def conversation(engines: dict[bool, object], turns: int, thinker_tokens: int, talker_tokens: int) -> list[str]:
    rng = random.Random(0)
    system = {"role": "system", "content": words(rng, 330)}
    users = [words(rng, 120) for _ in range(turns)]
    rows: dict[bool, list[tuple]] = {True: [], False: []}
    history: dict[bool, list[dict]] = {True: [system], False: [system]}
    for k in range(turns):
        for on, engine in both(engines, k):
            history[on].append({"role": "user", "content": users[k]})
            before = thinker_stats(engine)["prefix_cache_hits"]
            (t,) = drive(engine, [(list(history[on]), ["text", "audio"],
                                   params_for(True, thinker_tokens, talker_tokens))])
            cached = thinker_stats(engine)["prefix_cache_hits"] - before
            n_prompt = len(engine.render_prompt(history[on]).token_ids)
            rows[on].append((n_prompt, cached, t.first_token, t.first_audio))
            answer = engine.tokenizer.decode(t.tokens, skip_special_tokens=True)
            history[on].append({"role": "assistant", "content": answer})
    out = ["| turn | prompt tokens | cached (on) | TTFT on (s) | TTFT off (s) | TTFA on (s) | TTFA off (s) |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
    for k in range(turns):
        n, cached, ttft_on, ttfa_on = rows[True][k]
        _, _, ttft_off, ttfa_off = rows[False][k]
        out.append(f"| {k + 1} | {n} | {cached} | {ttft_on:.2f} | {ttft_off:.2f} | {ttfa_on:.2f} | {ttfa_off:.2f} |")
    last_on, last_off = rows[True][-1][3] / rows[True][0][3], rows[False][-1][3] / rows[False][0][3]
    out.append(f"\nTTFA turn {turns} / turn 1: on {last_on:.2f}x, off {last_off:.2f}x")
    return out


def shared_prompt(engines: dict[bool, object], n: int, thinker_tokens: int) -> list[str]:
    rng = random.Random(1)
    system = {"role": "system", "content": words(rng, SYSTEM_WORDS)}
    questions = [words(rng, 12) for _ in range(n + 1)]
    out = ["| case | system prompt tokens | rows from cache (on) | TTFT p50 on (s) | TTFT p50 off (s) | off / on |",
           "|---|---:|---:|---:|---:|---:|"]
    n_system = len(engines[True].render_prompt([system]).token_ids)
    for k, case in enumerate(("warm", "cold")):
        p50 = {}
        frac = 0.0
        for on, engine in both(engines, k):
            if case == "warm":  # an earlier request saw the system prompt (its own question differs)
                drive(engine, [([system, {"role": "user", "content": questions[n]}], ["text"],
                                params_for(False, 1, 0))])
            # A fresh system prompt per case, so that "cold" is cold.
            reqs = [([system, {"role": "user", "content": q}], ["text"], params_for(False, thinker_tokens, 0))
                    for q in questions[:n]]
            before = thinker_stats(engine)
            timings = drive(engine, reqs)
            after = thinker_stats(engine)
            if on:
                q = after["prefix_cache_queries"] - before["prefix_cache_queries"]
                frac = (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / max(1, q)
            p50[on] = statistics.median(t.first_token for t in timings)
        out.append(f"| {case} | {n_system} | {frac:.1%} | {p50[True]:.2f} | {p50[False]:.2f} | "
                   f"{p50[False] / p50[True]:.2f}x |")
        system = {"role": "system", "content": words(rng, SYSTEM_WORDS)}
    return out


def nothing_shared(engines: dict[bool, object], n: int, thinker_tokens: int, repeats: int) -> list[str]:
    rng = random.Random(2)
    out = ["| caching | wall (s, median of runs) | TTFT p50 (s) |", "|---|---:|---:|"]
    walls: dict[bool, list[float]] = {True: [], False: []}
    ttft: dict[bool, list[float]] = {True: [], False: []}
    for k in range(repeats):
        prompts = [[{"role": "user", "content": f"{i} {words(rng, 60)}"}] for i in range(n)]
        for on, engine in both(engines, k):  # the same distinct prompts for both
            t0 = time.perf_counter()
            timings = drive(engine, [(p, ["text", "audio"], params_for(True, 16, 24)) for p in prompts])
            walls[on].append(time.perf_counter() - t0)
            ttft[on].append(statistics.median(t.first_token for t in timings))
    for on in (True, False):
        out.append(f"| {'on' if on else 'off'} | {statistics.median(walls[on]):.2f} | "
                   f"{statistics.median(ttft[on]):.2f} |")
    ratio = statistics.median(walls[True]) / statistics.median(walls[False])
    out.append(f"\nwall on / off: {ratio:.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: build --preset)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--thinker-tokens", type=int, default=24)
    ap.add_argument("--talker-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs of the nothing-shared case")
    ap.add_argument("--parts", nargs="+", default=["conversation", "shared", "overhead"])
    ap.add_argument("--thinker-kv-mib", type=int, default=512)
    ap.add_argument("--talker-kv-mib", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="the Thinker's (the preset's 4096 ends a 10-turn conversation at about turn 9)")
    args = ap.parse_args()
    args.kv_mib = {"thinker": args.thinker_kv_mib, "talker": args.talker_kv_mib}

    from omnistage.models.registry import load_pipeline_config
    from omnistage.pipeline.engine import OmniEngine
    from omnistage.pipeline.engine_args import EngineArgs

    torch.set_num_threads(args.threads)
    model = resolve_model(args.model, args.preset)
    # Two engines in one process: KV pools that hold this benchmark's traffic, not the preset's 1 GiB each.
    kv = {"thinker": {"scheduler": {"kv_cache_bytes": args.kv_mib["thinker"] << 20,
                                    "max_model_len": args.max_model_len}},
          "talker": {"scheduler": {"kv_cache_bytes": args.kv_mib["talker"] << 20}}}
    engines = {on: OmniEngine(EngineArgs(model, enable_prefix_caching=on), load_pipeline_config("qwen3_omni", {"stages": kv}))
               for on in (True, False)}
    rng = random.Random(99)
    for engine in engines.values():  # warm-up: lazily built (and compiled) parts are not timed
        drive(engine, [([{"role": "user", "content": words(rng, 400)}], ["text", "audio"], params_for(True, 8, 16))])
        drive(engine, [([{"role": "user", "content": words(rng, 30)}], ["text", "audio"], params_for(True, 8, 16))
                       for _ in range(args.concurrency)])
    print(f"# prefix caching: {args.preset} preset, CPU {platform.processor() or platform.machine()}, "
          f"torch.set_num_threads({args.threads}), torch {torch.__version__}")
    if "conversation" in args.parts:
        print(f"\n## {args.turns}-turn spoken conversation\n")
        print("\n".join(conversation(engines, args.turns, args.thinker_tokens, args.talker_tokens)))
    if "shared" in args.parts:
        print(f"\n## {args.concurrency} concurrent requests sharing a system prompt\n")
        print("\n".join(shared_prompt(engines, args.concurrency, args.thinker_tokens)))
    if "overhead" in args.parts:
        print(f"\n## nothing shared: {args.concurrency} concurrent distinct prompts, spoken\n")
        print("\n".join(nothing_shared(engines, args.concurrency, args.thinker_tokens, args.repeats)))


if __name__ == "__main__":
    main()
