import os

import pytest
import torch

# Models compile their code-predictor frame on first use (tens of seconds per model instance); the suite
# builds dozens of models, so it runs them eagerly: same results (tests/models/test_fast_paths.py compiles
# explicitly and checks compiled == eager).
os.environ.setdefault("OMNISTAGE_COMPILE", "0")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from omnistage.checkpoints.builder import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def gqa_ckpt(tmp_path_factory):
    """head_dim != hidden / heads, GQA ratio 4, 8 code groups."""
    from omnistage.checkpoints.builder import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tiny-gqa"), preset="tiny-gqa", seed=0)


@pytest.fixture(scope="session")
def act_ckpt(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint with another activation than its own in every part (transformers' ``ACT2FN`` names)
    and the audio tower's ``scale_embedding`` set; no weight changes."""
    from omnistage.testing.variants import checkpoint_variant

    def edit(cfg):
        thinker, talker = cfg["thinker_config"], cfg["talker_config"]
        thinker["text_config"]["hidden_act"] = "gelu"
        thinker["audio_config"]["activation_function"] = "relu"
        thinker["audio_config"]["scale_embedding"] = True  # (transformers' tower never applies it)
        thinker["vision_config"]["hidden_act"] = "quick_gelu"
        talker["text_config"]["hidden_act"] = "gelu_new"
        talker["code_predictor_config"]["hidden_act"] = "relu"
        cfg["code2wav_config"]["hidden_act"] = "quick_gelu"

    return checkpoint_variant(tiny_ckpt, tmp_path_factory.mktemp("tiny-act") / "ckpt", edit)


@pytest.fixture(scope="session")
def fp8_ckpt(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint in transformers' FP8 format (``variants.fp8_variant``: every part's linear layers, the
    towers' too, scales of every stored kind)."""
    from omnistage.testing.variants import fp8_variant

    return fp8_variant(tiny_ckpt, tmp_path_factory.mktemp("tiny-fp8") / "ckpt")


@pytest.fixture(scope="session")
def q25_ckpt():
    """The tiny Qwen2.5-Omni checkpoint (seed 0), shared with the model tests."""
    from omnistage.testing.qwen2_5_omni.reference import tiny_checkpoint

    return tiny_checkpoint()


@pytest.fixture(scope="session")
def hf_model_factory():
    """Call with a checkpoint path: transformers' float32 reference model, cached per path (do not modify)."""
    from omnistage.testing.reference import load_hf_reference

    return load_hf_reference


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # 2-core CI machines: torch's spinning worker threads cost more than they give on tiny models.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
