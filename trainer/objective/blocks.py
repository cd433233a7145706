"""Anchors and block inputs: what each of the N draft blocks of a row sees and predicts.

docs/objective.md §2-3. Position `a` is a valid anchor iff `loss_mask[a]` and `loss_mask[a + 1]` (the
clean token and the first target are both supervised). Every row gets exactly N block slots; slots
beyond the valid count are dummy blocks (`keep` False) that carry no loss. Block n occupies
`[n * B, (n + 1) * B)` of the packed draft sequence; its slot k sits at position `a_n + k` and
predicts `input_ids[a_n + k]` (slot 0, the anchor itself, is never scored).

Packed rows (docs/objective.md §10) hold several documents; `position_ids` [b, S] restart at 0 where
each document starts (transformers' packed-sequence convention), and they alone say where the
documents are. Each document is then treated as if it were its own row: an anchor and its first
target lie in one document, a block's slots past its document's end carry no weight, its positions
are the document's own, and each document gets `num_anchors` slots of its own (so the number of
anchors per supervised token is what it is unpacked); every row of the batch gets as many slots
as its fullest row needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_INT64_MAX = torch.iinfo(torch.int64).max
# splitmix64 constants as signed int64 (torch integer arithmetic wraps around).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


@dataclass(frozen=True)
class AnchorDraw:
    """Everything that decides which anchors a row gets, so a resumed run draws the same ones."""

    seed: int
    step: int
    rank: int = 0


@dataclass
class BlockBatch:
    """Packed draft inputs for a batch of b rows with N block slots of size B.

    anchors [b, N] (0 for dummy slots), keep [b, N], draft_ids and position_ids [b, N*B] (the
    slots' positions in their document), labels [b, N, B] (labels[..., 0] is the anchor token),
    weights [b, N, B] (float, 0/1), starts [b, N] (where the anchor's document starts in the row: a
    block sees context from there on), context_positions [b, S] (the rows' positions; None: 0..S-1).
    """

    anchors: torch.Tensor
    keep: torch.Tensor
    draft_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    context_length: int
    block_size: int
    starts: torch.Tensor | None = None
    context_positions: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    def model_position_ids(self) -> torch.Tensor:
        """The context's positions followed by the draft positions: the draft's `position_ids`."""
        context = self.context_positions
        if context is None:
            batch = self.anchors.shape[0]
            context = torch.arange(self.context_length, device=self.anchors.device).expand(batch, -1)
        return torch.cat([context, self.position_ids], dim=1)


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, S] index of the first token of each token's document: a document starts wherever a
    position is not the previous one plus 1 (as transformers' `find_packed_sequence_indices` reads it)."""
    index = torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)
    first = torch.ones_like(position_ids, dtype=torch.bool)
    first[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return torch.where(first, index, 0).cummax(dim=1).values


def document_ends(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, S] index one past the last token of each token's document."""
    length = position_ids.shape[1]
    index = torch.arange(length, device=position_ids.device).expand_as(position_ids)
    last = torch.ones_like(position_ids, dtype=torch.bool)
    last[:, :-1] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    ends = torch.where(last, index + 1, length)
    return ends.flip(1).cummin(dim=1).values.flip(1)


def valid_anchor_mask(loss_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[b, S] bool: a <= S - 2, loss_mask[a] and loss_mask[a + 1], and (packed rows) a + 1 in a's document."""
    supervised = loss_mask.bool()
    valid = torch.zeros_like(supervised)
    valid[:, :-1] = supervised[:, :-1] & supervised[:, 1:]
    if position_ids is not None:
        valid[:, :-1] &= position_ids[:, 1:] == position_ids[:, :-1] + 1
    return valid


def _splitmix64(values: torch.Tensor) -> torch.Tensor:
    def shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:  # logical shift on int64
        return (x >> bits) & ((1 << (64 - bits)) - 1)

    z = values + _GOLDEN
    z = (z ^ shift_right(z, 30)) * _MIX1
    z = (z ^ shift_right(z, 27)) * _MIX2
    return z ^ shift_right(z, 31)


def anchor_keys(draw: AnchorDraw, row_ids: torch.Tensor, length: int) -> torch.Tensor:
    """[b, length] pseudo-random int64 keys, a pure function of (seed, step, rank, row, position).

    Counter-based hashing instead of a stateful generator: identical on CPU and GPU, independent of
    the other rows and of how far the row is padded.
    """
    device = row_ids.device
    state = _splitmix64(torch.tensor(draw.seed, dtype=torch.int64, device=device))
    state = _splitmix64(state ^ draw.step)
    state = _splitmix64(state ^ draw.rank)
    rows = _splitmix64(state ^ row_ids.to(torch.int64))
    positions = torch.arange(length, dtype=torch.int64, device=device)
    return _splitmix64(rows[:, None] ^ _splitmix64(positions)[None, :])


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    draw: AnchorDraw | None = None,
    row_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor slots per row: (anchors [b, N'] sorted ascending with dummies last at 0, keep [b, N']).

    Each document (a row, or with `position_ids` each document of a packed row) gets
    min(num_anchors, its valid positions) anchors: with `draw`, a uniform sample without replacement
    among its valid positions; with `draw=None`, its first ones in order (deterministic, for
    evaluation at every valid position). N' is `num_anchors` for rows of one document, and for
    packed rows the most anchors any row of the batch gets. Raises if no row has a valid anchor.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1 (got {num_anchors}).")
    valid = valid_anchor_mask(loss_mask, position_ids)
    batch, length = valid.shape
    if not valid.any():
        raise ValueError(
            "No valid anchor in this batch: every anchor needs two adjacent supervised tokens "
            "(loss_mask[a] and loss_mask[a + 1])."
        )
    positions = torch.arange(length, device=valid.device).expand(batch, -1)
    if draw is None:
        keys = positions.to(torch.int64)
    else:
        row_ids = torch.arange(batch, device=valid.device) if row_ids is None else row_ids.to(valid.device)
        keys = anchor_keys(draw, row_ids, length)
    keys = torch.where(valid, keys, _INT64_MAX)
    starts = torch.zeros_like(positions) if position_ids is None else document_starts(position_ids)
    # order each row by (document, key): two stable sorts; a position's rank in its document is
    # its place in that order minus where its document begins there
    order = keys.argsort(dim=1, stable=True)
    if position_ids is not None:  # rows of one document are in order already
        order = order.gather(1, starts.gather(1, order).argsort(dim=1, stable=True))
    sorted_starts = starts.gather(1, order)
    begins = torch.ones_like(valid)
    begins[:, 1:] = sorted_starts[:, 1:] != sorted_starts[:, :-1]
    rank = positions - torch.where(begins, positions, 0).cummax(dim=1).values
    chosen = torch.zeros_like(valid).scatter(1, order, (rank < num_anchors) & valid.gather(1, order))
    slots = num_anchors if position_ids is None else max(int(chosen.sum(dim=1).max()), 1)
    ordered = torch.where(chosen, positions, _INT64_MAX)
    if length < slots:
        # (torch.cat, not F.pad: padding an int64 tensor with 2**63 - 1 goes through a float)
        filler = torch.full((batch, slots - length), _INT64_MAX, dtype=ordered.dtype, device=ordered.device)
        ordered = torch.cat([ordered, filler], dim=1)
    anchors = torch.topk(ordered, slots, dim=1, largest=False, sorted=True).values
    keep = anchors != _INT64_MAX
    return torch.where(keep, anchors, 0), keep


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    position_ids: torch.Tensor | None = None,
) -> BlockBatch:
    """Draft ids, positions, labels and weights for anchors [b, N] (docs/objective.md §3); with
    `position_ids` (packed rows), each block stops at its anchor's document end and takes that
    document's positions."""
    batch, length = input_ids.shape
    num_blocks = anchors.shape[1]
    offsets = torch.arange(block_size, device=input_ids.device)
    label_positions = anchors[:, :, None] + offsets  # [b, N, B]
    if position_ids is None:
        in_range = label_positions < length
        slot_positions, starts = label_positions, None
    else:
        in_range = label_positions < document_ends(position_ids).gather(1, anchors)[:, :, None]
        slot_positions = position_ids.gather(1, anchors)[:, :, None] + offsets
        starts = document_starts(position_ids).gather(1, anchors)
    clamped = label_positions.clamp(max=length - 1).view(batch, -1)
    labels = input_ids.gather(1, clamped).view(batch, num_blocks, block_size)
    supervised = loss_mask.bool().gather(1, clamped).view(batch, num_blocks, block_size)
    weights = keep[:, :, None] & in_range & (offsets > 0) & supervised
    draft_ids = torch.full_like(labels, mask_token_id)
    draft_ids[:, :, 0] = torch.where(keep, labels[:, :, 0], mask_token_id)
    return BlockBatch(
        anchors=anchors,
        keep=keep,
        draft_ids=draft_ids.view(batch, -1),
        position_ids=slot_positions.reshape(batch, -1),
        labels=labels,
        weights=weights.float(),
        context_length=length,
        block_size=block_size,
        starts=starts,
        context_positions=position_ids,
    )
