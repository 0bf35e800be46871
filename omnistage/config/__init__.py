"""Stage and pipeline configuration, presets, runner selection and validation."""

from omnistage.config.errors import ConfigError, UnsupportedConfigError
from omnistage.config.input_processors import (
    InputProcessorSpec,
    get_input_processor_spec,
    known_input_processors,
    register_input_processor,
)
from omnistage.config.loader import apply_overrides, available_presets, load_pipeline_config
from omnistage.config.runner_selection import ModelCapabilities, resolve_stage_runner, validate_pipeline
from omnistage.config.stage_config import (
    ExecutionType,
    PipelineConfig,
    StageConfig,
    StageSchedulerConfig,
    register_model_arch,
)

__all__ = [
    "ConfigError",
    "ExecutionType",
    "InputProcessorSpec",
    "ModelCapabilities",
    "PipelineConfig",
    "StageConfig",
    "StageSchedulerConfig",
    "UnsupportedConfigError",
    "apply_overrides",
    "available_presets",
    "get_input_processor_spec",
    "known_input_processors",
    "load_pipeline_config",
    "register_input_processor",
    "register_model_arch",
    "resolve_stage_runner",
    "validate_pipeline",
]
