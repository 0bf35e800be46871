"""Thinker parity with transformers (float32, same checkpoint): prompt logits, captured hidden rows, chunked
prefill, paged decode, mixed batches with padding, greedy tokens, and dense/MoE layer variants."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omni_reference import THINKER_NEW_TOKENS, PagedRequests, reference, single_thread

from omnistage.models.qwen3_omni.thinker import Thinker

PRESETS = ["tiny", "tiny-gqa"]
TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def _cache(thinker: Thinker) -> PagedRequests:
    return PagedRequests(thinker.cfg.num_layers, thinker.cfg.num_kv_heads, thinker.cfg.head_dim)


def _run_chunks(thinker: Thinker, ids: torch.Tensor, chunk_lens: list[int]) -> tuple[torch.Tensor, ...]:
    """One request through the paged cache in the given chunks; returns (logits, embeds, accept) over all rows."""
    pr = _cache(thinker)
    logits, embeds, accept = [], [], []
    pos = 0
    for n in chunk_lens:
        out = thinker(ids[pos : pos + n], torch.arange(pos, pos + n), pr.kv, pr.meta(["r"], [n]))
        logits.append(thinker.compute_logits(out.hidden))
        embeds.append(out.embeds)
        accept.append(out.accept_hidden)
        pos += n
    assert pos == ids.shape[0]
    return torch.cat(logits), torch.cat(embeds), torch.cat(accept)


@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_prompt_logits_and_captured_rows(preset):
    ref = reference(preset)
    thinker = ref.thinker
    p = ref.prompt_ids.shape[0]
    logits, embeds, accept = _run_chunks(thinker, ref.prompt_ids, [p])
    assert (logits - ref.thinker_logits).abs().max().item() <= TOL
    # transformers' hidden_states[0] is the layer-0 input; [accept_hidden_layer] is the input of that layer.
    layer = ref.config.talker_config.accept_hidden_layer
    assert thinker.accept_hidden_layer == layer
    torch.testing.assert_close(embeds, ref.thinker_hidden_states[0][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(accept, ref.thinker_hidden_states[layer][0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_chunked_prefill_and_token_by_token_decode(preset):
    ref = reference(preset)
    p = ref.prompt_ids.shape[0]
    for chunks in ([5, p - 12, 7], [1] * p):
        logits, _, accept = _run_chunks(ref.thinker, ref.prompt_ids, chunks)
        assert (logits - ref.thinker_logits).abs().max().item() <= TOL, chunks
        layer = ref.config.talker_config.accept_hidden_layer
        assert (accept - ref.thinker_hidden_states[layer][0]).abs().max().item() <= TOL


@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_greedy_tokens_match_reference(preset):
    """Prefill + paged decode, greedy with the reference's min-new-tokens EOS ban: identical token ids."""
    ref = reference(preset, "length")
    thinker = ref.thinker
    pr = _cache(thinker)
    p = ref.prompt_ids.shape[0]
    out = thinker(ref.prompt_ids, torch.arange(p), pr.kv, pr.meta(["r"], [p]))
    tokens = []
    last = out.hidden[-1:]
    for step in range(THINKER_NEW_TOKENS):
        logits = thinker.compute_logits(last)
        logits[:, ref.thinker_eos] = float("-inf")
        tok = logits.argmax(-1)
        tokens.append(int(tok))
        if step + 1 < THINKER_NEW_TOKENS:
            last = thinker(tok, torch.tensor([p + step]), pr.kv, pr.meta(["r"], [1])).hidden
    assert tokens == ref.sequences[p:].tolist()


