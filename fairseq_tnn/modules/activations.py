"""Activation functions selectable by name from the model configs."""
import torch.nn.functional as F

ACTIVATIONS = {
    "relu": F.relu,
    "silu": F.silu,
    "gelu": F.gelu,
    "elu": F.elu,
    "sigmoid": F.sigmoid,
    "tanh": F.tanh,
    "identity": lambda x: x,
}


def get_activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
