"""Checkpoint loader: config fix-ups, single vs sharded files, PyTorch's pickled files, strict loading with named
errors, casting."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from omnistage.checkpoints.builder import build_checkpoint
from omnistage.models.loader import checkpoint_files, load_embedding_rows, load_into, load_weights
from omnistage.models.qwen3_omni.config import load_config
from omnistage.pipeline.memory_plan import tensor_sizes
from omnistage.testing.variants import pickled_variant


@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("sharded"), "tiny", seed=0, max_shard_bytes=1_000_000)


def test_sharded_and_single_file_give_identical_tensors(tiny_ckpt, sharded_ckpt):
    assert (sharded_ckpt / "model.safetensors.index.json").is_file()
    assert len(list(sharded_ckpt.glob("model-*-of-*.safetensors"))) > 1
    for prefix in ("thinker.model.", "talker.", "code2wav.", ""):
        single = load_weights(tiny_ckpt, prefix)
        sharded = load_weights(sharded_ckpt, prefix)
        assert single.keys() == sharded.keys() and single
        assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_prefix_is_stripped_and_only_matching_tensors_return(tiny_ckpt):
    thinker = load_weights(tiny_ckpt, "thinker.model.")
    assert "embed_tokens.weight" in thinker and "layers.0.mlp.experts.0.gate_proj.weight" in thinker
    assert not any(k.startswith(("audio_tower", "visual", "thinker.")) for k in thinker)
    talker = load_weights(tiny_ckpt, "talker.")
    nested = {k[len("code_predictor.") :] for k in talker if k.startswith("code_predictor.")}
    assert set(load_weights(tiny_ckpt, "talker.code_predictor.")) == nested and nested


def test_bfloat16_cast(tiny_ckpt):
    f32 = load_weights(tiny_ckpt, "code2wav.", torch.float32)
    bf16 = load_weights(tiny_ckpt, "code2wav.", torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(torch.equal(bf16[k], f32[k].to(torch.bfloat16)) for k in f32)
    with pytest.raises(ValueError, match="dtype"):
        load_weights(tiny_ckpt, "code2wav.", torch.int8)


class _Head(nn.Module):
    """Matches `talker.text_projection.*` (a 2-layer MLP with biases)."""

    def __init__(self, hidden: int = 64, inter: int = 128, out: int = 64):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, inter)
        self.linear_fc2 = nn.Linear(inter, out)


def test_load_into_loads_and_casts(tiny_ckpt):
    head = _Head()
    load_into(head, tiny_ckpt, "talker.text_projection.", torch.bfloat16)
    ref = load_weights(tiny_ckpt, "talker.text_projection.", torch.bfloat16)
    assert head.linear_fc1.weight.dtype == torch.bfloat16
    assert torch.equal(head.linear_fc2.bias, ref["linear_fc2.bias"])


def test_load_into_meta_module(tiny_ckpt):
    with torch.device("meta"):
        head = _Head()
    load_into(head, tiny_ckpt, "talker.hidden_projection.")
    assert not head.linear_fc1.weight.is_meta
    assert torch.equal(head.linear_fc1.weight, load_weights(tiny_ckpt, "talker.hidden_projection.")["linear_fc1.weight"])


def test_load_into_names_missing_unexpected_and_mismatched(tiny_ckpt):
    class Wrong(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_fc1 = nn.Linear(64, 7)  # wrong shape
            self.extra = nn.Linear(2, 2)  # not in the checkpoint

    with pytest.raises(ValueError) as err:
        load_into(Wrong(), tiny_ckpt, "talker.text_projection.")
    msg = str(err.value)
    assert "extra.weight" in msg and "extra.bias" in msg  # missing from the checkpoint
    assert "linear_fc2.weight" in msg and "linear_fc2.bias" in msg  # unexpected in the checkpoint
    assert "linear_fc1.weight (checkpoint (128, 64), module (7, 64))" in msg


def test_tensors_the_module_does_not_use_are_logged_and_not_read(tiny_ckpt, tmp_path, caplog):
    """As transformers: a checkpoint with extra tensors (saved rotary tables, a head nothing uses) loads where
    nothing is missing; the extras are named in the log."""
    from safetensors.torch import load_file, save_file

    from omnistage.testing.variants import checkpoint_variant

    ckpt = checkpoint_variant(tiny_ckpt, tmp_path / "ckpt", lambda cfg: None)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["talker.text_projection.rotary_emb.inv_freq"] = torch.ones(8)
    tensors["talker.text_projection.value_head.weight"] = torch.ones(1, 64)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})

    class Projection(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_fc1, self.linear_fc2 = nn.Linear(64, 128), nn.Linear(128, 64)

    with caplog.at_level("WARNING", logger="omnistage.models.loader"):
        ours = load_into(Projection(), ckpt, "talker.text_projection.")
    assert ours is None and "2 tensors Projection does not use" in caplog.text and "value_head.weight" in caplog.text
    loaded, want = Projection(), load_weights(tiny_ckpt, "talker.text_projection.")
    load_into(loaded, ckpt, "talker.text_projection.")
    assert all(torch.equal(t, want[k]) for k, t in loaded.state_dict().items())
    # an extra tensor of a layer that is loaded (a scale of a quantization the config does not declare) refuses
    tensors["talker.text_projection.linear_fc1.weight_scale"] = torch.ones(128, 1)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"beside loaded layers .*linear_fc1\.weight_scale"):
        load_into(Projection(), ckpt, "talker.text_projection.")


def test_skip_ignores_towers_relative_or_full_prefix(tiny_ckpt, caplog):
    class Towers(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(64, 768, bias=False)

    only_head = ("model.", "audio_tower.", "visual.")
    with caplog.at_level("WARNING", logger="omnistage.models.loader"):
        load_into(Towers(), tiny_ckpt, "thinker.", skip=only_head)
        load_into(Towers(), tiny_ckpt, "thinker.", skip=tuple("thinker." + s for s in only_head))
        assert not caplog.text  # skipped names are not even looked at
        load_into(Towers(), tiny_ckpt, "thinker.", skip=("model.", "visual."))
    assert "audio_tower.conv2d1.bias" in caplog.text  # (not skipped: unused, named)


def test_load_config_fills_undeclared_fields(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["talker_config"]["spatial_merge_size"]
    del raw["talker_config"]["text_config"]["shared_expert_intermediate_size"]
    del raw["thinker_config"]["vision_start_token_id"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    config = load_config(ckpt)
    assert config.talker_config.spatial_merge_size == 2
    assert config.talker_config.text_config.shared_expert_intermediate_size == 128
    assert config.thinker_config.vision_start_token_id == raw["talker_config"]["vision_start_token_id"]
    full = load_config(tiny_ckpt)
    assert full.talker_config.text_config.shared_expert_intermediate_size == 64
    assert full.im_end_token_id == raw["im_end_token_id"]
    with pytest.raises(ValueError, match="config.json"):
        load_config(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_are_the_tables_rows_and_nothing_else(sharded_ckpt, dtype):
    """A stage that reads a few rows of another stage's table holds those rows only, looked up by full-table id."""
    table = load_weights(sharded_ckpt, "thinker.model.embed_tokens.", dtype)["weight"]
    ids = [5, 0, table.shape[0] - 1]
    rows = load_embedding_rows(sharded_ckpt, "thinker.model.embed_tokens.weight", ids, dtype)
    assert rows.weight.shape == (3, table.shape[1]) and rows.weight.dtype == dtype
    looked_up = rows(torch.tensor([[table.shape[0] - 1, 5], [0, 0]]))
    assert torch.equal(looked_up, table[torch.tensor([[table.shape[0] - 1, 5], [0, 0]])])
    with pytest.raises(KeyError, match="embedding row 7 was not loaded"):
        rows(torch.tensor([7]))
    with pytest.raises(ValueError, match=r"outside 'thinker.model.embed_tokens.weight'"):
        load_embedding_rows(sharded_ckpt, "thinker.model.embed_tokens.weight", [table.shape[0]])
    with pytest.raises(ValueError, match="has no tensor 'nope'"):
        load_embedding_rows(sharded_ckpt, "nope", [0])


