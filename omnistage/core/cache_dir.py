"""Where omnistage keeps what it builds on a machine (the built-in model, compiled CPU kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$OMNISTAGE_CACHE``, else ``~/.cache/omnistage``."""
    return Path(os.environ.get("OMNISTAGE_CACHE", Path.home() / ".cache" / "omnistage"))
