"""Offline Qwen-style tokenizer for test checkpoints.

A byte-level BPE (the Qwen2 pre-tokenizer regex, NFC, byte-level decoder) trained on the built-in corpus,
followed by the Qwen special tokens in the order the real vocabulary has them. Saved as `tokenizer.json`
+ `tokenizer_config.json` (ChatML template) + `vocab.json`/`merges.txt`, loadable with
`transformers.AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from omnistage.checkpoints.corpus import training_corpus

# Same split rule as the Qwen2 tokenizer: words with an optional leading non-letter, single digits,
# punctuation runs, newline runs, whitespace.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# (content, special) in the order of the real Qwen3-Omni vocabulary (151643 ... 151675).
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

def chatml_template(image: str, audio: str, video: str, default_system: str | None = None) -> str:
    """ChatML over string content or typed parts (text / image / audio / video), each media part written as
    its marker string; ``default_system``: a system turn put first when the conversation has none."""
    opening = "" if default_system is None else (
        "{%- if loop.first and message['role'] != 'system' -%}"
        "{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' -}}"
        "{%- endif -%}"
    )
    return (
        "{%- for message in messages -%}"
        + opening
        + "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['content'] is string -%}"
        "{{- message['content'] -}}"
        "{%- else -%}"
        "{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
        "{%- elif part['type'] == 'image' or part['type'] == 'image_url' -%}"
        "{{- '" + image + "' -}}"
        "{%- elif part['type'] == 'audio' or part['type'] == 'input_audio' or part['type'] == 'audio_url' -%}"
        "{{- '" + audio + "' -}}"
        "{%- elif part['type'] == 'video' or part['type'] == 'video_url' -%}"
        "{{- '" + video + "' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


# ChatML as Qwen3-Omni renders it.
CHAT_TEMPLATE = chatml_template("<|vision_start|><|image_pad|><|vision_end|>",
                                "<|audio_start|><|audio_pad|><|audio_end|>",
                                "<|vision_start|><|video_pad|><|vision_end|>")

# Tokenizer attributes the Qwen3-Omni processor reads (tokenizer.image_token, ...).
_EXTRA_SPECIAL_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

SINGLE_TOKEN_WORDS = ("system", "user", "assistant", "\n")


@dataclass(frozen=True)
class TokenizerIds:
    """Ids a Qwen3-Omni config refers to, as assigned by the built tokenizer."""

    vocab_size: int
    endoftext: int
    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int
    audio_start: int
    audio_end: int
    audio_pad: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    system: int
    user: int
    assistant: int
    newline: int

    def __post_init__(self) -> None:
        ids = [v for k, v in self.__dict__.items() if k != "vocab_size"]
        if len(set(ids)) != len(ids):
            raise ValueError(f"token ids must be distinct: {self}")
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}): {self}")


def train_tokenizer(
    bpe_vocab_size: int = 735, added_tokens: Sequence[tuple[str, bool]] = QWEN_ADDED_TOKENS
) -> Tokenizer:
    """Train the byte-level BPE on the built-in corpus and append the Qwen added tokens.

    `bpe_vocab_size` counts the 256 byte symbols and the learned merges; the added tokens come after, in the
    order of `added_tokens` ((content, special) pairs; the default is Qwen3-Omni's list).
    """
    if bpe_vocab_size <= 256:
        raise ValueError(f"bpe_vocab_size must exceed the 256-symbol byte alphabet, got {bpe_vocab_size}")
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    # Added one at a time so ids follow the Qwen order exactly.
    for content, special in added_tokens:
        token = AddedToken(content, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    for word in SINGLE_TOKEN_WORDS:
        n = len(tok.encode(word, add_special_tokens=False).ids)
        if n != 1:
            raise RuntimeError(f"role word {word!r} encodes to {n} tokens; the corpus must make it one token")
    return tok


def token_id(tok: Tokenizer, text: str) -> int:
    """The id of a (special) token; KeyError if the tokenizer lacks it."""
    i = tok.token_to_id(text)
    if i is None:
        raise KeyError(f"token {text!r} missing from the tokenizer")
    return i


def single_token_id(tok: Tokenizer, text: str) -> int:
    """The id `text` encodes to; RuntimeError unless it is exactly one token."""
    ids = tok.encode(text, add_special_tokens=False).ids
    if len(ids) != 1:
        raise RuntimeError(f"{text!r} is not a single token: {ids}")
    return ids[0]


def tokenizer_ids(tok: Tokenizer) -> TokenizerIds:
    def tid(text: str) -> int:
        return token_id(tok, text)

    def word(text: str) -> int:
        return single_token_id(tok, text)

    return TokenizerIds(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        endoftext=tid("<|endoftext|>"),
        im_start=tid("<|im_start|>"),
        im_end=tid("<|im_end|>"),
        vision_start=tid("<|vision_start|>"),
        vision_end=tid("<|vision_end|>"),
        image_pad=tid("<|image_pad|>"),
        video_pad=tid("<|video_pad|>"),
        audio_start=tid("<|audio_start|>"),
        audio_end=tid("<|audio_end|>"),
        audio_pad=tid("<|audio_pad|>"),
        tts_pad=tid("<tts_pad>"),
        tts_bos=tid("<tts_text_bos>"),
        tts_eos=tid("<tts_text_eod>"),
        system=word("system"),
        user=word("user"),
        assistant=word("assistant"),
        newline=word("\n"),
    )


@dataclass(frozen=True)
class TokenizerFlavor:
    """What differs between the Qwen omni tokenizers: added tokens, processor attributes, chat template."""

    added_tokens: Sequence[tuple[str, bool]] = QWEN_ADDED_TOKENS
    extra_special_tokens: Mapping[str, str] = field(default_factory=lambda: dict(_EXTRA_SPECIAL_TOKENS))
    chat_template: str = CHAT_TEMPLATE


def _tokenizer_config(tok: Tokenizer, model_max_length: int, flavor: TokenizerFlavor) -> dict:
    decoder = {}
    for content, special in flavor.added_tokens:
        decoder[str(tok.token_to_id(content))] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [
            c for c, special in flavor.added_tokens if special and c != "<|endoftext|>"
        ],
        "extra_special_tokens": dict(flavor.extra_special_tokens),
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": flavor.chat_template,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "add_prefix_space": False,
    }


def save_tokenizer(
    tok: Tokenizer, out_dir: Path, model_max_length: int = 32768, flavor: TokenizerFlavor | None = None
) -> None:
    """Write tokenizer.json, tokenizer_config.json, vocab.json and merges.txt into `out_dir`.

    `flavor` picks the model family's added tokens and chat template (default: Qwen3-Omni's).
    """
    flavor = TokenizerFlavor() if flavor is None else flavor
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(tok, model_max_length, flavor), indent=2, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )
    # vocab.json / merges.txt as the hub ships them, for loaders that read BPE files directly.
    model = json.loads(tok.to_str())["model"]
    (out_dir / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False) + "\n", encoding="utf-8")
    merges = ["#version: 0.2"]
    for merge in model["merges"]:
        merges.append(" ".join(merge) if isinstance(merge, list) else merge)
    (out_dir / "merges.txt").write_text("\n".join(merges) + "\n", encoding="utf-8")
