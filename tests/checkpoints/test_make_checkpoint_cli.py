from __future__ import annotations

import torch
from transformers import Qwen3OmniMoeForConditionalGeneration

from omnistage.entrypoints.cli import main
from omnistage.models.loader import load_weights
from omnistage.models.qwen3_omni.config import load_config
from omnistage.models.registry import family_for_checkpoint


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


def test_make_checkpoint_of_another_family(tmp_path, capsys, q25_ckpt):
    out = tmp_path / "q25"
    assert main(["make-checkpoint", str(out), "--family", "qwen2_5_omni", "--preset", "tiny"]) == 0
    for name in ("config.json", "model.safetensors", "spk_dict.pt", "tokenizer.json"):
        assert (out / name).read_bytes() == (q25_ckpt / name).read_bytes(), name  # the builder's, byte for byte
    assert family_for_checkpoint(out).name == "qwen2_5_omni"  # what serve --model / Omni(model=) pick
    assert main(["make-checkpoint", str(tmp_path / "x"), "--family", "qwen2_5_omni", "--preset", "tiny-gqa"]) == 2
    assert "unknown qwen2_5_omni preset 'tiny-gqa'; choose from ['small', 'tiny']" in capsys.readouterr().err
    assert main(["make-checkpoint", str(tmp_path / "y"), "--family", "nope"]) == 2
    assert "unknown model family 'nope'; choose from ['qwen3_omni', 'qwen2_5_omni']" in capsys.readouterr().err


def test_make_checkpoint_real_preset_refuses_bad_depths_before_building(tmp_path, capsys):
    """(Building the released architecture takes GBs: tests/checkpoints/test_real_checkpoint.py runs its writer
    on a tiny preset.)"""
    assert main(["make-checkpoint", str(tmp_path / "r"), "--preset", "real", "--depth", "thinker=0"]) == 2
    assert "depth entries are STACK=N with N >= 1" in capsys.readouterr().err
    assert main(["make-checkpoint", str(tmp_path / "r"), "--preset", "real", "--family", "qwen2_5_omni"]) == 2
    assert "preset 'real' is Qwen3-Omni's released architecture" in capsys.readouterr().err
    assert main(["make-checkpoint", str(tmp_path / "t"), "--depth", "thinker=2"]) == 2
    assert "--depth applies to --preset real" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "t").exists()
