"""Build a running pipeline from a checkpoint directory + pipeline config, and turn user requests into
stage requests (prompt rendering, per-stage sampling parameters, voice).

``OmniEngine`` is synchronous and single-threaded: ``add_request`` / ``abort`` / ``step``. The offline
``Omni`` and the streaming ``AsyncOmni`` (``omnistage.pipeline.omni``) drive it.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from omnistage.config import (
    ExecutionType,
    ModelCapabilities,
    PipelineConfig,
    StageConfig,
    load_pipeline_config,
    validate_pipeline,
)
from omnistage.core.generation_scheduler import GenerationScheduler
from omnistage.core.kv_cache import KVCacheManager
from omnistage.core.sampling_params import SamplingParams
from omnistage.core.scheduler import ARScheduler, SchedulerConfig
from omnistage.models.loader import load_config, load_into
from omnistage.models.qwen3_omni.code2wav import Code2Wav
from omnistage.models.qwen3_omni.stage_models import Code2WavStageModel, TalkerStageModel, ThinkerStageModel
from omnistage.models.qwen3_omni.talker import Talker
from omnistage.models.qwen3_omni.talker_inputs import TalkerTokenIds, text_specials
from omnistage.models.qwen3_omni.thinker import Thinker
from omnistage.pipeline.orchestrator import Orchestrator, RequestDelta
from omnistage.pipeline.stage_engine import ARStageEngine, GenerationStageEngine, StageEvents
from omnistage.pipeline.talker2code2wav import Talker2Code2Wav
from omnistage.pipeline.thinker2talker import Thinker2Talker
from omnistage.runner.ar_runner import ARModelRunner
from omnistage.runner.generation_runner import GenerationRunner
from omnistage.runner.graph_runner import GraphARModelRunner, GraphRunnerConfig

# What Qwen3-Omni's stage models declare (validated against the stage config before any request runs).
QWEN3_OMNI_CAPABILITIES = {
    "thinker": ModelCapabilities(supports_full_graph_aux_outputs=True, supports_native_data_plane=False),
    "talker": ModelCapabilities(supports_full_graph_aux_outputs=True, supports_native_data_plane=False),
    "code2wav": ModelCapabilities(supports_full_graph_aux_outputs=False, supports_native_data_plane=False),
}
DEFAULT_KV_BUDGET_BYTES = 512 * 1024**2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Messages = Sequence[Mapping[str, Any]]
Prompt = str | Messages


@dataclass(frozen=True)
class EngineArgs:
    model: str
    stage_config: str = "qwen3_omni"  # preset name or YAML path
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not Path(self.model).is_dir():
            raise ValueError(f"model directory {self.model!r} does not exist")


@contextlib.contextmanager
def _building(dtype: torch.dtype, device: str):
    """Create a model's tensors directly in its serving dtype and on its device: a 30B checkpoint must not
    first materialise as float32 on the host."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def _kv_blocks(stage: StageConfig, model, dtype: torch.dtype) -> int:
    s = stage.scheduler
    if s.num_blocks is not None:
        return s.num_blocks
    per_request = math.ceil(s.max_model_len / s.block_size)
    budget = s.kv_cache_bytes if s.kv_cache_bytes is not None else DEFAULT_KV_BUDGET_BYTES
    fit = KVCacheManager.num_blocks_for_budget(
        budget, model.num_layers, model.num_kv_heads, model.head_dim, s.block_size, dtype
    )
    return max(per_request, min(fit, per_request * s.max_num_seqs))


def _ar_stage(stage: StageConfig, model, dtype: torch.dtype, device: str, runner_version: str) -> ARStageEngine:
    num_blocks = _kv_blocks(stage, model, dtype)
    s = stage.scheduler
    sched = ARScheduler(
        SchedulerConfig(
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=s.max_model_len,
            block_size=s.block_size,
            num_blocks=num_blocks,
        )
    )
    if runner_version == "v2":
        buckets = tuple(1 << i for i in range((s.max_num_seqs - 1).bit_length() + 1))
        # MoE layers switch to host-sync-free routing while a CUDA graph is being captured.
        graph = GraphRunnerConfig(decode_buckets=buckets, max_model_len=s.max_model_len)
        runner = GraphARModelRunner(model, num_blocks=num_blocks, block_size=s.block_size, dtype=dtype,
                                    device=device, graph_config=graph)
    else:
        runner = ARModelRunner(model, num_blocks=num_blocks, block_size=s.block_size, dtype=dtype, device=device)
    return ARStageEngine(stage.name, sched, runner)


def _eos_ids(model_dir: Path, tokenizer) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{model_dir}: no eos_token_id in generation_config.json or the tokenizer")
    return (int(tokenizer.eos_token_id),)


