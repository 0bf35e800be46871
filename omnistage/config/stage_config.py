"""Stage and pipeline configuration: frozen dataclasses that validate themselves on construction.

A pipeline is a DAG of stages. Each stage names the model part it runs (of the pipeline's model family),
its execution type (which picks the scheduler + runner classes), its upstream stages and the bridge that
turns upstream outputs into its inputs. Everything a typo could break is checked here, before any model is
loaded; what only the family knows (its parts, its bridges and their arguments, capabilities) is checked
against the family when the engine is built (``runner_selection.validate_pipeline``), still before any
request runs.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from omnistage.config.errors import ConfigError
from omnistage.config.quantization import check_method
from omnistage.core.sampling_params import SamplingParams
from omnistage.core.scheduler_config import SchedulerConfig

# Runner kinds: "eager" (plain torch every step) and "cuda_graph" (decode steps captured per batch bucket).
# The seed's names "v1" / "v2" are accepted as aliases.
RUNNERS: tuple[str, ...] = ("eager", "cuda_graph")
RUNNER_ALIASES: Mapping[str, str] = MappingProxyType({"v1": "eager", "v2": "cuda_graph"})
FINAL_OUTPUTS: tuple[str, ...] = ("text", "audio")
DATA_PLANES: tuple[str, ...] = ("inproc", "native")
SESSION_MODES: tuple[str, ...] = ("single_turn", "multi_turn")
# Where stages run: all in the API process, one worker process per stage, or one Ray actor per stage.
EXECUTOR_BACKENDS: tuple[str, ...] = ("inproc", "mp", "ray")
# A stage worker's devices: "cpu", "cuda", "cuda:N" or a CUDA device list "N[,M...]".
_DEVICES = re.compile(r"cpu|cuda(:\d+)?|\d+(,\d+)*")
# Older key names still read from YAML files.
_STAGE_KEY_ALIASES = {"input_processor": "bridge", "processor_args": "bridge_args"}


class ExecutionType(enum.Enum):
    AR = "ar"  # token budget, KV cache, logits, sampling
    GENERATION = "generation"  # one model call per request input, no sampler

    @classmethod
    def parse(cls, value: ExecutionType | str) -> ExecutionType:
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value.lower() == member.value:
                    return member
        raise ValueError(f"must be one of {[m.value for m in cls]}, got {value!r}")


def canonical_runner(value: str) -> str:
    """'eager' | 'cuda_graph' (aliases 'v1' | 'v2')."""
    if isinstance(value, str):
        value = RUNNER_ALIASES.get(value, value)
        if value in RUNNERS:
            return value
    raise ValueError(f"unknown runner {value!r}; known: {list(RUNNERS)} (aliases {dict(RUNNER_ALIASES)})")


def _reject_unknown_keys(data: Mapping[str, Any], cls: type, *, stage: str | None, what: str) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} must be a mapping, got {type(data).__name__}", stage=stage)
    allowed = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {what}; allowed: {sorted(allowed)}", stage=stage)


def _build(cls: type, data: Mapping[str, Any], *, stage: str | None, what: str) -> Any:
    _reject_unknown_keys(data, cls, stage=stage, what=what)
    try:
        return cls(**data)
    except ValueError as exc:
        raise ConfigError(str(exc), stage=stage, field=what) from None


@dataclass(frozen=True)
class StageConfig:
    name: str
    execution: ExecutionType
    model_part: str
    inputs: tuple[str, ...] = ()  # upstream stage names; empty => the request prompt
    bridge: str | None = None  # the family's bridge for the incoming edge(s)
    final_output: str | None = None  # "text" | "audio" | None (intermediate stage)
    runner: str | None = None  # None => the pipeline's deployment default
    sampling: SamplingParams = field(default_factory=SamplingParams)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Compared but not hashed: a mapping proxy is unhashable, and configs are usable as dict keys.
    bridge_args: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    data_plane: str = "inproc"
    session_mode: str = "single_turn"
    # Placement of the stage's worker (backends "mp" / "ray"; the in-process backend ignores them).
    devices: str | None = None  # None: the engine's device
    threads: int | None = None  # torch threads; None: the host's cores split between the workers
    resources: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}), hash=False)  # Ray
    quantization: str | None = None  # none | int8 | int4 for this stage's weights; None: the engine's option

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"stage name must be a non-empty str, got {self.name!r}", field="name")
        stage = self.name

        def fail(field_name: str, message: str) -> ConfigError:
            return ConfigError(message, stage=stage, field=field_name)

        try:
            object.__setattr__(self, "execution", ExecutionType.parse(self.execution))
        except ValueError as exc:
            raise fail("execution", str(exc)) from None
        if not isinstance(self.model_part, str) or not self.model_part:
            raise fail("model_part", f"must be a non-empty str, got {self.model_part!r}")

        inputs = self.inputs
        if isinstance(inputs, str) or not isinstance(inputs, (list, tuple)):
            raise fail("inputs", f"must be a list of stage names, got {inputs!r}")
        inputs = tuple(inputs)
        if not all(isinstance(i, str) and i for i in inputs):
            raise fail("inputs", f"must hold non-empty stage names, got {list(inputs)}")
        if len(set(inputs)) != len(inputs):
            raise fail("inputs", f"lists a stage twice: {list(inputs)}")
        if stage in inputs:
            raise fail("inputs", "a stage cannot consume its own output")
        object.__setattr__(self, "inputs", inputs)

        args = self.bridge_args if self.bridge_args is not None else {}
        if not isinstance(args, Mapping):
            raise fail("bridge_args", f"must be a mapping, got {type(args).__name__}")
        if self.bridge is None:
            if inputs:
                raise fail("bridge", f"a stage with inputs {list(inputs)} needs a bridge")
            if args:
                raise fail("bridge_args", "given without a bridge")
        elif not isinstance(self.bridge, str) or not self.bridge:
            raise fail("bridge", f"must be a non-empty str, got {self.bridge!r}")
        elif not inputs:
            raise fail("bridge", "set on a stage without inputs (it reads the request prompt)")
        object.__setattr__(self, "bridge_args", MappingProxyType(dict(args)))

        if self.final_output is not None and self.final_output not in FINAL_OUTPUTS:
            raise fail("final_output", f"must be one of {list(FINAL_OUTPUTS)} or null, got {self.final_output!r}")
        if self.runner is not None:
            try:
                object.__setattr__(self, "runner", canonical_runner(self.runner))
            except ValueError as exc:
                raise fail("runner", str(exc)) from None
        if self.data_plane not in DATA_PLANES:
            raise fail("data_plane", f"must be one of {list(DATA_PLANES)}, got {self.data_plane!r}")
        if self.session_mode not in SESSION_MODES:
            raise fail("session_mode", f"must be one of {list(SESSION_MODES)}, got {self.session_mode!r}")
        if self.devices is not None and not (isinstance(self.devices, str) and _DEVICES.fullmatch(self.devices)):
            raise fail("devices", f"must be 'cpu', 'cuda', 'cuda:N' or a CUDA device list like '0,1', got "
                                  f"{self.devices!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise fail("threads", f"must be a positive int, got {self.threads!r}")
        resources = self.resources if self.resources is not None else {}
        if not isinstance(resources, Mapping):
            raise fail("resources", f"must map Ray resource names to amounts, got {type(resources).__name__}")
        for key, amount in resources.items():
            if (not isinstance(key, str) or not key or isinstance(amount, bool)
                    or not isinstance(amount, (int, float)) or not math.isfinite(amount) or amount <= 0):
                raise fail("resources", f"must map resource names to positive amounts, got {key!r}: {amount!r}")
        object.__setattr__(self, "resources", MappingProxyType(dict(resources)))
        if self.quantization is not None:
            try:
                check_method(self.quantization)
            except ValueError as exc:
                raise fail("quantization", str(exc)) from None
        if not isinstance(self.sampling, SamplingParams):
            raise fail("sampling", f"must be SamplingParams, got {type(self.sampling).__name__}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise fail("scheduler", f"must be SchedulerConfig, got {type(self.scheduler).__name__}")

        if self.execution is ExecutionType.AR:
            sched = self.scheduler
            # Every running request needs at least one token of budget per decode step.
            if sched.max_num_batched_tokens < sched.max_num_seqs:
                raise fail(
                    "scheduler.max_num_batched_tokens",
                    f"({sched.max_num_batched_tokens}) must be >= max_num_seqs ({sched.max_num_seqs})",
                )
            # Room for at least one prompt token plus max_tokens generated tokens.
            if self.sampling.max_tokens >= sched.max_model_len:
                raise fail(
                    "sampling.max_tokens",
                    f"({self.sampling.max_tokens}) must be < scheduler.max_model_len ({sched.max_model_len})",
                )

    def to_dict(self) -> dict[str, Any]:
        """Plain data that ``from_dict`` turns back into an equal config (e.g. for a stage worker)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (SamplingParams, SchedulerConfig)):
                value = dataclasses.asdict(value)
            elif isinstance(value, ExecutionType):
                value = value.value
            elif isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageConfig:
        stage = data.get("name") if isinstance(data, Mapping) else None
        stage = stage if isinstance(stage, str) else None
        if isinstance(data, Mapping):
            data = {_STAGE_KEY_ALIASES.get(k, k): v for k, v in data.items()}
        _reject_unknown_keys(data, cls, stage=stage, what="stage")
        for required in ("name", "execution", "model_part"):
            if required not in data:
                raise ConfigError("is required", stage=stage, field=required)
        kwargs = dict(data)
        if kwargs.get("inputs") is None:
            kwargs["inputs"] = ()
        if kwargs.get("bridge_args") is None:
            kwargs["bridge_args"] = {}
        if kwargs.get("resources") is None:
            kwargs["resources"] = {}
        sampling = kwargs.get("sampling") or {}
        if not isinstance(sampling, SamplingParams):
            kwargs["sampling"] = _build(SamplingParams, sampling, stage=stage, what="sampling")
        scheduler = kwargs.get("scheduler") or {}
        if not isinstance(scheduler, SchedulerConfig):
            kwargs["scheduler"] = _build(SchedulerConfig, scheduler, stage=stage, what="scheduler")
        return cls(**kwargs)


