"""fairseq's Adam step and gradient-norm clipping as multi-tensor kernels (the ``fused-adam`` and
``foreach-grad-norm`` rows of the table in ``__init__``), where NVIDIA's apex is not installed.

Without apex (a stock fairseq from PyPI), ``--optimizer adam`` runs ``fairseq.optim.adam.Adam``, which loops over
the parameters in Python: about 9 operations per parameter (``mul_``, ``add_``, ``mul_``, ``addcmul_``, ``sqrt``,
``add_``, the weight decay's ``add_``, ``addcdiv_``), and ``fairseq.utils.clip_grad_norm_`` takes one norm and one
device copy per gradient. Where the master weights are one flat tensor (``--fp16``, fairseq's default) that is
9 operations an update, each a full pass over all the weights; where they are not (fp32, ``--bf16-autocast``,
``--fp16-no-flatten-grads``) it is about 1,550 operations an update for ``tnn_lm_wt103``'s 171 parameters, more than
its forward and backward, and on a GPU each is a kernel launch the host must issue.

* ``adam_step``: the same update as fairseq's, by ``torch._fused_adam_``, one kernel (per chunk of tensors) for
  all the parameters of a device, reading each weight, gradient and moment once. fairseq adds eps to the square
  root of the second moment before the bias correction, torch after it; passing eps / sqrt(1 - beta2^t) to
  torch's kernel gives fairseq's update (up to rounding). The decoupled weight decay, where there is one, is
  fairseq's own expression, one multi-tensor ``_foreach_add_`` before the kernel. The state keeps fairseq's
  layout (an int ``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints load either way. Groups it does not
  cover (amsgrad, 16-bit weights of ``--memory-efficient-fp16``, sparse gradients, a torch without the kernel)
  run fairseq's own step.
* ``clip_grad_norm``: the total norm of several gradients by ``torch._foreach_norm`` (one multi-tensor kernel
  per device) instead of one norm and one copy per gradient; the clipping was already one ``_foreach_mul_``.
  With apex's ``multi_tensor_l2norm`` available, or one gradient (the flat fp16 master), fairseq's own code runs.

Where ``--fp16``'s overflow is decided on the device (``device_overflow.py``), the step it hands over under
:data:`FOUND_INF` holds the device's verdict: the kernel then skips the update on the device (torch's ``found_inf``),
the weight decay is multiplied by zero, and the steps it counts are listed for the host to take back once it learns
of the overflow.

``benchmarks/optimizer_step.py`` measures both side by side with fairseq's code; tests/reliability/
test_multi_tensor_optim.py compares them with it.
"""
import math
from typing import Dict, List, Tuple

import torch

FLOAT_DTYPES = (torch.float32, torch.float64)
DEVICE_TYPES = ("cpu", "cuda")
STATE_KEYS = frozenset(("step", "exp_avg", "exp_avg_sq"))
# The Adam optimizer's attribute that holds, for its next step, (found_inf, counted): a float32 tensor on the weights'
# device, 1.0 where the gradients overflowed, and the list that collects the states whose step the update counted
FOUND_INF = "fairseq_tnn_found_inf"


def _fusable(opt, group) -> bool:
    """Whether ``group`` of fairseq's Adam ``opt`` can take the fused kernel: no amsgrad, every parameter with a
    gradient a dense fp32/fp64 tensor like its gradient, on a CPU or CUDA device, its state empty or fairseq's."""
    if group.get("amsgrad", False) or not hasattr(torch, "_fused_adam_"):
        return False
    states = opt.state
    for p in group["params"]:
        g = p.grad
        if g is None:
            continue
        dtype = p.dtype
        if (dtype not in FLOAT_DTYPES or g.dtype is not dtype or g.layout is not torch.strided
                or p.device.type not in DEVICE_TYPES or g.device != p.device):
            return False
        state = states.get(p)
        if state and not (STATE_KEYS <= state.keys() and type(state["step"]) is int):
            return False
    return True


