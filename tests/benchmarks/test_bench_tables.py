"""The pipeline benchmark's own machinery (timers, work model, tables): cheap, no timing asserted."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from benchmarks.pipeline_bench import (
    OVERHEAD,
    code2wav_frame_flops,
    component_table,
    output_difference,
    stage_table,
)
from benchmarks.roofline import (
    DecoderShape,
    Peaks,
    count_flops,
    decoder_forward_work,
    largest_cache_bytes,
    largest_tensor_bytes,
    read_dtype,
    read_probe_mib,
    stored_dtype,
    with_three_parts,
)
from benchmarks.stage_timers import Component, StageTimers
from omnistage.models.layers.decoder import DecoderConfig, PagedDecoder
from omnistage.models.layers.fast_linear import pack_linear_weights
from omnistage.models.loader import load_into
from omnistage.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig


class Counter:
    def add(self, x: int, y: int = 0) -> int:
        return x + y


def test_timers_count_calls_and_work_and_detach_restores():
    obj = Counter()
    module = sys.modules[__name__]
    original_fn = module.helper
    timers = StageTimers()
    timers.attach(obj, "add", "adder", work=lambda args, kwargs, out: (float(out), 2.0))
    timers.attach(module, "helper", "helper")
    assert obj.add(2, y=3) == 5 and obj.add(1) == 1
    assert helper() == "ok"
    c = timers.components["adder"]
    assert (c.calls, c.flops, c.bytes) == (2, 6.0, 4.0) and c.seconds >= 0.0
    assert timers.components["helper"].calls == 1
    snap = timers.snapshot()
    timers.reset()
    assert timers.components["adder"].calls == 0 and snap["adder"].calls == 2
    timers.detach()
    assert "add" not in vars(obj) and module.helper is original_fn
    obj.add(1)
    assert timers.components["adder"].calls == 0


def helper() -> str:
    return "ok"


def test_missing_hook_point_is_named():
    with pytest.raises(AttributeError, match="predict_codes"):
        StageTimers().attach(Counter(), "predict_codes", "code predictor")


@pytest.mark.parametrize("sparse", [(), (1,), (0, 1, 2)])
def test_decoder_shape_counts_the_modules_matrices(sparse):
    cfg = DecoderConfig(hidden_size=16, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=24,
                        rms_norm_eps=1e-6, rope_theta=1e4, num_experts=4 if sparse else 0,
                        num_experts_per_tok=2 if sparse else 0, moe_intermediate_size=12 if sparse else 0,
                        sparse_layers=sparse, shared_expert_intermediate_size=20 if sparse else 0)
    shape = DecoderShape.from_config(cfg, torch.float32)
    # Every weight matrix of the layers (norm and bias vectors are not in the work model).
    matrices = sum(p.numel() for p in PagedDecoder(cfg).layers.parameters() if p.dim() >= 2)
    assert shape.dense_params + shape.sparse_layers * shape.num_experts * shape.expert_params == matrices


def test_forward_work_counts_attended_positions_per_row():
    cfg = DecoderConfig(hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=24,
                        rms_norm_eps=1e-6, rope_theta=1e4)
    shape = DecoderShape.from_config(cfg, torch.float32)
    # A 3-row prefill after 5 cached positions and a 1-row decode at context 9.
    meta = SimpleNamespace(num_tokens=4, seq_lens=torch.tensor([8, 10]), query_start_loc=torch.tensor([0, 3, 4]))
    flops, bytes_ = decoder_forward_work(shape)((None, meta), {}, None)
    attended = (6 + 7 + 8) + 10
    assert flops == 2 * 4 * shape.dense_params + 2 * 4 * attended * 4 * 8
    assert bytes_ == (shape.dense_params + 2 * 2 * 18 * 2 * 8) * 4


def test_weights_count_at_the_width_the_checkpoint_stores(tmp_path):
    from safetensors.torch import save_file

    save_file({"thinker.a": torch.zeros(4, 8, dtype=torch.bfloat16), "thinker.b": torch.zeros(2),
               "code2wav.c": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    assert stored_dtype(str(tmp_path), "thinker.") == torch.bfloat16  # by element count
    assert stored_dtype(str(tmp_path), "code2wav.") == torch.float32 and stored_dtype(str(tmp_path), "x.") is None
    assert largest_tensor_bytes(str(tmp_path), torch.float32) == 32 * 4  # thinker.a's 32 elements, as served
    assert read_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
    assert read_dtype(torch.bfloat16, torch.float32) == torch.bfloat16 and read_dtype(torch.float32, None) == torch.float32
    cfg = DecoderConfig(hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=24,
                        rms_norm_eps=1e-6, rope_theta=1e4)
    # float32 serving of a bfloat16 checkpoint: weights read at 2 bytes, the float32 KV cache at 4.
    shape = DecoderShape.from_config(cfg, torch.float32, torch.bfloat16)
    meta = SimpleNamespace(num_tokens=1, seq_lens=torch.tensor([5]), query_start_loc=torch.tensor([0, 1]))
    _, bytes_ = decoder_forward_work(shape)((None, meta), {}, None)
    assert bytes_ == shape.dense_params * 2 + 2 * 2 * 5 * 2 * 8 * 4


def test_tables_account_for_the_whole_wall_time():
    peaks = Peaks(gemm_gflops=100.0, read_gbps=10.0)
    assert peaks.bound_seconds(2e9, 1e9) == pytest.approx(0.1)
    ours = {"thinker": Component(seconds=1.0, calls=3, flops=50e9, bytes=2e9), "sampler": Component(seconds=0.5)}
    hf = {"thinker": Component(seconds=2.0)}
    lines = component_table(4.0, ours, hf_wall=3.0, hf=hf, hf_scale=2.0, peaks=peaks)
    thinker = next(line.split() for line in lines if line.split()[0] == "thinker")
    assert thinker[1:3] == ["1.00", "25.0%"] and thinker[8:10] == ["0.500", "50.0%"]  # bound: 50 GFLOP / 100
    assert thinker[-2:] == ["4.00", "4.0"]  # transformers' 2 s per request, scaled to N
    overhead = next(line for line in lines if line.strip().startswith(OVERHEAD)).split()
    assert overhead[2:4] == ["2.50", "62.5%"] and overhead[-2:] == ["2.00", "0.8"]  # 4 - 1.5; (3 - 2) x 2
    total = next(line.split() for line in lines if line.split()[0] == "total")
    assert total[3:5] == ["0.500", "12.5%"]  # the measured components' bounds summed, against the wall
    steps = stage_table(4.0, {"thinker": Component(seconds=1.0, calls=4), "talker": Component(seconds=2.0, calls=4)})
    assert steps[-1].split()[2:4] == ["1.00", "25.0%"]


def test_float32_peak_counts_three_part_products_where_amx_serves(monkeypatch):
    """float32's GEMM peak for weights of bfloat16 values: a third of the bfloat16 rate where the AMX kernels serve
    (the pipeline takes the best bfloat16 probe of the run), its own rate elsewhere; the read rate its own."""
    from omnistage.models.layers import amx_kernels

    f32, bf16 = Peaks(gemm_gflops=300.0, read_gbps=20.0), Peaks(gemm_gflops=2400.0, read_gbps=30.0)
    monkeypatch.setattr(amx_kernels, "available", lambda: True)
    assert with_three_parts(f32, bf16) == Peaks(800.0, 20.0)
    assert with_three_parts(f32, Peaks(600.0, 30.0)) == f32  # a slow bfloat16 probe never lowers it
    monkeypatch.setattr(amx_kernels, "available", lambda: False)
    assert with_three_parts(f32, bf16) == f32


def test_read_probe_outsizes_the_last_level_cache(tmp_path, monkeypatch):
    """The read peak comes from a buffer four times the largest cache (at least 1 GiB): one the cache partly holds
    reads faster than memory."""
    import benchmarks.roofline as roofline

    for index, size in enumerate(["48K", "2048K", "307200K", "not a size"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert largest_cache_bytes(tmp_path) == 307200 << 10
    assert largest_cache_bytes(tmp_path / "missing") == 0
    monkeypatch.setattr(roofline, "largest_cache_bytes", lambda: 300 << 20)
    assert read_probe_mib() == 1200
    monkeypatch.setattr(roofline, "largest_cache_bytes", lambda: 0)
    assert read_probe_mib() == 1024


def test_output_difference_names_the_first_difference():
    codes = torch.arange(12).reshape(3, 4)
    assert output_difference(([1, 2], codes), ([1, 2, 9], codes.clone())) is None  # transformers' EOS appended
    assert output_difference(([1, 3], codes), ([1, 2], codes)) == "text token 1"
    changed = codes.clone()
    changed[2, 3] = -1
    assert output_difference(([1, 2], codes), ([1, 2], changed)) == "frame 3"
    assert output_difference(([1, 2], codes), ([1, 2], codes[:, :2])) == "codes shape (3, 4) vs (3, 2)"


def test_media_bench_ceiling_is_the_vocoder_alone_against_transformers():
    from benchmarks.media_bench import throughput_ceiling

    ref = {"audio_s": 4.0, "wall": 20.0}  # transformers: 0.2 audio seconds per second
    assert throughput_ceiling({"audio_s": 8.0, "vocoder": 10.0}, ref) == pytest.approx(4.0)  # 0.8 / 0.2
    assert throughput_ceiling({"audio_s": 8.0, "vocoder": 0.0}, ref) == float("inf")


def test_code2wav_frame_flops_of_a_served_model_are_the_reference_count(tiny_ckpt):
    """The work model's Code2Wav frame on the served model (packed for ``fast`` as the engine packs it: on AMX its
    convolutions no longer hold their unpacked weights; elsewhere its linear layers hold panel buffers the
    reference has not) counts what the reference kernels' torch convolutions do."""
    config = Code2WavConfig.from_checkpoint(tiny_ckpt)
    reference = Code2Wav(config, reference_kernels=True).eval()
    load_into(reference, tiny_ckpt, "code2wav.")
    want = count_flops(reference, torch.zeros(1, config.num_quantizers, 50, dtype=torch.long)) / 50
    served = Code2Wav(config).eval()
    load_into(served, tiny_ckpt, "code2wav.")
    with torch.no_grad():
        for p in served.parameters():  # bfloat16 values, as a checkpoint stored in bfloat16 loads: AMX takes them
            p.copy_(p.to(torch.bfloat16).float())
    assert pack_linear_weights(served, 16) > 0
    assert want > 0 and code2wav_frame_flops(served) == want
