"""Qwen2.5-Omni's tokenizer flavour for test checkpoints: its added tokens, processor attributes, chat template.

The byte-level BPE is the shared test tokenizer (``omnistage.checkpoints.tokenizer``); only what Qwen2.5-Omni names
differently changes: ``<|AUDIO|>`` / ``<|IMAGE|>`` / ``<|VIDEO|>`` placeholders, ``<|audio_bos|>`` ... markers,
and a ChatML template that inserts a default system turn the way the real one does.

The Talker's text-side ids (tts pad/start/end) and the speakers' bos ids are *not* tokenizer tokens in the real
model either: they are rows of the Thinker's (padded) embedding table past the tokenizer's last id.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from omnistage.checkpoints.tokenizer import TokenizerFlavor, chatml_template, single_token_id, token_id

# (content, special) in the order of the real Qwen2.5-Omni vocabulary (151643 ... 151664).
QWEN2_5_OMNI_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|AUDIO|>", True),
    ("<|audio_bos|>", True),
    ("<|audio_eos|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_bos|>", True),
    ("<|vision_eos|>", True),
    ("<|vision_pad|>", True),
    ("<|IMAGE|>", True),
    ("<|VIDEO|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)

DEFAULT_TEMPLATE_SYSTEM = "You are a helpful assistant."

# ChatML with typed content parts; a conversation that does not open with a system turn gets the default one.
CHAT_TEMPLATE = chatml_template("<|vision_bos|><|IMAGE|><|vision_eos|>", "<|audio_bos|><|AUDIO|><|audio_eos|>",
                                "<|vision_bos|><|VIDEO|><|vision_eos|>", DEFAULT_TEMPLATE_SYSTEM)

FLAVOR = TokenizerFlavor(
    added_tokens=QWEN2_5_OMNI_ADDED_TOKENS,
    extra_special_tokens={
        "image_token": "<|IMAGE|>",
        "audio_token": "<|AUDIO|>",
        "video_token": "<|VIDEO|>",
        "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
    },
    chat_template=CHAT_TEMPLATE,
)


_TOKEN_FIELDS = {
    "endoftext": "<|endoftext|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "audio": "<|AUDIO|>",
    "audio_bos": "<|audio_bos|>",
    "audio_eos": "<|audio_eos|>",
    "vision_bos": "<|vision_bos|>",
    "vision_eos": "<|vision_eos|>",
    "image": "<|IMAGE|>",
    "video": "<|VIDEO|>",
}


@dataclass(frozen=True)
class Qwen25TokenIds:
    """Ids a Qwen2.5-Omni config refers to, as assigned by the built tokenizer."""

    num_tokens: int  # tokenizer size; the Thinker's embedding table is larger (reserved rows follow)
    endoftext: int
    im_start: int
    im_end: int
    audio: int
    audio_bos: int
    audio_eos: int
    vision_bos: int
    vision_eos: int
    image: int
    video: int
    user: int  # the role word, one token

    def __post_init__(self) -> None:
        ids = [v for k, v in self.__dict__.items() if k != "num_tokens"]
        if len(set(ids)) != len(ids) or any(not 0 <= i < self.num_tokens for i in ids):
            raise ValueError(f"token ids must be distinct and below {self.num_tokens}: {self}")


def token_ids(tok: Tokenizer) -> Qwen25TokenIds:
    return Qwen25TokenIds(
        num_tokens=tok.get_vocab_size(with_added_tokens=True),
        **{field: token_id(tok, text) for field, text in _TOKEN_FIELDS.items()},
        user=single_token_id(tok, "user"),
    )
