"""Next-token targets of a causal LM batch, as transformers' causal-LM loss shifts them.

Position ``t`` predicts token ``t + 1``: ``targets[:, t] = labels[:, t + 1]`` and the last
position gets ``ignore_index``. Positions that cannot be scored are set to ``ignore_index``:

- labels already equal to ``ignore_index`` (``-100`` by default);
- ``attention_mask == 0`` at ``t`` or at ``t + 1`` (padding, left or right: a padded
  position neither predicts nor is predicted);
- a sequence boundary of a packed row: ``position_ids[:, t + 1] - position_ids[:, t] != 1``,
  the rule transformers uses to find packed sequences (the last token of one sequence
  does not predict the first token of the next).
"""

from __future__ import annotations

import torch

__all__ = ["next_token_targets", "slice_to_keep"]


def _check_2d(name: str, value: torch.Tensor, shape: torch.Size, *, batch_broadcast: bool) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    ok = value.dim() == 2 and value.shape[1] == shape[1]
    ok = ok and (value.shape[0] == shape[0] or (batch_broadcast and value.shape[0] == 1))
    if not ok:
        want = f"[{shape[0]} or 1, {shape[1]}]" if batch_broadcast else f"[{shape[0]}, {shape[1]}]"
        raise ValueError(f"{name} must have shape {want} (as labels), got {tuple(value.shape)}")


def next_token_targets(
    labels: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The target of every position: the next label, or ``ignore_index`` where none is scored.

    Args:
        labels: ``[B, T]`` integer token ids (``ignore_index`` where no loss is wanted);
            usually the ``input_ids``.
        attention_mask: ``[B, T]``, 0 at padding, or None.
        position_ids: ``[B, T]`` or ``[1, T]`` positions, or None. Where the position
            does not step by 1 from ``t`` to ``t + 1`` a packed sequence starts, and
            position ``t`` gets ``ignore_index``.
        ignore_index: the label value of positions without a target.

    Returns:
        ``[B, T]`` int64: ``labels[:, 1:]`` shifted left, ``ignore_index`` at the last
        position and wherever a rule of this module applies.

    Example:
        >>> import torch
        >>> next_token_targets(torch.tensor([[5, 6, 7, -100, 9]]))
        tensor([[   6,    7, -100,    9, -100]])
    """
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dim() != 2:
        raise ValueError(f"labels must be 2-D [B, T], got shape {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    labels = labels.long()
    targets = torch.full_like(labels, ignore_index)
    targets[:, :-1] = labels[:, 1:]
    drop = torch.zeros_like(labels, dtype=torch.bool)
    if attention_mask is not None:
        _check_2d("attention_mask", attention_mask, labels.shape, batch_broadcast=False)
        pad = attention_mask.to(labels.device) == 0
        drop |= pad
        drop[:, :-1] |= pad[:, 1:]
    if position_ids is not None:
        _check_2d("position_ids", position_ids, labels.shape, batch_broadcast=True)
        pos = position_ids.to(labels.device)
        boundary = (pos[:, 1:] - pos[:, :-1]) != 1
        drop[:, :-1] |= boundary.expand(labels.shape[0], -1)
    return targets.masked_fill(drop, ignore_index)


def slice_to_keep(targets: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The targets of the positions a causal LM keeps with ``logits_to_keep``.

    The same selection transformers applies to the hidden states before the output layer:
    an int ``k`` keeps the last ``k`` positions (0 keeps all); a 1-D tensor keeps those
    positions of every row; a 2-D integer tensor ``[B, K]`` keeps those positions per row;
    a 2-D bool tensor ``[B, T]`` keeps its True positions, flattened to ``[num_true]``.

    Args:
        targets: ``[B, T]`` from :func:`next_token_targets`.
        logits_to_keep: as the model's ``logits_to_keep`` argument.

    Returns:
        The kept targets: ``[B, k]``, ``[B, K]`` or ``[num_true]``.
    """
    if isinstance(logits_to_keep, bool):
        raise TypeError("logits_to_keep must be an int or a tensor of positions, got a bool")
    if isinstance(logits_to_keep, int):
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0 (0 keeps all), got {logits_to_keep}")
        return targets if logits_to_keep == 0 else targets[:, -logits_to_keep:]
    if not isinstance(logits_to_keep, torch.Tensor):
        raise TypeError(
            f"logits_to_keep must be an int or a tensor, got {type(logits_to_keep).__name__}"
        )
    keep = logits_to_keep.to(targets.device)
    if keep.dim() == 2:
        if keep.dtype == torch.bool:
            return targets[keep]
        return torch.take_along_dim(targets, keep.long(), dim=1)
    if keep.dim() != 1:
        raise ValueError(
            f"logits_to_keep must be an int, a 1-D or a 2-D tensor, got shape {tuple(keep.shape)}"
        )
    return targets[:, keep]