class OmniEngine:
    def __init__(
        self,
        args: EngineArgs,
        pipeline: PipelineConfig | None = None,
        on_step: Callable[[StageEvents], None] | None = None,
    ) -> None:
        self.args = args
        model_dir = Path(args.model)
        self.pipeline = pipeline or load_pipeline_config(args.stage_config)
        self.runners = validate_pipeline(self.pipeline, QWEN3_OMNI_CAPABILITIES)
        self.stage_configs = {s.model_part: s for s in self.pipeline.stages}
        if "thinker" not in self.stage_configs:
            raise ValueError("the pipeline needs a thinker stage")
        dtype = DTYPES[args.dtype]
        device = args.device
        self.hf_config = load_config(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_ids = _eos_ids(model_dir, self.tokenizer)
        self.model_name = model_dir.name
        self.max_model_len = self.stage_configs["thinker"].scheduler.max_model_len

        with _building(dtype, device):
            thinker = Thinker(self.hf_config)
        load_into(thinker, model_dir, "thinker.", dtype, skip=("audio_tower.", "visual."))
        thinker.eval()
        th_cfg = self.stage_configs["thinker"]
        thinker_stage = _ar_stage(th_cfg, ThinkerStageModel(thinker), dtype, device, self.runners[th_cfg.name])

        talker_engine = code2wav_engine = t2t = t2c = None
        self.speakers: dict[str, int] = {}
        if "talker" in self.stage_configs and "code2wav" in self.stage_configs:
            with _building(dtype, device):
                talker = Talker(self.hf_config)
            load_into(talker, model_dir, "talker.", dtype)
            talker.eval()
            ids = TalkerTokenIds.from_config(self.hf_config)
            with torch.inference_mode():
                specials = text_specials(talker, thinker.model.embed_tokens, ids)
            self.talker_model = TalkerStageModel(talker, ids, specials)
            tk_cfg = self.stage_configs["talker"]
            talker_engine = _ar_stage(tk_cfg, self.talker_model, dtype, device, self.runners[tk_cfg.name])
            t2t = Thinker2Talker(talker_engine, self.talker_model)
            with _building(dtype, device):
                code2wav = Code2Wav(self.hf_config.code2wav_config)
            load_into(code2wav, model_dir, "code2wav.", dtype)
            code2wav.eval()
            c2w_stage = self.stage_configs["code2wav"]
            if c2w_stage.execution is not ExecutionType.GENERATION:
                raise ValueError(f"stage {c2w_stage.name!r} must be a generation stage")
            code2wav_engine = GenerationStageEngine(
                c2w_stage.name,
                GenerationScheduler(c2w_stage.scheduler.max_num_seqs),
                GenerationRunner(Code2WavStageModel(code2wav)),
            )
            t2c = Talker2Code2Wav(code2wav_engine, **dict(c2w_stage.processor_args))
            self.speakers = {k.lower(): int(v) for k, v in self.hf_config.talker_config.speaker_id.items()}
            self.sample_rate = int(code2wav.sample_rate)
        self._deltas: list[RequestDelta] = []
        self.orchestrator = Orchestrator(
            thinker_stage, talker_engine, code2wav_engine, t2t, t2c, self.eos_token_ids,
            sink=self._deltas.append, on_step=on_step,
        )
        self._counter = 0

    # ---- request preparation -----------------------------------------------------------------------
    @property
    def default_speaker(self) -> str | None:
        if not self.speakers:
            return None
        return "ethan" if "ethan" in self.speakers else next(iter(self.speakers))

    def render_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            messages: Messages = [{"role": "user", "content": prompt}]
        else:
            messages = prompt
        if not messages:
            raise ValueError("messages must not be empty")
        for m in messages:
            if m.get("role") not in ("system", "user", "assistant"):
                raise ValueError(f"unsupported message role {m.get('role')!r}")
            if not isinstance(m.get("content"), str):
                raise ValueError("message content must be a string (text parts are joined by the server)")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def stage_params(
        self, sampling_params: SamplingParams | Mapping[str, SamplingParams] | None
    ) -> dict[str, SamplingParams]:
        """Per model part: stage defaults, overridden by the request (a bare SamplingParams = the Thinker)."""
        params = {part: stage.sampling for part, stage in self.stage_configs.items()}
        if sampling_params is None:
            return params
        if isinstance(sampling_params, SamplingParams):
            params["thinker"] = sampling_params
            return params
        by_name = {stage.name: part for part, stage in self.stage_configs.items()}
        for name, p in sampling_params.items():
            if name not in by_name:
                raise ValueError(f"sampling_params names unknown stage {name!r}; stages: {sorted(by_name)}")
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{name!r}] must be a SamplingParams")
            params[by_name[name]] = p
        return params

    def add_request(
        self,
        prompt: Prompt | list[int],
        modalities: Sequence[str] = ("text",),
        sampling_params: SamplingParams | Mapping[str, SamplingParams] | None = None,
        speaker: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and register one request in every stage it needs; returns its id."""
        modalities = tuple(modalities)
        if not modalities or any(m not in ("text", "audio") for m in modalities) or "text" not in modalities:
            raise ValueError(f"modalities must be ['text'] or ['text', 'audio'], got {list(modalities)}")
        prompt_ids = list(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) \
            else self.render_prompt(prompt)
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.hf_config.thinker_config.text_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}); got {min(prompt_ids)}..{max(prompt_ids)}")
        params = self.stage_params(sampling_params)
        if len(prompt_ids) + 1 > self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; this model allows at most {self.max_model_len - 1}"
            )
        speaker_id = talker_rows = None
        if "audio" in modalities:
            if not self.speakers:
                raise ValueError("this pipeline has no audio stages; request modalities ['text'] only")
            name = (speaker or self.default_speaker).lower()
            if name not in self.speakers:
                raise ValueError(f"unknown voice {speaker!r}; available: {sorted(self.speakers)}")
            speaker_id = self.speakers[name]
            talker_rows = self.talker_model.prompt_rows_needed(prompt_ids)
        if request_id is None:
            self._counter += 1
            request_id = f"req-{self._counter}"
        self.orchestrator.add_request(
            request_id, prompt_ids, modalities, params["thinker"], params.get("talker"), speaker_id, talker_rows
        )
        return request_id

    def abort(self, request_id: str) -> bool:
        return self.orchestrator.abort(request_id)

    def has_work(self) -> bool:
        return self.orchestrator.has_work()

    def step(self) -> list[RequestDelta]:
        """Run one engine step over every stage; returns the deltas it produced (and any from aborts)."""
        if self.orchestrator.has_work():
            self.orchestrator.step()
        out, self._deltas[:] = list(self._deltas), []
        return out

    def resource_stats(self) -> dict[str, Any]:
        return self.orchestrator.resource_stats()
