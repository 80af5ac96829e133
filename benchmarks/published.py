"""The published figures the benchmark prints (and plots) beside its own measurements, with their sources.

* ``PAPER``, ``SKI_PAPER_A100``: whole training steps on an A100, from Moreno, Mei, Walters, "SKI to go Faster:
  Accelerating Toeplitz Neural Networks via Asymmetric Kernels", NeurIPS 2023: speed-ups of FD-TNN and
  SKI-TNN over the TNN of Qin et al., "Toeplitz Neural Network for Sequence Modeling", ICLR 2023, and SKI-TNN's
  memory as a fraction of TNN's (docs/references.md#ski-tnn-and-fd-tnn).
* ``AUTHORS_MS``, ``AUTHORS_MIB_2048_BI``: the authors' released operators, one TNO layer forward + backward at
  b = 4, d1 = 1536, timed on a 2-core CPU machine like the one the benchmark was written on, with the bare FFT
  convolution (the floors) timed the same way for calibration (docs/references.md#the-authors-operators-on-cpu).
"""

# Keyed (section, configuration, n or None for every n, baseline configuration): the text of the table's
# "papers" column. Speed-up = the baseline's step time / the configuration's; memory = the configuration's / the baseline's.
PAPER = {
    # SKI paper, A100, whole training steps (speed-up over the TNN baseline; memory as a fraction of it)
    ("causal", "fd3", 512, "tnn6"): "1.15x (A100, 15% faster)",
    ("causal", "fd3", 512, "tnn3"): "1.10x (A100, 10% faster)",
    ("bidirectional", "fd3", None, "tnn6"): "1.35-1.8x (A100, 35-80% faster)",
    ("bidirectional", "ski", 512, "tnn6"): "1.25x, memory 0.83x (A100)",
    ("bidirectional", "ski", 2048, "tnn6"): "1.3x, memory 0.58x (A100)",
}

# The same figures as numbers, for the plots.
SKI_PAPER_A100 = {
    "fd_causal_speedup_vs_tnn6": {512: 1.15},
    "fd_bidirectional_speedup_range": (1.35, 1.8),
    "ski_speedup": {512: 1.25, 2048: 1.3},
    "ski_memory": {512: 0.83, 2048: 0.58},
}

# (direction, n): {operator: ms}; "floor_dim2" is the FFT convolution along dim -2 (the authors' layout),
# "floor_autograd" the channel-major one with torch's autograd, the floor both runs measure.
AUTHORS_MS = {
    ("causal", 512): {"tnn": 139, "fd": 149, "floor_dim2": 92, "floor_autograd": 55},
    ("causal", 2048): {"tnn": 641, "fd": 673, "floor_dim2": 494, "floor_autograd": 211},
    ("bidirectional", 512): {"tnn": 188, "fd": 178, "ski": 230, "floor_dim2": 130, "floor_autograd": 63},
    ("bidirectional", 2048): {"tnn": 647, "fd": 655, "ski": 905, "floor_dim2": 455, "floor_autograd": 208},
}
# Peak tensor memory (MiB above the input and the output gradient) of the same operators, n = 2048, bidirectional
AUTHORS_MIB_2048_BI = {"tnn": 950, "fd": 916, "ski": 288, "floor_dim2": 864, "floor_autograd": 672}

