"""Turn detection on synthetic spoken turns: server VAD (its silence_duration_ms) against semantic VAD (each
eagerness). Each turn is 2-3 phrases with hesitation pauses of 300-1000 ms between them, its last phrase
trailing off, then silence (``omnistage.testing.speech_turns``). Per detector: turns cut at a hesitation
(false ends), turns never ended, and the end latency (end of speech -> ``speech_stopped``, the silence the
detector waited) over the turns it ended at the right place. Single-threaded CPU work (the WebRTC VAD is C);
no model runs.

    python -m benchmarks.turn_detection --turns 200
"""

from __future__ import annotations

import argparse
import platform

from omnistage.entrypoints.realtime.config import TurnDetection
from omnistage.entrypoints.realtime.vad import SpeechDetector
from omnistage.testing.speech_turns import measure, turns

DETECTORS = {
    "server_vad 200 ms": TurnDetection(silence_duration_ms=200),
    "server_vad 500 ms (default)": TurnDetection(),
    "server_vad 1000 ms": TurnDetection(silence_duration_ms=1000),
    "semantic_vad high": TurnDetection(type="semantic_vad", eagerness="high"),
    "semantic_vad medium / auto": TurnDetection(type="semantic_vad", eagerness="medium"),
    "semantic_vad low": TurnDetection(type="semantic_vad", eagerness="low"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    data = turns(args.turns, args.seed)
    pauses = [p for t in data for p in t.pauses_ms]
    print(f"CPU: {platform.processor() or platform.machine()}; {len(data)} turns, {len(pauses)} hesitation pauses "
          f"({min(pauses)}-{max(pauses)} ms)")
    print(f"{'detector':30s} {'false ends':>10s} {'missed':>7s} {'mean end ms':>12s} {'max end ms':>11s}")
    for name, config in DETECTORS.items():
        s = measure(lambda c=config: SpeechDetector(c), data)
        print(f"{name:30s} {s.false_ends:10d} {s.missed:7d} {s.mean_latency_ms:12.0f} {s.max_latency_ms:11d}")


if __name__ == "__main__":
    main()
