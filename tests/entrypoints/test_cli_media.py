"""`omnistage generate --audio-in/--image/--video`: the files become media parts of the user message."""

import numpy as np
import soundfile
from PIL import Image

from omnistage import Omni, SamplingParams
from omnistage.entrypoints.cli import main
from omnistage.models.qwen3_omni.config import load_config


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