@dataclass(frozen=True)
class PipelineConfig:
    family: str  # the model family whose parts the stages run (e.g. the one config.json names)
    stages: tuple[StageConfig, ...]
    runner: str = "eager"  # deployment default for stages that do not choose one
    distributed_executor_backend: str = "inproc"  # where stages run (EngineArgs may override)
    order: tuple[str, ...] = field(init=False, default=())  # stage names, upstream before downstream

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise ConfigError(f"must be a non-empty str, got {self.family!r}", field="family")
        try:
            object.__setattr__(self, "runner", canonical_runner(self.runner))
        except ValueError as exc:
            raise ConfigError(str(exc), field="runner") from None
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(f"must be one of {list(EXECUTOR_BACKENDS)}, got {self.distributed_executor_backend!r}",
                              field="distributed_executor_backend")
        stages = self.stages
        if isinstance(stages, StageConfig) or not isinstance(stages, (list, tuple)):
            raise ConfigError(f"must be a list of stages, got {type(stages).__name__}", field="stages")
        stages = tuple(stages)
        if not stages:
            raise ConfigError("a pipeline needs at least one stage", field="stages")
        for s in stages:
            if not isinstance(s, StageConfig):
                raise ConfigError(f"must hold StageConfig objects, got {type(s).__name__}", field="stages")
        object.__setattr__(self, "stages", stages)

        names = [s.name for s in stages]
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ConfigError("duplicate stage name", stage=name, field="name")
            seen.add(name)
        for s in stages:
            for upstream in s.inputs:
                if upstream not in seen:
                    raise ConfigError(
                        f"input {upstream!r} is not a stage of this pipeline; stages: {names}",
                        stage=s.name,
                        field="inputs",
                    )
        outputs = [s.final_output for s in stages if s.final_output is not None]
        if not outputs:
            raise ConfigError("no stage has a final_output; the pipeline would return nothing", field="stages")
        if len(set(outputs)) != len(outputs):
            raise ConfigError(f"two stages produce the same final output: {outputs}", field="final_output")
        object.__setattr__(self, "order", _topological_order(stages))

    def stage(self, name: str) -> StageConfig:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage named {name!r}; stages: {[s.name for s in self.stages]}")

    def downstream(self, name: str) -> tuple[str, ...]:
        """Stages that consume `name`'s output, in topological order."""
        self.stage(name)
        return tuple(n for n in self.order if name in self.stage(n).inputs)

    def upstream_closure(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """``names`` and every stage they depend on, in topological order."""
        needed: set[str] = set()
        todo = list(names)
        while todo:
            n = todo.pop()
            if n not in needed:
                needed.add(n)
                todo.extend(self.stage(n).inputs)
        return tuple(n for n in self.order if n in needed)

    def final_stage(self, output: str) -> StageConfig | None:
        """The stage whose final output is ``output`` ("text" / "audio"), if any."""
        for s in self.stages:
            if s.final_output == output:
                return s
        return None

    @property
    def final_stages(self) -> tuple[StageConfig, ...]:
        return tuple(self.stage(n) for n in self.order if self.stage(n).final_output is not None)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"a pipeline config must be a mapping, got {type(data).__name__}")
        data = dict(data)
        if "model_arch" in data and "family" not in data:  # older name of the key
            data["family"] = data.pop("model_arch")
        allowed = {"family", "runner", "stages", "distributed_executor_backend"}
        unknown = sorted(str(k) for k in data if k not in allowed)
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in pipeline config; allowed: {sorted(allowed)}")
        if "family" not in data:
            raise ConfigError("is required", field="family")
        raw_stages = data.get("stages")
        if not isinstance(raw_stages, (list, tuple)):
            raise ConfigError(f"must be a list of stages, got {type(raw_stages).__name__}", field="stages")
        stages = tuple(StageConfig.from_dict(s) for s in raw_stages)
        kwargs: dict[str, Any] = {"family": data["family"], "stages": stages}
        for key in ("runner", "distributed_executor_backend"):
            if data.get(key) is not None:
                kwargs[key] = data[key]
        return cls(**kwargs)


