"""The released Qwen3-Omni architecture at any depth as a checkpoint of headers only: its config and processor
files, and safetensors shards whose tensor data are holes (sparse files). What reads only names, shapes and
dtypes (the memory plan, ``omnistage plan``) sees the full 35 B model in a few MB of disk; reading a tensor
gives zeros."""

from __future__ import annotations

import json
import math
import struct
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import Qwen3OmniMoeForConditionalGeneration

from omnistage.checkpoints.config_files import make_hf_config, write_config_files
from omnistage.checkpoints.real import DEFAULT_SHARD_BYTES, REAL_VOCAB, real_preset
from omnistage.checkpoints.weights import hub_tensors


def header_only_checkpoint(out_dir: str | Path, depth: Mapping[str, int] | None = None,
                           max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write ``real_preset(depth)`` (default: the full depth) in bfloat16 as headers and holes; returns the
    directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    probe = out / "hole.probe"  # a filesystem without holes would write the 70 GB
    with open(probe, "wb") as f:
        f.truncate(64 << 20)
    held = probe.stat().st_blocks * 512
    probe.unlink()
    if held >= 1 << 20:
        raise OSError(f"{out}: this filesystem does not keep holes in files (a 64 MiB hole took {held} bytes)")
    _, config = write_config_files(out, real_preset(depth), thinker_vocab=REAL_VOCAB)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        skeleton = Qwen3OmniMoeForConditionalGeneration(make_hf_config(config))
    shapes = {hub: list(value.shape) for name, tensor in skeleton.state_dict().items()
              for hub, value in hub_tensors(name, tensor)}
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(shapes):
        nbytes = 2 * math.prod(shapes[name])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            nbytes = 2 * math.prod(shapes[name])
            header[name] = {"dtype": "BF16", "shape": shapes[name], "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)  # (safetensors aligns the data to 8 bytes)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(8 + len(text) + offset)  # the data: a hole
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index) + "\n")
    return out
