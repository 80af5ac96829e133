"""fairseq-tnn: Toeplitz neural networks as a fairseq plugin.

fairseq itself (the maintained ``fairseq-fixed`` release) must be built against
the installed torch with ``--no-build-isolation``; scripts/setup.sh does it in
the right order. Install this package editable (``pip install --no-deps -e .``)
so that the installed package and the ``--user-dir`` are the same directory.
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
    install_requires=[
        "torch>=2.6",
        "fairseq-fixed==0.12.3.1",
        "sentencepiece==0.2.3",
        "sacremoses==0.2.0",
        "tensorboard==2.21.0",
        "tensorboardX==2.6.5",
        "matplotlib>=3.8",
    ],
    extras_require={"test": ["pytest>=8"]},
)
