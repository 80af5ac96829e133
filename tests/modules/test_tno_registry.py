"""The TNO interface: one registry, one settings dataclass per type (defaults, checks), ``build_tno``
from plain values, and a new type registered from outside the package working like the built-in ones."""
import dataclasses
import sys
from dataclasses import dataclass, field

import pytest
import torch

from helpers import assert_on
from fairseq_tnn.modules.tno import TNO_TYPES, FdTno, SkiTno, SpectralTno, TnnTno, build_tno, register_tno, tno_settings
from fairseq_tnn.modules.tno.base import TnoSettings, require
from fairseq_tnn.ops.toeplitz import kernel_spectrum, next_fast_len, toeplitz_ref


def test_the_registered_types_and_their_published_defaults():
    assert TNO_TYPES == {"tnn": TnnTno, "fd": FdTno, "ski": SkiTno}
    assert dataclasses.asdict(TnnTno.Settings()) == dict(rpe_dim=64, rpe_layers=6, rpe_activation="relu",
                                                        rpe_norm_type="simplermsnorm", decay=0.99)
    assert dataclasses.asdict(FdTno.Settings()) == dict(rpe_dim=64, rpe_layers=3, rpe_activation="relu",
                                                       rpe_norm_type="simplermsnorm")
    assert dataclasses.asdict(SkiTno.Settings()) == dict(ski_rank=32, ski_taps=17, ski_warp_decay=0.99, ski_lowrank="mean")
    for cls in TNO_TYPES.values():
        assert all(f.metadata.get("help") for f in dataclasses.fields(cls.Settings)), cls


def test_what_each_type_declares_for_decoding():
    assert TnnTno.supports_incremental and not TnnTno.kernel_depends_on_length
    assert FdTno.supports_incremental and FdTno.kernel_depends_on_length
    assert not SkiTno.supports_causal and not SkiTno.supports_incremental


def test_build_tno_takes_plain_values_and_fills_the_defaults():
    tno = build_tno("tnn", 8, True, rpe_layers=2)
    assert tno.settings == TnnTno.Settings(rpe_layers=2) and len(tno.rpe.linears) == 2 and tno.rpe.out.out_features == 8
    ski = build_tno("ski", 8, False, ski_rank=4)
    assert ski.knots.shape == (8, 8) and ski.conv_weight.shape == (8, 17) and ski.decay == 0.99
    # or a checked Settings instance, as a model passes the one it resolved to every layer
    settings = tno_settings("fd", True, rpe_layers=1)
    assert FdTno(8, True, settings).settings is settings
    with pytest.raises(TypeError, match="FdTno takes a FdSettings instance or plain values, not TnnSettings"):
        FdTno(8, True, TnnTno.Settings())


@pytest.mark.parametrize("tno_type,causal,values,match", [
    ("tnn", True, dict(rpe_dim=0), r"--rpe-dim=0 is invalid: must be an integer >= 1"),
    ("tnn", True, dict(decay=1.5), r"--decay=1.5 is invalid: lambda must be in \(0, 1\] for --tno-type tnn"),
    ("fd", False, dict(rpe_activation="swishy"), r"--rpe-activation='swishy' is invalid: must be one of"),
    ("fd", False, dict(decay=0.9), r"--tno-type fd has no setting --decay \(its settings: --rpe-dim"),
    ("ski", False, dict(ski_taps=4), r"--ski-taps=4 is invalid: m must be an odd integer"),
    ("ski", False, dict(ski_warp_decay=1.0), r"--ski-warp-decay=1.0 is invalid: lambda must be in \(0, 1\)"),
    ("ski", True, dict(), r"--tno-type='ski' is invalid for a causal model: SKI-TNO is bidirectional only.*"
                          r"use --tno-type tnn or fd"),
    ("fourier", False, dict(), r"--tno-type='fourier' is invalid: must be one of \['fd', 'ski', 'tnn'\]"),
])
def test_bad_settings_are_refused_by_name(tno_type, causal, values, match):
    with pytest.raises(ValueError, match=match):
        tno_settings(tno_type, causal, **values)
    with pytest.raises(ValueError, match=match):
        build_tno(tno_type, 4, causal, **values)


@dataclass
class ToySettings(TnoSettings):
    toy_decay: float = field(default=0.5, metadata={"help": "lambda of the toy kernel lambda^|t|, in (0, 1)"})

    def check(self):
        require(0.0 < self.toy_decay < 1.0, "toy_decay", self.toy_decay, "must be in (0, 1)")


class ToyTno(SpectralTno):
    """A fourth type, as a user would add one: a fixed exponential kernel lambda^|t|, no parameters."""

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


@pytest.fixture
def toy_registered():
    register_tno(ToyTno)
    yield
    del TNO_TYPES["toy"]


def test_a_new_type_is_one_class_and_one_registration(toy_registered, device):
    """On every device (the `device` fixture); the other tests of this file check settings: CPU only."""
    tno = build_tno("toy", 3, False, toy_decay=0.25).to(device)
    x = torch.randn(2, 6, 3, dtype=torch.float64, device=device)
    pos, neg = tno.kernel(6, device)
    y = tno(x)
    assert_on(device, y, pos, neg)
    torch.testing.assert_close(y, toeplitz_ref(x, pos.t(), neg.t()))
    # a SpectralTno decodes incrementally with its causal kernel
    causal = build_tno("toy", 3, True, toy_decay=0.25).to(device)
    assert causal.supports_incremental and not causal.kernel_depends_on_length
    torch.testing.assert_close(causal.decoding_kernel(6, device), pos)
    with pytest.raises(ValueError, match=r"--toy-decay=2.0 is invalid: must be in \(0, 1\)"):
        build_tno("toy", 3, True, toy_decay=2.0)
    with pytest.raises(ValueError, match="registered twice"):
        register_tno(type("OtherToy", (ToyTno,), {}))


def test_ops_and_modules_import_without_fairseq():
    import subprocess
    code = ("import sys, fairseq_tnn.ops.toeplitz, fairseq_tnn.ops.fd, fairseq_tnn.ops.ski, fairseq_tnn.modules; "
            "assert 'fairseq' not in sys.modules, sorted(m for m in sys.modules if m.startswith('fairseq'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
