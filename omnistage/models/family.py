"""The model-family plug-in interface: what a family package (``omnistage/models/<family>/``) provides and
what the runtime offers it back.

A family declares its model parts (execution type, capabilities, how to build each from a checkpoint), its
bridges (how one part's outputs become the next part's inputs), its packaged pipeline preset, and the
request side: tokenizer, prompt rendering, voices, and the per-stage request each user request becomes.
The runtime (pipeline/) knows no family and no stage name: it walks the configured stage graph and calls
this interface. Everything that crosses it per request is plain data (ids, tensors, small dataclasses), so a
stage can live in another process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

import torch

from omnistage.config import ConfigError, ExecutionType, ModelCapabilities, PipelineConfig, StageConfig
from omnistage.config.quantization import NO_QUANTIZATION, Quantization
from omnistage.config.stage_config import producing
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.layers.quant_layers import QuantScheme
from omnistage.models.tool_calls import ToolCallFormat

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageRequest:
    """One user request as one stage sees it."""

    req_id: str
    sampling_params: SamplingParams | None = None  # AR stages
    prompt_token_ids: tuple[int, ...] | None = None  # None: the stage's input comes from upstream
    eos_token_ids: tuple[int, ...] = ()
    # Family-specific plain data: the stage's model gets it as initial per-request state, its bridge too.
    data: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


class ARStageInputs(Protocol):
    """What an AR stage offers the bridge of its incoming edge (all per request)."""

    def append_tokens(self, req_id: str, token_ids: Sequence[int], finished: bool) -> None: ...

    def update_state(self, req_id: str, update: Mapping[str, Any]) -> None: ...

    def state(self, req_id: str) -> Mapping[str, Any]: ...

    def finish(self, req_id: str, reason: str) -> None: ...


class GenerationStageInputs(Protocol):
    """What a generation stage offers the bridge of its incoming edge."""

    def add_payload(self, req_id: str, payload: Any, finished: bool) -> None: ...

    def finish(self, req_id: str, reason: str) -> None: ...


class Bridge(Protocol):
    """Turns an upstream stage's per-request outputs into this stage's inputs. Lives with the downstream
    stage; its per-request state is created by ``add_request`` and dropped by ``drop`` (finish or abort)."""

    def add_request(self, req_id: str, data: Mapping[str, Any]) -> None: ...

    def on_input(self, req_id: str, payload: Mapping[str, Any], sink: Any) -> None: ...

    def on_end(self, req_id: str, sink: Any) -> None: ...

    def drop(self, req_id: str) -> None: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class BuildContext:
    """What building one stage's model needs."""

    model_dir: Path
    dtype: torch.dtype
    device: str
    stage: StageConfig
    fast: bool = False  # faster kernels whose rounding may differ from the reference
    quantization: Quantization = NO_QUANTIZATION  # this stage's weight quantization (the family's quant_scheme)


@dataclass(frozen=True)
class PartSpec:
    execution: ExecutionType
    capabilities: ModelCapabilities = field(default_factory=ModelCapabilities)
    # Checkpoint name prefixes of the weights the part holds while it serves, less those under weight_skip (its
    # memory plan); float32_weights: held in float32 whatever the serving dtype.
    weight_prefixes: tuple[str, ...] = ()
    weight_skip: tuple[str, ...] = ()
    float32_weights: bool = False


@dataclass(frozen=True)
class BridgeSpec:
    # Normalises a stage's bridge_args (fills defaults); raises ValueError naming the bad key.
    validate_args: Callable[[Mapping[str, Any]], Mapping[str, Any]]
    num_inputs: int = 1


@dataclass(frozen=True)
class PreparedPrompt:
    """A rendered prompt: token ids plus family-specific per-request data (e.g. media features)."""

    token_ids: list[int]
    data: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


def no_args(args: Mapping[str, Any]) -> Mapping[str, Any]:
    if args:
        raise ValueError(f"takes no bridge_args, got {sorted(args)}")
    return MappingProxyType({})


def thinker_layout(model_dir: str | Path, thinker_architecture: str,
                   parts: Mapping[str, PartSpec]) -> tuple[str, Mapping[str, PartSpec]]:
    """The Thinker's tensor-name prefix in a checkpoint and the parts' weights: ``thinker.`` in the whole model's,
    none in the Thinker's own (transformers' Thinker class saved alone, e.g. a fine-tuned Thinker: config.json's
    ``architectures`` names ``thinker_architecture``, its config is the thinker_config), where part ``thinker``
    then holds every tensor."""
    path = Path(model_dir) / "config.json"
    architectures = (json.loads(path.read_text("utf-8")).get("architectures") or []) if path.is_file() else []
    if thinker_architecture not in architectures:
        return "thinker.", parts
    return "", {**parts, "thinker": dataclasses.replace(parts["thinker"], weight_prefixes=("",))}


