from __future__ import annotations

import torch
from transformers import Qwen3OmniMoeForConditionalGeneration

from omnistage.entrypoints.cli import main
from omnistage.models.loader import load_weights
from omnistage.models.qwen3_omni.config import load_config


def test_make_checkpoint_writes_a_loadable_dir(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["make-checkpoint", str(out), "--preset", "tiny-gqa", "--seed", "3"]) == 0
    assert str(out) in capsys.readouterr().out
    config = load_config(out)
    assert config.talker_config.num_code_groups == 8
    assert len(load_weights(out, "code2wav.")) > 0
    _, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_make_checkpoint_sharded(tmp_path):
    out = tmp_path / "ckpt"
    assert main(["make-checkpoint", str(out), "--max-shard-bytes", "2000000"]) == 0
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    assert len(load_weights(out, "thinker.model.")) > 0
