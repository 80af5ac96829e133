"""The TNO interface: ``build_tno`` from plain values (the defaults filled, the values checked), a checked
``Settings`` instance, and what a ``SpectralTno`` inherits."""
import sys
from dataclasses import dataclass, field

import pytest
import torch

from helpers import assert_on
from fairseq_tnn.modules.tno import FdTno, SpectralTno, TnnTno, build_tno, register_tno, tno_settings
from fairseq_tnn.modules.tno.base import TnoSettings, require
from fairseq_tnn.ops.toeplitz import kernel_spectrum, next_fast_len, toeplitz_ref


def test_build_tno_takes_plain_values_and_fills_the_defaults():
    """Missing settings are the published ones (docs/references.md#published-configurations): RPE 64 wide,
    SKI's m = 17 taps and lambda = 0.99."""
    tno = build_tno("tnn", 8, True, rpe_layers=2)
    assert len(tno.rpe.linears) == 2 and tno.rpe.proj.out_features == 64 and tno.rpe.out.out_features == 8
    ski = build_tno("ski", 8, False, ski_rank=4)
    assert ski.knots.shape == (8, 8) and ski.conv_weight.shape == (8, 17) and ski.warp_decay == 0.99
    # or a checked Settings instance, as a model passes the one it resolved to every layer
    settings = tno_settings("fd", True, rpe_layers=1)
    assert FdTno(8, True, settings).settings is settings
    with pytest.raises(TypeError, match="FdTno takes a FdSettings instance or plain values, not TnnSettings"):
        FdTno(8, True, TnnTno.Settings())
    # plain values are checked as options are (tests/models/test_bad_options.py), and only the type's own
    with pytest.raises(ValueError, match=r"--tno-type fd has no setting --decay \(its settings: --rpe-dim"):
        build_tno("fd", 4, False, decay=0.9)
    with pytest.raises(ValueError, match=r"--tno-type='fourier' is invalid: must be one of \['fd', 'ski', 'tnn'\]"):
        build_tno("fourier", 4, False)


@dataclass
class ToySettings(TnoSettings):
    toy_decay: float = field(default=0.5, metadata={"help": "lambda of the toy kernel lambda^|t|, in (0, 1)"})

    def check(self):
        require(0.0 < self.toy_decay < 1.0, "toy_decay", self.toy_decay, "must be in (0, 1)")


class ToyTno(SpectralTno):
    """A fixed exponential kernel lambda^|t|, no parameters."""

    name = "toy"
    summary = "toy (fixed lambda^|t|)"
    Settings = ToySettings

    def kernel(self, n, device=None):
        lags = torch.arange(n, device=device, dtype=torch.float64)
        pos = (self.settings.toy_decay ** lags).expand(self.dim, n)
        return pos, None if self.causal else pos[:, 1:]

    def spectrum(self, n, device=None):
        size = next_fast_len(2 * n - 1)
        return kernel_spectrum(*self.kernel(n, device), size, layout="dbn"), size


def test_a_spectral_tno_is_the_toeplitz_matrix_of_its_kernel(device):
    """A SpectralTno gives spectrum and kernel and inherits the FFT forward and incremental decoding: the forward
    of a fixed exponential kernel is the dense Toeplitz product. On every device (the `device` fixture); the
    other tests of this file: CPU only."""
    tno = ToyTno(3, False, toy_decay=0.25).to(device)
    x = torch.randn(2, 6, 3, dtype=torch.float64, device=device)
    pos, neg = tno.kernel(6, device)
    y = tno(x)
    assert_on(device, y, pos, neg)
    torch.testing.assert_close(y, toeplitz_ref(x, pos.t(), neg.t()))
    # a SpectralTno decodes incrementally with its causal kernel
    causal = ToyTno(3, True, toy_decay=0.25).to(device)
    assert causal.supports_incremental and not causal.kernel_depends_on_length
    torch.testing.assert_close(causal.decoding_kernel(6, device), pos)
    with pytest.raises(ValueError, match=r"--toy-decay=2.0 is invalid: must be in \(0, 1\)"):
        ToyTno(3, True, toy_decay=2.0)
    with pytest.raises(ValueError, match="registered twice"):
        register_tno(type("OtherTnn", (TnnTno,), {}))


def test_ops_and_modules_import_without_fairseq():
    import subprocess
    code = ("import sys, fairseq_tnn.ops.toeplitz, fairseq_tnn.ops.fd, fairseq_tnn.ops.ski, fairseq_tnn.modules; "
            "assert 'fairseq' not in sys.modules, sorted(m for m in sys.modules if m.startswith('fairseq'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
