"""Per-stage runner selection and the config-time check of runner/model/session combinations.

A stage may pick its runner ("eager" or "cuda_graph"; the seed's "v1"/"v2"), so stages can move to graphs
one at a time; otherwise it uses the deployment default. Choosing a runner and the model declaring a capability are separate facts that must
hold together, so `validate_pipeline` checks them when the pipeline is built, before any request, rather
than letting a request hang halfway waiting for input that never arrives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from omnistage.config.errors import UnsupportedConfigError
from omnistage.config.stage_config import PipelineConfig, StageConfig


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model part declares it supports."""

    # Returns a valid auxiliary-output tree (non-empty, tensor leaves on the token axis, stable
    # structure), so full-graph capture may keep and rebuild it. Undeclared => no full-graph capture.
    supports_full_graph_aux_outputs: bool = False
    # Can hand data to / take data from neighbouring stages over the CUDA-graph runner's native data plane.
    supports_native_data_plane: bool = False

    def __post_init__(self) -> None:
        for name in ("supports_full_graph_aux_outputs", "supports_native_data_plane"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelCapabilities.{name} must be a bool, got {getattr(self, name)!r}")


def resolve_stage_runner(stage: StageConfig, pipeline: PipelineConfig) -> str:
    """The stage's own runner, else the deployment default."""
    return stage.runner if stage.runner is not None else pipeline.runner


def validate_pipeline(
    pipeline: PipelineConfig, capabilities: Mapping[str, ModelCapabilities]
) -> dict[str, str]:
    """Reject unsupported runner/model/session combinations. Returns stage name -> resolved runner."""
    resolved: dict[str, str] = {}
    for name in pipeline.order:
        stage = pipeline.stage(name)
        runner = resolve_stage_runner(stage, pipeline)

        def reject(field_name: str, reason: str, stage_name: str = name) -> UnsupportedConfigError:
            return UnsupportedConfigError(reason, stage=stage_name, field=field_name)

        caps = capabilities.get(stage.model_part)
        if caps is None:
            raise reject("model_part", f"no capabilities declared for model part {stage.model_part!r}")
        if not isinstance(caps, ModelCapabilities):
            raise reject("model_part", f"capabilities must be ModelCapabilities, got {type(caps).__name__}")

        if stage.data_plane == "native":
            if runner != "cuda_graph":
                raise reject(
                    "data_plane",
                    f"the native data plane exists only in the cuda_graph runner; this stage resolves to {runner!r}",
                )
            if not caps.supports_native_data_plane:
                raise reject(
                    "data_plane",
                    f"model part {stage.model_part!r} does not declare supports_native_data_plane",
                )
            # A native-data-plane stage that receives upstream input is bound to single-turn sessions: in other
            # modes the next turn's input would never be delivered and the request would wait forever.
            if stage.inputs and stage.session_mode != "single_turn":
                raise reject(
                    "session_mode",
                    f"a stage with a native data plane that receives upstream input {list(stage.inputs)} "
                    f"supports only session_mode 'single_turn', got {stage.session_mode!r}",
                )
        resolved[name] = runner
    return resolved
