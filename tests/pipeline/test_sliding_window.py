"""Sliding-window attention layers, where transformers honours them: Qwen3-Omni's code predictor (``layer_types``
from ``sliding_window`` / ``max_window_layers``) and Qwen2.5-Omni's Thinker and Talker (``use_sliding_window``).
The window changes no weight, so each test takes a built checkpoint and turns it on in config.json; text, codes
and audio must equal transformers' generate in the default configuration, and differ from the same checkpoint
without the window (the window bites)."""

from __future__ import annotations

import json

import pytest
import torch
from test_pipeline_parity import PROMPTS, assert_all_free, make_engine, run

from omnistage import Omni
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.loader import load_into
from omnistage.models.qwen2_5_omni.loading import load_config
from omnistage.models.qwen2_5_omni.thinker import Thinker
from omnistage.models.qwen3_omni.code_predictor import CodePredictorConfig
from omnistage.models.qwen3_omni.talker import Talker
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.testing.qwen2_5_omni.reference import reference_speech
from omnistage.testing.reference import load_hf_reference
from omnistage.testing.variants import checkpoint_variant


@pytest.fixture(scope="module")
def sliding_code_predictor(tiny_ckpt, tmp_path_factory):
    def edit(cfg):  # layer 1 of 2 attends within 3 of the frame's 17 positions
        cfg["talker_config"]["code_predictor_config"].update(sliding_window=3, max_window_layers=1)

    return checkpoint_variant(tiny_ckpt, tmp_path_factory.mktemp("cp-window") / "ckpt", edit)


def test_code_predictor_window_layers_read_from_the_config(sliding_code_predictor):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(sliding_code_predictor).talker_config.code_predictor_config
    d = CodePredictorConfig.from_hf(cfg).decoder
    assert (d.sliding_layers, d.sliding_window) == ((1,), 3)
    assert [d.window(i) for i in range(d.num_layers)] == [None, 3]


@torch.no_grad()
def test_code_predictor_window_logits_equal_transformers_layers(sliding_code_predictor):
    """Teacher-forced frames: every group's logits against transformers' code-predictor layers given the window
    mask its attention modules honour. (Its ``generate`` cannot run this config: the code-predictor forward
    builds only the full-attention mask and fails looking up the sliding one, so generate is no reference here.)"""
    from transformers.masking_utils import sliding_window_overlay

    hf = load_hf_reference(sliding_code_predictor)
    cp_hf = hf.talker.code_predictor
    talker = Talker(hf.config).eval()
    load_into(talker, sliding_code_predictor, "talker.")
    q = talker.num_code_groups
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, talker.cfg.hidden_size, generator=g)
    codes = torch.randint(0, talker.code_predictor.cfg.vocab_size, (3, q), generator=g)
    seen = []
    talker.code_predictor.predict(hidden, codes[:, 0], talker.embed_codec(codes[:, 0]),
                                  lambda logits, group: seen.append(logits) or logits.argmax(-1),
                                  forced_codes=codes[:, 1:])
    # transformers' rows: the Talker hidden, code 0's codec embedding, then group g's code through table g - 1
    rows = [hidden, talker.embed_codec(codes[:, 0])]
    rows += [cp_hf.model.codec_embedding[j - 1](codes[:, j]) for j in range(1, q - 1)]
    x = torch.stack(rows, dim=1)
    t = torch.arange(x.shape[1])
    causal = t[None, :] <= t[:, None]
    window = causal & sliding_window_overlay(3)(0, 0, t[:, None], t[None, :])
    out = cp_hf.model(inputs_embeds=x, attention_mask={"full_attention": causal[None, None].expand(3, 1, -1, -1),
                                                       "sliding_attention": window[None, None].expand(3, 1, -1, -1)})
    h = out.last_hidden_state
    for j, logits in enumerate(seen, start=1):
        torch.testing.assert_close(logits, cp_hf.lm_head[j - 1](h[:, j]), atol=1e-4, rtol=1e-4)
    plain = cp_hf.model(inputs_embeds=x, attention_mask={"full_attention": causal[None, None].expand(3, 1, -1, -1),
                                                         "sliding_attention": causal[None, None].expand(3, 1, -1, -1)})
    assert not torch.allclose(plain.last_hidden_state[:, -1], h[:, -1], atol=1e-3)  # the window bites


