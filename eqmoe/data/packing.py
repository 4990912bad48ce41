"""Packing encoded conversations into fixed-length rows, and the next-token target mask.

:func:`pack` places conversations greedily, first fit, in order: each goes into the first row with room
for all of it, else into a new row, so a conversation is never split across rows and the conversations
of a row keep their input order. Rows are padded with ``pad_id`` to ``seq_len``. A conversation longer
than ``seq_len`` is skipped (``overflow="skip"``, the default: a reply cut short would teach the model
not to stop) or cut to its first ``seq_len`` tokens (``overflow="truncate"``); either way it is counted
in ``Packed.too_long``. Empty conversations are dropped.

Every row has (see :class:`PackedRows`):

- ``tokens``: the ids, ``pad_id`` after the last conversation;
- ``segment_ids``: ``1, 2, 3, ...`` for the row's conversations, ``0`` for padding (attention stays
  within a segment, so ``segment_ids > 0`` is the model's ``token_mask``);
- ``positions``: ``0, 1, ...`` restarting for each conversation, ``0`` on padding;
- ``loss_mask``: true on the tokens that are trained as targets (what the assistant produces, its
  end-of-turn token included): the mask belongs to the token being predicted.

The loss predicts ``tokens[t + 1]`` from position ``t`` and counts it when ``loss_mask[t + 1]`` is true
and ``segment_ids[t + 1] == segment_ids[t]``. :func:`target_mask` returns that condition aligned with the
predicted token (false at ``t = 0``), the form ``eqmoe.losses`` takes (it uses ``mask[:, 1:]``). With
chat data the first token of a conversation (``<|im_start|>``) is never a target anyway; the segment
check keeps that true for any data.
"""

from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
from jaxtyping import Bool, Int32

from eqmoe.data.chat import encode_chats
from eqmoe.data.tokenizer import Tokenizer

Overflow = Literal["skip", "truncate"]


class PackedRows(NamedTuple):
    """Packed rows as NumPy arrays ``[batch, seq]`` (also the type of a whole packed data set)."""

    tokens: Int32[np.ndarray, "batch seq"]
    segment_ids: Int32[np.ndarray, "batch seq"]
    positions: Int32[np.ndarray, "batch seq"]
    loss_mask: Bool[np.ndarray, "batch seq"]


class Packed(NamedTuple):
    """The packed rows, how many conversations they hold and how many were too long."""

    rows: PackedRows
    num_conversations: int
    too_long: int
    labels: Int32[np.ndarray, "batch seq"] | None = None  # each item's label on its tokens, -1 on padding

    @property
    def fill(self) -> float:
        """Fraction of the rows' tokens that are not padding."""
        return float(np.mean(self.rows.segment_ids > 0))


def pack(
    encoded: Sequence[tuple[np.ndarray, np.ndarray]],
    seq_len: int,
    pad_id: int,
    overflow: Overflow = "skip",
    labels: Sequence[int] | None = None,
) -> Packed:
    """Pack ``(ids, loss_mask)`` pairs (from :func:`~eqmoe.data.chat.encode_chat`) into rows of ``seq_len``.

    With ``labels`` (one integer per item, such as a domain) ``Packed.labels`` carries each item's label
    on its tokens and -1 on padding."""
    if labels is not None and len(labels) != len(encoded):
        raise ValueError(f"labels: {len(labels)} given for {len(encoded)} items")
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} is invalid; allowed: a positive number")
    if overflow not in ("skip", "truncate"):
        raise ValueError(f"overflow={overflow!r} is invalid; allowed: skip | truncate")
    room = np.zeros(len(encoded), np.int64)  # free tokens of each open row
    rows: list[list[tuple[np.ndarray, np.ndarray, int]]] = []
    too_long = 0
    for i, (ids, mask) in enumerate(encoded):
        ids, mask = np.asarray(ids), np.asarray(mask, bool)
        if ids.ndim != 1 or ids.shape != mask.shape:
            raise ValueError(f"encoded[{i}]: ids {ids.shape} and loss_mask {mask.shape} must be equal 1-D shapes")
        if len(ids) > seq_len:
            too_long += 1
            if overflow == "skip":
                continue
            ids, mask = ids[:seq_len], mask[:seq_len]
        if len(ids) == 0:
            continue
        fits = room[: len(rows)] >= len(ids)
        row = int(np.argmax(fits)) if fits.any() else len(rows)
        if row == len(rows):
            rows.append([])
            room[row] = seq_len
        rows[row].append((ids, mask, -1 if labels is None else int(labels[i])))
        room[row] -= len(ids)
    if not rows:
        why = f"all {too_long} are longer than seq_len={seq_len}" if too_long else "every one is empty"
        raise ValueError(f"pack: no conversation to pack ({len(encoded)} given; {why})")

    shape = (len(rows), seq_len)
    tokens = np.full(shape, pad_id, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    loss_mask = np.zeros(shape, bool)
    item_labels = np.full(shape, -1, np.int32)
    for r, docs in enumerate(rows):
        start = 0
        for segment, (ids, mask, label) in enumerate(docs, start=1):
            end = start + len(ids)
            tokens[r, start:end] = ids
            segment_ids[r, start:end] = segment
            positions[r, start:end] = np.arange(len(ids))
            loss_mask[r, start:end] = mask
            item_labels[r, start:end] = label
            start = end
    rows_out = PackedRows(tokens, segment_ids, positions, loss_mask)
    return Packed(rows_out, sum(map(len, rows)), too_long, None if labels is None else item_labels)


def pack_conversations(
    conversations: Sequence[object], tokenizer: Tokenizer, seq_len: int, overflow: Overflow = "skip"
) -> Packed:
    """Encode each conversation with the tokenizer's chat template and :func:`pack` them (padding with ``pad_id``)."""
    where = [f"conversations[{i}]" for i in range(len(conversations))]
    encoded = [(e.ids, e.loss_mask) for e in encode_chats(conversations, tokenizer, where=where)]
    return pack(encoded, seq_len, tokenizer.pad_id, overflow)


def target_mask(batch: PackedRows) -> Bool[np.ndarray, "batch seq"]:
    """``loss_mask[t] and segment_ids[t] == segment_ids[t - 1]`` (false at ``t = 0``): whether
    ``tokens[t]``, predicted from position ``t - 1``, counts in the loss."""
    loss_mask, segment_ids = np.asarray(batch.loss_mask, bool), np.asarray(batch.segment_ids)
    same = np.zeros_like(loss_mask)
    same[:, 1:] = segment_ids[:, 1:] == segment_ids[:, :-1]
    return loss_mask & same & (segment_ids > 0)
