"""Argument checks shared by the ops (toeplitz.py, fd.py, ski.py): each raises ``ValueError`` naming the
argument, the value it got and what is allowed. Nothing here imports the ops, so every op module can use it."""
from typing import Tuple, Union

import torch

LAYOUTS = ("bnd", "dbn")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def check_length(n: int) -> None:
    """A sequence length: an integer >= 1."""
    if n < 1:
        raise ValueError(f"sequence length n must be >= 1, got n={n}")


def check_shape(name: str, t: torch.Tensor, want: Tuple[int, ...], why: str = "") -> None:
    """``t`` (the argument ``name``) has shape ``want``; ``why`` says where that shape comes from
    (e.g. "for n=7 and layout 'bnd'")."""
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must have shape {tuple(want)}{' ' + why if why else ''}, got {tuple(t.shape)}")


def check_circulant_size(size: int, n: int) -> None:
    """An FFT size that embeds n x n Toeplitz matrices in circulants without wrap-around."""
    if size < 2 * n - 1:
        raise ValueError(f"size must be >= 2n - 1 = {2 * n - 1}, got {size}")


# SKI's hyperparameters (ski.py)

def check_rank(r: int) -> None:
    if r < 2:
        raise ValueError(f"SKI rank r (inducing points, knots per side) must be an integer >= 2, got r={r}")


def check_taps(m: int) -> None:
    if m < 1 or m % 2 == 0:
        raise ValueError(f"SKI sparse filter size m must be odd and >= 1 (centred taps), got m={m}")


def check_lam(lam: Union[float, torch.Tensor]) -> None:
    if not 0.0 < float(lam) < 1.0:
        raise ValueError(f"SKI time-warp decay lam must satisfy 0 < lam < 1, got lam={lam}")