def test_code_predictor_window_in_the_pipeline_fast_and_reference_kernels_agree(sliding_code_predictor, tiny_ckpt):
    got = {}
    for fast in (True, False):
        engine = OmniEngine(EngineArgs(str(sliding_code_predictor), fast=fast), load_pipeline_config("qwen3_omni"))
        got[fast] = run(engine, {0: [1], 1: [0], 3: [2]})
        assert_all_free(engine)
    plain = run(make_engine(tiny_ckpt), {0: [1]})
    for i in range(len(PROMPTS)):
        a, b = got[True][i], got[False][i]
        assert a["tokens"] == b["tokens"] and torch.equal(a["codes"], b["codes"])
        assert (a["audio"] - b["audio"]).abs().max().item() <= 1e-4
    assert got[True][1]["tokens"] == plain[1]["tokens"]  # the Thinker has no window
    assert not torch.equal(got[True][1]["codes"], plain[1]["codes"])


TEXT_TOKENS, CODES, SEED = 10, 30, 5
Q25_PROMPTS = [
    "Tell me a short story about the sea and a small boat that sails far away.",
    [{"role": "system", "content": "You are a helpful voice assistant."},
     {"role": "user", "content": "What is the weather like today in the mountains?"}],
    "Tell me a short story about the sea and a whale.",  # shares the first one's cached prefix blocks
]


@pytest.fixture(scope="module")
def sliding_q25(q25_ckpt, tmp_path_factory):
    def edit(cfg):  # layers from 1 on attend within the last 5 positions, in the Thinker and in the Talker
        for part in (cfg["thinker_config"]["text_config"], cfg["talker_config"]):
            part.update(use_sliding_window=True, sliding_window=5, max_window_layers=1)

    return checkpoint_variant(q25_ckpt, tmp_path_factory.mktemp("q25-window") / "ckpt", edit)


# whole prompts; prefill chunks of at most 7 rows in blocks of 4 (windows cut across chunks and cached blocks)
@pytest.mark.parametrize("scheduler", [{}, {"max_num_batched_tokens": 7, "max_num_seqs": 4, "block_size": 4}],
                         ids=["whole", "chunked"])
def test_q25_thinker_and_talker_with_a_sliding_window_equal_transformers(sliding_q25, q25_ckpt, scheduler):
    assert Thinker(load_config(sliding_q25)).model.cfg.sliding_layers == (1,)
    params = {"thinker": SamplingParams(temperature=0.0, max_tokens=TEXT_TOKENS),
              "talker": SamplingParams(temperature=0.0, max_tokens=CODES, repetition_penalty=1.05, seed=SEED)}
    stages = {"token2wav": {"bridge_args": {"chunk_blocks": 10_000, "past_blocks": 0, "future_blocks": 0}},
              "thinker": {"scheduler": scheduler}, "talker": {"scheduler": scheduler}}
    with Omni(sliding_q25, pipeline=load_pipeline_config("qwen2_5_omni", {"stages": stages})) as o:
        outs = o.generate(Q25_PROMPTS, ["text", "audio"], params)  # all in one batch
        assert o.engine.resource_stats()["requests"] == 0
        # Text-only requests take cached prefix blocks (spoken ones compute every prompt row: the Talker reads
        # their hidden states); the window reaches into them and gives the same text.
        texts = o.generate(Q25_PROMPTS, ["text"], params["thinker"])
        assert [t.token_ids for t in texts] == [out.token_ids for out in outs]
        assert o.engine.resource_stats()["thinker"]["prefix_cache_hits"] > 0
    eos = json.loads((sliding_q25 / "generation_config.json").read_text())["eos_token_id"]
    for out in outs:
        tokens, wav = reference_speech(sliding_q25, out.prompt_token_ids, TEXT_TOKENS, CODES, SEED)
        assert out.token_ids == (tokens[:-1] if tokens[-1] in eos else tokens)  # ours leave the EOS out
        assert out.audio.shape == wav.shape and (out.audio - wav).abs().max().item() <= 1e-4
    plain, _ = reference_speech(q25_ckpt, outs[0].prompt_token_ids, TEXT_TOKENS, 1, SEED)
    windowed, _ = reference_speech(sliding_q25, outs[0].prompt_token_ids, TEXT_TOKENS, 1, SEED)
    assert plain != windowed  # the window bites
