"""Resuming a checkpoint whose optimizer state was written in another layout of the parameters: before the RPEs'
weights were packed (fairseq_tnn 2026-11-28, ``Rpe.packed`` in fairseq_tnn/modules/rpe.py), or before the GTU's and
GLU's Linears were fused (later the same day, ``FusedLinear`` in fairseq_tnn/modules/linear.py). The rows
``checkpoint-key-order`` and ``packed-optimizer-state`` of the table in ``__init__``.

The model's weights load as they are: the packed modules' state_dict keeps each weight's own name. The optimizer's
state does not, in two ways:

- Where fairseq keeps a state per parameter tensor (fp32, ``--bf16-autocast``, ``--bf16`` on the CPU,
  ``--fp16-no-flatten-grads``), an older checkpoint lists 2 (layers + 2) tensors for each RPE and two (weight, bias)
  for each of the layers' Linears where the model now has one, and torch refuses the load (``loaded state dict
  contains a parameter group that doesn't match the size of optimizer's group``).
- Where fairseq keeps one flat state (``--fp16`` and ``--bf16`` on a GPU, fairseq's default), its values follow the
  order of the model's parameters. The packing kept that order for the Linears and for RPEs with RMS norms (the
  presets'), but an RPE with ``--rpe-norm-type layernorm`` had its norms' weights between its input projection and
  its hidden Linears and now has them after its packed tensor. torch loads such a state without a word, its Adam
  moments then belonging to other weights.

What tells the layout a checkpoint was written in is the order of its model's keys: a model's state_dict lists its
parameters' values in the order ``model.parameters()`` holds them (a packed parameter's weights under their own
names, in its order), in every layout. ``record_key_order`` (around ``Trainer.load_checkpoint``) notes that order as
the model loads the checkpoint, on every rank; ``merges_packed_state`` (around ``Trainer._build_optimizer``) then
hands the optimizer the state in the model's layout:

- a flat state is reordered from the checkpoint's order of keys to the model's;
- a per-tensor state is split and merged by the weights' names, the checkpoint's tensors found as runs of its keys
  under one of the layouts the plugin has had (every packed parameter as now, the RPEs packed and the Linears apart,
  every weight apart): each per-element value (Adam's moments) the concatenation of the weights' slices in the packed
  order, each other value (the step) the first weight's.

A state that fits none of them is handed on unchanged, for torch to load or refuse as before; a state already in the
model's layout (every resume but these) too.
"""
import functools
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger("fairseq_tnn.patches")

# the Trainer's attribute that holds the order of the keys of the checkpoint its model loaded last
KEY_ORDER = "_tnn_checkpoint_key_order"

# the key of a parameter that is not the model's (the criterion's), which no checkpoint's model lists
OUTSIDE = "<not the model's> "

# the layouts the plugin's checkpoints have had, newest first: {kind of packed parameter: packed as now?}, and when
LAYOUTS = (({"rpe": True, "linear": True}, "as now"),
           ({"rpe": True, "linear": False}, "before the GTU's and GLU's Linears were fused"),
           ({"rpe": False, "linear": False}, "before the RPEs' weights were packed"))


