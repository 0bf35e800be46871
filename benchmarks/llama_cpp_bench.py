"""The Thinker's decode side by side with llama.cpp on the same weights: tokens/s at 1, 4 and 16 sequences and
prefill tokens/s, omnistage (the checkpoint as ``omnistage serve`` loads it) against llama.cpp's GGUF BF16 /
Q8_0 / Q4_0 made from the same checkpoint.

The checkpoint's Thinker text model (a Qwen3-MoE decoder: q/k norms, routed experts; for text the interleaved
MRoPE is plain rotary) is written as a ``qwen3moe`` GGUF per type, tensor by tensor (packed int4/int8 layers
dequantized first, then encoded by gguf-py's reference quantizer). Before timing, the first type's logits are
checked against transformers' ``Qwen3MoeForCausalLM`` holding the same tensors (teacher-forced top-1
agreement), so the conversion is known to be the same model; ``--no-check`` skips that where transformers'
bfloat16 copy does not fit (full depth).

llama.cpp runs through llama-cpp-python's bindings (``pip install -e .[llama]``, which builds llama.cpp for this
CPU; optional). Each decode step submits one token per sequence in one batch and reads every sequence's
logits (greedy); omnistage serves the same number of requests at once. Towers, Talker and Code2Wav are loaded by
omnistage but not used (text only).

    python -m benchmarks.llama_cpp_bench --model DIR --quantization int4 --types bf16 q8_0 q4_0 --threads 2
    python -m benchmarks.llama_cpp_bench --model FULL --types q4_0 --no-check \
        --stage-config benchmarks/qwen3_omni_24gib.yaml   # the full depth: Q4_0 alone fits beside nothing else
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

PREFIX = "thinker."


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


class ThinkerWeights:
    """The checkpoint's Thinker text tensors by transformers' Qwen3-MoE names (``model.layers.N...``,
    ``lm_head.weight``), packed layers dequantized to float32, read one at a time."""

    def __init__(self, model_dir: str | Path) -> None:
        from omnistage.models.loader import checkpoint_files
        from omnistage.models.prequantized import read_stored, stored_layers

        self.files = {n: p for n, p in checkpoint_files(model_dir).items() if n.startswith(PREFIX)
                      and not n.startswith((PREFIX + "audio_tower.", PREFIX + "visual."))}
        stored = read_stored(model_dir)
        self.packed: dict = {}
        if stored is not None:
            from safetensors import safe_open

            shapes = {}
            for path in set(self.files.values()):
                with safe_open(str(path), framework="pt") as f:
                    shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if n in self.files})
            self.packed = stored_layers(shapes, stored).packed
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.text = config["thinker_config"]["text_config"]
        self.n_layers = self.text["num_hidden_layers"]
        self._open: dict[Path, object] = {}

    def _file(self, name: str):
        """The open safetensors file holding ``name`` (opened once: a full-depth export reads ~37k tensors)."""
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def get(self, name: str) -> torch.Tensor:
        from omnistage.models.prequantized import unpack

        full = PREFIX + name
        if full in self.packed:
            module = full[: -len(".weight")]
            packed = self._file(module + ".weight_packed").get_tensor(module + ".weight_packed")
            scale = self._file(module + ".weight_scale").get_tensor(module + ".weight_scale")
            values, scales = unpack(packed, scale, self.packed[full][1])
            return (values.float().unflatten(1, (scales.shape[1], -1)) * scales[..., None]).flatten(1)
        return self._file(full).get_tensor(full).float()

    def shape(self, name: str) -> tuple[int, ...]:
        full = PREFIX + name
        if full in self.packed:
            return tuple(self.packed[full][0])
        return tuple(self._file(full).get_slice(full).get_shape())

    def rope_theta(self) -> float:
        return float((self.text.get("rope_parameters") or {}).get("rope_theta", self.text.get("rope_theta")))

    def gguf_tensors(self) -> Iterator[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
        """(GGUF name, shape, reader of the float32 tensor) in file order; experts stacked per layer ([E, out,
        in])."""
        def one(name: str):
            return self.shape(name), lambda: self.get(name)

        def stacked(names: list[str]):
            return (len(names), *self.shape(names[0])), lambda: torch.stack([self.get(n) for n in names])

        for name, gguf_name in TOP_NAMES.items():
            if name != "lm_head.weight":
                yield gguf_name, *one(name)
        for i in range(self.n_layers):
            for rel, gguf_name in GGUF_NAMES.items():
                yield f"blk.{i}.{gguf_name}", *one(f"model.layers.{i}.{rel}")
            for proj, gguf_name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                                    ("down_proj", "ffn_down_exps")):
                yield f"blk.{i}.{gguf_name}.weight", *stacked(
                    [f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" for e in range(self.text["num_experts"])])
        yield TOP_NAMES["lm_head.weight"], *one("lm_head.weight")


# What each GGUF type holds: (layers' matrices, token embedding, output head), as llama-quantize's defaults
# for the type, except the head: Q8_0 where llama-quantize picks Q6_K (gguf-py cannot write Q6_K; 8.5 bits
# instead of 6.6, so llama.cpp's decode reads slightly more, never less).
LAYOUTS = {"bf16": ("BF16", "BF16", "BF16"), "q8_0": ("Q8_0", "Q8_0", "Q8_0"), "q4_0": ("Q4_0", "Q4_0", "Q8_0")}


def _encode(t: torch.Tensor, qtype: str) -> np.ndarray:
    """Norms stay float32 (as llama.cpp's converter keeps them); matrices as ``qtype`` (BF16 as uint16 words,
    Q8_0 / Q4_0 by gguf-py's reference quantizer: ggml's own rounding)."""
    import gguf

    if t.dim() == 1:
        return t.float().numpy()
    if qtype == "BF16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    return gguf.quants.quantize(t.float().numpy(), getattr(gguf.GGMLQuantizationType, qtype))


def write_gguf(model_dir: str | Path, path: Path, kind: str) -> None:
    """The checkpoint's Thinker as a ``qwen3moe`` GGUF of ``kind`` (a LAYOUTS key; tokenizer included), written
    tensor by tensor (one tensor in memory at a time)."""
    import gguf
    from transformers import PreTrainedTokenizerFast

    weights = ThinkerWeights(model_dir)
    text = weights.text
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_expert_feed_forward_length(text["moe_intermediate_size"])
    writer.add_expert_count(text["num_experts"])
    writer.add_expert_used_count(text["num_experts_per_tok"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_key_length(text["head_dim"])
    writer.add_value_length(text["head_dim"])
    writer.add_rope_freq_base(weights.rope_theta())
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_file_type(getattr(gguf.LlamaFileType, "MOSTLY_" + LAYOUTS[kind][0]))
    # The tokenizer: byte-level BPE (vocab, merges, specials as control tokens), padded to the embedding's rows.
    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    spec = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    vocab = {i: t for t, i in tok.get_vocab().items()}
    specials = {a["id"] for a in spec["added_tokens"] if a.get("special")}
    tokens, types = [], []
    for i in range(text["vocab_size"]):
        tokens.append(vocab.get(i, f"[PAD{i}]"))
        types.append(gguf.TokenType.CONTROL if i in specials else
                     gguf.TokenType.NORMAL if i in vocab else gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_eos_token_id(tok.convert_tokens_to_ids("<|im_end|>"))
    writer.add_add_bos_token(False)
    # Tensor infos first (shapes and dtypes only), then the data in the same order.
    layers, embed, head = LAYOUTS[kind]
    tensors = [(name, shape, read, embed if name == "token_embd.weight" else head if name == "output.weight"
                else layers) for name, shape, read in weights.gguf_tensors()]
    for name, shape, _, qtype in tensors:
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
            continue
        raw = getattr(gguf.GGMLQuantizationType, qtype)
        block, type_bytes = gguf.GGML_QUANT_SIZES[raw]
        row_bytes = shape[-1] // block * type_bytes  # (given as bytes: the writer derives the shape back)
        writer.add_tensor_info(name, (*shape[:-1], row_bytes), np.dtype(np.uint8),
                               int(np.prod(shape[:-1])) * row_bytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, read, qtype in tensors:
        writer.write_tensor_data(_encode(read(), qtype))
    writer.close()


class LlamaCpp:
    """One GGUF loaded by llama.cpp, with a context for ``n_seq`` sequences."""

    def __init__(self, path: Path, n_seq: int, n_ctx: int, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = 512
        cparams.n_seq_max = n_seq
        cparams.kv_unified = True  # one cache for all sequences (else each gets n_ctx / n_seq)
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(512, 0, n_seq)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, logits wanted), at most 512."""
        b = self.batch
        b.n_tokens = len(items)
        for j, (token, pos, seq, want) in enumerate(items):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = token, pos, 1, want
            b.seq_id[j][0] = seq
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def logits(self, j: int) -> np.ndarray:
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, j), shape=(self.n_vocab,))

    def prompt_logits(self, ids: list[int]) -> np.ndarray:
        self.clear()
        self.decode([(t, p, 0, True) for p, t in enumerate(ids)])
        return np.stack([self.logits(j).copy() for j in range(len(ids))])

    def decode_run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        """All prompts at once, then ``max_tokens`` greedy steps of one token per sequence -> (seconds to the
        first tokens, seconds per step after them)."""
        self.clear()
        t0 = time.perf_counter()
        items = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        nxt = [0] * len(prompts)
        for i in range(0, len(items), 512):
            chunk = items[i:i + 512]
            self.decode(chunk)
            for j, (_, _, seq, want) in enumerate(chunk):
                if want:
                    nxt[seq] = int(np.argmax(self.logits(j)))
        first = time.perf_counter()
        pos = [len(ids) for ids in prompts]
        for _ in range(max_tokens - 1):
            self.decode([(nxt[s], pos[s], s, True) for s in range(len(prompts))])
            nxt = [int(np.argmax(self.logits(s))) for s in range(len(prompts))]
            pos = [p + 1 for p in pos]
        return first - t0, (time.perf_counter() - first) / max(1, max_tokens - 1)