@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_mixed_batch_with_padding_matches_solo(preset):
    """A decode row, a prefill chunk and a fresh prompt in one flattened step (+ padding rows) give the same
    logits as each request alone: rows never leak across requests."""
    ref = reference(preset)
    thinker = ref.thinker
    ids = ref.prompt_ids
    solo, _, _ = _run_chunks(thinker, ids, [ids.shape[0]])
    pr = _cache(thinker)
    # Warm-up: a has 10 tokens cached, b has 4.
    thinker(ids[:10], torch.arange(10), pr.kv, pr.meta(["a"], [10]))
    thinker(ids[:4], torch.arange(4), pr.kv, pr.meta(["b"], [4]))
    rows_ids = torch.cat((ids[10:11], ids[4:12], ids[:6], torch.zeros(3, dtype=torch.long)))
    positions = torch.cat(
        (torch.tensor([10]), torch.arange(4, 12), torch.arange(6), torch.zeros(3, dtype=torch.long))
    )
    meta = pr.meta(["a", "b", "c"], [1, 8, 6], padded=18)
    out = thinker(rows_ids, positions, pr.kv, meta)
    logits = thinker.compute_logits(out.hidden)
    assert torch.isfinite(logits).all()
    assert (logits[0] - solo[10]).abs().max().item() <= TOL
    assert (logits[1:9] - solo[4:12]).abs().max().item() <= TOL
    assert (logits[9:15] - solo[:6]).abs().max().item() <= TOL


@torch.no_grad()
def test_inputs_embeds_path_equals_ids_path():
    ref = reference("tiny")
    thinker = ref.thinker
    ids = ref.prompt_ids[:9]
    a, _, _ = _run_chunks(thinker, ids, [9])
    pr = _cache(thinker)
    out = thinker(None, torch.arange(9), pr.kv, pr.meta(["r"], [9]), inputs_embeds=thinker.embed(ids))
    torch.testing.assert_close(thinker.compute_logits(out.hidden), a, rtol=0, atol=0)
    with pytest.raises(ValueError):
        thinker(ids, torch.arange(9), pr.kv, pr.meta(["s"], [9]), inputs_embeds=thinker.embed(ids))


@pytest.mark.parametrize(
    "overrides, accept_layer",
    [
        # dense layer 1, raw (unnormalised) top-k weights, accept = final-normed hidden
        ({"mlp_only_layers": [1], "norm_topk_prob": False}, 3),
        # layers 1 and 3 MoE, 0 and 2 dense; accept = the embeddings
        ({"decoder_sparse_step": 2}, 0),
    ],
)
@torch.no_grad()
def test_dense_and_moe_layer_variants(overrides, accept_layer):
    """Layer-type rules (mlp_only_layers / decoder_sparse_step / norm_topk_prob) against transformers' text model."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextModel

    from omnistage.checkpoints.weights import init_state_dict, to_hub_layout

    base = reference("tiny").config.thinker_config.text_config
    text_cfg = type(base)(**{**base.to_dict(), "num_hidden_layers": 4, **overrides})
    hf = Qwen3OmniMoeThinkerTextModel(text_cfg).eval()
    state = init_state_dict(hf, seed=3)
    hf.load_state_dict(state)
    config = SimpleNamespace(
        thinker_config=SimpleNamespace(text_config=text_cfg, tie_word_embeddings=False),
        talker_config=SimpleNamespace(accept_hidden_layer=accept_layer),
    )
    ours = Thinker(config).eval()
    hub = to_hub_layout(state)
    ours.model.load_state_dict(hub)
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    ref_kinds = [type(layer.mlp).__name__ for layer in hf.layers]
    assert [k == "SparseMoE" for k in kinds] == ["SparseMoe" in k for k in ref_kinds]

    torch.manual_seed(0)
    ids = torch.randint(0, text_cfg.vocab_size, (1, 11))
    ref_out = hf(input_ids=ids, output_hidden_states=True)
    pr = _cache(ours)
    out = ours(ids[0], torch.arange(11), pr.kv, pr.meta(["r"], [11]))
    assert (out.hidden - ref_out.last_hidden_state[0]).abs().max().item() <= TOL
    assert (out.accept_hidden - ref_out.hidden_states[accept_layer][0]).abs().max().item() <= TOL
