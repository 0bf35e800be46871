"""Speech-to-speech sessions over the OpenAI Realtime API (``WS /v1/realtime``); see ``router``."""

from omnistage.entrypoints.realtime.config import RealtimeLimits
from omnistage.entrypoints.realtime.router import realtime_router

__all__ = ["RealtimeLimits", "realtime_router"]