def _fused_group_step(opt, group, found_inf=None, counted=None) -> None:
    """fairseq's Adam update of one group (see the module docstring), one fused call per (device, dtype, step);
    ``found_inf`` and ``counted``: the device's verdict on the gradients (see :data:`FOUND_INF`)."""
    beta1, beta2 = group["betas"]
    buckets: Dict[Tuple, Tuple[List, List, List, List]] = {}
    for p in group["params"]:
        if p.grad is None:
            continue
        state = opt.state[p]
        if len(state) == 0:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        else:  # as fairseq: moments loaded from a checkpoint follow the parameter's device and dtype (a cast only
            # where they differ: fairseq's unconditional .to(p.data), 2 dispatches per parameter and step, was most
            # of this loop's host time)
            for key in ("exp_avg", "exp_avg_sq"):
                t = state[key]
                if t.device != p.device or t.dtype != p.dtype:
                    state[key] = t.to(p)
        state["step"] += 1
        if counted is not None:
            counted.append(state)
        params, grads, avgs, sqs = buckets.setdefault((p.device, p.dtype, state["step"]), ([], [], [], []))
        params.append(p)
        grads.append(p.grad)
        avgs.append(state["exp_avg"])
        sqs.append(state["exp_avg_sq"])
    for (device, _, step), (params, grads, avgs, sqs) in buckets.items():
        if group["weight_decay"] != 0:
            # fairseq's p + (-wd lr) p, before the update: the kernel's p (1 - lr wd) rounds 1 - lr wd to the
            # weights' precision, a bias of the decay that grows over the steps (1e-5 after 200 in fp32)
            # (after an overflow found on the device, p + (-wd lr) 0: p * 1 is p, so the sum is the same otherwise)
            decayed = params if found_inf is None else torch._foreach_mul(params, 1 - found_inf)
            torch._foreach_add_(params, decayed, alpha=-group["weight_decay"] * group["lr"])
        bias_correction2 = 1 - beta2 ** step
        # the kernel reads the step (for its bias corrections) from a float32 tensor on the parameters' device
        steps = [torch.full((), float(step), dtype=torch.float32, device=device)] * len(params)
        torch._fused_adam_(params, grads, avgs, sqs, [], steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                           weight_decay=0.0, eps=group["eps"] / math.sqrt(bias_correction2), amsgrad=False,
                           maximize=False, found_inf=found_inf)


def adam_step(original):
    def step(self, closure=None):
        verdict = self.__dict__.pop(FOUND_INF, (None, None))
        if not all(_fusable(self, group) for group in self.param_groups):
            if verdict[0] is not None:
                raise RuntimeError("fairseq_tnn: an Adam step with the device's overflow verdict cannot be fused")
            return original(self, closure)
        loss = closure() if closure is not None else None
        with torch.no_grad():  # the weights themselves updated in place (fairseq's code goes through .data)
            for group in self.param_groups:
                _fused_group_step(self, group, *verdict)
        return loss

    return step


def _total_norm(grads: List[torch.Tensor], device) -> torch.Tensor:
    """The 2-norm of all ``grads`` together, in float32 on ``device``: each device's norms in one multi-tensor
    kernel (fp32 accumulation, as fairseq's ``torch.norm(g, dtype=torch.float32)``)."""
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    norms = []
    for on, same in by_device.items():
        each = torch._foreach_norm(same, 2, dtype=torch.float32)
        norms += each if on == device else [n.to(device) for n in each]  # a copy per norm only across devices
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_grad_norm(original):
    import fairseq.utils

    @torch.no_grad()
    def clip_grad_norm_(params, max_norm, aggregate_norm_fn=None) -> torch.Tensor:
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        with_grad = [p for p in params if p is not None and getattr(p, "grad", None) is not None]
        # fairseq's p.grad.detach(): under no_grad the gradients themselves (a view each was host time only)
        grads = [p.grad for p in with_grad if not hasattr(p, "expert")]
        if fairseq.utils.multi_tensor_l2norm_available or len(grads) < 2 or grads[0].device.type == "xla":
            return original(params, max_norm, aggregate_norm_fn)
        expert_grads = [p.grad for p in with_grad if hasattr(p, "expert")]
        # fairseq gathers the norms on the current CUDA device where there is one, else on the CPU
        device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                  else torch.device("cpu"))
        total_norm = _total_norm(grads, device)
        if aggregate_norm_fn is not None:
            total_norm = aggregate_norm_fn(total_norm)
        if max_norm > 0:
            clip_coef = (float(max_norm) / (total_norm + 1e-6)).clamp_(max=1)
            torch._foreach_mul_(grads + expert_grads, clip_coef)
        return total_norm

    return clip_grad_norm_