class ModelFamily(ABC):
    """Subclass per family; one instance per checkpoint directory and process.

    Class attributes declare the family; the instance reads the checkpoint's config (cheap) and, on the
    API side, its tokenizer. ``build_model`` / ``build_bridge`` run where the stage runs.
    """

    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]  # config.json "architectures" this family serves
    parts: Mapping[str, PartSpec]  # declared per class; an instance may narrow a part's weights (thinker_layout)
    bridges: ClassVar[Mapping[str, BridgeSpec]]
    preset_file: ClassVar[str]  # packaged YAML next to the family's modules
    # Dataclasses the family puts in per-request values (StageRequest.data, payloads, outputs): a stage in
    # another process gets them rebuilt by name; any other object is refused there.
    wire_types: ClassVar[tuple[type, ...]] = ()

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)

    # Whether the checkpoint speaks: a family reads it from its config (``enable_audio_output: false``, as the
    # text-only releases have, means no Talker or vocoder weights; transformers then builds the Thinker alone).
    speaks: bool = True

    def serving_pipeline(self, pipeline: PipelineConfig) -> PipelineConfig:
        """The stages this checkpoint runs: all of ``pipeline``'s, or where it does not speak only those
        producing text (requests for audio are then refused naming the modality)."""
        if self.speaks or pipeline.final_stage("audio") is None:
            return pipeline
        logger.info("%s does not speak (enable_audio_output is false): serving text only", self.model_dir)
        return producing(pipeline, ("text",))

    # ---- declaration --------------------------------------------------------------------------------
    @classmethod
    def preset_text(cls) -> str:
        return resources.files(cls.__module__.rsplit(".", 1)[0]).joinpath(cls.preset_file).read_text("utf-8")

    @classmethod
    def validate_pipeline(cls, pipeline: PipelineConfig) -> PipelineConfig:
        """Check the stage graph against this family (parts, kinds, bridges, bridge args); returns the
        pipeline with normalised bridge args. Raises ConfigError naming the stage and field."""
        stages = []
        for s in pipeline.stages:
            part = cls.parts.get(s.model_part)
            if part is None:
                raise ConfigError(f"family {cls.name!r} has no part {s.model_part!r}; known: {sorted(cls.parts)}",
                                  stage=s.name, field="model_part")
            if part.execution is not s.execution:
                raise ConfigError(f"part {s.model_part!r} runs as {part.execution.value!r}, not "
                                  f"{s.execution.value!r}", stage=s.name, field="execution")
            if s.bridge is not None:
                spec = cls.bridges.get(s.bridge)
                if spec is None:
                    raise ConfigError(f"family {cls.name!r} has no bridge {s.bridge!r}; known: {sorted(cls.bridges)}",
                                      stage=s.name, field="bridge")
                if len(s.inputs) != spec.num_inputs:
                    raise ConfigError(f"bridge {s.bridge!r} takes {spec.num_inputs} upstream stage(s), got "
                                      f"{list(s.inputs)}", stage=s.name, field="inputs")
                try:
                    args = spec.validate_args(dict(s.bridge_args))
                except ValueError as exc:
                    raise ConfigError(str(exc), stage=s.name, field="bridge_args") from None
                s = dataclasses.replace(s, bridge_args=args)
            stages.append(s)
        return dataclasses.replace(pipeline, stages=tuple(stages))

    # ---- stage side ---------------------------------------------------------------------------------
    @abstractmethod
    def build_model(self, ctx: BuildContext) -> Any:
        """The stage model for ``ctx.stage.model_part`` (an ARStageModel or a GenerationStageModel)."""

    @abstractmethod
    def build_bridge(self, name: str, model: Any, args: Mapping[str, Any]) -> Bridge:
        """The bridge ``name`` feeding ``model`` (the downstream stage's model)."""

    def weight_dtype(self, part: str, dtype: torch.dtype, device: str) -> torch.dtype:
        """The dtype ``part`` holds its weights (and computes) in when the engine serves in ``dtype`` on
        ``device`` (the memory plan and the build agree on it): float32 for a ``float32_weights`` part, else
        ``dtype``."""
        return torch.float32 if self.parts[part].float32_weights else dtype

    def quant_scheme(self, part: str, quantization: Quantization) -> QuantScheme | None:
        """Which of ``part``'s checkpoint weights (names relative to its prefix) ``quantization`` quantizes, in
        which format; None when it quantizes none. Raises ValueError where the family cannot quantize."""
        if quantization.enabled:
            raise ValueError(f"model family {self.name!r} does not support weight quantization "
                             f"({quantization.method!r})")
        return None

    def kv_geometry(self, part: str) -> tuple[int, int, int] | None:
        """(layers, KV heads, head size) of an AR part's paged KV cache, from the checkpoint's config, for the
        memory plan before anything loads; None where unknown (the plan then counts no KV for it)."""
        return None

    # ---- request side -------------------------------------------------------------------------------
    @property
    @abstractmethod
    def tokenizer(self) -> Any: ...

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Prompt token ids must lie in [0, vocab_size)."""

    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    input_modalities: tuple[str, ...] = ("text",)  # what prompts may hold (e.g. + "audio", "image", "video")
    sample_rate: int | None = None  # of the audio output, when the family speaks
    num_code_groups: int | None = None  # codec codes per frame, when the family emits codes
    samples_per_frame: int | None = None  # output audio samples per codec frame, when the family speaks
    # How tool definitions, calls and results are written for the model and calls read back from its text;
    # None: the family's model does not call tools.
    tool_calls: ClassVar[ToolCallFormat | None] = None

    @abstractmethod
    def render_prompt(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> PreparedPrompt:
        """Chat messages -> prompt. Raises ValueError naming what is wrong. The built-in families take
        ``answer_prefix``: text the answer is made to begin with, written after the assistant header (the
        model's tokens continue it; such a prompt is for text output only: a Talker needs the prompt to end
        with the header)."""

    @abstractmethod
    def stage_requests(
        self,
        req_id: str,
        prompt: PreparedPrompt,
        stages: Sequence[StageConfig],
        params: Mapping[str, SamplingParams],
        voice: str | None,
    ) -> dict[str, StageRequest]:
        """The per-stage requests of one user request that visits ``stages`` (topological order);
        ``params`` by stage name. Raises ValueError for a request these stages cannot serve."""


class HFChatFamily(ModelFamily):
    """The request side shared by families whose checkpoint is a Hugging Face directory: its tokenizer,
    its EOS ids (generation_config.json, else the tokenizer's), and chat-template rendering."""

    roles: ClassVar[tuple[str, ...]] = ("system", "user", "assistant")

    @cached_property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, rendering with the chat template transformers' processor loads: its legacy
        ``chat_template.json`` first, else ``chat_template.jinja``, else the tokenizer's own."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        legacy, jinja = self.model_dir / "chat_template.json", self.model_dir / "chat_template.jinja"
        if legacy.is_file():
            tokenizer.chat_template = json.loads(legacy.read_text(encoding="utf-8"))["chat_template"]
        elif jinja.is_file():
            tokenizer.chat_template = jinja.read_text(encoding="utf-8")
        return tokenizer

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        path = self.model_dir / "generation_config.json"
        if path.is_file():
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            if eos is not None:
                return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"{self.model_dir}: no eos_token_id in generation_config.json or the tokenizer")
        return (int(self.tokenizer.eos_token_id),)

    def check_roles(self, messages: Sequence[Mapping[str, Any]]) -> None:
        for m in messages:
            if m.get("role") not in self.roles:
                raise ValueError(f"unsupported message role {m.get('role')!r}; roles: {list(self.roles)}")

    def check_chat_template(self) -> None:
        """Raises ValueError where the checkpoint has no chat template to render messages with."""
        if not self.tokenizer.chat_template:
            raise ValueError(f"the checkpoint {self.model_dir.name} has no chat template to render messages with "
                             "(none in tokenizer_config.json, chat_template.jinja or chat_template.json)")

    def chat_template_ids(self, messages: Sequence[Mapping[str, Any]], answer_prefix: str = "") -> list[int]:
        """Text-only messages rendered with the checkpoint's chat template, assistant header appended (then
        ``answer_prefix``, tokenized)."""
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids) + (self.tokenizer.encode(answer_prefix, add_special_tokens=False) if answer_prefix else [])
