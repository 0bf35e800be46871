"""Qwen2.5-Omni voices: the speakers of ``spk_dict.pt`` (speaker -> Thinker bos row, ``cond``, ``ref_mel``).

The API's ``voice`` names one of them. transformers looks speakers up by exact key ("Chelsie", "Ethan"); here a
voice matches its key case-insensitively as well, and an unknown voice is an error that lists the known ones
(the server turns it into a 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

SPEAKER_FILE = "spk_dict.pt"


class UnknownVoiceError(ValueError):
    def __init__(self, voice: str, known: list[str]) -> None:
        super().__init__(f"unknown voice {voice!r}; available voices: {', '.join(known)}")
        self.voice = voice
        self.known = known


@dataclass(frozen=True)
class Speaker:
    name: str
    bos_token: int  # Thinker embedding row that opens the Talker's text side
    cond: torch.Tensor  # [enc_emb_dim] DiT speaker conditioning
    ref_mel: torch.Tensor  # [frames, mel_dim] reference mel for the DiT's speaker encoder


def load_speakers(model_dir: str | Path) -> dict[str, Speaker]:
    path = Path(model_dir) / SPEAKER_FILE
    if not path.is_file():
        raise ValueError(f"{model_dir} has no {SPEAKER_FILE}; a Qwen2.5-Omni checkpoint needs it for speech")
    raw = torch.load(path, weights_only=True, map_location="cpu")
    out = {}
    for name, entry in raw.items():
        missing = {"bos_token", "cond", "ref_mel"} - set(entry)
        if missing:
            raise ValueError(f"{SPEAKER_FILE}: speaker {name!r} lacks {sorted(missing)}")
        cond = torch.as_tensor(entry["cond"]).float().reshape(-1)
        ref_mel = torch.as_tensor(entry["ref_mel"]).float()
        ref_mel = ref_mel.reshape(-1, ref_mel.shape[-1])
        out[name] = Speaker(name, int(entry["bos_token"]), cond, ref_mel)
    if not out:
        raise ValueError(f"{SPEAKER_FILE} lists no speakers")
    return out


def resolve_voice(voice: str, speakers: Mapping[str, Speaker]) -> str:
    """The speaker key for ``voice`` (exact, else case-insensitive); UnknownVoiceError otherwise."""
    if voice in speakers:
        return voice
    folded = {name.lower(): name for name in speakers}
    if voice.lower() in folded:
        return folded[voice.lower()]
    raise UnknownVoiceError(voice, sorted(speakers))