def layout(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> List[tuple]:
    """For each of ``params`` (the optimizer's, in the Trainer's order): (kind, shape, ((state_dict key, size), ...)):
    the keys whose values it holds, in its order; kind "rpe" or "linear" for a packed parameter (``PackedWeights``),
    None for any other. A parameter that is not the model's (the criterion's) has a key of its own, ``OUTSIDE``."""
    from ..modules.linear import PackedWeights
    from ..modules.rpe import Rpe
    packs = {id(m.packed): (prefix, m) for prefix, m in model.named_modules()
             if isinstance(m, PackedWeights) and "packed" in m._parameters}
    names: Dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    out = []
    for i, p in enumerate(params):
        if id(p) in packs:
            prefix, m = packs[id(p)]
            keys = tuple((f"{prefix}.{n}" if prefix else n, s) for n, s in zip(m._names, m._sizes))
            out.append(("rpe" if isinstance(m, Rpe) else "linear", tuple(p.shape), keys))
        else:
            out.append((None, tuple(p.shape), ((names.get(id(p), f"{OUTSIDE}{i}"), p.numel()),)))
    return out


def model_order(entries: List[tuple]) -> List[Tuple[str, int]]:
    """Every (key, size) of ``entries`` (``layout``) in the model's order: the order of its optimizer's values."""
    return [ks for _, _, keys in entries for ks in keys]


def written_order(entries: List[tuple], key_order: Optional[Sequence[str]]) -> List[Tuple[str, int]]:
    """Every (key, size) of ``entries`` in the order the checkpoint's writer held them: the order of its keys
    (``key_order``), the criterion's after the model's. Where ``key_order`` is unknown or lacks a key: the model's
    order."""
    now = model_order(entries)
    if key_order is None:
        return now
    position = {k: i for i, k in enumerate(key_order)}
    model = [ks for ks in now if not ks[0].startswith(OUTSIDE)]
    if any(k not in position for k, _ in model):
        return now
    return sorted(model, key=lambda ks: position[ks[0]]) + [ks for ks in now if ks[0].startswith(OUTSIDE)]


def written_params(entries: List[tuple], order: List[tuple], packed: Dict[str, bool]) -> Optional[List[list]]:
    """The checkpoint's parameters under the layout ``packed`` (``LAYOUTS``), each a list of (key, size): runs of
    ``order`` that are one packed parameter's weights in its order, or one weight each; None where ``order`` does not
    fit that layout."""
    label, pack_keys = {}, {}
    for i, (kind, _, keys) in enumerate(entries):
        whole = kind is not None and packed[kind]
        for j, (key, _) in enumerate(keys):
            label[key] = i if whole else (i, j)
        if whole:
            pack_keys[i] = [k for k, _ in keys]
    runs: List[list] = []
    for ks in order:
        if runs and label[ks[0]] == label[runs[-1][0][0]]:
            runs[-1].append(ks)
        else:
            runs.append([ks])
    seen = set()
    for run in runs:
        lab = label[run[0][0]]
        if lab in seen or (lab in pack_keys and [k for k, _ in run] != pack_keys[lab]):
            return None
        seen.add(lab)
    return runs


def _per_element(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def regrouped(state: Dict, entries: List[tuple], runs: List[list]) -> Optional[Dict]:
    """A per-tensor optimizer state whose parameters are ``runs`` (``written_params``), as the parameters of
    ``entries``; None where its values do not fit."""
    (group,) = state["param_groups"]
    ids, states = group["params"], state.get("state", {})
    if len(ids) != len(runs):
        return None
    where = {}
    for j, run in enumerate(runs):
        offset = 0
        for key, size in run:
            where[key] = (j, offset, size)
            offset += size
        total = offset
        for value in states.get(ids[j], {}).values():
            if _per_element(value) and value.numel() != total:
                return None
    out = {}
    for k, (_, shape, keys) in enumerate(entries):
        parts = [where[key] for key, _ in keys]
        have = [ids[j] in states for j, _, _ in parts]
        if not any(have):
            continue  # no state yet (no update took this parameter)
        if not all(have) or any(set(states[ids[j]]) != set(states[ids[parts[0][0]]]) for j, _, _ in parts):
            return None
        first = states[ids[parts[0][0]]]
        out[k] = {name: (torch.cat([states[ids[j]][name].reshape(-1)[o: o + s] for j, o, s in parts]).view(shape)
                         if _per_element(value) else value)
                  for name, value in first.items()}
    return {**state, "state": out, "param_groups": [{**group, "params": list(range(len(entries)))}]}


def reordered_flat(state: Dict, entries: List[tuple], order: List[tuple]) -> Optional[Dict]:
    """A flat optimizer state (one parameter holding every value) written in ``order``, in the order of ``entries``;
    None where it is not one, or is in that order already."""
    (group,) = state["param_groups"]
    now = model_order(entries)
    total = sum(s for _, s in now)
    if len(group["params"]) != 1 or order == now:
        return None
    (pid,) = group["params"]
    values = state.get("state", {}).get(pid)
    if not values or not any(_per_element(v) for v in values.values()) or any(
            _per_element(v) and v.numel() != total for v in values.values()):
        return None
    offsets, offset = {}, 0
    for key, size in order:
        offsets[key] = offset
        offset += size
    index = torch.cat([torch.arange(offsets[key], offsets[key] + size) for key, size in now])
    moved = {name: (v.reshape(-1)[index.to(v.device)].view(v.shape) if _per_element(v) else v)
             for name, v in values.items()}
    return {**state, "state": {**state["state"], pid: moved}}


def in_model_layout(state: Dict, entries: List[tuple], key_order: Optional[Sequence[str]]) -> Tuple[Optional[Dict], str]:
    """``state`` (a torch optimizer state dict, with any other keys of fairseq's) in the layout of ``entries``
    (``layout``), written by a model whose state_dict listed ``key_order``; (None, "") where it is in that layout
    already or fits no layout known here. The second value says what was done, for the log."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not groups or len(groups) != 1:
        return None, ""
    order = written_order(entries, key_order)
    n = len(groups[0]["params"])
    if n == 1 and len(entries) > 1:
        flat = reordered_flat(state, entries, order)
        return (flat, "its flat state reordered from the checkpoint's order of weights") if flat else (None, "")
    now = model_order(entries)
    if n == len(entries) and order == now:
        return None, ""
    for packed, when in LAYOUTS:
        runs = written_params(entries, order, packed)
        merged = regrouped(state, entries, runs) if runs is not None else None
        if merged is not None:
            return merged, f"its {n} per-tensor states as the model's {len(entries)} (written {when})"
    return None, ""


def record_key_order(original):
    """``Trainer.load_checkpoint``, noting the order of the keys of the checkpoint's model as the model loads it (on
    every rank: the others load what rank 0 broadcasts) for ``merges_packed_state``."""

    @functools.wraps(original)
    def load_checkpoint(self, *args, **kwargs):
        def note(module, state_dict, prefix, *rest):
            if prefix == "":
                setattr(self, KEY_ORDER, list(state_dict))

        setattr(self, KEY_ORDER, None)
        handle = self.get_model().register_load_state_dict_pre_hook(note)
        try:
            return original(self, *args, **kwargs)
        finally:
            handle.remove()

    return load_checkpoint


def merges_packed_state(trainer, optimizer) -> None:
    """Make ``optimizer.load_state_dict`` hand the optimizer a state of another layout in the model's
    (``in_model_layout``) first."""
    load = optimizer.load_state_dict

    @functools.wraps(load)
    def load_state_dict(state_dict, optimizer_overrides=None):
        params = [p for p in list(trainer.model.parameters()) + list(trainer.criterion.parameters()) if p.requires_grad]
        entries = layout(trainer.get_model(), params)
        # keeps the dict's other keys (FP16Optimizer's loss scale)
        changed, what = in_model_layout(state_dict, entries, getattr(trainer, KEY_ORDER, None))
        if changed is not None:
            logger.info("the checkpoint's optimizer state was written in another layout of the parameters: %s", what)
            state_dict = changed
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
