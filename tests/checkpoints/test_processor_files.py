"""The processor's files of a built checkpoint: transformers reads them offline, with Qwen3-Omni's settings."""

import json

import pytest
from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

from omnistage.checkpoints.tokenizer import CHAT_TEMPLATE


def test_feature_extractor_image_processor_and_templates_load(tiny_ckpt):
    fe = AutoFeatureExtractor.from_pretrained(tiny_ckpt)
    assert type(fe).__name__ == "WhisperFeatureExtractor"
    assert (fe.feature_size, fe.sampling_rate, fe.hop_length, fe.n_fft) == (128, 16000, 160, 400)
    ip = AutoImageProcessor.from_pretrained(tiny_ckpt)
    assert type(ip).__name__.startswith("Qwen2VLImageProcessor")
    assert (ip.patch_size, ip.temporal_patch_size, ip.merge_size) == (16, 2, 2)
    assert (ip.size["shortest_edge"], ip.size["longest_edge"]) == (56 * 56, 12845056)
    assert json.loads((tiny_ckpt / "chat_template.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert AutoTokenizer.from_pretrained(tiny_ckpt).chat_template == CHAT_TEMPLATE
    video = json.loads((tiny_ckpt / "video_preprocessor_config.json").read_text())
    assert video["video_processor_type"] == "Qwen2VLVideoProcessor" and video["patch_size"] == 16


def test_transformers_processor_from_pretrained(tiny_ckpt):
    """Needs torchvision (transformers' video processor); it does not import with this project's torch build."""
    pytest.importorskip("torchvision")
    from transformers import Qwen3OmniMoeProcessor

    proc = Qwen3OmniMoeProcessor.from_pretrained(tiny_ckpt)
    assert proc.audio_token == "<|audio_pad|>" and proc.image_token == "<|image_pad|>"
