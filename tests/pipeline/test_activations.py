"""A checkpoint whose parts use other activations than the released SiLU (GELU Thinker, GELU-new Talker, ReLU code
predictor, QuickGELU Code2Wav; transformers' ``ACT2FN`` names): text, codes and audio equal transformers' generate
in the default configuration, where the fused SiLU kernels step aside."""

from __future__ import annotations

import torch
from test_pipeline_parity import (
    PROMPTS,
    assert_all_free,
    assert_matches_reference,
    make_engine,
    reference,
    run,
)


def test_speech_equals_transformers(act_ckpt, tiny_ckpt):
    engine = make_engine(act_ckpt)
    got = run(engine, {0: [1], 1: [0], 3: [2]})
    assert_all_free(engine)
    assert_matches_reference(act_ckpt, got)
    # the activations change the answers (the same weights under SiLU answer otherwise)
    assert any(reference(str(act_ckpt), i)[0] != reference(str(tiny_ckpt), i)[0] for i in range(len(PROMPTS)))
    assert not torch.equal(got[1]["codes"], reference(str(tiny_ckpt), 1)[1])
