"""Stage and pipeline configuration: frozen dataclasses that validate themselves on construction.

A pipeline is a DAG of stages. Each stage names the model part it runs, its execution type (which picks
the scheduler + runner classes), its upstream stages and the processor that turns upstream outputs into
its inputs. Everything a typo could break is checked here, before any request runs.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from omnistage.config.errors import ConfigError
from omnistage.config.input_processors import get_input_processor_spec
from omnistage.core.sampling_params import SamplingParams

RUNNER_VERSIONS: tuple[str, ...] = ("v1", "v2")
FINAL_OUTPUTS: tuple[str, ...] = ("text", "audio")
DATA_PLANES: tuple[str, ...] = ("inproc", "native")
SESSION_MODES: tuple[str, ...] = ("single_turn", "multi_turn")

# Model parts each architecture provides; register more with register_model_arch().
_MODEL_ARCH_PARTS: dict[str, tuple[str, ...]] = {"qwen3_omni": ("thinker", "talker", "code2wav")}


def register_model_arch(name: str, parts: tuple[str, ...], *, replace: bool = False) -> None:
    if name in _MODEL_ARCH_PARTS and not replace:
        raise ValueError(f"model arch {name!r} is already registered")
    if not parts or not all(isinstance(p, str) and p for p in parts):
        raise ValueError(f"model arch {name!r}: parts must be non-empty strings")
    _MODEL_ARCH_PARTS[name] = tuple(parts)


def model_arch_parts(name: str) -> tuple[str, ...]:
    try:
        return _MODEL_ARCH_PARTS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model arch {name!r}; known: {sorted(_MODEL_ARCH_PARTS)}", field="model_arch"
        ) from None


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


def _positive_int(value: object, *, stage: str | None, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"must be a positive int, got {value!r}", stage=stage, field=name)


def _reject_unknown_keys(data: Mapping[str, Any], cls: type, *, stage: str | None, what: str) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} must be a mapping, got {type(data).__name__}", stage=stage)
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {what}; allowed: {sorted(allowed)}", stage=stage)


@dataclass(frozen=True)
class StageSchedulerConfig:
    """Batch limits of one stage. A GENERATION stage only uses max_num_seqs."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    block_size: int = 16
    num_blocks: int | None = None  # explicit KV pool size; wins over kv_cache_bytes
    kv_cache_bytes: int | None = None  # KV pool budget in bytes, turned into blocks by the runner

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            _positive_int(getattr(self, name), stage=None, name=f"scheduler.{name}")
        for name in ("num_blocks", "kv_cache_bytes"):
            if getattr(self, name) is not None:
                _positive_int(getattr(self, name), stage=None, name=f"scheduler.{name}")
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ConfigError("set num_blocks or kv_cache_bytes, not both", field="scheduler")

    def blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """KV pool size: explicit count, else the byte budget, else enough for max_num_seqs full sequences."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_bytes is not None:
            _positive_int(bytes_per_block, stage=None, name="bytes_per_block")
            blocks = self.kv_cache_bytes // bytes_per_block
            if blocks < self.blocks_per_seq():
                raise ConfigError(
                    f"kv_cache_bytes={self.kv_cache_bytes} gives {blocks} blocks, fewer than one "
                    f"max_model_len sequence needs ({self.blocks_per_seq()})",
                    field="scheduler.kv_cache_bytes",
                )
            return blocks
        return self.blocks_per_seq() * self.max_num_seqs

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, stage: str | None = None) -> StageSchedulerConfig:
        _reject_unknown_keys(data, cls, stage=stage, what="scheduler")
        try:
            return cls(**data)
        except ConfigError as exc:
            raise exc.with_stage(stage) from None


@dataclass(frozen=True)
class StageConfig:
    name: str
    execution: ExecutionType
    model_part: str
    inputs: tuple[str, ...] = ()  # upstream stage names; empty => the request prompt
    input_processor: str | None = None
    final_output: str | None = None  # "text" | "audio" | None (intermediate stage)
    runner: str | None = None  # None => the pipeline's deployment default
    sampling: SamplingParams = field(default_factory=SamplingParams)
    scheduler: StageSchedulerConfig = field(default_factory=StageSchedulerConfig)
    # Compared but not hashed: a mapping proxy is unhashable, and configs are usable as dict keys.
    processor_args: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    data_plane: str = "inproc"
    session_mode: str = "single_turn"

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

        args = self.processor_args if self.processor_args is not None else {}
        if not isinstance(args, Mapping):
            raise fail("processor_args", f"must be a mapping, got {type(args).__name__}")
        if self.input_processor is None:
            if inputs:
                raise fail("input_processor", f"a stage with inputs {list(inputs)} needs an input processor")
            if args:
                raise fail("processor_args", "given without an input_processor")
            object.__setattr__(self, "processor_args", MappingProxyType({}))
        else:
            if not inputs:
                raise fail("input_processor", "set on a stage without inputs (it reads the request prompt)")
            try:
                spec = get_input_processor_spec(self.input_processor)
                if spec.num_inputs is not None and len(inputs) != spec.num_inputs:
                    raise fail(
                        "inputs",
                        f"processor {spec.name!r} takes {spec.num_inputs} upstream stage(s), got {list(inputs)}",
                    )
                normalised = spec.validate_args(dict(args))
            except ConfigError as exc:
                raise exc.with_stage(stage) from None
            except ValueError as exc:
                raise fail("processor_args", str(exc)) from None
            object.__setattr__(self, "processor_args", MappingProxyType(dict(normalised)))

        if self.final_output is not None and self.final_output not in FINAL_OUTPUTS:
            raise fail(
                "final_output", f"must be one of {list(FINAL_OUTPUTS)} or null, got {self.final_output!r}"
            )
        if self.runner is not None and self.runner not in RUNNER_VERSIONS:
            raise fail("runner", f"unknown runner version {self.runner!r}; known: {list(RUNNER_VERSIONS)}")
        if self.data_plane not in DATA_PLANES:
            raise fail("data_plane", f"must be one of {list(DATA_PLANES)}, got {self.data_plane!r}")
        if self.session_mode not in SESSION_MODES:
            raise fail("session_mode", f"must be one of {list(SESSION_MODES)}, got {self.session_mode!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise fail("sampling", f"must be SamplingParams, got {type(self.sampling).__name__}")
        if not isinstance(self.scheduler, StageSchedulerConfig):
            raise fail("scheduler", f"must be StageSchedulerConfig, got {type(self.scheduler).__name__}")

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

    @property
    def is_source(self) -> bool:
        """Reads the request prompt rather than an upstream stage."""
        return not self.inputs

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageConfig:
        stage = data.get("name") if isinstance(data, Mapping) else None
        stage = stage if isinstance(stage, str) else None
        _reject_unknown_keys(data, cls, stage=stage, what="stage")
        for required in ("name", "execution", "model_part"):
            if required not in data:
                raise ConfigError("is required", stage=stage, field=required)
        kwargs = dict(data)
        if kwargs.get("inputs") is None:
            kwargs["inputs"] = ()
        if kwargs.get("processor_args") is None:
            kwargs["processor_args"] = {}
        sampling = kwargs.get("sampling") or {}
        if not isinstance(sampling, SamplingParams):
            kwargs["sampling"] = _parse_sampling(sampling, stage=stage)
        scheduler = kwargs.get("scheduler") or {}
        if not isinstance(scheduler, StageSchedulerConfig):
            kwargs["scheduler"] = StageSchedulerConfig.from_dict(scheduler, stage=stage)
        return cls(**kwargs)


def _parse_sampling(data: Mapping[str, Any], *, stage: str | None) -> SamplingParams:
    _reject_unknown_keys(data, SamplingParams, stage=stage, what="sampling")
    try:
        return SamplingParams(**data)
    except ValueError as exc:
        raise ConfigError(str(exc), stage=stage, field="sampling") from None


@dataclass(frozen=True)
class PipelineConfig:
    model_arch: str
    stages: tuple[StageConfig, ...]
    runner: str = "v1"  # deployment default for stages that do not choose one
    order: tuple[str, ...] = field(init=False, default=())  # stage names, upstream before downstream

    def __post_init__(self) -> None:
        parts = model_arch_parts(self.model_arch)
        if self.runner not in RUNNER_VERSIONS:
            raise ConfigError(
                f"unknown runner version {self.runner!r}; known: {list(RUNNER_VERSIONS)}", field="runner"
            )
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
            if s.model_part not in parts:
                raise ConfigError(
                    f"model arch {self.model_arch!r} has no part {s.model_part!r}; known: {list(parts)}",
                    stage=s.name,
                    field="model_part",
                )
            for upstream in s.inputs:
                if upstream not in seen:
                    raise ConfigError(
                        f"input {upstream!r} is not a stage of this pipeline; stages: {names}",
                        stage=s.name,
                        field="inputs",
                    )
        if not any(s.final_output is not None for s in stages):
            raise ConfigError(
                "no stage has a final_output; the pipeline would return nothing", field="stages"
            )
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

    @property
    def final_stages(self) -> tuple[StageConfig, ...]:
        return tuple(self.stage(n) for n in self.order if self.stage(n).final_output is not None)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"a pipeline config must be a mapping, got {type(data).__name__}")
        allowed = {"model_arch", "runner", "stages"}
        unknown = sorted(str(k) for k in data if k not in allowed)
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in pipeline config; allowed: {sorted(allowed)}")
        if "model_arch" not in data:
            raise ConfigError("is required", field="model_arch")
        raw_stages = data.get("stages")
        if not isinstance(raw_stages, (list, tuple)):
            raise ConfigError(f"must be a list of stages, got {type(raw_stages).__name__}", field="stages")
        stages = tuple(StageConfig.from_dict(s) for s in raw_stages)
        kwargs: dict[str, Any] = {"model_arch": data["model_arch"], "stages": stages}
        if data.get("runner") is not None:
            kwargs["runner"] = data["runner"]
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
