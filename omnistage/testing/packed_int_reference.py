"""transformers' greedy Thinker text for a GPTQ / AWQ Qwen2.5-Omni or Qwen3-Omni checkpoint, through gptqmodel's pure-torch CPU
kernels (``gptq_torch`` and ``awq_torch_aten`` pinned, whatever the CPU: they multiply by the dequantized weight in
the model's dtype; the output names the kernels that ran). Run in a process of its own (``python -m
omnistage.testing.packed_int_reference CKPT NEW_TOKENS ID...``, prints the generated ids as JSON): importing
gptqmodel patches torch and transformers process-wide, which a test process must not see."""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
    ckpt, new_tokens, prompt = argv[0], int(argv[1]), [int(i) for i in argv[2:]]
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(os.cpu_count() or 1))  # (its default asks for more)
    import torch
    import transformers
    from transformers import AwqConfig, GPTQConfig

    full = json.loads(open(os.path.join(ckpt, "config.json"), encoding="utf-8").read())
    model_class = getattr(transformers, full["architectures"][0])
    config = full["quantization_config"]
    kwargs = {}
    if config["quant_method"] == "gptq":
        kwargs["quantization_config"] = GPTQConfig(bits=config["bits"], backend="gptq_torch")
    else:  # AWQ: the aten kernel, pinned (auto picks an AVX-512 BF16 kernel where the CPU has one, which
        # multiplies in bfloat16 and takes only widths in multiples of 32); AwqConfig's check does not list it by name
        awq = AwqConfig(bits=config["bits"])
        awq.backend = "awq_torch_aten"
        kwargs["quantization_config"] = awq
    model = model_class.from_pretrained(ckpt, dtype=torch.float32, **kwargs).eval()
    eos = json.loads(open(os.path.join(ckpt, "generation_config.json"), encoding="utf-8").read())["eos_token_id"]
    with torch.no_grad():
        seq = model.thinker.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False, eos_token_id=eos)
    kernels = sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__ and
                      type(m).__module__.startswith("gptqmodel")})
    print(json.dumps({"tokens": seq[0, len(prompt):].tolist(), "kernels": kernels}))


if __name__ == "__main__":
    main(sys.argv[1:])
