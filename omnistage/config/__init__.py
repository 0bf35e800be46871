"""Stage and pipeline configuration, YAML reading, runner selection and validation."""

from omnistage.config.errors import ConfigError, UnsupportedConfigError
from omnistage.config.loader import apply_overrides, parse_pipeline_yaml, read_pipeline_file
from omnistage.config.runner_selection import ModelCapabilities, resolve_stage_runner, validate_pipeline
from omnistage.config.stage_config import ExecutionType, PipelineConfig, StageConfig, without_prefix_caching

__all__ = [
    "ConfigError",
    "ExecutionType",
    "ModelCapabilities",
    "PipelineConfig",
    "StageConfig",
    "UnsupportedConfigError",
    "apply_overrides",
    "parse_pipeline_yaml",
    "read_pipeline_file",
    "resolve_stage_runner",
    "validate_pipeline",
    "without_prefix_caching",
]
