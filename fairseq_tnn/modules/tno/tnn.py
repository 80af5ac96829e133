"""Qin et al.'s TNO (``--tno-type tnn``): T_ij = lambda^|i-j| RPE(i - j), applied by FFT."""
import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from ...ops import fast
from ...ops.toeplitz import KernelRfft, circulant_lags, fft_dtype, lag_function_spectrum, next_fast_len
from ..rpe import Rpe
from .base import RpeSettings, SpectralTno, register_tno, require


@dataclass
class TnnSettings(RpeSettings):
    decay: float = field(default=0.99, metadata={
        "help": "decay bias lambda^|i-j| in (0, 1], fixed, not trained; 1 = none"})

    def check(self) -> None:
        super().check()
        require(isinstance(self.decay, (int, float)) and 0.0 < self.decay <= 1.0, "decay", self.decay,
                "lambda must be in (0, 1] for --tno-type tnn")


@register_tno
class TnnTno(SpectralTno):
    """The TNO of Qin et al. (ICLR 2023): T_ij = lambda^|i-j| * RPE(i-j).

    The RPE sees the raw integer lag and is evaluated once per forward for all lags in one batched
    call (n lags causal; bidirectional, straight on the circulant column, ``lag_function_spectrum``),
    its last Linear producing the coefficients channel-major with the decay folded in
    (``Rpe.channel_major``); one real FFT of the kernel per forward. The decay lambda is a fixed
    hyperparameter (not trained); lag 0 is undecayed.
    """

    name = "tnn"
    summary = "tnn (Qin et al.: RPE MLP of the lag x decay)"
    Settings = TnnSettings
    kernel_in_time = True

    def __init__(self, dim: int, causal: bool, settings: Optional[TnnSettings] = None, **values):
        super().__init__(dim, causal, settings, **values)
        s = self.settings
        self.decay = s.decay
        self.rpe = Rpe(dim, s.rpe_dim, s.rpe_layers, str(s.rpe_activation), str(s.rpe_norm_type))

    def coefficients(self, lags: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(d, m): RPE(lag) lambda^|lag| at each of the m (float) ``lags``, times ``weights`` (m,) if given.

        The lags (integers, exact in float32) and the decay are taken in the RPE's dtype (at least float32, as
        the RPE computes): a float64 model's kernel is lambda^|t| RPE(t) to float64 round-off, where a float32
        decay was off by up to 5e-7 relative within 1000 lags; a float32 model computes exactly what it did."""
        lags, scale = self._lags_and_scale(lags, weights)
        k = self.rpe.channel_major(lags, scale)
        return k.to(fft_dtype(k))

    def _dtype(self) -> torch.dtype:
        return torch.promote_types(self.rpe.packed.dtype, torch.float32)

    def _lags_and_scale(self, lags: torch.Tensor, weights: Optional[torch.Tensor]):
        """The lags in the RPE's dtype and the scale (m,) of each: lambda^|lag| times ``weights`` (None: 1)."""
        lags = lags.to(self._dtype())
        scale = None if self.decay >= 1.0 else torch.exp(lags.abs() * math.log(self.decay))
        if weights is not None:
            scale = weights if scale is None else scale * weights
        return lags, scale

    def kernel(self, n: int, device=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.causal:
            return self.coefficients(torch.arange(n, device=device, dtype=torch.float32)), None
        coef = self.coefficients(torch.arange(-(n - 1), n, device=device, dtype=torch.float32))  # (d, 2n - 1)
        return coef[:, n - 1:], coef[:, : n - 1].flip(-1)

    def spectrum(self, n: int, device=None) -> Tuple[torch.Tensor, int]:
        if not fast.enabled():  # the reference: lags and decay built at every call
            size = next_fast_len(2 * n - 1)
            return lag_function_spectrum(self.coefficients, n, size, self.causal, device), size
        k, size = self.rpe_output(n, device)
        return self.spectrum_of(k, size), size

    def time_kernel(self, n: int, device=None) -> Tuple[torch.Tensor, int]:
        if not fast.enabled():  # the reference, as lag_function_spectrum evaluates it
            size = next_fast_len(2 * n - 1)
            return self.coefficients(*self._lags(n, size, device)), size
        return super().time_kernel(n, device)

    def time_kernel_of(self, k: torch.Tensor, size: int) -> torch.Tensor:
        """The RPE's output itself: the lags 0 .. n - 1 causal, the circulant column bidirectional."""
        return k.to(fft_dtype(k))

    def rpe_positions(self, n: int, device=None) -> Tuple[torch.Tensor, Optional[torch.Tensor], int]:
        """The fast path's RPE input for length n: the lags (of the circulant column where bidirectional, as
        lag_function_spectrum), their decay, and the FFT size (no wrap-around for lags up to n - 1 either way);
        built once per length and device, and shared by every layer."""
        size = next_fast_len(2 * n - 1)
        dt = self._dtype()
        lags, scale = fast.constant(("tnn-lags", n, size, self.causal, self.decay, dt), device,
                                    lambda: self._lags_and_scale(*self._lags(n, size, device)))
        return lags, scale, size

    def spectrum_of(self, k: torch.Tensor, size: int) -> torch.Tensor:
        """The spectrum of the RPE's output k (..., d, size) at ``rpe_positions``: its real FFT."""
        return KernelRfft.apply(k.to(fft_dtype(k)), size)

    def _lags(self, n: int, size: int, device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.causal:
            return torch.arange(n, device=device, dtype=torch.float32), None
        return circulant_lags(n, size, device)
