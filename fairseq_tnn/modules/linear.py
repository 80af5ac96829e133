"""Linear layers whose weights and biases are views of one parameter, with the state_dict of ``nn.Linear``s.

Every parameter tensor costs an update host time of its own: autograd's ``AccumulateGrad``, the checks of a CUDA
graph's inputs and outputs, fairseq's gradient copies (the eighth GPU run: about 15 microseconds a tensor in a graphed
update, docs/performance.md). ``PackedWeights`` holds a module's Linears' weights and biases as one flat parameter,
``packed``, in the order the Linears would have held them, so that ``model.parameters()`` lists the same values in the
same order (fairseq's flat fp32 master copy of ``--fp16`` is laid out alike either way), while the state_dict keeps each
weight under the name an ``nn.Linear`` child would give it: checkpoints are the same with or without the packing.
``Rpe`` packs its MLP's Linears this way (modules/rpe.py), ``FusedLinear`` its own weight and bias (the GTU's and the
GLU's projections, modules/layers.py).
"""
import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn


class PackedLinear(nn.Module):
    """A Linear layer whose ``weight`` and ``bias`` are views of its owner's packed parameter (``PackedWeights``),
    made at each access, so that they follow it through device moves, casts and loads. It holds no parameter of its
    own: the owner saves and loads its weights under this module's names (``weight``, ``bias``), as an ``nn.Linear``'s.
    ``slot``: the weight's place in the owner's ``_names`` (the bias's is the next)."""

    def __init__(self, owner: nn.Module, slot: int, in_features: int, out_features: int):
        super().__init__()
        object.__setattr__(self, "_owner", owner)  # a plain reference: the owner holds this module, not the reverse
        self.slot, self.in_features, self.out_features = slot, in_features, out_features

    @property
    def weight(self) -> torch.Tensor:
        return self._owner.packed_view(self.slot)

    @property
    def bias(self) -> torch.Tensor:
        return self._owner.packed_view(self.slot + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def _load_from_state_dict(self, state_dict, prefix, *args):
        """Nothing: the owner loads this module's keys into its packed parameter (``PackedWeights``)."""


class PackedWeights:
    """A mixin for an ``nn.Module``: the weights and biases of its Linears as one parameter, ``packed`` (see the
    module's docstring). ``pack(linears)`` takes (state_dict name, ``nn.Linear``) pairs, concatenates their weights and
    biases (weight before bias, the Linears in the order given) into ``packed``, and returns a ``PackedLinear`` of
    views for each, to put in the Linear's place."""

    def pack(self, linears: Sequence[Tuple[str, nn.Linear]]) -> list:
        tensors = [(f"{name}{'.' if name else ''}{kind}", getattr(m, kind)) for name, m in linears
                   for kind in ("weight", "bias")]
        self._names = tuple(name for name, _ in tensors)
        self._shapes = tuple(tuple(t.shape) for _, t in tensors)
        self._sizes = tuple(math.prod(shape) for shape in self._shapes)
        self._offsets = tuple(sum(self._sizes[:i]) for i in range(len(self._sizes)))
        self.packed = nn.Parameter(torch.cat([t.detach().reshape(-1) for _, t in tensors]))
        return [PackedLinear(self, 2 * i, m.in_features, m.out_features) for i, (_, m) in enumerate(linears)]

    def packed_view(self, slot: int) -> torch.Tensor:
        """The weight or bias ``slot`` (``_names``' order) as a view of ``packed``."""
        return self.packed.narrow(0, self._offsets[slot], self._sizes[slot]).view(self._shapes[slot])

    def unpacked(self, packed: Optional[torch.Tensor] = None) -> list:
        """Every weight and bias (``_names``' order) as views of ``packed`` (default: ``self.packed``), made by one
        split (whose backward is one concatenation, where a view each would add a zero-filled gradient each)."""
        packed = self.packed if packed is None else packed
        return [v.view(shape) for v, shape in zip(packed.split(self._sizes), self._shapes)]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if prefix + "packed" not in destination:  # not packed (the tests' stand-in for the layout before packing)
            return
        packed = destination.pop(prefix + "packed")
        for name, view in zip(self._names, self.unpacked(packed)):
            destination[prefix + name] = view

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Each weight and bias, under the name an ``nn.Linear`` would give it, copied into its place in ``packed``;
        missing, unexpected and wrongly sized keys reported as ``nn.Module`` reports them."""
        if "packed" not in self._parameters:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        for hook in self._load_state_dict_pre_hooks.values():
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        with torch.no_grad():
            for name, view in zip(self._names, self.unpacked(self.packed.detach())):
                key = prefix + name
                if key not in state_dict:
                    if strict:
                        missing_keys.append(key)
                    continue
                value = state_dict[key]
                if not isinstance(value, torch.Tensor) or value.shape != view.shape:
                    error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                      f"{getattr(value, 'shape', type(value).__name__)} from checkpoint, the shape "
                                      f"in current model is {view.shape}.")
                    continue
                view.copy_(value)
        if strict:
            unexpected_keys.extend(key for key in state_dict if key.startswith(prefix)
                                   and key[len(prefix):] not in self._names
                                   and key[len(prefix):].split(".", 1)[0] not in self._modules)


class FusedLinear(PackedWeights, PackedLinear):
    """``nn.Linear(in_features, out_features)`` with its weight and bias as one parameter (``packed``): the same
    initialisation (an ``nn.Linear``'s draws), function and state_dict (``weight``, ``bias``), one tensor where an
    ``nn.Linear`` has two. ``parts()`` gives both views by one operation."""

    def __init__(self, in_features: int, out_features: int):
        linear = nn.Linear(in_features, out_features)
        PackedLinear.__init__(self, self, 0, in_features, out_features)
        self.pack([("", linear)])

    def parts(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(weight, bias), views of ``packed`` made by one split (and the weight's reshape; the bias is a piece of the
        split as it is)."""
        weight, bias = self.packed.split(self._sizes)
        return weight.view(self._shapes[0]), bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, *self.parts())