def test_loading_casts_tensor_by_tensor_into_the_modules_own_storage(sharded_ckpt):
    """load_into writes into the module's tensors in place (their storage is the one copy) and casts on the copy:
    the result equals the stored values cast once."""
    with torch.device("cpu"):
        module = nn.Embedding(*load_weights(sharded_ckpt, "thinker.model.embed_tokens.", None)["weight"].shape,
                              dtype=torch.bfloat16)
    before = module.weight.data_ptr()
    load_into(module, sharded_ckpt, "thinker.model.embed_tokens.", torch.bfloat16)
    stored = load_weights(sharded_ckpt, "thinker.model.embed_tokens.", None)["weight"]
    assert module.weight.data_ptr() == before
    assert torch.equal(module.weight, stored.to(torch.bfloat16))


def test_loaded_hook_sees_each_module_once_with_all_its_tensors(sharded_ckpt):
    """``loaded`` fires once per module owning checkpoint tensors (a fused parameter's parts count for the module
    holding it), after the last of them is in, across shard boundaries."""
    from omnistage.models.qwen3_omni.thinker import Thinker

    thinker = Thinker(load_config(sharded_ckpt))
    stored = load_weights(sharded_ckpt, "thinker.", None)
    seen: list[str] = []
    names = {id(m): n for n, m in thinker.named_modules()}

    def loaded(module: nn.Module) -> None:
        name = names[id(module)]
        seen.append(name)
        children = dict(module.named_children())
        own = {k: v for k, v in module.state_dict().items() if k.split(".")[0] not in children}
        assert own and all(torch.equal(v, stored[f"{name}.{k}" if name else k].to(v.dtype)) for k, v in own.items())

    load_into(thinker, sharded_ckpt, "thinker.", torch.float32, skip=("audio_tower.", "visual."), loaded=loaded)
    assert len(seen) == len(set(seen))
    assert any(n.endswith("mlp.experts") for n in seen) and "lm_head" in seen and "model.embed_tokens" in seen
    owners = {k.rpartition(".")[0] for k in stored if not k.startswith(("audio_tower.", "visual."))}
    assert all(any(o == s or o.startswith(s + ".") for s in seen) for o in owners)  # every tensor's owner reported


