"""Accuracy of weight-only int8 / int4 against the serving dtype, at any checkpoint's widths (the released ones:
``omnistage make-checkpoint DIR --preset real --depth thinker=2,talker=2,...``).

Per part (Thinker, Talker with its code predictor): per-layer relative output error of every quantized layer
against its checkpoint weights (random float32 rows), and teacher-forced top-1 agreement of the Thinker's text
logits / the Talker's codec logits with the unquantized model over P prefixes x T positions (one prefill: the
same prefix for both). Code2Wav is not quantized by any method (its weights stay in the serving dtype), so the
same codes give the same waveform. Models load one at a time (the reference's argmaxes are kept, not its
logits). Prints a markdown table.

    python benchmarks/quant_accuracy.py --model /work/bigckpt/real-d2 --dtype bfloat16 --threads 2

A method ``int8:32`` is int8 in groups of 32 inputs (``--quantization int8 --quantization-group-size 32``);
``int4`` takes ``--group-size`` (default 128).
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time

import torch

from omnistage.config.quantization import Quantization
from omnistage.models.layers.quant_layers import QuantExperts, QuantLinear
from omnistage.pipeline.engine_args import DTYPES
from omnistage.testing.quant_accuracy import codec_logits, layer_errors, load_part, thinker_logits


def held_bytes(model: torch.nn.Module) -> int:
    floats = {t.data_ptr(): t.numel() * t.element_size() for t in model.parameters()}
    quantized = sum(sub.weight_q.nbytes if isinstance(sub, QuantLinear) else sub.gate_up_q.nbytes + sub.down_q.nbytes
                    for sub in model.modules() if isinstance(sub, (QuantLinear, QuantExperts)))
    return sum(floats.values()) + quantized


def quantization_of(method: str, int4_group: int | None) -> Quantization:
    """``int8``, ``int8:G`` (groups of G) or ``int4`` (groups of ``int4_group``) as a Quantization."""
    name, _, group = method.partition(":")
    if name == "int4":
        return Quantization("int4", int(group) if group else int4_group)
    return Quantization(name, int(group) if group else None)


def measure(model_dir: str, dtype: torch.dtype, methods: list[str], group: int | None, prompts: int,
            positions: int, seed: int) -> list[dict]:
    rows = []
    for part in ("thinker", "talker"):
        logits = thinker_logits if part == "thinker" else codec_logits
        t0 = time.perf_counter()
        ref = load_part(model_dir, part, dtype, Quantization())
        table = ref.model.embed_tokens if part == "thinker" else ref.model.codec_embedding
        ids = torch.randint(0, table.num_embeddings, (prompts, positions), generator=torch.Generator().manual_seed(seed))
        expected = logits(ref, ids).argmax(-1)
        rows.append(dict(part=part, method="none", bytes=held_bytes(ref), agreement=1.0, errors={},
                         seconds=time.perf_counter() - t0))
        del ref
        gc.collect()
        for method in methods:
            t0 = time.perf_counter()
            model = load_part(model_dir, part, dtype, quantization_of(method, group))
            agreement = float((logits(model, ids).argmax(-1) == expected).float().mean())
            by_format: dict[str, list[float]] = {}
            for e in layer_errors(model, model_dir, f"{part}."):
                kind = ("code predictor " if e.name.startswith("code_predictor.") else "") + e.fmt
                by_format.setdefault(kind, []).append(e.relative_error)
            rows.append(dict(part=part, method=method, bytes=held_bytes(model), agreement=agreement,
                             errors=by_format, seconds=time.perf_counter() - t0))
            del model
            gc.collect()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--methods", nargs="+", default=["int8", "int4"])
    p.add_argument("--group-size", type=int, default=None, help="int4's groups (default 128)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--positions", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {args.model}: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.dtype}, int4 groups of {args.group_size or 128}, "
          f"{args.prompts} prefixes x {args.positions} positions")
    rows = measure(args.model, DTYPES[args.dtype], args.methods, args.group_size, args.prompts, args.positions,
                   args.seed)
    print("| part | method | weights GiB | top-1 agreement | per-layer rel. error (mean / max) | s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        errors = "; ".join(f"{k}: {statistics.mean(v):.4f} / {max(v):.4f} ({len(v)})" for k, v in r["errors"].items())
        print(f"| {r['part']} | {r['method']} | {r['bytes'] / (1 << 30):.3f} | {100 * r['agreement']:.2f}% | "
              f"{errors or '-'} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
