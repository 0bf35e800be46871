"""Parity of our Code2Wav with transformers' Qwen3OmniMoeCode2Wav, batching and chunked decoding."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeCode2WavConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnistage.models.layers.rotary import RotaryEmbedding
from omnistage.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig

TOL = 1e-4
CODEBOOK = 64


def tiny_hf_config(num_quantizers: int) -> Qwen3OmniMoeCode2WavConfig:
    return Qwen3OmniMoeCode2WavConfig(
        codebook_size=CODEBOOK,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # exercises grouped-query attention
        sliding_window=72,
        num_quantizers=num_quantizers,
        upsample_rates=(8, 5, 4, 3),
        upsampling_ratios=(2, 2),
        decoder_dim=16,  # channels 8, 4, 2, 1 through the decoder blocks: keeps 700 frames fast
    )


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded, non-degenerate values (the library init leaves zeros)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("alpha", "beta"):  # SnakeBeta log-parameters
                values = 0.3 * torch.randn(param.shape, generator=gen)
            elif leaf in ("scale", "gamma"):  # layer scales
                values = 0.5 + 0.1 * torch.randn(param.shape, generator=gen)
            elif leaf == "bias":
                values = 0.1 * torch.randn(param.shape, generator=gen)
            elif param.dim() == 1:  # norm weights
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
            elif "embedding" in name:
                values = torch.randn(param.shape, generator=gen)
            else:
                fan_in = param[0].numel()
                # The vocoder stacks 12 residual units; a gain below 1 keeps the signal from saturating.
                gain = 0.65 if name.startswith("decoder.") else 1.0
                values = gain * torch.randn(param.shape, generator=gen) / fan_in**0.5
            param.copy_(values)


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    # Many tiny elementwise ops over long signals: on a shared 2-core machine intra-op threads mostly spin.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@functools.cache
def build_pair(num_quantizers: int) -> tuple[Qwen3OmniMoeCode2Wav, Code2Wav]:
    torch.manual_seed(0)
    hf_config = tiny_hf_config(num_quantizers)
    reference = Qwen3OmniMoeCode2Wav(hf_config).float().eval()
    randomize_(reference, seed=num_quantizers)
    ours = Code2Wav(hf_config).float().eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


@pytest.fixture(scope="module", params=[16, 8], ids=["q16", "q8"])
def pair(request) -> tuple[Qwen3OmniMoeCode2Wav, Code2Wav]:
    return build_pair(request.param)


def random_codes(num_quantizers: int, frames: int, seed: int, batch: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CODEBOOK, (batch, num_quantizers, frames), generator=gen)


def test_names_match_reference(pair):
    reference, ours = pair
    assert set(ours.state_dict()) == set(reference.state_dict())
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in reference.named_parameters()}
    for name, tensor in reference.state_dict().items():
        assert ours.state_dict()[name].shape == tensor.shape, name


def test_reference_waveform_is_not_degenerate(pair):
    reference, ours = pair
    with torch.no_grad():
        wave = reference(random_codes(ours.config.num_quantizers, 40, seed=1))[0, 0]
    assert wave.std() > 0.02
    assert (wave.abs() >= 1.0).float().mean() < 0.5  # not clamped everywhere


@pytest.mark.parametrize("frames", [1, 5, 73, 150])
def test_forward_matches_reference(pair, frames):
    reference, ours = pair
    codes = random_codes(ours.config.num_quantizers, frames, seed=frames, batch=2)
    with torch.no_grad():
        expected = reference(codes)
        actual = ours(codes)
    assert actual.shape == expected.shape
    assert expected.shape[-1] == ours.samples_for_frames(frames)
    assert (actual - expected).abs().max().item() <= TOL


def test_sliding_window_is_active(pair):
    """Sanity check of the test itself: with full causal attention the output differs after frame 72."""
    _, ours = pair
    full = Code2Wav(dataclasses.replace(ours.config, sliding_window=None)).eval()
    full.load_state_dict(ours.state_dict())
    codes = random_codes(ours.config.num_quantizers, 150, seed=3)
    spf = ours.samples_per_frame
    with torch.no_grad():
        windowed, unwindowed = ours(codes)[0, 0], full(codes)[0, 0]
    assert torch.equal(windowed[: 70 * spf], unwindowed[: 70 * spf])
    assert (windowed[80 * spf :] - unwindowed[80 * spf :]).abs().max() > 1e-3


def test_output_length_rule():
    hf_config = Qwen3OmniMoeCode2WavConfig()  # the real model's sizes; meta device allocates nothing
    with torch.device("meta"):
        model = Code2Wav(hf_config)
    assert model.samples_per_frame == 1920
    assert model.sample_rate == 24000
    for frames in (1, 2, 25, 300, 325):
        assert model.samples_for_frames(frames) == 1920 * frames - 555
    assert model.samples_for_frames(0) == 0
    with pytest.raises(ValueError):
        model.samples_for_frames(-1)


def test_batched_decode_equals_each_alone(pair):
    reference, ours = pair
    q = ours.config.num_quantizers
    lengths = torch.tensor([150, 7, 80, 1])
    codes = random_codes(q, int(lengths.max()), seed=11, batch=len(lengths))
    for row, n in enumerate(lengths.tolist()):
        codes[row, :, n:] = -1  # padding content must not matter
    with torch.no_grad():
        wave, wave_lengths = ours.decode(codes, lengths)
        assert wave.shape == (4, ours.samples_for_frames(150))
        for row, n in enumerate(lengths.tolist()):
            alone = ours(codes[row : row + 1, :, :n])[0, 0]
            ref_alone = reference(codes[row : row + 1, :, :n])[0, 0]
            assert wave_lengths[row].item() == alone.shape[-1] == ours.samples_for_frames(n)
            got = wave[row, : alone.shape[-1]]
            assert (got - alone).abs().max().item() <= 1e-5
            assert (got - ref_alone).abs().max().item() <= TOL
            assert torch.count_nonzero(wave[row, alone.shape[-1] :]) == 0


def test_bad_inputs_are_rejected():
    _, ours = build_pair(8)
    codes = random_codes(8, 10, seed=0)
    with pytest.raises(ValueError, match="codes must be"):
        ours(random_codes(16, 10, seed=0)[:, :7])
    with pytest.raises(ValueError, match="codes must lie"):
        ours(codes + CODEBOOK)
    with pytest.raises(ValueError, match="lengths must lie"):
        ours.decode(codes, torch.tensor([11]))
    with pytest.raises(ValueError, match="lengths must lie"):
        ours.decode(codes, torch.tensor([0]))


def test_config_from_json_dict():
    section = {
        "codebook_size": 2048,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "rope_theta": 10000,
        "sliding_window": 72,
        "num_quantizers": 16,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 1536,
    }
    config = Code2WavConfig.from_hf(section)
    assert config.upsample_rates == (8, 5, 4, 3)
    assert config.samples_per_frame == 1920
    assert config.resolved_head_dim == 64
    with pytest.raises(ValueError):
        Code2WavConfig(num_attention_heads=16, num_key_value_heads=3)
    yarn = Code2WavConfig.from_hf({**section, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    assert yarn.rope_scale > 1.0 and len(yarn.rope_inv_freq) == yarn.resolved_head_dim // 2  # (as transformers')
    # A rope that follows the forward's length keeps its base frequencies within transformers' 325-frame chunks
    # (the released original length is 8000); below that it would follow each chunk's length: refused.
    dynamic = Code2WavConfig.from_hf({**section, "max_position_embeddings": 8000,
                                      "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    assert torch.equal(torch.tensor(dynamic.rope_inv_freq),
                       RotaryEmbedding(dynamic.resolved_head_dim, dynamic.rope_theta).inv_freq)
    with pytest.raises(ValueError, match="rope_type 'dynamic' with an original length of 300 frames"):
        Code2WavConfig.from_hf({**section, "max_position_embeddings": 300,
                                "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
