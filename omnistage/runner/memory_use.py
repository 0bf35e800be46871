"""What a loaded stage holds, measured: bytes of weights per component and of the KV pool.

The memory plan (``pipeline.memory_plan``) predicts these from the checkpoint's headers before anything loads;
this counts what is actually there after the load (packing included: oneDNN's opaque packed weights, the CPU
kernels' panels, kept as parameters, buffers or plain tensor attributes of the modules), for ``/metrics`` and the benchmarks. A tensor shared by two components (tied embeddings) is
counted once, under the first that holds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any

import torch
from torch import nn


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _key(t: torch.Tensor) -> tuple[int, int]:
    # A tensor is its start address and size (views of one storage, e.g. fused weights, are distinct; a tied
    # weight is the same); opaque (oneDNN-packed) tensors have no address to compare, each is its own.
    return (id(t), -1) if t.is_mkldnn else (t.data_ptr(), t.numel())


def held_modules(stage_model: Any) -> Iterator[tuple[str, nn.Module, bool]]:
    """The modules a stage model holds, by attribute path, and whether to split them into their children: its
    own module attributes (split), and those of its omnistage helper objects one level deep, e.g. the Thinker's
    media encoders (counted whole). A stage model that is a module is split itself."""
    if isinstance(stage_model, nn.Module):
        yield type(stage_model).__name__.lower(), stage_model, True
        return
    for name, value in vars(stage_model).items():
        if isinstance(value, nn.Module):
            yield name, value, True
        elif type(value).__module__.startswith("omnistage"):
            for sub, inner in vars(value).items():
                if isinstance(inner, nn.Module):
                    yield f"{name}.{sub}", inner, False


def _component(name: str, tensor_name: str, split: bool) -> str:
    parts = tensor_name.split(".")[:-1]
    while parts and parts[0] == "model":  # look through transformers-style wrappers
        parts = parts[1:]
    return f"{name}.{parts[0]}" if split and parts else name


def _attribute_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors a module keeps in plain attributes rather than as parameters or buffers (the ``fast`` option's
    packed copies: expert panels, per-expert oneDNN weights, packed heads; quantized weights), in lists, tuples and
    dataclasses too."""
    for sub_name, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if attr.startswith("_"):
                continue
            stack = [value]
            while stack:
                v = stack.pop()
                if isinstance(v, torch.Tensor):
                    yield f"{sub_name}.{attr}" if sub_name else attr, v
                elif isinstance(v, (list, tuple)):
                    stack.extend(v)
                elif dataclasses.is_dataclass(v) and not isinstance(v, type):  # e.g. a quantized weight's parts
                    stack.extend(getattr(v, f.name) for f in dataclasses.fields(v))


def weight_bytes_by_component(stage_model: Any) -> dict[str, int]:
    """Bytes of parameters and buffers per component: a held module's direct children (``thinker.layers``,
    ``thinker.lm_head``, ``talker.code_predictor``; its direct tensors under its own name), or a helper's module
    whole (``encoders.audio``)."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = {}
    for name, module, split in held_modules(stage_model):
        for tname, t in chain(module.named_parameters(), module.named_buffers(), _attribute_tensors(module)):
            if t is None or t.numel() == 0 or _key(t) in seen:
                continue
            seen.add(_key(t))
            component = _component(name, tname, split)
            out[component] = out.get(component, 0) + tensor_bytes(t)
    return out


def pool_bytes(tensors: Iterable[torch.Tensor] | None) -> int:
    """Bytes of a list of pool tensors (a runner's KV caches)."""
    return sum(tensor_bytes(t) for t in tensors or ())
