"""fairseq's own ``--bf16`` on a GPU or a CPU: bf16 weights with an fp32 master copy, as ``--fp16`` trains
(the ``bf16-without-tpu`` and ``bf16-flat-master`` rows of the table in ``__init__``).

fairseq 0.12 reads ``--bf16`` as TPU training: ``options.parse_args_and_arch`` turns ``--tpu`` on with it, the
distributed launch then skips its GPU set-up, and the Trainer asks torch_xla for its device, which fails with an
ImportError wherever torch_xla is not installed. Apart from that flag, what fairseq does with ``common.bf16``
holds on any device: the Trainer casts the model and criterion to bf16 (our RPEs keep fp32 weights,
``modules/rpe.py``) and the samples' floating-point tensors too, and builds ``FP16Optimizer``, which keeps an fp32
master copy of the weights and their gradients and, for bf16, no loss scaler (bf16 has fp32's exponent range).
That is ``--fp16``'s training with bf16 in place of fp16: no autocast casting fp32 weights at every forward, as
``--bf16-autocast`` (``tasks/precision.py``) does.

* ``call_main``: fairseq's CLIs hand their config to ``distributed_utils.call_main``. Where torch_xla is not
  installed and ``--tpu`` is not on the command line, ``--bf16`` (or ``--memory-efficient-bf16``) leaves
  ``common.tpu`` off there, before the launch reads it: the run trains on the GPU or, with ``--cpu``, the CPU.
  The plugin is imported during ``parse_args_and_arch``, before it sets ``tpu``, so no earlier place is left.
* ``build_optimizer``: under bf16 FP16Optimizer keeps the master copy per parameter ("mixed precision is faster on
  TPUs without flat grads"). On CUDA it is flat here, as fairseq keeps ``--fp16``'s (unless
  ``--fp16-no-flatten-grads``): one tensor for the gradients' sync, the clipping and Adam's step, and the
  plugin's one-copy syncs (``fp16_syncs.py``). fairseq keys a flat copy by the current CUDA device, so off CUDA it
  stays per parameter, fairseq's own bf16 layout.

tests/modules/test_precision.py trains with ``--bf16`` through fairseq-train; tests/gpu does on CUDA, flat.
"""
import importlib.util
import logging
import sys

logger = logging.getLogger("fairseq_tnn.patches")


def _xla_installed() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def _sections(cfg):
    """The sections of fairseq's config (``common``, ``criterion``, ``optimizer``, ...), as they are held."""
    for name in list(cfg.keys()):
        section = cfg.get(name)
        if section is not None and hasattr(section, "keys"):
            yield section


def bf16_leaves_tpu_off(cfg, argv=None) -> bool:
    """Turn ``tpu`` off where fairseq turned it on for ``--bf16`` alone: torch_xla not installed and no ``--tpu`` in
    ``argv`` (the command line by default). Off in every section that holds it: the config made from fairseq-train's
    command line holds a copy of the flag, not a reference to ``common.tpu``, in ``distributed_training`` (the
    launch), ``criterion`` (masked_lm scores every token on a TPU) and ``optimizer``. Returns whether it did."""
    common = cfg.common
    argv = sys.argv[1:] if argv is None else argv
    if not (getattr(common, "bf16", False) and getattr(common, "tpu", False)) or "--tpu" in argv or _xla_installed():
        return False
    for section in _sections(cfg):
        if "tpu" in section.keys() and section.get("tpu") is True:
            section["tpu"] = False
    logger.info("--bf16 without torch_xla: bf16 weights %s on %s, no loss scaler (fairseq 0.12 reads --bf16 as "
                "--tpu; give --tpu with torch_xla installed for a TPU)",
                "without a master copy (--memory-efficient-bf16)" if getattr(common, "memory_efficient_bf16", False)
                else "with an fp32 master copy", "the CPU" if getattr(common, "cpu", False) else "the GPU")
    return True


def call_main(original):
    def call_main(cfg, main, **kwargs):
        bf16_leaves_tpu_off(cfg)
        return original(cfg, main, **kwargs)

    return call_main


def flat_bf16(cfg, params) -> bool:
    """Whether FP16Optimizer's master copy of ``params`` under ``cfg`` is flat here where fairseq's is not: bf16
    off a TPU, flattening not turned off, every parameter on CUDA."""
    common = cfg.common
    return (bool(getattr(common, "bf16", False)) and not getattr(common, "tpu", False)
            and not getattr(common, "fp16_no_flatten_grads", False) and len(params) > 0
            and all(p.is_cuda for p in params))


def build_optimizer(original):
    fairseq_build = original.__func__

    def build_optimizer(cls, cfg, params, **kwargs):
        params = list(params)
        if not flat_bf16(cfg, params):
            return fairseq_build(cls, cfg, params, **kwargs)
        from fairseq import optim
        fp32_params = cls.build_fp32_params(cfg.optimizer, params, flatten=True)
        fp32_optimizer = optim.build_optimizer(cfg.optimizer, [fp32_params])
        if not fp32_optimizer.supports_flat_params:
            raise RuntimeError(f"--bf16: the optimizer {fp32_optimizer.__class__.__name__} does not support flat "
                               "master weights; add --fp16-no-flatten-grads")
        return cls(cfg, params, fp32_optimizer, fp32_params, **kwargs)

    return classmethod(build_optimizer)
