"""Build a running pipeline from a checkpoint directory + pipeline config, and turn user requests into
stage requests (through the checkpoint's model family).

``OmniEngine`` is synchronous and single-threaded: ``add_request`` / ``abort`` / ``step``. The offline
``Omni`` and the streaming ``AsyncOmni`` (``omnistage.pipeline.omni``) drive it.

Backends (``distributed_executor_backend``): ``inproc`` builds every stage in this process; ``mp`` / ``ray``
run each stage in its own worker (``omnistage.pipeline.workers``) behind a ``RemoteStage`` proxy, so this
process keeps the tokenizer and the orchestrator and loads no weights. The same orchestrator drives both.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.config import (
    ConfigError,
    ExecutionType,
    PipelineConfig,
    validate_pipeline,
    without_prefix_caching,
)
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.family import ModelFamily, PreparedPrompt
from omnistage.models.registry import family_for_checkpoint, load_pipeline_config
from omnistage.pipeline.client import ModelInfo, RequestDelta
from omnistage.pipeline.engine_args import DTYPES, EngineArgs
from omnistage.pipeline.faults import FaultInjector
from omnistage.pipeline.memory_plan import StageMemory, check_fits, plan_memory
from omnistage.pipeline.orchestrator import Orchestrator
from omnistage.pipeline.stage import StepEvents
from omnistage.pipeline.stage_builder import build_stage

logger = logging.getLogger("omnistage.engine")
WORKER_POLL_S = 0.05

Messages = Sequence[Mapping[str, Any]]
Prompt = str | Messages | list[int] | PreparedPrompt


@dataclass(frozen=True)
class EnginePlan:
    """What an engine will run, decided before anything loads: the checkpoint's family, the stages it serves, each
    stage's runner, the backend and each stage's memory (``memory_plan.plan_memory``)."""

    family: ModelFamily
    pipeline: PipelineConfig
    runners: dict[str, str]
    backend: str
    memory: list[StageMemory]


def plan_engine(args: EngineArgs, pipeline: PipelineConfig | None = None) -> EnginePlan:
    """The plan ``OmniEngine(args, pipeline)`` builds from (reads config files and tensor headers only); raises
    ConfigError for a pipeline the checkpoint cannot serve."""
    family_cls = family_for_checkpoint(args.model)
    pipeline = pipeline or load_pipeline_config(args.stage_config or family_cls.name)
    if pipeline.family != family_cls.name:
        raise ConfigError(f"the pipeline config is for model family {pipeline.family!r}, but {args.model} "
                          f"holds a {family_cls.name!r} checkpoint", field="family")
    family = family_cls(args.model)
    pipeline = family.serving_pipeline(family_cls.validate_pipeline(pipeline))
    if not args.enable_prefix_caching:
        pipeline = without_prefix_caching(pipeline)  # before any stage (or worker) is built
    runners = validate_pipeline(pipeline, {p: spec.capabilities for p, spec in family_cls.parts.items()})
    backend = args.distributed_executor_backend or pipeline.distributed_executor_backend
    placement = {s.name: s.devices if s.devices.startswith(("cpu", "cuda")) else f"cuda:{s.devices.split(',')[0]}"
                 for s in pipeline.stages if backend == "mp" and s.devices}
    memory = plan_memory(family, pipeline, DTYPES[args.dtype], args.device, placement, args.quant)
    return EnginePlan(family, pipeline, runners, backend, memory)


class OmniEngine:
    def __init__(
        self,
        args: EngineArgs,
        pipeline: PipelineConfig | None = None,
        on_step: Callable[[StepEvents], None] | None = None,
    ) -> None:
        self.args = args
        plan = plan_engine(args, pipeline)
        self.family, self.pipeline, self.backend, self.memory_plan = plan.family, plan.pipeline, plan.backend, plan.memory
        family_cls, runners = type(self.family), plan.runners
        # Refuse before loading what cannot fit (Ray places stages on other machines: not checked here).
        if self.backend != "ray":
            check_fits(self.memory_plan, dtype=args.dtype, quantization=args.quantization)
        self.workers = None
        self._wake = threading.Event()
        if self.backend == "inproc":
            if any(s.devices or s.threads for s in self.pipeline.stages):
                logger.warning("stage devices/threads take effect only with stage workers (backend mp or ray)")
            faults = FaultInjector.from_env()
            stages = {name: build_stage(self.family, self.pipeline.stage(name), runners[name], args, faults)
                      for name in self.pipeline.order}
        else:
            from omnistage.pipeline.workers import StageWorkers

            self.workers = StageWorkers(self.backend, family_cls, self.pipeline, runners, args)
            stages = self.workers.stages
        self._deltas: list[RequestDelta] = []
        self.orchestrator = Orchestrator(self.pipeline, stages, sink=self._deltas.append, on_step=on_step)
        text = self.pipeline.final_stage("text") or self.pipeline.stage(self.pipeline.order[0])
        ar = {s.name: s.sampling for s in self.pipeline.stages if s.execution is ExecutionType.AR}
        self.info = ModelInfo(
            name=Path(args.model).name,
            family=family_cls.name,
            max_model_len=self.pipeline.stage(self.pipeline.order[0]).scheduler.max_model_len,
            output_modalities=self.orchestrator.output_modalities,
            text_stage=text.name,
            stage_sampling=ar,
            voices=tuple(self.family.voices),
            default_voice=self.family.default_voice,
            sample_rate=self.family.sample_rate,
            num_code_groups=self.family.num_code_groups,
            samples_per_frame=self.family.samples_per_frame,
            vocab_size=self.family.vocab_size,
            input_modalities=tuple(self.family.input_modalities),
            tool_calls=self.family.tool_calls,
        )

    @property
    def tokenizer(self) -> Any:
        return self.family.tokenizer

    # ---- request preparation -----------------------------------------------------------------------
    def render_prompt(self, prompt: Prompt, **options: Any) -> PreparedPrompt:
        """A prompt string, chat messages or token ids -> a prepared prompt (validated). ``options`` go to
        the family's prompt rendering (e.g. ``use_audio_in_video``)."""
        if isinstance(prompt, PreparedPrompt):
            prepared = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prepared = PreparedPrompt(list(prompt))
        else:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if not messages:
                raise ValueError("messages must not be empty")
            prepared = self.family.render_prompt(messages, **options)
        ids = prepared.token_ids
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.family.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}); got {min(ids)}..{max(ids)}")
        if len(ids) + 1 > self.info.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; this model allows at most {self.info.max_model_len - 1}")
        return prepared

    def stage_params(
        self, sampling_params: SamplingParams | Mapping[str, SamplingParams] | None
    ) -> dict[str, SamplingParams]:
        """By AR stage name: stage defaults, overridden by the request (a bare SamplingParams = the text stage)."""
        params = dict(self.info.stage_sampling)
        if sampling_params is None:
            return params
        if isinstance(sampling_params, SamplingParams):
            params[self.info.text_stage] = sampling_params
            return params
        for name, p in sampling_params.items():
            if name not in params:
                raise ValueError(f"sampling_params names unknown stage {name!r}; stages: {sorted(params)}")
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{name!r}] must be a SamplingParams")
            params[name] = p
        return params

    def add_request(
        self,
        prompt: Prompt,
        modalities: Sequence[str] = ("text",),
        sampling_params: SamplingParams | Mapping[str, SamplingParams] | None = None,
        speaker: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and register one request in every stage it needs; returns its id."""
        modalities = tuple(dict.fromkeys(modalities))
        if not modalities or "text" not in modalities:
            raise ValueError(f"modalities must include 'text' (e.g. ['text'] or ['text', 'audio']), got "
                             f"{list(modalities)}")
        stage_names = self.orchestrator.stages_for(modalities)
        prepared = self.render_prompt(prompt)
        params = self.stage_params(sampling_params)
        if speaker is not None and speaker.lower() not in self.info.voices:
            raise ValueError(f"unknown voice {speaker!r}; available: {sorted(self.info.voices)}")
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        stages = [self.pipeline.stage(n) for n in stage_names]
        requests = self.family.stage_requests(request_id, prepared, stages, params, speaker)
        self.orchestrator.add_request(request_id, requests)
        return request_id

    def abort(self, request_id: str) -> bool:
        return self.orchestrator.abort(request_id)

    def has_work(self) -> bool:
        """A stage has work, a request is in flight, or deltas (e.g. of an abort) wait for ``step``."""
        return bool(self._deltas) or self.orchestrator.has_work()

    def step(self) -> list[RequestDelta]:
        """Run one engine step over every stage; returns the deltas it produced (and any from aborts).

        With stage workers, a step routes the steps the workers have sent; when none has arrived it first
        waits up to ``WORKER_POLL_S`` for one (``wake`` cuts that short), so a loop of steps does not spin.
        A dead or failed worker raises ``StageWorkerError``.
        """
        if self.workers is not None:
            self.workers.check()
            if not self._deltas and not any(s.has_work() for s in self.workers.stages.values()):
                self.workers.wait(WORKER_POLL_S)
        if self.orchestrator.has_work():
            self.orchestrator.step()
        out, self._deltas[:] = list(self._deltas), []
        return out

    def wait(self, timeout: float) -> None:
        """Idle until ``timeout`` passes, ``wake`` is called or (with workers) a worker sends something;
        with workers this also watches them (a dead one raises ``StageWorkerError``)."""
        if self.workers is not None:
            self.workers.wait(timeout)
        else:
            self._wake.wait(timeout)
            self._wake.clear()

    def wake(self) -> None:
        """Cut a ``wait`` (or a step's wait for workers) short; thread-safe."""
        if self.workers is not None:
            self.workers.wake()
        else:
            self._wake.set()

    def shutdown(self) -> None:
        """Stop the stage workers, if any (bounded; also done at interpreter exit)."""
        if self.workers is not None:
            self.workers.close()

    def num_waiting(self) -> int:
        """Requests admitted but not yet running in the stage that reads the prompt."""
        stage = self.orchestrator.stages[self.pipeline.order[0]]
        cheap = getattr(stage, "num_waiting", None)  # a remote stage answers without a round trip
        return int(cheap() if cheap is not None else stage.stats().get("waiting", 0))

    def resource_stats(self) -> dict[str, Any]:
        return self.orchestrator.resource_stats()
