"""The SKI paper's FD-TNO (``--tno-type fd``): an RPE MLP of the frequency (section 3.3)."""
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from ...ops.fd import fd_bidirectional_spectrum, fd_causal_kernel, fd_grid, hilbert_causal_spectrum
from ...ops.toeplitz import spectrum_kernel
from ..rpe import Rpe
from .base import RPE_HELP, RpeSettings, SpectralTno, register_tno


@dataclass
class FdSettings(RpeSettings):
    rpe_layers: int = field(default=3, metadata={"help": RPE_HELP["rpe_layers"]})


@register_tno
class FdTno(SpectralTno):
    """FD-TNO: the RPE MLP models the kernel's frequency response on omega_m = m pi / N'.

    Causal (Algorithm 2): the RPE output is the real part; the imaginary part is its discrete
    Hilbert transform, so the time kernel is causal. Bidirectional (section 3.3.2): the RPE outputs
    2d values, real and imaginary parts, the imaginary part forced to 0 at omega = 0 and pi. No decay
    bias: the smoothness of the RPE's activation sets the kernel's decay (section 4.2). A longer
    sequence samples the same MLP on a finer grid over [0, pi], so every lag's coefficient changes a
    little with the length (``kernel_depends_on_length``).
    """

    name = "fd"
    summary = "fd (RPE MLP of the frequency; causal via the Hilbert transform)"
    Settings = FdSettings
    kernel_depends_on_length = True

    def __init__(self, dim: int, causal: bool, settings: Optional[FdSettings] = None, **values):
        super().__init__(dim, causal, settings, **values)
        s = self.settings
        self.rpe = Rpe(dim if causal else 2 * dim, s.rpe_dim, s.rpe_layers, str(s.rpe_activation), str(s.rpe_norm_type))

    def spectrum(self, n: int, device=None) -> Tuple[torch.Tensor, int]:
        k, size = self.rpe_output(n, device)
        return self.spectrum_of(k, size), size

    def rpe_positions(self, n: int, device=None) -> Tuple[torch.Tensor, None, int]:
        """The RPE's input for length n: the frequencies of ``fd_grid`` (no per-position scale), and the FFT size."""
        size, omegas = fd_grid(n, device)
        return omegas, None, size

    @property
    def kernel_in_time(self) -> bool:
        """Causal: the spectrum is the real FFT of the Hilbert transform's causal kernel (``time_kernel_of``).
        Bidirectional: the RPE gives the spectrum itself, whose kernel in time would take an inverse FFT."""
        return self.causal

    def time_kernel_of(self, k: torch.Tensor, size: int) -> torch.Tensor:
        """Causal: the lags 0 .. N' of the kernel whose spectrum ``hilbert_causal_spectrum`` gives
        (``fd_causal_kernel``)."""
        return fd_causal_kernel(k, layout="dbn")

    def spectrum_of(self, k: torch.Tensor, size: int) -> torch.Tensor:
        """The spectrum from the RPE's output k (..., d, N'+1) causal, (..., 2d, N'+1) bidirectional."""
        if self.causal:
            return hilbert_causal_spectrum(k, layout="dbn")
        k_real, k_imag = k.chunk(2, dim=-2)
        return fd_bidirectional_spectrum(k_real, k_imag, layout="dbn")

    def kernel(self, n: int, device=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Causal: the inverse DFT of the causal spectrum on n's grid (``fd_causal_kernel``), which
        incremental decoding applies one position at a time; for the first m < n positions it is the
        kernel the full forward uses when called with ``kernel_length=n``. Bidirectional: the inverse FFT of
        the complex response."""
        if self.causal:
            return self.time_kernel(n, device)[0][:, :n], None
        spec, size = self.spectrum(n, device)
        return spectrum_kernel(spec, size, n)
