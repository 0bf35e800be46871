"""A model family written here, registered through the public registry, runs on the generic orchestrator:
two AR stages and a generation stage with names the runtime was not written for.

The toy chain: ``writer`` (AR, reads the prompt) answers token t_{k+1} = (3 * t_k + position + 1) % V;
``echo`` (AR) reads the writer's fed-back answer tokens as its prompt and answers each step with
(last token + 5) % V; ``render`` (generation) turns echo's tokens into "audio" samples token / V.
"""

from __future__ import annotations

import json

import torch

from omnistage.config import ExecutionType
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.family import BridgeSpec, ModelFamily, PartSpec, PreparedPrompt, StageRequest, no_args
from omnistage.models.registry import family_for_checkpoint, register_family
from omnistage.pipeline.omni import Omni
from omnistage.runner.outputs import OmniOutput

V = 97
PRESET = """
family: toy_chain
stages:
  - {name: writer, execution: ar, model_part: writer, final_output: text,
     sampling: {temperature: 0.0, max_tokens: 6}, scheduler: {max_model_len: 64, block_size: 4, num_blocks: 64}}
  - {name: echo, execution: ar, model_part: echo, inputs: [writer], bridge: tokens,
     sampling: {temperature: 0.0, max_tokens: 3}, scheduler: {max_model_len: 64, block_size: 4, num_blocks: 64}}
  - {name: render, execution: generation, model_part: render, inputs: [echo], bridge: samples, final_output: audio}
"""


class TokenModel:
    """Logits pick ``rule(token, position)``; fed-back answer tokens go downstream."""

    num_layers, num_kv_heads, head_dim = 1, 1, 2

    def __init__(self, rule, emits_token_ids=True):
        self.rule, self.emits_token_ids = rule, emits_token_ids

    def prepare_inputs(self, ctx, input_ids, positions):
        return {"input_ids": input_ids, "positions": positions}, [None] * len(ctx.req_ids)

    def forward(self, kv_caches, attn_meta, input_ids, positions):
        return OmniOutput(torch.stack([input_ids, positions], 1), {"ids": input_ids, "pos": positions})

    def compute_logits(self, hidden):
        return torch.nn.functional.one_hot(self.rule(hidden[:, 0], hidden[:, 1]) % V, V).float()

    def postprocess(self, ctx, output, sampled):
        return [None] * len(ctx.req_ids)

    def stage_outputs(self, ctx, output, sampled):
        out = {}
        for req, start in zip(ctx.requests, ctx.num_computed):
            s, e = ctx.spans[req.req_id]
            keep = torch.arange(start, start + e - s) >= req.num_prompt_tokens
            if keep.any():
                out[req.req_id] = {"tokens": output.multimodal_outputs["ids"][s:e][keep].clone()}
        return out

    def client_outputs(self, ctx, output, sampled):
        return {} if self.emits_token_ids else {r: {"codes": torch.tensor([[t]])} for r, t in sampled.items()}


class RenderModel:
    def forward_batch(self, payloads, states):
        width = max(p.numel() for p in payloads)
        audio = torch.zeros(len(payloads), width)
        for i, p in enumerate(payloads):
            audio[i, : p.numel()] = p.float() / V
        updates = [{"chunks": s.get("chunks", 0) + 1} for s in states]
        return {"audio": audio, "audio_lengths": torch.tensor([p.numel() for p in payloads])}, updates


class TokensBridge:
    """writer -> echo: fed-back answer tokens become echo's prompt, streamed."""

    def __init__(self):
        self.seen = {}

    def __len__(self):
        return len(self.seen)

    def add_request(self, req_id, data):
        self.seen[req_id] = 0

    def drop(self, req_id):
        self.seen.pop(req_id, None)

    def on_input(self, req_id, payload, sink):
        self.seen[req_id] += payload["tokens"].numel()
        sink.append_tokens(req_id, payload["tokens"].tolist(), finished=False)

    def on_end(self, req_id, sink):
        if self.seen.pop(req_id, 0):
            sink.append_tokens(req_id, [], finished=True)
        else:
            sink.finish(req_id, "stop")


