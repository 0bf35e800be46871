"""Content keys of full KV blocks (prefix caching).

A block's key is its parent block's digest, its token ids and an ``extra`` byte string carrying everything
else that decides its KV (media content hashes of encoder-filled rows, 3-D positions that differ from the
token index, per-row inputs of a stage fed by another stage). The digest chains the parent's, so equal
digests mean equal prefixes; a hit compares the whole key (token ids included), so a digest collision
cannot hand a request someone else's KV.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

ROOT = b""  # the parent digest of a request's first block

# extra(start, end) -> the extra key of token rows [start, end), or None when those rows cannot be cached
# (their inputs are not known, or depend on something outside the key).
ExtraKeyFn = Callable[[int, int], "bytes | None"]


@dataclass(frozen=True)
class BlockKey:
    parent: bytes
    token_ids: tuple[int, ...]
    extra: bytes = b""
    digest: bytes = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        h = hashlib.sha256(self.parent)
        h.update(len(self.token_ids).to_bytes(4, "little"))
        for t in self.token_ids:
            h.update(t.to_bytes(8, "little"))
        h.update(self.extra)
        object.__setattr__(self, "digest", h.digest())


def extend_block_keys(
    keys: list[BlockKey], token_ids: Sequence[int], block_size: int, num_tokens: int, extra: ExtraKeyFn | None
) -> bool:
    """Append to ``keys`` the keys of the full blocks within the first ``num_tokens`` of ``token_ids``.

    Returns False when a block's rows cannot be cached (``extra`` said None): the chain stops there, and
    no later block gets a key either.
    """
    while (len(keys) + 1) * block_size <= num_tokens:
        start = len(keys) * block_size
        end = start + block_size
        more = b"" if extra is None else extra(start, end)
        if more is None:
            return False
        parent = keys[-1].digest if keys else ROOT
        keys.append(BlockKey(parent, tuple(token_ids[start:end]), more))
    return True
