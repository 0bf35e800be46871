"""Variants of a built checkpoint for tests: a copy whose config.json is edited and whose tensors are filtered
(the weights otherwise untouched)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file


def checkpoint_variant(src: str | Path, dst: str | Path, edit: Callable[[dict[str, Any]], None],
                       drop: Callable[[str], bool] | None = None) -> Path:
    """Copy checkpoint ``src`` to ``dst``, let ``edit`` change its config.json contents in place, and leave out
    the tensors whose names ``drop`` selects."""
    dst = Path(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if drop is not None:
        for f in dst.glob("*.safetensors"):
            tensors = {k: v for k, v in load_file(str(f)).items() if not drop(k)}
            save_file(tensors, str(f), metadata={"format": "pt"})
    return dst
