"""One scheduler configuration for every stage, and the one rule that sizes a stage's KV pool."""

from __future__ import annotations

import math
from dataclasses import dataclass

from omnistage.core.validation import check_bool, check_positive_int

# KV budget of a stage whose config names neither num_blocks nor kv_cache_bytes.
DEFAULT_KV_CACHE_BYTES = 1024**3


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits of one stage. A generation stage uses only ``max_num_seqs``.

    The KV pool is ``num_blocks`` when given, else what ``kv_cache_bytes`` (default
    ``DEFAULT_KV_CACHE_BYTES``) holds, never more than ``max_num_seqs`` full-length sequences need
    (see ``resolve_num_blocks``).
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    enable_chunked_prefill: bool = True
    # Keep full KV blocks content-addressed so requests sharing a prefix reuse them (core.kv_cache).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            check_positive_int(getattr(self, name), name)
        for name in ("num_blocks", "kv_cache_bytes"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("set num_blocks or kv_cache_bytes, not both")
        check_bool(self.enable_chunked_prefill, "enable_chunked_prefill")
        check_bool(self.enable_prefix_caching, "enable_prefix_caching")
        if self.num_blocks is not None and self.num_blocks < self.blocks_per_seq:
            raise ValueError(
                f"num_blocks ({self.num_blocks}) * block_size ({self.block_size}) must cover max_model_len "
                f"({self.max_model_len}): one request of that length would preempt itself forever"
            )
        # Without chunking a whole prompt must fit in one step's budget.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is False"
            )

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """The KV pool size in blocks.

        An explicit ``num_blocks`` wins. Otherwise the byte budget decides, capped at what ``max_num_seqs``
        sequences of ``max_model_len`` tokens can use; a budget that cannot hold one such sequence is an
        error (it would preempt that request forever), naming the bytes needed.
        """
        if self.num_blocks is not None:
            return self.num_blocks
        check_positive_int(bytes_per_block, "bytes_per_block")
        budget = self.kv_cache_bytes if self.kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES
        blocks = min(budget // bytes_per_block, self.blocks_per_seq * self.max_num_seqs)
        if blocks < self.blocks_per_seq:
            need = self.blocks_per_seq * bytes_per_block
            raise ValueError(
                f"the KV budget of {budget} bytes holds {budget // bytes_per_block} blocks, but one request of "
                f"max_model_len {self.max_model_len} needs {self.blocks_per_seq} blocks ({need} bytes): raise "
                "kv_cache_bytes or lower max_model_len"
            )
        return blocks
