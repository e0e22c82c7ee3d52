"""``lp_kernels.losses.distill_loss``: values and gradients against sums written out by hand."""

from __future__ import annotations

import pytest
import torch

from lp_kernels.losses import distill_loss

# two sequences x 4 rows; the masked-out rows hold values that would show if counted
DIV = torch.tensor([[0.5, 1.5, 7.0, 100.0], [2.0, 4.0, 8.0, 100.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, False, False], [True, True, True, False]])
KEPT_SUM = 0.5 + 1.5 + 2.0 + 4.0 + 8.0  # 16.0, over 5 rows


def test_token_mean_sum_and_num_items_by_hand():
    assert distill_loss(DIV, MASK).item() == KEPT_SUM / 5
    assert distill_loss(DIV, MASK, reduction="sum").item() == KEPT_SUM
    assert distill_loss(DIV, MASK, num_items_in_batch=8).item() == KEPT_SUM / 8
    items = torch.tensor(32)  # a 0-d tensor, as transformers' Trainer passes it
    assert distill_loss(DIV, MASK, num_items_in_batch=items).item() == KEPT_SUM / 32
    assert distill_loss(DIV).item() == DIV.sum().item() / 8  # no mask: every row
    assert distill_loss(DIV, MASK.long()).item() == KEPT_SUM / 5  # 0/1 integer mask
    out = distill_loss(DIV.float(), MASK)
    assert out.dtype == torch.float32 and out.dim() == 0


def test_gradient_is_the_mask_over_the_divisor():
    div = DIV.clone().requires_grad_()
    distill_loss(div, MASK).backward()
    assert torch.equal(div.grad, MASK.double() / 5)
    div.grad = None
    distill_loss(div, MASK, num_items_in_batch=8).backward()
    assert torch.equal(div.grad, MASK.double() / 8)


def test_accumulated_micro_batches_give_the_step_mean():
    """Two micro-batches with num_items_in_batch = the step's count sum to its token mean."""
    total = int(MASK.sum())
    parts = [
        distill_loss(DIV[i : i + 1], MASK[i : i + 1], num_items_in_batch=total) for i in (0, 1)
    ]
    assert torch.allclose(sum(parts), distill_loss(DIV, MASK), rtol=1e-15, atol=0)


def test_masked_nan_stays_out_and_empty_mask_is_zero():
    div = DIV.clone()
    div[0, 3] = float("nan")  # a masked row that is not finite adds nothing
    assert distill_loss(div, MASK).item() == KEPT_SUM / 5
    none = torch.zeros_like(MASK)
    assert distill_loss(div, none).item() == 0.0
    assert distill_loss(div, none, num_items_in_batch=0).item() == 0.0


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((DIV.long(),), {}, TypeError, "divergence"),
        (([0.5],), {}, TypeError, "divergence"),
        ((DIV, MASK.double()), {}, TypeError, "mask"),
        ((DIV, MASK[:, :3]), {}, ValueError, "mask must have divergence's shape"),
        ((DIV,), {"reduction": "mean"}, ValueError, "reduction"),
        ((DIV,), {"reduction": "sum", "num_items_in_batch": 3}, ValueError, "num_items_in_batch"),
        ((DIV,), {"num_items_in_batch": -1}, ValueError, "num_items_in_batch"),
        ((DIV,), {"num_items_in_batch": 2.0}, TypeError, "num_items_in_batch"),
        ((DIV,), {"num_items_in_batch": True}, TypeError, "num_items_in_batch"),
        ((DIV,), {"num_items_in_batch": torch.tensor([3])}, ValueError, "num_items_in_batch"),
    ],
    ids=[
        "int-divergence",
        "list-divergence",
        "float-mask",
        "mask-shape",
        "reduction",
        "items-with-sum",
        "negative-items",
        "float-items",
        "bool-items",
        "1d-items",
    ],
)
def test_bad_arguments_are_named(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        distill_loss(*args, **kwargs)
