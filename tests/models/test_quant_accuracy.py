"""Accuracy of the quantized Thinker and Talker at small size (the tiny checkpoint, float32, int4 in groups of
32), as bounds: per-layer relative output error and teacher-forced top-1 agreement over 16 prefixes x 64
positions. Measured: int8 0.6% per layer, agreement 98.6% (Thinker) / 99.0% (Talker codec logits); int4 ~10%
per layer, 83% / 82% (random weights: small logit margins). ``benchmarks/quant_accuracy.py`` measures the
released widths."""

from __future__ import annotations

import pytest
import torch

from omnistage.config.quantization import Quantization
from omnistage.models.layers.quant import QuantFormat
from omnistage.testing.quant_accuracy import (
    codec_logits,
    layer_errors,
    load_part,
    thinker_logits,
    top1_agreement,
)

# (max per-layer relative error, min top-1 agreement); int8 per channel and in groups of 32
BOUNDS = {Quantization("int8"): (0.01, 0.97), Quantization("int8", 32): (0.01, 0.97),
          Quantization("int4", 32): (0.12, 0.75)}


@pytest.mark.parametrize("part", ["thinker", "talker"])
def test_quantized_layers_and_logits_stay_close(tiny_ckpt, part):
    ref = load_part(tiny_ckpt, part, torch.float32, Quantization())
    table = ref.model.embed_tokens if part == "thinker" else ref.model.codec_embedding
    gen = torch.Generator().manual_seed(0)
    prefixes = torch.randint(0, table.num_embeddings, (16, 64), generator=gen)
    logits = thinker_logits if part == "thinker" else codec_logits
    expected = logits(ref, prefixes)
    mean_errors = {}
    for quantization, (max_error, min_agreement) in BOUNDS.items():
        method = quantization.method
        model = load_part(tiny_ckpt, part, torch.float32, quantization)
        errors = layer_errors(model, tiny_ckpt, f"{part}.")
        # the int8 parts (the code predictor) are in int8's groups under int8, per channel under int4
        int8 = QuantFormat(8, quantization.group_size if method == "int8" else None).name
        layers = 2 * len(model.model.layers) + len(model.model.layers) * (2 if part == "thinker" else 4)
        if part == "talker":  # + the code predictor's layers (attention 2, MLP 2), int8 under both methods
            layers += 4 * len(model.code_predictor.model.layers)
            assert all(e.fmt == int8 for e in errors if e.name.startswith("code_predictor."))
        assert not any(e.name == "lm_head" for e in errors)  # output heads stay in the serving dtype
        assert len(errors) == layers
        assert max(e.relative_error for e in errors) <= max_error, (method, max(errors, key=lambda e: e.relative_error))
        assert min(e.relative_error for e in errors) > 0
        agreement = top1_agreement(expected, logits(model, prefixes))
        assert agreement >= min_agreement, (quantization, agreement)
        mean_errors[quantization] = sum(e.relative_error for e in errors) / len(errors)
    # a scale per 32 inputs follows the weights more closely than one per row
    assert mean_errors[Quantization("int8", 32)] < mean_errors[Quantization("int8")], mean_errors
