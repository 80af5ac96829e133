"""Resuming a checkpoint written before the RPEs' weights were packed (fairseq_tnn 2026-11-28, ``Rpe.packed`` in
fairseq_tnn/modules/rpe.py), or before the GTU's and GLU's Linears were fused (later the same day, ``FusedLinear`` in
fairseq_tnn/modules/linear.py): its optimizer state, where fairseq keeps one per parameter tensor, is merged into the
packed layout (the ``packed-optimizer-state`` row of the table in ``__init__``).

The model's weights load as they are: the packed modules' state_dict keeps each weight's own name. The optimizer's
state does not. Where fairseq keeps it per parameter tensor (fp32, ``--bf16-autocast``, ``--bf16`` on the CPU,
``--fp16-no-flatten-grads``), an older checkpoint lists 2 (layers + 2) tensors for each RPE and two (weight, bias) for
each of the layers' Linears where the model now has one, and torch refuses the load (``loaded state dict contains a
parameter group that doesn't match the size of optimizer's group``). A flat master copy (``--fp16`` and ``--bf16`` on a
GPU, fairseq's default) needs nothing where the packing kept the parameters' order: it does for the Linears, and for
RPEs with RMS norms (the presets'); an RPE with ``--rpe-norm-type layernorm`` lists its norms' weights after its packed
tensor, where they were between its Linears, so such a flat state written before the RPE packing does not line up.

``Trainer._build_optimizer`` builds the optimizer that ``Trainer.load_checkpoint`` then loads the checkpoint's state
into; after it, the optimizer's ``load_state_dict`` merges a state of an older layout first: for each packed
parameter, its weights' consecutive entries become one, each per-element tensor (Adam's moments) their flattened
concatenation in the packed order, each other value (the step) the first weight's. The layouts tried: every packed
parameter's weights apart (before the RPE packing), then the RPEs packed and the Linears' weights apart. A state of
any other shape is handed on unchanged, for torch to load or refuse as before.
"""
import functools
import logging
from typing import Dict, List, Optional, Sequence

import torch

logger = logging.getLogger("fairseq_tnn.patches")


def packed_sizes(model: torch.nn.Module, params: Sequence[torch.Tensor], rpes: bool = True) -> List[Optional[tuple]]:
    """For each of ``params`` (the optimizer's, in the Trainer's order): the sizes of the weights a packed parameter
    holds (``PackedWeights``: an RPE's, a ``FusedLinear``'s), or None for any other parameter; with ``rpes`` False,
    None for the RPEs' too (the layout before the Linears were fused, whose RPEs were packed already)."""
    from ..modules.linear import PackedWeights
    from ..modules.rpe import Rpe
    packs = {id(m.packed): m._sizes for m in model.modules()
             if isinstance(m, PackedWeights) and "packed" in m._parameters and (rpes or not isinstance(m, Rpe))}
    return [packs.get(id(p)) for p in params]


def _merged(parts: List[Dict], sizes: tuple) -> Optional[Dict]:
    """One packed parameter's state from its weights' ``parts``; None where they do not fit ``sizes``."""
    if len(parts) != len(sizes) or any(set(p) != set(parts[0]) for p in parts):
        return None
    out = {}
    for key, first in parts[0].items():
        values = [p[key] for p in parts]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            if [v.numel() for v in values] != list(sizes):
                return None
            out[key] = torch.cat([v.reshape(-1) for v in values])
        else:
            out[key] = first  # the step, the same for every weight of one update
    return out


def packed_state(state: Dict, sizes: List[Optional[tuple]]) -> Optional[Dict]:
    """A torch optimizer state dict of the layout before the packing, as the packed parameters' (``sizes``: one per
    parameter now, ``packed_sizes``); None where ``state`` is not of that layout (one parameter group listing each
    packed parameter's weights in their place)."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not groups or len(groups) != 1 or not any(sizes):
        return None
    old = groups[0]["params"]
    if len(old) != sum(len(s) if s else 1 for s in sizes):
        return None
    states, new_states, j = state.get("state", {}), {}, 0
    for k, s in enumerate(sizes):
        ids = old[j: j + (len(s) if s else 1)]
        j += len(ids)
        parts = [states[i] for i in ids if i in states]
        if not parts:
            continue  # no state yet (no update took this parameter)
        if s is None:
            new_states[k] = parts[0]
            continue
        merged = _merged(parts, s)
        if merged is None:
            return None
        new_states[k] = merged
    return {**state, "state": new_states, "param_groups": [{**groups[0], "params": list(range(len(sizes)))}]}


def merges_packed_state(trainer, optimizer) -> None:
    """Make ``optimizer.load_state_dict`` merge an older checkpoint's per-tensor state (``packed_state``) first."""
    load = optimizer.load_state_dict

    @functools.wraps(load)
    def load_state_dict(state_dict, optimizer_overrides=None):
        params = [p for p in list(trainer.model.parameters()) + list(trainer.criterion.parameters()) if p.requires_grad]
        for rpes, when in ((True, "before the RPEs' weights were packed"),
                           (False, "before the GTU's and GLU's Linears were fused")):
            sizes = packed_sizes(trainer.model, params, rpes)
            merged = packed_state(state_dict, sizes)  # keeps the dict's other keys (FP16Optimizer's loss scale)
            if merged is not None:
                logger.info("the checkpoint's optimizer state lists packed weights apart (written %s): %d states merged "
                            "into %d", when, len(state_dict["param_groups"][0]["params"]), len(sizes))
                state_dict = merged
                break
        return load(state_dict, optimizer_overrides)

    optimizer.load_state_dict = load_state_dict


def build_optimizer(original):
    """``Trainer._build_optimizer``, whose optimizer then loads an older checkpoint's state (``merges_packed_state``)."""

    @functools.wraps(original)
    def _build_optimizer(self):
        out = original(self)
        merges_packed_state(self, self._optimizer)
        return out

    return _build_optimizer
