"""Shared reference runs for the Thinker/Talker parity tests.

One transformers ``generate(return_audio=True)`` run per (preset, thinker stop mode) is cached per process,
with everything the Talker was given and everything it computed captured by hooks, plus our modules loaded
from the same checkpoint directory.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from omnistage.attention.backend import AttentionMetadata, allocate_kv_cache, build_attention_metadata
from omnistage.models.qwen3_omni.talker import Talker
from omnistage.models.qwen3_omni.thinker import Thinker

PROMPT = [
    {"role": "system", "content": "You are a helpful voice assistant."},
    {"role": "user", "content": "Hello there, how are you today?"},
    {"role": "assistant", "content": "Fine, thanks."},
    {"role": "user", "content": "Tell me a story about the sea."},
]
THINKER_NEW_TOKENS = 6
TALKER_NEW_TOKENS = 6
SPEAKER = "Ethan"  # looked up lower-cased, as generate() does
EOS_AT = 3  # "eos" runs stop the thinker on the token it generates at this index


@contextlib.contextmanager
def single_thread():
    """Tiny models are dominated by per-op overhead; extra intra-op threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.cache
def checkpoint_dir(preset: str) -> Path:
    from omnistage.checkpoints.builder import build_checkpoint

    root = Path(tempfile.mkdtemp(prefix=f"omnistage-h2-{preset}-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # (tests used to leave one behind per run)
    return build_checkpoint(root, preset=preset, seed=0)


def load_state(module: torch.nn.Module, ckpt: Path, prefix: str, skip: tuple[str, ...] = ()) -> None:
    """Load ``prefix``-ed checkpoint tensors into ``module`` (strict), by the on-disk (hub) names."""
    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    sub = {
        k[len(prefix) :]: v.float()
        for k, v in tensors.items()
        if k.startswith(prefix) and not k[len(prefix) :].startswith(skip)
    }
    module.load_state_dict(sub, strict=True)


@dataclass
class Capture:
    talker_kwargs: dict = field(default_factory=dict)
    talker_result: object = None
    talker_steps: list[dict] = field(default_factory=list)  # per talker forward: inputs_embeds, logits
    cp_steps: list[dict] = field(default_factory=list)  # per code-predictor forward: inputs_embeds, logits


@dataclass
class Reference:
    preset: str
    config: object
    hf: object
    thinker: Thinker
    talker: Talker
    prompt_ids: torch.Tensor  # [P]
    sequences: torch.Tensor  # [P + G] prompt + generated thinker tokens
    thinker_eos: int
    speaker_id: int
    cap: Capture
    thinker_hidden_states: tuple  # transformers' thinker forward over the prompt, output_hidden_states=True
    thinker_logits: torch.Tensor  # [P, V]

    @property
    def codes(self) -> torch.Tensor:
        """Reference frames [T, Q]."""
        res = self.cap.talker_result
        frames = [h[-1] for h in res.hidden_states if h[-1] is not None]
        return torch.stack(frames, dim=1)[0]


class _CaptureSlot:
    """Hooks write into whichever Capture is current, so one loaded model serves several runs."""

    def __init__(self) -> None:
        self.cap = Capture()


def _install_hooks(hf, slot: _CaptureSlot) -> None:
    def talker_hook(_m, args, kwargs, out):
        slot.cap.talker_steps.append({"inputs_embeds": kwargs["inputs_embeds"].clone(), "logits": out.logits})

    def cp_hook(_m, args, kwargs, out):
        emb = kwargs.get("inputs_embeds")
        slot.cap.cp_steps.append(
            {"inputs_embeds": None if emb is None else emb.clone(), "logits": out.logits}
        )

    hf.talker.register_forward_hook(talker_hook, with_kwargs=True)
    hf.talker.code_predictor.register_forward_hook(cp_hook, with_kwargs=True)
    original = hf.talker.generate

    def generate(**kwargs):
        slot.cap.talker_kwargs = kwargs
        slot.cap.talker_result = original(**kwargs)
        return slot.cap.talker_result

    hf.talker.generate = generate


@dataclass
class Loaded:
    hf: object
    tokenizer: object
    slot: _CaptureSlot
    thinker: Thinker
    talker: Talker


@functools.cache
def loaded(preset: str) -> Loaded:
    """transformers' model and ours, from the same checkpoint directory (float32)."""
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    ckpt = checkpoint_dir(preset)
    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    slot = _CaptureSlot()
    _install_hooks(hf, slot)
    # These tests stop at codec codes; skip the vocoder generate() would run afterwards.
    hf.code2wav.chunked_decode = lambda codes, **_: torch.zeros(codes.shape[0], 1, 1)
    thinker = Thinker(hf.config).eval()
    load_state(thinker, ckpt, "thinker.", skip=("audio_tower.", "visual."))
    talker = Talker(hf.config).eval()
    load_state(talker, ckpt, "talker.")
    return Loaded(hf, AutoTokenizer.from_pretrained(ckpt), slot, thinker, talker)


@functools.cache
@torch.no_grad()
def reference(preset: str, stop: str = "length") -> Reference:
    """stop="length": the thinker runs to its token limit; stop="eos": it stops on a generated token."""
    if stop not in ("length", "eos"):
        raise ValueError(stop)
    torch.manual_seed(0)
    ld = loaded(preset)
    hf = ld.hf
    config = hf.config
    prompt = ld.tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    input_ids = prompt["input_ids"]
    cap = ld.slot.cap = Capture()
    common = dict(
        speaker=SPEAKER,
        return_audio=True,
        thinker_max_new_tokens=THINKER_NEW_TOKENS,
        talker_max_new_tokens=TALKER_NEW_TOKENS,
        talker_do_sample=False,
        talker_repetition_penalty=1.0,
    )
    if stop == "length":
        eos = config.im_end_token_id
        sequences, _ = hf.generate(
            input_ids, thinker_eos_token_id=eos, thinker_min_new_tokens=THINKER_NEW_TOKENS, **common
        )
    else:
        # Declare a token the greedy thinker really produces to be the EOS: a natural early stop.
        probe = hf.thinker.generate(
            input_ids,
            max_new_tokens=EOS_AT + 1,
            min_new_tokens=EOS_AT + 1,
            eos_token_id=config.im_end_token_id,
        )
        eos = int(probe[0, input_ids.shape[1] + EOS_AT])
        sequences, _ = hf.generate(input_ids, thinker_eos_token_id=eos, **common)
    th_out = hf.thinker(input_ids=input_ids, output_hidden_states=True)
    return Reference(
        preset=preset,
        config=config,
        hf=hf,
        thinker=ld.thinker,
        talker=ld.talker,
        prompt_ids=input_ids[0],
        sequences=sequences[0],
        thinker_eos=eos,
        speaker_id=config.talker_config.speaker_id[SPEAKER.lower()],
        cap=cap,
        thinker_hidden_states=th_out.hidden_states,
        thinker_logits=th_out.logits[0],
    )


class PagedRequests:
    """A minimal paged-KV bookkeeper for tests: per-request block tables over one shared cache."""

    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int = 64, block_size: int = 4
    ):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = allocate_kv_cache(num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.free = list(range(num_blocks))[::-1]
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def meta(self, reqs: list[str], query_lens: list[int], padded: int | None = None) -> AttentionMetadata:
        ctx = []
        for r, q in zip(reqs, query_lens):
            table = self.tables.setdefault(r, [])
            have = self.lens.setdefault(r, 0)
            while len(table) * self.block_size < have + q:
                table.append(self.free.pop())
            ctx.append(have)
        meta = build_attention_metadata(
            query_lens, ctx, [self.tables[r] for r in reqs], self.block_size, self.num_blocks, padded
        )
        for r, q in zip(reqs, query_lens):
            self.lens[r] += q
        return meta