def check_conversion(model_dir: str | Path, gguf_path: Path, kind: str, threads: int, n: int = 48) -> str:
    """transformers' Qwen3MoeForCausalLM with the same tensors (bfloat16) vs the GGUF in llama.cpp,
    teacher-forced over ``n`` positions of a fixed random prompt: top-1 agreement and the logits' relative
    difference (for BF16 they differ by bfloat16 arithmetic only; a wrong mapping gives ~1.0)."""
    import warnings

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    weights = ThinkerWeights(model_dir)
    t = weights.text
    cfg = Qwen3MoeConfig(vocab_size=t["vocab_size"], hidden_size=t["hidden_size"],
                         intermediate_size=t["intermediate_size"], moe_intermediate_size=t["moe_intermediate_size"],
                         num_hidden_layers=t["num_hidden_layers"], num_attention_heads=t["num_attention_heads"],
                         num_key_value_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
                         num_experts=t["num_experts"], num_experts_per_tok=t["num_experts_per_tok"],
                         norm_topk_prob=t["norm_topk_prob"], rms_norm_eps=t["rms_norm_eps"],
                         rope_theta=weights.rope_theta(), tie_word_embeddings=False,
                         max_position_embeddings=t["max_position_embeddings"])
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        hf = Qwen3MoeForCausalLM(cfg)
    state = {}
    for name in hf.state_dict():
        if ".mlp.experts." in name and name.endswith(("gate_up_proj", "down_proj")) and name.split(".")[-1] != "weight":
            # transformers' fused expert tensors ([E, 2 * ff, hidden] gate then up, [E, hidden, ff])
            layer = name.split(".")[2]
            base = f"model.layers.{layer}.mlp.experts"
            e = range(t["num_experts"])
            if name.endswith("gate_up_proj"):
                state[name] = torch.stack([torch.cat([weights.get(f"{base}.{i}.gate_proj.weight"),
                                                      weights.get(f"{base}.{i}.up_proj.weight")]) for i in e])
            else:
                state[name] = torch.stack([weights.get(f"{base}.{i}.down_proj.weight") for i in e])
        else:
            state[name] = weights.get(name)
        state[name] = state[name].to(torch.bfloat16)
    hf.load_state_dict(state, assign=True, strict=True)
    del state
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)  # (its inv_freq is a buffer, not in the state)
    ids = torch.randint(1000, t["vocab_size"], (n,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float().numpy()
    del hf
    llama = LlamaCpp(gguf_path, 1, 256, threads)
    ours = llama.prompt_logits(ids.tolist())
    llama.close()
    agree = float((ref.argmax(-1) == ours.argmax(-1)).mean())
    rel = float(np.linalg.norm(ref - ours) / np.linalg.norm(ref))
    return f"{kind.upper()} GGUF vs transformers (same tensors, bfloat16): top-1 {100 * agree:.1f}% of {n}, relative {rel:.4f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--quantization", default="int4", help="omnistage's --quantization (a pre-quantized "
                   "checkpoint loads as stored)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--stage-config", default=None, help="omnistage's pipeline YAML (full depth: "
                   "benchmarks/qwen3_omni_24gib.yaml)")
    p.add_argument("--types", nargs="+", default=["bf16", "q8_0", "q4_0"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=None, help="folder for the GGUF files (default: next to the checkpoint)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the conversion check (it holds the Thinker in bfloat16 in transformers)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from benchmarks.quant_serving import decode_run, decode_step_bytes, prefill_rate, thinker_weight_bytes
    from omnistage import Omni
    from omnistage.models.layers import quant_kernels

    bandwidth = quant_kernels.read_bandwidth()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"# {cpu}, {os.cpu_count()} cores, {args.threads} threads; streaming read {bandwidth / 1e9:.1f} GB/s")
    work = Path(args.work or Path(args.model).parent / (Path(args.model).name + "-gguf"))
    work.mkdir(parents=True, exist_ok=True)
    files = {kind: work / f"thinker-{kind}.gguf" for kind in args.types}
    t0 = time.perf_counter()
    for kind, path in files.items():
        if not path.exists():
            write_gguf(args.model, path, kind)
    print(f"# GGUF written in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{k} {path.stat().st_size / 1e9:.2f} GB" for k, path in files.items()))
    if args.check:
        print("# " + check_conversion(args.model, files[args.types[0]], args.types[0], args.threads))

    rows = []
    n_max = max(args.concurrency)
    # prefill: the best of three distinct prompts per engine, as quant_serving.prefill_rate times ours
    long_prompts = [[int(x) for x in torch.randint(1000, 150000, (args.prefill_tokens,),
                                                    generator=torch.Generator().manual_seed(1 + i))] for i in range(3)]
    for name in args.types:
        llama = LlamaCpp(files[name], n_max, n_max * 64 + args.prefill_tokens, args.threads)
        short = [[int(x) for x in torch.randint(1000, 150000, (16 + (i * 5) % 12,),
                                                generator=torch.Generator().manual_seed(10 + i))] for i in range(n_max)]
        llama.decode_run(short[:1], 2)  # warm-up
        steps = {n: llama.decode_run(short[:n], args.max_tokens)[1] for n in args.concurrency}
        rate = max(len(prompt) / llama.decode_run([prompt], 1)[0] for prompt in long_prompts)
        llama.close()
        rows.append((f"llama.cpp {name.upper()}", files[name].stat().st_size, steps, rate))

    omni = Omni(args.model, stage_config=args.stage_config, dtype=args.dtype, quantization=args.quantization)
    decode_run(omni, 1, 2)  # warm-up
    steps = {n: decode_run(omni, n, args.max_tokens)[1] for n in args.concurrency}
    bounds = {n: decode_step_bytes(omni, n) / bandwidth for n in args.concurrency}
    prefill = prefill_rate(omni, args.prefill_tokens)
    rows.append((f"omnistage {args.quantization} ({args.dtype})", thinker_weight_bytes(omni), steps, prefill))
    omni.shutdown()

    head = " | ".join(f"{n} seq tok/s" for n in args.concurrency)
    print(f"\n| engine, weights | Thinker GB | {head} | prefill tok/s |")
    print("|---|---:|" + "---:|" * len(args.concurrency) + "---:|")
    for label, nbytes, steps, rate in rows:
        cells = " | ".join(f"{n / steps[n]:.1f}" for n in args.concurrency)
        print(f"| {label} | {nbytes / 1e9:.2f} | {cells} | {rate:.0f} |")
    print("omnistage's bandwidth bound: " + ", ".join(f"{n} seq {n / bounds[n]:.1f} tok/s" for n in args.concurrency))


if __name__ == "__main__":
    main()
