"""Sign steps as large as the signs are persistent: Adam's small steps where the gradient is
noise, for the sign output.

With ``output="sign"`` the optimizer (AdamW with betas (0, 0)) moves every coordinate the hook
hands a sign by the whole rate. Dense Adam moves a coordinate by ``|m| / sqrt(v)`` of the rate,
about 1 where its gradient keeps one direction and much less where it is noise; at a constant
rate the sign step's jitter therefore stays well above dense's (docs/design/recipes-adamw.md,
"Persistent signs"). The gate keeps, per coordinate, a running mean ``a`` of the signs handed
(bias-corrected as Adam's moments are) and lets the coordinate move at a share ``|a|`` of the
steps: it adds ``|a|`` to a credit and passes the sign on the steps where the credit reaches 1
(taking 1 off), and hands 0 on the others. Over any stretch of steps a coordinate moves by the
rate times the sum of its ``|a|``, the magnitude Adam's step has, while the optimizer still sees
only signs and zeros, so AdamW's normalisation keeps what the gate decided.

The gate's inputs are the agreed signs, the same on every rank, so its state (the mean and the
credit, two float32 buffers per gradient element) is too: a checkpoint keeps it per plan bucket
and a resize takes it from the first saved rank (:data:`AGREED_PLAN_TENSORS`).
"""

import torch

__all__ = ["SIGN_MEAN", "SIGN_CREDIT", "AGREED_PLAN_TENSORS", "gate_persistent_signs"]

SIGN_MEAN = "sign_mean"
SIGN_CREDIT = "sign_credit"
# Plan tensors that hold the same values on every rank (redistributed from the first rank).
AGREED_PLAN_TENSORS = (SIGN_MEAN, SIGN_CREDIT)
# A share within this of 1 counts as 1: float32's running mean of a sign kept at every step
# settles a little below 1 (by about 1e-7 / (1 - decay)), and such a sign must move at every step.
SHARE_ROUNDING = 1e-3


def gate_persistent_signs(signs: torch.Tensor, mean: torch.Tensor, credit: torch.Tensor,
                          decay: float, gated_steps: int) -> torch.Tensor:
    """Zero, in place, the signs of the coordinates that do not move at this step, and update
    their running ``mean`` (decay ``decay``) and ``credit``; ``gated_steps``: how many steps
    the gate has seen, this one included (for the mean's bias correction). A NaN in ``signs``
    (a bucket handed on as non-finite) stays NaN and counts as 0 in the mean."""
    if not 0.0 < decay < 1.0:
        raise ValueError(f"decay must be in (0, 1); got {decay!r}")
    if gated_steps < 1:
        raise ValueError(f"gated_steps must be at least 1; got {gated_steps!r}")
    if not (signs.shape == mean.shape == credit.shape):
        raise ValueError(f"signs, mean and credit must have one shape; got {tuple(signs.shape)}, "
                         f"{tuple(mean.shape)} and {tuple(credit.shape)}")
    # (products then sums, each rounded in float32: the same on every rank and device)
    mean.mul_(decay).add_(torch.nan_to_num(signs.float(), nan=0.0).mul_(1.0 - decay))
    correction = (1.0 + SHARE_ROUNDING) / (1.0 - decay ** gated_steps)
    credit.add_(mean.abs().mul_(correction).clamp_(max=1.0))
    moves = credit >= 1.0
    credit.sub_(moves.to(credit.dtype))
    return signs.mul_(moves)