def test_experts_packed_while_loading_equal_packing_after_it(sharded_ckpt):
    """``fast_linear.pack_on_load``: each layer's experts are packed as soon as they are read (their unpacked
    copy released before the next layer's), with the panels packing after the load gives."""
    from omnistage.models.layers import cpu_kernels
    from omnistage.models.layers.fast_linear import pack_on_load
    from omnistage.models.qwen3_omni.thinker import Thinker

    if not cpu_kernels.available():
        pytest.skip("the expert kernel does not build here")
    config = load_config(sharded_ckpt)
    after, during = Thinker(config), Thinker(config)
    load_into(after, sharded_ckpt, "thinker.", torch.float32, skip=("audio_tower.", "visual."))
    experts_after = [layer.mlp.experts for layer in after.model.layers]
    for e in experts_after:
        e.pack_weights(16)
    packed_at: list[int] = []
    hook = pack_on_load(True)

    def loaded(module: nn.Module) -> None:
        hook(module)
        if getattr(module, "packs_alone", False):
            packed_at.append(sum(e.panels is not None for e in (layer.mlp.experts for layer in during.model.layers)))

    load_into(during, sharded_ckpt, "thinker.", torch.float32, skip=("audio_tower.", "visual."), loaded=loaded)
    assert packed_at == list(range(1, len(during.model.layers) + 1))  # one layer at a time, as each is read
    for a, d in zip(experts_after, (layer.mlp.experts for layer in during.model.layers)):
        assert d.gate_up_proj.numel() == 0 and all(torch.equal(x, y) for x, y in zip(a.panels, d.panels))
        assert d.pack_weights(16) == 0  # packing again (fast_kernels after the load) leaves them as they are
    assert pack_on_load(False) is None


def test_pickled_weights_read_as_their_safetensors_twin(sharded_ckpt, tmp_path):
    """``pytorch_model.bin`` (read memory-mapped): every tensor, embedding rows, and the headers the memory plan
    reads (an integer tensor keeps its stored width) equal the safetensors checkpoint's; safetensors win where a
    directory holds both, as in transformers."""
    pickled = pickled_variant(sharded_ckpt, tmp_path / "bin", shards=1)
    assert set(checkpoint_files(pickled).values()) == {pickled / "pytorch_model.bin"}
    for prefix in ("thinker.", "talker.", "code2wav."):
        ours, theirs = load_weights(pickled, prefix, None), load_weights(sharded_ckpt, prefix, None)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    rows = [3, 0, 7]
    assert torch.equal(load_embedding_rows(pickled, "thinker.model.embed_tokens.weight", rows).weight,
                       load_embedding_rows(sharded_ckpt, "thinker.model.embed_tokens.weight", rows).weight)
    assert tensor_sizes(pickled) == tensor_sizes(sharded_ckpt)
    ints = tmp_path / "ints"
    ints.mkdir()
    torch.save({"a": torch.zeros(2, 3, dtype=torch.int32), "b": torch.zeros(4)}, ints / "pytorch_model.bin")
    assert tensor_sizes(ints) == {"a": ((2, 3), 4), "b": ((4,), None)}
    shutil.copy(sharded_ckpt / "model.safetensors.index.json", pickled)
    for shard in sharded_ckpt.glob("*.safetensors"):
        shutil.copy(shard, pickled)
    assert {p.name for p in checkpoint_files(pickled).values()} == {p.name for p in sharded_ckpt.glob("*.safetensors")}


def test_unreadable_or_absent_weight_files_are_refused_naming_them(tmp_path):
    torch.save({"step": 3, "weights": [torch.zeros(2)]}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin: not a state dict of tensors"):
        checkpoint_files(tmp_path)
    torch.save({"w": torch.zeros(2), "what": ValueError("a pickled object")}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin: not readable as PyTorch weights"):  # (weights_only)
        checkpoint_files(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="holds no weights"):
        checkpoint_files(tmp_path)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lists weight files that are not there: model-00001-of-00002\.safetensors, "
                                         r"model-00002-of-00002\.safetensors"):
        checkpoint_files(tmp_path)
