"""The built-in default model: the tiny checkpoint (seed 0), built on first use into a cache directory."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from omnistage.core.cache_dir import cache_root

DEFAULT_PRESET = "tiny"
DEFAULT_SEED = 0


def builder_fingerprint() -> str:
    """Hash of the builder's sources: a changed builder gets a fresh cache entry, never a stale model."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in ("builder.py", "presets.py", "weights.py", "tokenizer.py", "corpus.py", "shaping.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:12]


def default_model_dir() -> Path:
    """Path of the built-in checkpoint; built atomically (temp dir, then rename) the first time."""
    target = cache_root() / f"{DEFAULT_PRESET}-seed{DEFAULT_SEED}-{builder_fingerprint()}"
    if (target / "config.json").is_file():
        return target
    from omnistage.checkpoints.builder import build_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build_checkpoint(tmp, preset=DEFAULT_PRESET, seed=DEFAULT_SEED)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race only if someone else won it
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
