"""Cost of one stage-worker hand-off on the wire, without a model: a step's events carrying a tensor of a given
size go from a PUSH socket to a PULL socket over the transport the ``mp`` backend uses (an abstract Unix
socket on Linux; ``--tcp`` for loopback TCP, as across hosts), then are decoded. Per size: bytes on the wire
and the median milliseconds of encode, send-to-received, decode and the whole hand-off.

    python -m benchmarks.wire_speed --sizes 500 5000 90000 560000 --repeats 200
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import torch
import zmq

from omnistage.pipeline import wire
from omnistage.pipeline.stage import StepEvents


def events_with(nbytes: int, dtype: torch.dtype) -> wire.Events:
    n = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
    ev = StepEvents("bench", stage_outputs={"req-0": {"rows": torch.randn(n).to(dtype)}}, num_tokens=1)
    return wire.Events(ev, 1, 0, time.monotonic())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[500, 5000, 90000, 560000], help="tensor bytes")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tcp", action="store_true", help="loopback TCP instead of an abstract Unix socket")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    if args.tcp:
        address = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    else:
        address = f"ipc://@omnistage-wire-speed-{uuid.uuid4().hex}"
        pull.bind(address)
    push.connect(address)
    out, inp = wire.Codec(wire.FromWorker), wire.Codec(wire.FromWorker)
    print(f"transport={address.split(':')[0]} dtype={args.dtype} repeats={args.repeats}")
    print(f"{'tensor B':>9} {'wire B':>9} | {'encode ms':>9} {'send->recv ms':>13} {'decode ms':>9} {'total ms':>8}")
    for size in args.sizes:
        message = events_with(size, dtype)
        enc, move, dec, total, nbytes = [], [], [], [], 0
        for i in range(args.repeats + 10):  # the first 10: warm-up
            t0 = time.perf_counter()
            frames = out.encode(message)
            t1 = time.perf_counter()
            push.send_multipart(frames)
            got = pull.recv_multipart(copy=False)
            t2 = time.perf_counter()
            inp.decode([f.buffer for f in got])
            t3 = time.perf_counter()
            if i >= 10:
                enc.append(t1 - t0)
                move.append(t2 - t1)
                dec.append(t3 - t2)
                total.append(t3 - t0)
                nbytes = wire.frame_bytes(frames)
        print(f"{size:>9} {nbytes:>9} | {1e3 * statistics.median(enc):>9.3f} {1e3 * statistics.median(move):>13.3f} "
              f"{1e3 * statistics.median(dec):>9.3f} {1e3 * statistics.median(total):>8.3f}")
    push.close(0)
    pull.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
