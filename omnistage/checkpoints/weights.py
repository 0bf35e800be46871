"""Seeded, non-degenerate random weights for a Qwen3-Omni test checkpoint, in the hub's tensor layout.

transformers' own initialisation leaves MoE routers at zero, SnakeBeta parameters at 0 and layer scales
at 1e-2/1e-6, which makes every token route identically and the vocoder nearly silent. Here every tensor
is drawn from its own generator (seeded by the checkpoint seed and the tensor name, so the result does not
depend on iteration order) with a scale chosen per module type so activations keep a stable size through
every stack.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

# Output projections of residual branches: scaled down so the residual stream grows slowly with depth.
_RESIDUAL_OUT = re.compile(r"\.(o_proj|down_proj|out_proj|fc2)\.weight$")
# Output heads: larger than 1/sqrt(fan_in) so the top logits are well separated (fewer near-ties).
_HEADS = re.compile(r"(^|\.)(lm_head(\.\d+)?|codec_head)\.weight$")
# Code2Wav residual units: the second (1x1) conv of each unit, kept small so the three stacked units per
# decoder block do not multiply the signal size; the final 1-channel conv sets the waveform level.
_VOCODER_RESIDUAL = re.compile(r"\.conv2\.conv\.weight$")
_VOCODER_RESIDUAL_GAIN = 0.3
_WAVEFORM_GAIN = 0.08
_HEAD_GAIN = 2.0
_RESIDUAL_GAIN = 0.7
_ROUTER_GAIN = 2.0
_BIAS_STD = 0.02
_NORM_STD = 0.05


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63))
    return g


def _normal(shape: torch.Size, std: float, g: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean


def _uniform(shape: torch.Size, low: float, high: float, g: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=g, dtype=torch.float32) * (high - low) + low


def _init_tensor(name: str, module: nn.Module, attr: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    kind = type(module).__name__
    if attr == "bias":
        return _normal(shape, _BIAS_STD, g)
    if kind.endswith("RMSNorm") or isinstance(module, nn.LayerNorm):
        return _normal(shape, _NORM_STD, g, mean=1.0)
    if kind.endswith("TopKRouter"):
        return _normal(shape, _ROUTER_GAIN / shape[-1] ** 0.5, g)
    if kind.endswith("Experts"):
        # gate_up_proj [E, 2I, H] and down_proj [E, H, I]: fan-in is the last dim.
        gain = _RESIDUAL_GAIN if attr == "down_proj" else 1.0
        return _normal(shape, gain / shape[-1] ** 0.5, g)
    if kind.endswith("SnakeBeta"):
        # Log-scale frequency / magnitude: exp() of these stays within about [0.6, 1.7].
        return _normal(shape, 0.25, g)
    if kind.endswith("LayerScale") or (kind.endswith("ConvNeXtBlock") and attr == "gamma"):
        return _uniform(shape, 0.1, 0.6, g)
    if isinstance(module, nn.Embedding):
        if name.endswith("pos_embed.weight"):
            return _normal(shape, 0.1, g)
        return _normal(shape, 1.0, g)
    if isinstance(module, nn.ConvTranspose1d):
        # weight [in, out/groups, k]; each output sample sees in * k / stride inputs.
        fan_in = shape[0] * shape[2] / module.stride[0]
        return _normal(shape, 1.0 / fan_in**0.5, g)
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        fan_in = 1
        for d in shape[1:]:
            fan_in *= d
        gain = 1.0
        if name.startswith("code2wav.") and _VOCODER_RESIDUAL.search(name):
            gain = _VOCODER_RESIDUAL_GAIN
        elif name.startswith("code2wav.") and shape[0] == 1:
            gain = _WAVEFORM_GAIN
        return _normal(shape, gain / fan_in**0.5, g)
    if isinstance(module, nn.Linear):
        gain = 1.0
        if _HEADS.search(name):
            gain = _HEAD_GAIN
        elif _RESIDUAL_OUT.search(name):
            gain = _RESIDUAL_GAIN
        return _normal(shape, gain / shape[-1] ** 0.5, g)
    raise TypeError(f"no initialisation rule for {name} ({kind}.{attr}, shape {tuple(shape)})")


def init_tensors(model: nn.Module, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded float32 values for every entry of `model.state_dict()` (in-memory names), one at a time.

    `model` may live on the meta device: only names, shapes and module types are used.
    """
    for name, tensor in model.state_dict().items():
        parent, _, attr = name.rpartition(".")
        module = model.get_submodule(parent)
        if attr not in module._parameters:
            raise TypeError(f"persistent buffer {name} has no initialisation rule")
        yield name, _init_tensor(name, module, attr, tensor.shape, _generator(seed, name))


def init_state_dict(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``init_tensors`` as one dict."""
    return dict(init_tensors(model, seed))


def _hub_name(name: str) -> str:
    """In-memory transformers 5.x name -> the name the hub checkpoint stores."""
    for memory, hub in (
        ("thinker.model.language_model.", "thinker.model."),
        ("thinker.model.audio_tower.", "thinker.audio_tower."),
        ("thinker.model.visual.", "thinker.visual."),
    ):
        if name.startswith(memory):
            return hub + name[len(memory) :]
    return name


def hub_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One in-memory tensor as the hub stores it: renamed, and fused MoE experts split into per-expert linear
    weights.

    transformers 5.x fuses `mlp.experts.{e}.{gate,up,down}_proj.weight` on load into
    `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `mlp.experts.down_proj` [E, H, I];
    the hub files hold the per-expert form.
    """
    hub = _hub_name(name)
    if hub.endswith(".mlp.experts.gate_up_proj"):
        base = hub[: -len("gate_up_proj")]
        inter = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"{base}{e}.gate_proj.weight", tensor[e, :inter].clone()
            yield f"{base}{e}.up_proj.weight", tensor[e, inter:].clone()
    elif hub.endswith(".mlp.experts.down_proj"):
        base = hub[: -len("down_proj")]
        for e in range(tensor.shape[0]):
            yield f"{base}{e}.down_proj.weight", tensor[e].clone()
    else:
        yield hub, tensor.contiguous()


def to_hub_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole state dict in the hub's names and layout (``hub_tensors`` of each entry)."""
    return {hub: t for name, tensor in state.items() for hub, t in hub_tensors(name, tensor)}


def write_safetensors(
    tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int | None = None
) -> list[Path]:
    """Write `model.safetensors`, or shards + `model.safetensors.index.json` when the size exceeds the limit.

    Tensors are grouped in sorted-name order, so the output is byte-identical for identical input.
    """
    out_dir = Path(out_dir)
    names = sorted(tensors)
    total = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    if max_shard_bytes is None or total <= max_shard_bytes:
        path = out_dir / "model.safetensors"
        save_file({n: tensors[n] for n in names}, str(path), metadata={"format": "pt"})
        return [path]
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = tensors[n].numel() * tensors[n].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(out_dir / fname), metadata={"format": "pt"})
        paths.append(out_dir / fname)
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths
