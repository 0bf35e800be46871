"""Messages render with the chat template transformers' processor loads from the checkpoint directory (its legacy
``chat_template.json`` first, then ``chat_template.jinja``, then the tokenizer's own), so a checkpoint whose
template sits only beside the processor renders, and one whose processor template differs from the tokenizer's
renders with the processor's; a checkpoint without any template is refused naming it."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, Qwen3OmniMoeProcessor

from omnistage.models.qwen3_omni.family import Qwen3OmniFamily
from omnistage.testing.variants import checkpoint_variant

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."}]
PREAMBLE = "{{- '<|im_start|>system\\nFrom the jinja file.<|im_end|>\\n' -}}"


def _variant(src, dst, tokenizer_template: bool, legacy: bool, jinja: str | None):
    ckpt = checkpoint_variant(src, dst, lambda cfg: None)
    template = json.loads((ckpt / "chat_template.json").read_text())["chat_template"]
    if not tokenizer_template:
        cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
        cfg.pop("chat_template")
        (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    if not legacy:
        (ckpt / "chat_template.json").unlink()
    if jinja is not None:
        (ckpt / "chat_template.jinja").write_text(jinja + template)
    return ckpt


@pytest.mark.parametrize(("tokenizer_template", "legacy", "jinja"), [
    (False, True, None),  # only beside the processor (legacy file)
    (False, False, PREAMBLE),  # only beside the processor (jinja file)
    (True, False, PREAMBLE),  # the processor's differs from the tokenizer's: the processor's
    (True, True, PREAMBLE),  # both processor files: the legacy one, as transformers' processor loads them
], ids=["legacy-only", "jinja-only", "jinja-over-tokenizer", "legacy-over-jinja"])
def test_renders_with_the_processors_template(tiny_ckpt, tmp_path, tokenizer_template, legacy, jinja):
    ckpt = _variant(tiny_ckpt, tmp_path / "ckpt", tokenizer_template, legacy, jinja)
    theirs = Qwen3OmniMoeProcessor.get_processor_dict(str(ckpt))[0]["chat_template"]
    want = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        MESSAGES, chat_template=theirs, add_generation_prompt=True, tokenize=True)["input_ids"]
    got = Qwen3OmniFamily(ckpt).render_prompt(MESSAGES).token_ids
    assert got == list(want)
    jinja_used = jinja is not None and not legacy
    assert ("From the jinja file." in AutoTokenizer.from_pretrained(ckpt).decode(got)) == jinja_used


def test_a_checkpoint_without_a_template_is_refused_naming_it(tiny_ckpt, tmp_path):
    ckpt = _variant(tiny_ckpt, tmp_path / "ckpt", False, False, None)
    with pytest.raises(ValueError, match="has no chat template"):
        Qwen3OmniFamily(ckpt).render_prompt(MESSAGES)
