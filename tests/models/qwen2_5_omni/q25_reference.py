"""Shared reference runs for the Qwen2.5-Omni parity tests (tiny checkpoint, float32).

One transformers ``generate`` per (thinker stop mode, talker penalty) is cached per process, with the Thinker's
``generate`` result (hidden states of every step) and the Talker's inputs and output captured, plus our
modules loaded from the same checkpoint directory. The reference Talker always gets an explicit attention mask
(``explicit_talker_mask``); its Token2Wav is skipped inside ``generate`` (tests call it directly).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from omnistage.attention.backend import AttentionMetadata, allocate_kv_cache, build_attention_metadata
from omnistage.core.kv_cache import KVCacheManager
from omnistage.models.qwen2_5_omni.loading import load_config, load_talker, load_thinker, load_token2wav
from omnistage.models.qwen2_5_omni.talker import Talker
from omnistage.models.qwen2_5_omni.thinker import Thinker
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav
from omnistage.testing.qwen2_5_omni.reference import (
    codes_only,
    explicit_talker_mask,
    load_hf_reference,
    tiny_checkpoint,
)

PROMPTS = (
    [
        {"role": "system", "content": "You are a helpful voice assistant."},
        {"role": "user", "content": "Hello there, how are you today?"},
        {"role": "assistant", "content": "Fine, thanks."},
        {"role": "user", "content": "Tell me a story about the sea."},
    ],
    [{"role": "user", "content": "What is the capital of France?"}],
)
SPEAKER = "Ethan"
THINKER_NEW_TOKENS = 8
TALKER_NEW_TOKENS = 40
EOS_AT = 4  # "eos" runs stop the thinker on the token it generates at this index


def checkpoint_dir() -> Path:
    return tiny_checkpoint()


@dataclass
class Capture:
    thinker_result: object = None
    talker_kwargs: dict = field(default_factory=dict)
    talker_result: torch.Tensor | None = None


@dataclass
class Loaded:
    hf: object
    tokenizer: object
    cap: Capture
    config: object
    thinker: Thinker
    talker: Talker
    token2wav: Token2Wav


@functools.cache
def loaded() -> Loaded:
    from transformers import AutoTokenizer

    ckpt = checkpoint_dir()
    hf = load_hf_reference(ckpt)
    cap = Capture()
    thinker_generate, talker_generate = hf.thinker.generate, hf.talker.generate

    def capture_thinker(**kwargs):
        cap.thinker_result = thinker_generate(**kwargs)
        return cap.thinker_result

    def capture_talker(**kwargs):
        cap.talker_kwargs = kwargs
        cap.talker_result = talker_generate(**kwargs)
        return cap.talker_result

    hf.thinker.generate = capture_thinker
    hf.talker.generate = capture_talker
    config = load_config(ckpt)
    return Loaded(
        hf, AutoTokenizer.from_pretrained(ckpt), cap, config,
        load_thinker(ckpt, config), load_talker(ckpt, config), load_token2wav(ckpt, config),
    )


@dataclass
class Reference:
    prompt_ids: torch.Tensor  # [P]
    generated: torch.Tensor  # [G] thinker tokens
    thinker_eos: int
    prompt_rows: torch.Tensor  # [P, E] thinker embedding + final hidden of the prompt
    answer_rows: torch.Tensor  # [G - 1, E] the same for every fed-back answer token
    prompt_logits: torch.Tensor  # [P, V] transformers' thinker forward over the prompt
    codes: list[int]  # talker codes before the first EOS
    talker_prompt_len: int


def prompt_ids(prompt: int = 0) -> torch.Tensor:
    """[1, P] token ids of PROMPTS[prompt] with the assistant header."""
    return loaded().tokenizer.apply_chat_template(
        PROMPTS[prompt], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


@functools.cache
@torch.no_grad()
def reference(stop: str = "length", penalty: float = 1.0, prompt: int = 0, speaker: str = SPEAKER) -> Reference:
    """stop="length": the thinker runs to its token limit; "eos": it stops on a token it really generates."""
    ld = loaded()
    hf, talker_cfg = ld.hf, ld.config.talker_config
    ids = prompt_ids(prompt)
    im_end = ld.tokenizer.convert_tokens_to_ids("<|im_end|>")
    if stop == "length":
        eos, limits = im_end, {"thinker_min_new_tokens": THINKER_NEW_TOKENS}
    elif stop == "eos":
        probe = hf.thinker.generate(
            input_ids=ids, max_new_tokens=EOS_AT + 1, min_new_tokens=EOS_AT + 1, eos_token_id=im_end, do_sample=False
        )
        eos, limits = int(probe[0, ids.shape[1] + EOS_AT]), {}
    else:
        raise ValueError(stop)
    with explicit_talker_mask(hf), codes_only(hf):
        hf.generate(
            ids,
            speaker=speaker,
            thinker_max_new_tokens=THINKER_NEW_TOKENS,
            thinker_eos_token_id=eos,
            thinker_do_sample=False,
            talker_do_sample=False,
            talker_max_new_tokens=TALKER_NEW_TOKENS,
            talker_eos_token_id=[talker_cfg.tts_codec_pad_token_id, talker_cfg.tts_codec_end_token_id],
            talker_repetition_penalty=penalty,
            **limits,
        )
    res = ld.cap.thinker_result
    steps = res.hidden_states
    rows = [h[0][0] + h[-1][0] for h in steps]  # embedding + final hidden, per generate step
    talker_prompt = ld.cap.talker_kwargs["input_ids"].shape[1]
    codes = ld.cap.talker_result[0, talker_prompt:].tolist()
    stops = {talker_cfg.tts_codec_pad_token_id, talker_cfg.tts_codec_end_token_id}
    for i, c in enumerate(codes):
        if c in stops:
            codes = codes[:i]
            break
    return Reference(
        prompt_ids=ids[0],
        generated=res.sequences[0, ids.shape[1] :],
        thinker_eos=eos,
        prompt_rows=rows[0],
        answer_rows=torch.cat(rows[1:]) if len(rows) > 1 else rows[0][:0],
        prompt_logits=hf.thinker(input_ids=ids).logits[0],
        codes=codes,
        talker_prompt_len=talker_prompt,
    )


class PagedKV:
    """Paged KV for one model in tests: a KVCacheManager's block tables over freshly allocated caches."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int = 64, block_size: int = 4):
        self.manager = KVCacheManager(num_blocks, block_size)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv = allocate_kv_cache(num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.lens: dict[str, int] = {}

    @classmethod
    def for_model(cls, model: Thinker | Talker) -> PagedKV:
        return cls(model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim)

    def meta(self, reqs: list[str], query_lens: list[int], padded: int | None = None) -> AttentionMetadata:
        ctx = [self.lens.get(r, 0) for r in reqs]
        for r, c, q in zip(reqs, ctx, query_lens):
            if self.manager.allocate_slots(r, c + q) is None:
                raise RuntimeError("test KV cache exhausted")
            self.lens[r] = c + q
        tables = [self.manager.block_ids(r) for r in reqs]
        return build_attention_metadata(query_lens, ctx, tables, self.block_size, self.num_blocks, padded)
