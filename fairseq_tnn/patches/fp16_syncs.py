"""``--fp16``: FP16Optimizer's two syncs between the fp16 model and its flat fp32 master weights as one
multi-tensor copy each (the ``fp16-grads-sync`` and ``fp16-params-sync`` rows of the table in ``__init__``).

FP16Optimizer keeps the fp32 master weights and their gradients in one flat tensor per device, so Adam and
gradient clipping see one parameter. Its two syncs with the fp16 model, the gradients before every step and the
weights after it, copy parameter by parameter in a Python loop: 2 x 171 copies per update for tnn_lm_wt103, each a
kernel launch on a GPU, where training is bound by the host launching work (docs/performance.md). With flat master
weights (fairseq's default) these are one ``torch._foreach_copy_`` per direction, device and parameter dtype over
cached views of the flat tensors: the same copies, in the same dtypes, for any model. One per dtype, because CUDA's
multi-tensor copy takes its one-kernel path only where all sources share a dtype and all destinations share one;
a list that mixes the TNN models' fp16 weights with their RPEs' fp32 ones (``modules/rpe.py``) falls back to a copy
per tensor (a GPU profile counted 349 copies in a causal TNN update: docs/performance.md).
``benchmarks/fp16_syncs.py`` measures the host time of both, side by side; ``--fp16-no-flatten-grads`` runs
fairseq's own code.
"""
import torch


def _flat(optimizer) -> bool:
    """Whether ``optimizer`` keeps flat master weights (a dict device -> flat tensor: fairseq's default)."""
    return optimizer.has_flat_params and isinstance(optimizer.fp32_params, dict)


def _by_dtype(params, views) -> list:
    """(parameters, their flat views) per parameter dtype, each in the parameters' order."""
    groups = {}
    for p, v in zip(params, views):
        ps, vs = groups.setdefault(p.dtype, ([], []))
        ps.append(p)
        vs.append(v)
    return list(groups.values())


def _groups(optimizer, key: str, flat: torch.Tensor, params) -> list:
    """:func:`_by_dtype` of ``params`` and their views of ``flat``, laid end to end (FP16Optimizer's flat layout),
    kept on the optimizer for as long as ``flat`` keeps its storage and ``params`` are the same tensors: made once,
    not at each update (the grouping was 3% of a graphed update's host time in the eighth GPU run)."""
    cache = optimizer.__dict__.setdefault("_tnn_flat_groups", {})
    hit = cache.get(key)
    if (hit is None or hit[0] != flat.data_ptr() or len(hit[1]) != len(params)
            or not all(a is b for a, b in zip(hit[1], params))):
        views, offset = [], 0
        for p in params:
            views.append(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        hit = cache[key] = (flat.data_ptr(), list(params), _by_dtype(params, views))
    return hit[2]


def grads_sync(original):
    def _sync_fp16_grads_to_fp32(self):
        if not (self._needs_sync and _flat(self)):
            return original(self)
        with torch.no_grad():
            for device, flat in self.fp32_params.items():
                params = [p for p in self.fp16_params if p.requires_grad and p.device.index == device]
                for ps, views in _groups(self, f"grad{device}", flat.grad, params):
                    torch._foreach_copy_(views, [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps])
        self._needs_sync = False

    return _sync_fp16_grads_to_fp32


def params_sync(original):
    def _sync_fp32_params_to_fp16(self):
        if not _flat(self):
            return original(self)
        with torch.no_grad():
            for device, flat in self.fp32_params.items():
                params = [p for p in self.fp16_params if p.device.index == device]
                for ps, views in _groups(self, f"param{device}", flat, params):
                    torch._foreach_copy_(ps, views)

    return _sync_fp32_params_to_fp16
