"""Voice names clients may ask for: the served model's own, and OpenAI's mapped onto them (``--voice-map``).

Clients written for OpenAI hard-code its voices (alloy, ash, ballad, coral, echo, sage, shimmer, verse, marin,
cedar). Each maps to one of the model's voices: by default OpenAI's names, in that order, take the model's
voices in the model's order, cycling (with ``ethan, chelsie``: alloy -> ethan, ash -> chelsie, ballad -> ethan,
...); ``omnistage serve --voice-map alloy=chelsie,echo=ethan`` overrides entries (and may add other names). A
mapped name answers in its model voice everywhere a voice is taken: ``/v1/chat/completions`` ``audio.voice``,
``/v1/audio/speech`` ``voice``, realtime sessions (which echo the name the client chose). Names are
case-insensitive; an unknown one is refused listing both the model's voices and the mapped names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")


class UnknownVoice(ValueError):
    """A voice that is neither the model's nor mapped (the API layers add their param and code)."""


def parse_voice_map(text: str) -> dict[str, str]:
    """``alloy=ethan,echo=chelsie`` -> {"alloy": "ethan", "echo": "chelsie"} (the ``--voice-map`` value)."""
    out: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, target = entry.partition("=")
        name, target = name.strip().lower(), target.strip().lower()
        if not sep or not name or not target:
            raise ValueError(f"voice map entry {entry!r} is not NAME=MODEL_VOICE")
        if name in out:
            raise ValueError(f"voice map names {name!r} twice")
        out[name] = target
    return out


class VoiceMap:
    """The model's voices and the names mapped onto them."""

    def __init__(self, model_voices: Sequence[str], overrides: Mapping[str, str] | None = None) -> None:
        self.model_voices = tuple(v.lower() for v in model_voices)
        voices = self.model_voices
        self.aliases = {name: voices[i % len(voices)] for i, name in enumerate(OPENAI_VOICES)} if voices else {}
        for name, target in (overrides or {}).items():
            name, target = name.lower(), target.lower()
            if not voices:
                raise ValueError("the voice map needs a model that speaks; this one has no voices")
            if target not in voices:
                raise ValueError(f"voice map {name}={target}: {target!r} is not one of the model's voices "
                                 f"{list(voices)}")
            if name in voices:
                raise ValueError(f"voice map {name}={target}: {name!r} is one of the model's own voices")
            self.aliases[name] = target

    def resolve(self, name: str) -> str:
        """The model voice ``name`` speaks with; raises UnknownVoice."""
        key = name.lower()
        if key in self.model_voices:
            return key
        if key in self.aliases:
            return self.aliases[key]
        raise UnknownVoice(f"unknown voice {name!r}; available: the model's voices {sorted(self.model_voices)} "
                           f"and the names mapped to them {sorted(self.aliases)}")
