"""Auxiliary model outputs as a tree of tensors: flatten at graph capture, rebuild after replay.

Contract for a model that declares `supports_full_graph_aux_outputs`: its auxiliary output is a
non-empty nested dict/list/tuple whose leaves are all tensors sharing the same first dimension (the
token axis), and whose structure is identical across captures. The graph runner keeps the flat leaves
(static graph buffers) plus the spec, and rebuilds the tree from the leaves after each replay, so every
leaf holds *this* replay's values. A declared model that returns anything else gets an error, never a
silent fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

AuxTree = torch.Tensor | dict | list | tuple


class AuxOutputError(ValueError):
    """Auxiliary output breaks the declared full-graph contract."""


@dataclass(frozen=True)
class LeafSpec:
    """A tensor leaf; dtype and the dims after the token axis must stay the same across captures."""

    dtype: torch.dtype
    trailing_shape: tuple[int, ...]


@dataclass(frozen=True)
class NodeSpec:
    """A container: kind is "dict" (keys in sorted order), "list" or "tuple"."""

    kind: str
    keys: tuple[str, ...]  # dict keys, empty for list/tuple
    children: tuple[AuxSpec, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("dict", "list", "tuple"):
            raise ValueError(f"unknown node kind {self.kind!r}")
        if self.kind == "dict" and len(self.keys) != len(self.children):
            raise ValueError("dict node needs one key per child")


AuxSpec = LeafSpec | NodeSpec


def _num_leaves(spec: AuxSpec) -> int:
    if isinstance(spec, LeafSpec):
        return 1
    return sum(_num_leaves(c) for c in spec.children)


def flatten_aux(tree: AuxTree) -> tuple[list[torch.Tensor], AuxSpec]:
    """Leaves in a deterministic order (dict keys sorted) plus the spec that rebuilds the tree.

    Raises AuxOutputError for a leaf that is not a tensor or has no token axis (0-dim), and for dict
    keys that are not strings.
    """
    leaves: list[torch.Tensor] = []

    def visit(node: Any, path: str) -> AuxSpec:
        if isinstance(node, torch.Tensor):
            if node.dim() == 0:
                raise AuxOutputError(f"aux leaf {path or '<root>'} is 0-dim; leaves need a token axis")
            leaves.append(node)
            return LeafSpec(node.dtype, tuple(node.shape[1:]))
        if isinstance(node, dict):
            bad = [k for k in node if not isinstance(k, str)]
            if bad:
                raise AuxOutputError(f"aux dict at {path or '<root>'} has non-str keys {bad!r}")
            keys = tuple(sorted(node))
            children = tuple(visit(node[k], f"{path}[{k!r}]") for k in keys)
            return NodeSpec("dict", keys, children)
        # Exact types only: a namedtuple or other subclass would not be rebuilt faithfully.
        if type(node) in (list, tuple):
            children = tuple(visit(child, f"{path}[{i}]") for i, child in enumerate(node))
            return NodeSpec(type(node).__name__, (), children)
        raise AuxOutputError(
            f"aux leaf {path or '<root>'} is a {type(node).__name__}, not a tensor; leaves must all be tensors"
        )

    spec = visit(tree, "")
    return leaves, spec


def unflatten_aux(leaves: Sequence[torch.Tensor], spec: AuxSpec) -> AuxTree:
    """Rebuild the tree around the given leaf objects (no copies: leaves are placed as they are)."""
    expected = _num_leaves(spec)
    if len(leaves) != expected:
        raise AuxOutputError(f"spec has {expected} leaves, got {len(leaves)}")
    it = iter(leaves)

    def build(node: AuxSpec) -> AuxTree:
        if isinstance(node, LeafSpec):
            return next(it)
        children = [build(c) for c in node.children]
        if node.kind == "dict":
            return dict(zip(node.keys, children))
        return children if node.kind == "list" else tuple(children)

    return build(spec)


def _describe_difference(got: AuxSpec, want: AuxSpec, path: str = "") -> str:
    where = path or "<root>"
    if isinstance(want, LeafSpec) or isinstance(got, LeafSpec):
        if type(got) is not type(want):
            return f"at {where}: captured {_kind(want)}, got {_kind(got)}"
        return f"at {where}: captured leaf {want.dtype} [T, *{list(want.trailing_shape)}], got {got.dtype} [T, *{list(got.trailing_shape)}]"
    if got.kind != want.kind or got.keys != want.keys or len(got.children) != len(want.children):
        return (
            f"at {where}: captured {want.kind} {list(want.keys) or len(want.children)}, "
            f"got {got.kind} {list(got.keys) or len(got.children)}"
        )
    for i, (g, w) in enumerate(zip(got.children, want.children)):
        if g != w:
            sub = f"{path}[{want.keys[i]!r}]" if want.kind == "dict" else f"{path}[{i}]"
            return _describe_difference(g, w, sub)
    return f"at {where}: differs"


def _kind(spec: AuxSpec) -> str:
    return "a tensor leaf" if isinstance(spec, LeafSpec) else f"a {spec.kind}"


def validate_aux(tree: AuxTree, num_tokens: int, expected_spec: AuxSpec | None = None) -> AuxSpec:
    """Check the full-graph aux contract; returns the tree's spec. Raises AuxOutputError on violation."""
    if tree is None:
        raise AuxOutputError(
            "aux output is None; a model declaring full-graph aux outputs must return a tree"
        )
    leaves, spec = flatten_aux(tree)
    if not leaves:
        raise AuxOutputError("aux output tree is empty (no tensor leaves)")
    for i, leaf in enumerate(leaves):
        if leaf.shape[0] != num_tokens:
            raise AuxOutputError(
                f"aux leaf {i} has first dim {leaf.shape[0]}, expected the token axis {num_tokens} "
                f"(shape {list(leaf.shape)})"
            )
    if expected_spec is not None and spec != expected_spec:
        raise AuxOutputError(
            "aux output structure differs from the captured one " + _describe_difference(spec, expected_spec)
        )
    return spec
