"""fairseq-tnn: Toeplitz neural networks as a fairseq plugin.

Two parts. The core, ``fairseq_tnn.ops`` and ``fairseq_tnn.modules`` (the Toeplitz operators, the TNOs, the
GTU, the GLU and the TNN layer), needs torch alone: ``pip install .`` installs it and nothing else. The
fairseq plugin (models, tasks, hub, scripts) needs the ``fairseq`` extra: ``pip install .[fairseq]``.
fairseq itself (the maintained ``fairseq-fixed`` release) must be built against the installed torch with
``--no-build-isolation``; scripts/setup.sh installs everything in the right order and this package editable
(``pip install --no-deps -e .``), so that the installed package and the ``--user-dir`` are the same directory.
"""
from setuptools import find_packages, setup

setup(
    name="fairseq-tnn",
    version="0.1.0",
    description="Toeplitz neural networks (TNN, FD-TNN, SKI-TNN) for fairseq",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fairseq_tnn", "fairseq_tnn.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.6"],  # the ops and modules (docs/setup.md: the torch versions tested)
    # the project's commands (fairseq_tnn/commands), also ``python -m fairseq_tnn``
    entry_points={"console_scripts": ["fairseq-tnn=fairseq_tnn.commands:main"]},
    extras_require={
        "fairseq": [
            "torch>=2.10",  # --tnn-compile: torch._functorch's force_non_lazy_backward_lowering (docs/setup.md)
            "fairseq-fixed==0.12.3.1",
            "sentencepiece==0.2.3",
            "sacremoses==0.2.0",
            "tensorboard==2.21.0",
            "tensorboardX==2.6.5",
            "matplotlib>=3.8",
        ],
        "test": ["pytest>=8"],
    },
)