class SamplesBridge(TokensBridge):
    def on_input(self, req_id, payload, sink):
        sink.add_payload(req_id, payload["tokens"], finished=False)

    def on_end(self, req_id, sink):
        self.seen.pop(req_id, None)
        sink.add_payload(req_id, None, finished=True)


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


@register_family
class ToyChainFamily(ModelFamily):
    name = "toy_chain"
    architectures = ("ToyChainForTest",)
    parts = {"writer": PartSpec(ExecutionType.AR), "echo": PartSpec(ExecutionType.AR),
             "render": PartSpec(ExecutionType.GENERATION)}
    bridges = {"tokens": BridgeSpec(no_args), "samples": BridgeSpec(no_args)}
    preset_file = ""
    tokenizer = CharTokenizer()
    eos_token_ids = ()
    vocab_size = V
    sample_rate = 8000

    @classmethod
    def preset_text(cls):
        return PRESET

    def build_model(self, ctx):
        part = ctx.stage.model_part
        if part == "writer":
            return TokenModel(lambda t, p: 3 * t + p + 1)
        if part == "echo":
            return TokenModel(lambda t, p: t + 5, emits_token_ids=False)
        return RenderModel()

    def build_bridge(self, name, model, args):
        return TokensBridge() if name == "tokens" else SamplesBridge()

    def render_prompt(self, messages, **kwargs):
        return PreparedPrompt([ord(c) % V for m in messages for c in m["content"]])

    def stage_requests(self, req_id, prompt, stages, params, voice):
        out = {}
        for s in stages:
            if s.model_part == "writer":
                out[s.name] = StageRequest(req_id, params[s.name], tuple(prompt.token_ids))
            elif s.model_part == "echo":
                out[s.name] = StageRequest(req_id, params[s.name])
            else:
                out[s.name] = StageRequest(req_id)
        return out


def expected(prompt: str, n_writer: int = 6, n_echo: int = 3):
    ids = [ord(c) % V for c in prompt]
    answer = []
    for _ in range(n_writer):
        answer.append((3 * ids[-1] + len(ids) - 1 + 1) % V)
        ids.append(answer[-1])
    echo_prompt = answer[:-1]  # the last answer token is never fed back
    echo, seq = [], list(echo_prompt)
    for _ in range(n_echo):
        echo.append((seq[-1] + 5) % V)
        seq.append(echo[-1])
    return answer, echo


def test_generic_orchestrator_runs_a_family_it_was_not_written_for(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ToyChainForTest"]}))
    assert family_for_checkpoint(tmp_path) is ToyChainFamily
    omni = Omni(tmp_path)
    assert omni.info.text_stage == "writer" and omni.info.output_modalities == ("text", "audio")
    prompts = ["hello", "a much longer prompt here", "xy"]
    outs = omni.generate(prompts, modalities=["text", "audio"])
    for prompt, out in zip(prompts, outs):
        answer, echo = expected(prompt)
        assert out.token_ids == answer and out.finish_reason == "length"
        assert out.codes.flatten().tolist() == echo  # echo's client outputs, attributed to their request
        # render got echo's fed-back tokens (all but the last) in chunks, as samples
        assert torch.allclose(out.audio, torch.tensor(echo[:-1], dtype=torch.float32) / V)
    text_only = omni.generate("hello", modalities=["text"], sampling_params=SamplingParams(temperature=0, max_tokens=2))
    assert text_only[0].token_ids == expected("hello", 2)[0] and text_only[0].audio is None
    stats = omni.engine.resource_stats()
    assert stats["requests"] == 0 and all(stats[s]["records"] == 0 for s in ("writer", "echo", "render"))
