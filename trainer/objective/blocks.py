"""Anchors and block inputs: what each of the N draft blocks of a row sees and predicts.

docs/objective.md §2-3. Position `a` is a valid anchor iff `loss_mask[a]` and `loss_mask[a + 1]` (the
clean token and the first target are both supervised). Every row gets exactly N block slots; slots
beyond the valid count are dummy blocks (`keep` False) that carry no loss. Block n occupies
`[n * B, (n + 1) * B)` of the packed draft sequence; its slot k sits at position `a_n + k` and
predicts `input_ids[a_n + k]` (slot 0, the anchor itself, is never scored).
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

    anchors [b, N] (0 for dummy slots), keep [b, N], draft_ids and position_ids [b, N*B],
    labels [b, N, B] (labels[..., 0] is the anchor token), weights [b, N, B] (float, 0/1).
    """

    anchors: torch.Tensor
    keep: torch.Tensor
    draft_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    context_length: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    def model_position_ids(self) -> torch.Tensor:
        """Context positions 0..S-1 followed by the draft positions: the draft's `position_ids`."""
        batch = self.anchors.shape[0]
        context = torch.arange(self.context_length, device=self.anchors.device).expand(batch, -1)
        return torch.cat([context, self.position_ids], dim=1)


def valid_anchor_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """[b, S] bool: a <= S - 2, loss_mask[a] and loss_mask[a + 1]."""
    supervised = loss_mask.bool()
    valid = torch.zeros_like(supervised)
    valid[:, :-1] = supervised[:, :-1] & supervised[:, 1:]
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """N anchor slots per row: (anchors [b, N] sorted ascending with dummies last at 0, keep [b, N]).

    With `draw`, a uniform sample without replacement among valid positions; with `draw=None`, the
    first N valid positions in order (deterministic, for evaluation at every valid position).
    Raises if no row of the batch has a valid anchor.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1 (got {num_anchors}).")
    valid = valid_anchor_mask(loss_mask)
    batch, length = valid.shape
    if not valid.any():
        raise ValueError(
            "No valid anchor in this batch: every anchor needs two adjacent supervised tokens "
            "(loss_mask[a] and loss_mask[a + 1])."
        )
    positions = torch.arange(length, device=valid.device)
    if draw is None:
        keys = positions.expand(batch, -1).to(torch.int64)
    else:
        row_ids = torch.arange(batch, device=valid.device) if row_ids is None else row_ids.to(valid.device)
        keys = anchor_keys(draw, row_ids, length)
    keys = torch.where(valid, keys, _INT64_MAX)
    if length < num_anchors:
        # (torch.cat, not F.pad: padding an int64 tensor with 2**63 - 1 goes through a float)
        filler = torch.full((batch, num_anchors - length), _INT64_MAX, dtype=keys.dtype, device=keys.device)
        keys = torch.cat([keys, filler], dim=1)
    chosen_keys, chosen = torch.topk(keys, num_anchors, dim=1, largest=False, sorted=True)
    keep = chosen_keys != _INT64_MAX
    anchors = torch.where(keep, chosen, _INT64_MAX).sort(dim=1).values
    anchors = torch.where(keep, anchors, 0)
    return anchors, keep


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> BlockBatch:
    """Draft ids, positions, labels and weights for anchors [b, N] (docs/objective.md §3)."""
    batch, length = input_ids.shape
    num_blocks = anchors.shape[1]
    offsets = torch.arange(block_size, device=input_ids.device)
    label_positions = anchors[:, :, None] + offsets  # [b, N, B]
    in_range = label_positions < length
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
        position_ids=label_positions.view(batch, -1),
        labels=labels,
        weights=weights.float(),
        context_length=length,
        block_size=block_size,
    )