def _topological_order(stages: tuple[StageConfig, ...]) -> tuple[str, ...]:
    """Kahn's algorithm; ties keep declaration order so the order is deterministic."""
    pending = {s.name: set(s.inputs) for s in stages}
    order: list[str] = []
    while pending:
        ready = [s.name for s in stages if s.name in pending and not pending[s.name]]
        if not ready:
            cycle = sorted(pending)
            raise ConfigError(f"stage inputs form a cycle among {cycle}", stage=cycle[0], field="inputs")
        for name in ready:
            del pending[name]
            order.append(name)
        for deps in pending.values():
            deps.difference_update(ready)
    return tuple(order)


def producing(pipeline: PipelineConfig, outputs: tuple[str, ...]) -> PipelineConfig:
    """The pipeline cut to the stages producing ``outputs`` (final outputs, e.g. ("text",)) and those they read."""
    finals = [s.name for s in pipeline.stages if s.final_output in outputs]
    if not finals:
        raise ConfigError(f"no stage produces any of {list(outputs)}", field="final_output")
    keep = set(pipeline.upstream_closure(tuple(finals)))
    stages = tuple(dataclasses.replace(s, final_output=s.final_output if s.final_output in outputs else None)
                   for s in pipeline.stages if s.name in keep)
    return dataclasses.replace(pipeline, stages=stages)


def without_prefix_caching(pipeline: PipelineConfig) -> PipelineConfig:
    """The pipeline with prefix caching off in every AR stage (``--no-enable-prefix-caching``)."""
    stages = tuple(
        dataclasses.replace(s, scheduler=dataclasses.replace(s.scheduler, enable_prefix_caching=False))
        if s.execution is ExecutionType.AR else s
        for s in pipeline.stages
    )
    return dataclasses.replace(pipeline, stages=stages)
