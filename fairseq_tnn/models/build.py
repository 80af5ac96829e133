"""Build a registered TNN architecture outside fairseq's command line (benchmarks, tests, notebooks),
the way fairseq-train does: the arch preset fills an args namespace, then the model's dataclass config.
No models are registered here."""
import argparse

from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_NAME_REGISTRY, ARCH_MODEL_REGISTRY, MODEL_DATACLASS_REGISTRY

from . import tnn_lm, tnn_mlm  # noqa: F401  (registers the models and their architectures)


class VocabTask:
    """The two attributes a model's build_model reads from its task."""

    def __init__(self, dictionary: Dictionary):
        self.source_dictionary = self.target_dictionary = dictionary


def dictionary_of_size(size: int) -> Dictionary:
    """fairseq's 4 special symbols plus placeholder words, ``size`` symbols in all."""
    d = Dictionary()
    for i in range(size - len(d)):
        d.add_symbol(f"w{i}")
    return d


def build_arch(arch: str, vocab: int, **overrides):
    """A ``tnn_lm`` / ``tnn_mlm`` model of the registered ``arch`` with a ``vocab``-symbol dictionary;
    ``overrides`` (config field names) win over the preset, as command-line flags do."""
    args = argparse.Namespace(**overrides)
    ARCH_CONFIG_REGISTRY[arch](args)
    model_cls = ARCH_MODEL_REGISTRY[arch]
    cfg_cls = MODEL_DATACLASS_REGISTRY[ARCH_MODEL_NAME_REGISTRY[arch]]
    cfg = cfg_cls(**{k: v for k, v in vars(args).items() if k in cfg_cls.__dataclass_fields__})
    return model_cls.build_model(cfg, VocabTask(dictionary_of_size(vocab)))
