"""`omnistage generate --audio-in/--image/--video`: the files become media parts of the user message, answered
in text and, with `--audio`, in speech."""

import wave

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from omnistage import Omni, SamplingParams
from omnistage.entrypoints.cli import main
from omnistage.models.qwen3_omni.config import load_config
from omnistage.testing.media_files import write_video


def test_generate_with_audio_and_image_files(tmp_path, tiny_ckpt, capsys):
    rng = np.random.default_rng(0)
    wav, png = tmp_path / "q.wav", tmp_path / "p.png"
    soundfile.write(str(wav), (rng.standard_normal(24000) * 0.1).astype(np.float32), 24000)
    Image.fromarray(rng.integers(0, 256, (70, 90, 3), dtype=np.uint8)).save(png)
    assert main(["generate", "What is this?", "--model", str(tiny_ckpt), "--audio-in", str(wav),
                 "--image", str(png), "--max-tokens", "5"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    message = [{"role": "user", "content": [{"type": "audio", "audio": str(wav)}, {"type": "image", "image": png},
                                            {"type": "text", "text": "What is this?"}]}]
    (out,) = Omni(tiny_ckpt).generate(message, sampling_params=SamplingParams(temperature=0.0, max_tokens=5))
    assert len(out.token_ids) == 5 and printed == out.text
    thinker = load_config(tiny_ckpt).thinker_config
    assert thinker.image_token_id in out.prompt_token_ids and thinker.audio_token_id in out.prompt_token_ids


@pytest.mark.parametrize("checkpoint", ["tiny_ckpt", "q25_ckpt"])
def test_generate_speaks_about_audio_image_and_video_files(tmp_path, checkpoint, capsys, request):
    """Both families take the same media flags."""
    tiny_ckpt = request.getfixturevalue(checkpoint)
    rng = np.random.default_rng(1)
    wav, png, out = tmp_path / "q.wav", tmp_path / "p.png", tmp_path / "answer.wav"
    soundfile.write(str(wav), (rng.standard_normal(20000) * 0.1).astype(np.float32), 16000)
    Image.fromarray(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)).save(png)
    mkv = write_video(tmp_path / "v.mkv", rng.integers(0, 256, (4, 32, 48, 3), dtype=np.uint8), 2)
    assert main(["generate", "What is this?", "--model", str(tiny_ckpt), "--audio-in", str(wav), "--image", str(png),
                 "--video", str(mkv), "--audio", str(out), "--max-tokens", "4", "--seed", "0"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    # The same request through the offline API, with the CLI's seeded sampling, says the same.
    omni = Omni(tiny_ckpt)
    params = {"thinker": SamplingParams(temperature=0.0, max_tokens=4, seed=0),
              "talker": omni.info.stage_sampling["talker"].replace(seed=0)}
    message = [{"role": "user", "content": [{"type": "audio", "audio": str(wav)}, {"type": "image", "image": png},
                                            {"type": "video", "video": mkv}, {"type": "text", "text": "What is this?"}]}]
    (answer,) = omni.generate(message, modalities=["text", "audio"], sampling_params=params)
    assert printed == answer.text and pcm.size > 0
    assert np.array_equal(pcm, (answer.audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy())
    thinker = omni.engine.family.config.thinker_config
    assert {thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id} <= set(answer.prompt_token_ids)


def _generate_with(flags, tiny_ckpt, capsys, monkeypatch) -> Omni:
    """Run `omnistage generate` with flags; returns the Omni it built."""
    import omnistage

    built = []

    class Spy(Omni):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(omnistage, "Omni", Spy)
    assert main(["generate", "Hello", "--model", str(tiny_ckpt), *flags, "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()
    return built[0]


@pytest.mark.parametrize("flags, on", [([], True), (["--no-enable-prefix-caching"], False)])
def test_generate_caches_prefixes_by_default_and_not_with_the_flag(tiny_ckpt, capsys, monkeypatch, flags, on):
    omni = _generate_with(flags, tiny_ckpt, capsys, monkeypatch)
    for name in ("thinker", "talker"):
        assert omni.engine.pipeline.stage(name).scheduler.enable_prefix_caching is on, name
    assert (omni.engine.resource_stats()["thinker"]["prefix_cache_queries"] > 0) is on  # a text answer: Thinker only


@pytest.mark.parametrize("flags, packed", [([], True), (["--fast"], True), (["--no-fast"], False)])
def test_generate_runs_fast_kernels_by_default_and_reference_ones_with_no_fast(tiny_ckpt, capsys, monkeypatch, flags,
                                                                              packed):
    """The fast kernels are the default and reach every stage's build (linear layers on oneDNN-packed weights);
    `--no-fast` keeps the reference's kernels everywhere."""
    from omnistage.models.layers.fast_linear import PackedLinear

    stages = _generate_with(flags, tiny_ckpt, capsys, monkeypatch).engine.orchestrator.stages
    models = {"thinker": stages["thinker"].runner.model.thinker, "talker": stages["talker"].runner.model.talker}
    for name, model in models.items():
        assert any(isinstance(m, PackedLinear) for m in model.modules()) == packed, name
