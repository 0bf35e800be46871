"""Fused parameters that load from, and save as, the checkpoint's separate tensors.

A fused weight (q/k/v stacked, gate/up stacked, all experts in one 3-D tensor) saves one GEMM launch per
part, but checkpoints store the parts under their own names (``q_proj.weight``, ``experts.3.up_proj.weight``).
``fuse_parts`` registers two hooks on the owning module so that ``state_dict()`` lists the parts as views of
the fused tensor under the checkpoint names, and ``load_state_dict()`` (strict or not, ``assign`` or not)
copies each checkpoint part into its slice. Loaders that copy into ``state_dict(keep_vars=True)`` entries
write through the views; nothing else needs to know the parameter is fused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

# (checkpoint name relative to the module, index of that part in the fused tensor)
Part = tuple[str, tuple[Any, ...]]


def fuse_parts(module: nn.Module, param_name: str, parts: Sequence[Part]) -> None:
    """Expose ``module.<param_name>`` (a dotted path, e.g. ``qkv_proj.weight``) as the checkpoint tensors
    ``parts``: (name relative to ``module``, index into the fused tensor)."""
    parts = tuple(parts)
    shape = module.get_parameter(param_name).shape
    owner_path, _, leaf = param_name.rpartition(".")
    for _, index in parts:
        torch.empty(shape, device="meta")[index]  # raises on an index outside the fused shape
    names = [name for name, _ in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate part names for {param_name}")

    def save(mod: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
        fused = state_dict.pop(prefix + param_name, None)
        if fused is None:
            return
        for name, index in parts:
            state_dict[prefix + name] = fused[index]

    def load(mod, state_dict, prefix, _meta, _strict, missing_keys, _unexpected, error_msgs) -> None:
        present = [(name, index) for name, index in parts if prefix + name in state_dict]
        missing_keys.extend(prefix + name for name, _ in parts if prefix + name not in state_dict)
        if not present:
            return
        target = mod.get_parameter(param_name)
        with torch.no_grad():
            if target.is_meta:  # built on the meta device: materialise the fused tensor like the first part
                first = state_dict[prefix + present[0][0]]
                target = nn.Parameter(
                    torch.empty(target.shape, dtype=first.dtype, device=first.device),
                    requires_grad=target.requires_grad,
                )
                setattr(mod.get_submodule(owner_path), leaf, target)
            for name, index in present:
                src = state_dict.pop(prefix + name)
                dst = target[index]
                if tuple(src.shape) != tuple(dst.shape):
                    error_msgs.append(
                        f"size mismatch for {prefix + name}: copying a param with shape {tuple(src.shape)} "
                        f"from checkpoint, the shape in current model is {tuple(dst.shape)}."
                    )
                    continue
                dst.copy_(src)
        # The parts are in place; hand the fused tensor to the default loader as itself (a no-op copy) so it
        # is not reported missing.
        state_dict[prefix + param_name] = target

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)


def stacked_rows(names: Sequence[str], sizes: Sequence[int]) -> list[Part]:
    """Parts stacked along dim 0: ``[(names[0], (slice(0, sizes[0]),)), ...]``."""
    out, start = [], 0
    for name, size in zip(names, sizes, strict=True):
        out.append((name, (slice(start, start + size),)))
        start += size
    return out
