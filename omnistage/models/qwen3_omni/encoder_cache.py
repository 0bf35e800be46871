"""Encoder runs for the Thinker's media and their outputs, held per request until its prompt is prefilled.

When to encode (the per-step encoder budget): an item is encoded in the first step whose prefill chunk
touches one of its rows, never earlier (an early run only holds memory longer) and never later (the chunk
cannot be computed without it). The scheduler has already committed this step's rows when the model sees
them, so every item the step touches is encoded in that step; the budget ``max_rows_per_call`` bounds the
size of each encoder call instead: the step's missing items, deduplicated by content key and batched across
requests per modality, go through the towers in calls of at most that many output rows (an item larger than
the budget runs alone), which bounds the encoders' peak activation memory. (Capping encoder work per step
would need the scheduler to size chunks by it: ``item_span`` tells which items a prospective chunk touches.)

What is kept: one entry per content key (identical items of any requests share it) with the set of requests
holding it. A request lets go of its entries once its prompt is fully prefilled or when it is freed
(finish/abort). An entry with no holder moves to a least-recently-used store of at most ``cache_bytes``
(default 256 MiB; 0 keeps nothing): a later request with the same content (a clip that is part of a
conversation's history, the same image again) takes it back instead of running the tower, and the oldest
unheld entries are dropped when the budget is exceeded. A preempted request keeps its entries until it has
prefilled again; if it had already let go, they come back from that store or are encoded again.
(Outputs are per item; a batch of other items changes only the last bits of the matmuls, as for items
shared within a step.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from omnistage.models.qwen3_omni.audio_encoder import AudioEncoder
from omnistage.models.qwen3_omni.processor import MediaItem
from omnistage.models.qwen3_omni.vision_encoder import VisionEncoder

DEFAULT_MAX_ROWS_PER_CALL = 8192
DEFAULT_CACHE_BYTES = 256 * 1024**2


@dataclass
class EncodedItem:
    embeds: torch.Tensor  # [n, hidden] rows for the item's placeholders, in row order
    deepstack: torch.Tensor | None  # [num_deepstack, n, hidden] for visual items
    holders: set[str] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.deepstack is None else self.deepstack.nbytes
        return self.embeds.nbytes + extra


@dataclass
class EncoderStats:
    audio_calls: int = 0
    vision_calls: int = 0
    items_encoded: int = 0
    items_reused: int = 0  # taken back from the store of unheld outputs instead of encoded again


def item_span(item: MediaItem, lo: int, hi: int) -> tuple[int, int]:
    """[o1, o2): the item's output rows that land in prompt rows [lo, hi)."""
    o1 = int(torch.searchsorted(item.rows, lo))
    o2 = int(torch.searchsorted(item.rows, hi))
    return o1, o2


class MediaEncoders:
    def __init__(
        self,
        audio: AudioEncoder | None,
        vision: VisionEncoder | None,
        max_rows_per_call: int = DEFAULT_MAX_ROWS_PER_CALL,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        if max_rows_per_call <= 0:
            raise ValueError(f"max_rows_per_call must be positive, got {max_rows_per_call}")
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        self.cache_bytes = cache_bytes
        self.kept: OrderedDict[str, EncodedItem] = OrderedDict()  # unheld outputs, least recently used first
        self.kept_bytes = 0
        self.audio = audio
        self.vision = vision
        self.max_rows_per_call = max_rows_per_call
        self.entries: dict[str, EncodedItem] = {}
        self.held: dict[str, set[str]] = {}  # req_id -> keys it holds
        self.stats = EncoderStats()

    def __len__(self) -> int:
        return len(self.entries)

    def acquire(self, needs: Sequence[tuple[str, MediaItem]]) -> None:
        """Make every (request, item) available; missing items are encoded now, batched per modality."""
        missing: dict[str, MediaItem] = {}
        for _, item in needs:
            if item.key in self.entries:
                continue
            kept = self.kept.pop(item.key, None)
            if kept is not None:
                self.kept_bytes -= kept.nbytes
                self.entries[item.key] = kept
                self.stats.items_reused += 1
            else:
                missing.setdefault(item.key, item)
        audio = [i for i in missing.values() if not i.is_visual]
        visual = [i for i in missing.values() if i.is_visual]
        for batch in self._batches(audio):
            self._encode_audio(batch)
        for batch in self._batches(visual):
            self._encode_visual(batch)
        for req_id, item in needs:
            self.entries[item.key].holders.add(req_id)
            self.held.setdefault(req_id, set()).add(item.key)

    def release(self, req_id: str) -> None:
        """The request no longer needs its encoder outputs (prompt prefilled, finished or aborted)."""
        for key in self.held.pop(req_id, ()):
            entry = self.entries.get(key)
            if entry is None:
                continue
            entry.holders.discard(req_id)
            if not entry.holders:
                del self.entries[key]
                self._keep(key, entry)

    def _keep(self, key: str, entry: EncodedItem) -> None:
        if entry.nbytes > self.cache_bytes:
            return
        self.kept[key] = entry
        self.kept_bytes += entry.nbytes
        while self.kept_bytes > self.cache_bytes:
            _, old = self.kept.popitem(last=False)
            self.kept_bytes -= old.nbytes

    def _batches(self, items: list[MediaItem]) -> Iterable[list[MediaItem]]:
        batch: list[MediaItem] = []
        rows = 0
        for item in items:
            if batch and rows + item.num_tokens > self.max_rows_per_call:
                yield batch
                batch, rows = [], 0
            batch.append(item)
            rows += item.num_tokens
        if batch:
            yield batch

    def _encode_audio(self, items: list[MediaItem]) -> None:
        if self.audio is None:
            raise RuntimeError("this checkpoint has no audio encoder")
        device = next(self.audio.parameters()).device
        with torch.inference_mode():
            outs = self.audio([i.features.to(device) for i in items], [i.pad_frames for i in items])
        self.stats.audio_calls += 1
        for item, out in zip(items, outs):
            self._store(item, out, None)

    def _encode_visual(self, items: list[MediaItem]) -> None:
        if self.vision is None:
            raise RuntimeError("this checkpoint has no vision encoder")
        device = next(self.vision.parameters()).device
        pixels = torch.cat([i.pixels for i in items]).to(device)
        with torch.inference_mode():
            tokens, deepstack = self.vision(pixels, [i.grid for i in items])
        self.stats.vision_calls += 1
        sizes = [i.num_tokens for i in items]
        # A tower without deepstack features (Qwen2.5-Omni's) returns None for them.
        per_item = deepstack.split(sizes, dim=1) if deepstack is not None else [None] * len(items)
        for item, emb, ds in zip(items, tokens.split(sizes), per_item):
            self._store(item, emb, ds)

    def _store(self, item: MediaItem, embeds: torch.Tensor, deepstack: torch.Tensor | None) -> None:
        if embeds.shape[0] != item.num_tokens:
            raise RuntimeError(f"{item.kind} encoder gave {embeds.shape[0]} rows for {item.num_tokens} placeholders")
        self.entries[item.key] = EncodedItem(embeds, deepstack)
        self.stats.items_encoded += 1
