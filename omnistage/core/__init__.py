"""Requests, sampling parameters, KV block bookkeeping and the per-stage schedulers."""

from omnistage.core.generation_scheduler import GenerationScheduler, GenerationSchedulerOutput
from omnistage.core.kv_cache import BlockPool, KVCacheManager, KVCacheStats
from omnistage.core.request import Request, RequestStatus, finished_status_for
from omnistage.core.sampling_params import SamplingParams
from omnistage.core.sched_output import Phase, SchedulerOutput
from omnistage.core.scheduler import ARScheduler, RequestUpdate
from omnistage.core.scheduler_config import SchedulerConfig

__all__ = [
    "ARScheduler",
    "BlockPool",
    "GenerationScheduler",
    "GenerationSchedulerOutput",
    "KVCacheManager",
    "KVCacheStats",
    "Phase",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "SamplingParams",
    "SchedulerConfig",
    "SchedulerOutput",
    "finished_status_for",
]
