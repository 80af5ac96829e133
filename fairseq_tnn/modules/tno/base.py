"""What every Toeplitz neural operator (TNO) shares: the module interface, the settings, the registry.

A TNO maps (batch, n, d) to (batch, n, d) with one n x n Toeplitz-like matrix per channel. Each type
is a ``Tno`` subclass in a module of its own, with

- ``name``: its ``--tno-type`` value, and ``summary``: one line for that option's help;
- ``Settings``: a dataclass of its hyperparameters, each field with its default and ``help`` (and
  ``choices`` where the values are names). The fairseq model config makes one option of each setting
  from these (fairseq_tnn/models/config.py), so a default, a help text or a check is written once, here;
- ``Settings.check``: the validation, errors naming the option (``require``);
- ``supports_causal``: False for a bidirectional-only operator (refused for a causal model);
- ``supports_incremental``: True where ``decoding_kernel(n)`` gives the causal time kernel that
  incremental decoding applies one position at a time (every ``SpectralTno``); a causal model whose
  TNO lacks it decodes by the full forward of the whole prefix at each step (correct, slower);
  ``kernel_depends_on_length``: whether that kernel changes with the sequence length (FD); such a
  TNO's ``forward`` takes ``kernel_length``, the length whose kernel it applies (at least the input's: a
  causal model passes its planned generation length, so that every step of a generation, cached or not,
  applies one kernel); the others are called without it;
- ``uses_training_length``: True where the constructor takes ``training_length`` (the length the model
  trains at, which a model passes when it knows it: SKI's low-rank scale).

``@register_tno`` adds a class to ``TNO_TYPES``; fairseq_tnn/modules/tno/__init__.py imports the
modules that hold them. A constructor takes a checked ``Settings`` instance (``tno_settings``, what a
model resolves once for all its layers) or plain values (``build_tno``). Nothing here imports fairseq.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Type

import torch
from torch import nn

from ...ops.toeplitz import KernelRfft, direct_product, fft_conv, seq_shape, swap_kernel_layout
from ..activations import ACTIVATIONS
from ..norm import NORM_CHOICES
from ..rpe import Rpe


def option(name: str) -> str:
    """The command-line spelling of a settings field: rpe_dim -> --rpe-dim."""
    return "--" + name.replace("_", "-")


def require(ok: bool, name: str, value, allowed: str) -> None:
    """Raise a ValueError ``--name=value is invalid: allowed`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{option(name)}={value!r} is invalid: {allowed}")


def is_int(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclass
class TnoSettings:
    """Hyperparameters of one TNO type. Field metadata: ``help`` (required), ``choices`` (optional
    list of allowed names)."""

    def check(self) -> None:
        """Refuse invalid values with ``require`` (an error naming the option, the value and what is allowed)."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None:
                value = getattr(self, f.name)
                require(str(value) in choices, f.name, value, f"must be one of {sorted(choices)}")


RPE_HELP = {
    "rpe_dim": "width of the RPE MLP",
    "rpe_layers": "hidden [norm, act, linear] blocks of the RPE MLP",
    "rpe_activation": "activation inside the RPE MLP (for fd, relu/silu/gelu give square-summable/super-polynomial/"
                      "super-exponential decay of the kernel, the SKI paper's section 4.2)",
    "rpe_norm_type": "normalisation inside the RPE MLP",
}


@dataclass
class RpeSettings(TnoSettings):
    """The settings of a TNO whose coefficients come from an RPE MLP (``fairseq_tnn.modules.rpe.Rpe``)."""

    rpe_dim: int = field(default=64, metadata={"help": RPE_HELP["rpe_dim"]})
    rpe_layers: int = field(default=6, metadata={"help": RPE_HELP["rpe_layers"]})  # Qin et al.'s; FD's: FdSettings
    rpe_activation: str = field(default="relu", metadata={"help": RPE_HELP["rpe_activation"],
                                                          "choices": sorted(ACTIVATIONS)})
    rpe_norm_type: str = field(default="simplermsnorm", metadata={"help": RPE_HELP["rpe_norm_type"],
                                                                  "choices": list(NORM_CHOICES)})

    def check(self) -> None:
        require(is_int(self.rpe_dim, 1), "rpe_dim", self.rpe_dim, "must be an integer >= 1")
        require(is_int(self.rpe_layers, 0), "rpe_layers", self.rpe_layers, "must be an integer >= 0")
        super().check()


TNO_TYPES: Dict[str, Type["Tno"]] = {}


def register_tno(cls: Type["Tno"]) -> Type["Tno"]:
    """Class decorator: make ``cls`` selectable as ``--tno-type cls.name``."""
    if cls.name in TNO_TYPES and TNO_TYPES[cls.name] is not cls:
        raise ValueError(f"TNO type {cls.name!r} is registered twice ({TNO_TYPES[cls.name].__qualname__}, "
                         f"{cls.__qualname__})")
    TNO_TYPES[cls.name] = cls
    return cls


def tno_class(tno_type: str) -> Type["Tno"]:
    if tno_type not in TNO_TYPES:
        raise ValueError(f"--tno-type={tno_type!r} is invalid: must be one of {sorted(TNO_TYPES)}")
    return TNO_TYPES[tno_type]


def tno_settings(tno_type: str, causal: bool, **values) -> TnoSettings:
    """The checked settings of a ``tno_type`` TNO in a causal or bidirectional model, from plain values
    (missing ones: the type's defaults)."""
    return tno_class(tno_type).checked_settings(causal, **values)


def build_tno(tno_type: str, dim: int, causal: bool, **settings) -> "Tno":
    """A ``tno_type`` TNO over ``dim`` channels; ``settings`` are plain values of its ``Settings``
    fields (missing ones: the type's defaults)."""
    return tno_class(tno_type)(dim, causal, **settings)


class Tno(nn.Module):
    """Base class. ``forward(x, layout="bnd")``: x (b, n, d), or channel-major (d, *batch, n) with
    ``layout="dbn"`` (the layout the TNN layer feeds and every TNO here computes in: its FFTs and GEMMs
    run along the contiguous last dim). Returns x's shape and dtype."""

    name: str = ""
    summary: str = ""
    Settings: Type[TnoSettings] = TnoSettings
    supports_causal: bool = True
    why_not_causal: str = ""
    # Whether a causal one gives decoding_kernel (incremental decoding); without it, a causal model decodes
    # by the full forward of the prefix at every step.
    supports_incremental: bool = False
    # Whether every lag's coefficient depends on the sequence length (FD: the frequency grid does).
    # Incremental decoding recomputes its cache when such a kernel outgrows it.
    kernel_depends_on_length: bool = False
    # Whether the constructor takes training_length=n (the model's --tokens-per-sample; build_layers passes it).
    uses_training_length: bool = False
    # Whether the GTU keeps only its gate's input for the backward, and computes the activations, this TNO's output
    # and their product again there (``Gtu.forward``): for a TNO whose forward costs little beside the memory its
    # output and input hold (SKI's, ``--ski-backward``). False: the GTU keeps them, as autograd does.
    recompute_gate: bool = False

    def __init__(self, dim: int, causal: bool, settings: Optional[TnoSettings] = None, **values):
        """``settings``: a ``Settings`` instance as ``checked_settings`` (``tno_settings``) returns it, which a
        model resolves once for all its layers; or None and plain ``values`` (missing ones: the defaults)."""
        super().__init__()
        if settings is None:
            settings = self.checked_settings(causal, **values)
        elif values or not isinstance(settings, self.Settings):
            raise TypeError(f"{type(self).__name__} takes a {self.Settings.__name__} instance or plain values, "
                            f"not {type(settings).__name__} {'and values' if values else ''}".strip())
        self.settings = settings
        self.dim, self.causal = dim, causal

    @classmethod
    def checked_settings(cls, causal: bool, **values) -> TnoSettings:
        """This type's settings from plain values, checked, for a causal or bidirectional model; errors name
        the option, the value and what is allowed."""
        if causal and not cls.supports_causal:
            causal_types = " or ".join(t for t, c in TNO_TYPES.items() if c.supports_causal)
            raise ValueError(f"--tno-type={cls.name!r} is invalid for a causal model: {cls.why_not_causal}; "
                             f"use --tno-type {causal_types}")
        known = [f.name for f in dataclasses.fields(cls.Settings)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"--tno-type {cls.name} has no setting {', '.join(map(option, unknown))} "
                             f"(its settings: {', '.join(map(option, known)) or 'none'})")
        settings = cls.Settings(**values)
        settings.check()
        return settings

    def forward(self, x: torch.Tensor, layout: str = "bnd") -> torch.Tensor:
        raise NotImplementedError

    def decoding_kernel(self, n: int, device=None) -> torch.Tensor:
        """(d, n): the causal time kernel, lags 0 .. n - 1, that incremental decoding applies (a causal
        TNO with ``supports_incremental``); float32 (float64 for float64 weights)."""
        raise NotImplementedError(f"--tno-type {self.name} has no decoding kernel (supports_incremental is False)")


class SpectralTno(Tno):
    """A TNO whose matrix is exactly Toeplitz, applied as one FFT product: subclasses give
    ``spectrum(n)``, the rfft of the matrix's circulant embedding, and ``kernel(n)``, its coefficients
    in time (incremental decoding, pictures, the dense references in the tests).

    Where the product runs by direct summation instead (``toeplitz.direct_product``: short sequences on a GPU), a
    TNO whose spectrum is the real FFT of a kernel in time it computes first (``kernel_in_time``: TNN's, the RPE's
    output; causal FD-TNN's, the Hilbert transform's causal kernel) hands that kernel over (``time_kernel``), with
    no FFT of it and no inverse FFT back: the ``spectrum`` a forward takes is then a real tensor."""

    supports_incremental = True
    # Whether ``spectrum_of`` is the real FFT of ``time_kernel_of`` (of the RPE's output at ``rpe_positions``), so that
    # ``time_kernel`` gives the kernel in time without a transform of its own.
    kernel_in_time = False

    def spectrum(self, n: int, device=None) -> Tuple[torch.Tensor, int]:
        """(d, size // 2 + 1) complex spectrum for sequences of length n, and the FFT size."""
        raise NotImplementedError

    def kernel(self, n: int, device=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The Toeplitz coefficients for length n, channel-major: pos (d, n) for lags 0 .. n-1 and
        neg (d, n-1) for lags -1 .. -(n-1), None when causal; float32 (float64 for float64 weights)."""
        raise NotImplementedError

    def time_kernel(self, n: int, device=None) -> Tuple[torch.Tensor, int]:
        """(d, m) real, what ``spectrum(n)`` is the real FFT of (``kernel_in_time``), and that FFT's size: causal,
        the lags 0 .. m - 1, m >= n (the FFT zero-pads them); bidirectional, the circulant column (m = size)."""
        if not self.kernel_in_time:
            raise NotImplementedError(f"--tno-type {self.name} {'causal' if self.causal else 'bidirectional'} gives "
                                      "its kernel as a spectrum only (kernel_in_time is False)")
        k, size = self.rpe_output(n, device)
        return self.time_kernel_of(k, size), size

    def rpe_output(self, n: int, device=None) -> Tuple[torch.Tensor, int]:
        """The RPE's output (d, m) at ``rpe_positions(n)`` with their scale, and the FFT size: what ``spectrum_of``
        and ``time_kernel_of`` take."""
        positions, scale, size = self.rpe_positions(n, device)
        return self.rpe.channel_major(positions, scale), size

    def time_kernel_of(self, k: torch.Tensor, size: int) -> torch.Tensor:
        """The kernel in time from the RPE's output k (..., d, m) at ``rpe_positions`` (``kernel_in_time``), float32
        (float64 for float64 k): ``spectrum_of(k, size)`` is its real FFT of ``size``."""
        raise NotImplementedError

    def mixing_kernel(self, n: int, direct: bool, device=None) -> Tuple[torch.Tensor, int]:
        """What a forward of n positions applies: ``time_kernel(n)`` where its product runs by direct summation
        (``direct``) and the TNO has one (``kernel_in_time``), ``spectrum(n)`` otherwise."""
        return self.time_kernel(n, device) if direct and self.kernel_in_time else self.spectrum(n, device)

    def decoding_kernel(self, n: int, device=None) -> torch.Tensor:
        return self.kernel(n, device)[0]

    def spectrum_length(self, n: int, kernel_length: Optional[int] = None) -> int:
        """The length whose spectrum a forward of n positions applies: max(n, kernel_length) where the kernel
        depends on the length (``kernel_depends_on_length``; a planned generation's length), n otherwise."""
        return max(n, kernel_length) if self.kernel_depends_on_length and kernel_length else n

    def forward(self, x: torch.Tensor, layout: str = "bnd", kernel_length: Optional[int] = None,
                spectrum: Optional[Tuple[torch.Tensor, int]] = None) -> torch.Tensor:
        """``kernel_length``: where the kernel depends on the length (``kernel_depends_on_length``), apply that
        of max(n, kernel_length) positions (a planned generation's; None: the input's n); ignored otherwise.
        ``spectrum``: (spectrum, FFT size) as ``mixing_kernel`` gives it for that length, computed beforehand
        (``stacked_spectra``): complex, or real where it is the kernel in time (``time_kernel``); None: computed
        here."""
        n = seq_shape(x, layout)[0]
        direct = layout == "dbn" and direct_product(n, x.dtype, x.device)
        if spectrum is None:
            spectrum = self.mixing_kernel(self.spectrum_length(n, kernel_length), direct, x.device)
        spec, size = spectrum
        if not spec.is_complex():  # the kernel in time: summed directly, or (where that cannot run here) transformed
            if direct:
                from ...ops.toeplitz_direct import direct_toeplitz
                return direct_toeplitz(x, spec, causal=self.causal)
            spec = KernelRfft.apply(spec, size)
        return fft_conv(x, swap_kernel_layout(spec, layout), size, layout, causal=self.causal)

    @staticmethod
    def stacked_spectra(tnos, n: int, device=None, direct: bool = False) -> Optional[List[Tuple[torch.Tensor, int]]]:
        """The ``mixing_kernel(n, direct)`` of each of ``tnos`` (a model's layers'), computed together: their RPEs as
        one batched MLP (``Rpe.stacked_channel_major``) and the spectra as one transform (none with ``direct`` where
        the RPEs give the kernels in time), the operations of one TNO's spectrum instead of one per TNO (eagerly,
        each operation costs a GPU 10-25 microseconds of host time). None where that does not apply: fewer than
        two, of different types, settings or directions, without an RPE, or RPEs that do not stack
        (``Rpe.stackable``: also the references on, ``fast.references``)."""
        first = tnos[0] if tnos else None
        if (len(tnos) < 2 or not hasattr(first, "rpe_positions")
                or any(type(t) is not type(first) or t.causal != first.causal or t.settings != first.settings
                       for t in tnos)):
            return None
        rpes = [t.rpe for t in tnos]
        if not Rpe.stackable(rpes):
            return None
        positions, scale, size = first.rpe_positions(n, device)
        k = Rpe.stacked_channel_major(rpes, positions, scale)  # (L, d, m)
        # the kernels in time (L, d, m) as the direct product takes them, or the spectra (L, d, F)
        kernels = first.time_kernel_of(k, size) if direct and first.kernel_in_time else first.spectrum_of(k, size)
        # unbind: one operation in the backward gathers the L gradients (indexing would add one per TNO)
        return [(kernel, size) for kernel in kernels.unbind(0)]
