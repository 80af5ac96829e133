"""Where a training step's memory goes: the tensors autograd keeps for the backward pass, by model part.

    python benchmarks/memory.py [--quick] [--precision fp16|fp32] [--loss fused|fairseq] [--out results/bench-memory]
                                [--force]

For the TNN configurations of the GPU benchmark (``benchmarks/trainer.py``: causal 8 x 512; masked 16 x 512 and
4 x 2048; Wikitext-103's 50,264-symbol dictionary, and fairseq's ``<mask>`` beside it for the masked models, as
their task adds it; the published model sizes; TNN with the 6- and 3-layer
RPE, FD-TNN, SKI-TNN and the two bounds, a fixed spectrum and no token mixing; not its speed baseline,
fairseq's transformer_lm), one forward pass and the loss (the recipes' fused criteria; ``--loss fairseq``:
fairseq's) run on PyTorch's ``meta`` device: every operator computes shapes and dtypes but no values, so the
published sizes cost no memory and a second of CPU, and the result is the same on any device. Every tensor
autograd saves is recorded (``torch.autograd.graph.saved_tensors_hooks``) with the module that saved it and
the operator (the torch function, or the plugin's ``autograd.Function``), counted once per storage (a view
of a saved tensor keeps its whole storage alive, so the storage's bytes count), parameters excluded. The output
layer computes its logits as on a CUDA GPU (``ops/logits.py``): over a vocabulary padded to a multiple of 8, the
masked models' 50,265 to 50,272, from a padded copy of the weight that its GEMM keeps for the backward.

The activation memory of a step is what these tensors hold when the forward ends, the peak of the step is
that plus the resident state and the backward's transient buffers. The resident state is computed per
parameter: ``--precision fp16`` is fairseq's ``--fp16`` recipe, an fp16 model (the activations in fp16
except where the code chooses fp32: the FFTs, the RPE) with fp16 gradients and FP16Optimizer's fp32 master
weights, their gradients and Adam's two moments (20 bytes per parameter); ``fp32`` is 16 bytes per
parameter. What no token mixer can avoid is the "no token mixing" bound's activation memory.

Writes ``memory.json`` and ``memory.md`` into ``--out``: per configuration the totals (activations,
resident, their sum) and ratios against TNN and the bound, and per part of a TNN layer the bytes saved per
token and layer, e.g. the GTU's gate ``mul`` or the TNO's ``SpectralConv``.
"""
import argparse
import contextlib
import inspect
import os
import re
import sys
import time
import unittest.mock
from collections import defaultdict
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from fairseq_tnn.ops import logits  # noqa: E402
from benchmarks.measure import add_out_options, refuse_overwrite, write_results  # noqa: E402
from benchmarks.trainer import CONFIGS, FULL_GROUPS, LABELS, MASKED_FRACTION, PAPER, QUICK_GROUPS, QUICK_KEYS, \
    QUICK_MODEL, QUICK_VOCAB, VOCAB  # noqa: E402

MIB = 2.0 ** 20
LOSS_WORDS = {"fused": "the recipes' criteria, tnn_cross_entropy and tnn_masked_lm, fused as on a GPU (they keep "
                       "the logits and each row's log-sum-exp)",
              "fairseq": "fairseq's cross_entropy and masked_lm (they keep the fp32 log-softmax)"}
# The configurations of the GPU benchmark not accounted here: fairseq's transformer_lm is there as a speed baseline;
# the accounting is by part of a TNN layer, and the meta-device forward is the TNN models'.
NOT_ACCOUNTED = {"transformer"}
# resident bytes per parameter: fp16 weights + fp16 grads + fp32 master weights + their grads + Adam's 2 moments
RESIDENT_BYTES = {"fp16": 2 + 2 + 4 + 4 + 8, "fp32": 4 + 4 + 8}
# The GPU peaks issue 10 measured before this accounting (H100, --fp16, 4 x 2048, torch.cuda.max_memory_allocated)
MEASURED_GPU_PEAK_MIB = {("masked", 2048, "tnn6"): 8552, ("masked", 2048, "fd3"): 8952, ("masked", 2048, "ski"): 7265}


class SavedTensorLog(TorchFunctionMode):
    """Records every tensor autograd saves during the ``with`` block: its storage, bytes, the module
    that was running and the operator that saved it. ``ignore``: storages not to count (parameters)."""

    def __init__(self, model: torch.nn.Module, ignore=()):
        super().__init__()
        self.model = model
        self.ops: List[str] = []
        self.modules: List[str] = []
        self.ignore = {t.untyped_storage()._cdata for t in ignore}
        self.storages: Dict[int, Dict] = {}  # storage id -> record
        self._handles = []
        self._stack = contextlib.ExitStack()
        self._functions = []

    # the module that is running
    def _enter_module(self, name):
        def hook(module, args):
            self.modules.append(name)
        return hook

    def _exit_module(self, module, args, output):
        self.modules.pop()

    # the operator that is running: torch functions through this mode, the plugin's autograd Functions
    # (which save their tensors after their forward returns, outside any torch function) by wrapping apply
    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops.append(getattr(func, "__name__", str(func)))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.ops.pop()

    def _wrap_functions(self):
        from fairseq_tnn.ops import cross_entropy, fd, norm, rpe, ski, toeplitz
        for mod in (toeplitz, fd, ski, rpe, norm, cross_entropy):
            for name, cls in vars(mod).items():
                if inspect.isclass(cls) and issubclass(cls, torch.autograd.Function) and cls.__module__ == mod.__name__:
                    self._functions.append((cls, cls.__dict__["apply"] if "apply" in cls.__dict__ else None))
                    cls.apply = classmethod(self._named_apply(name))

    def _named_apply(self, name):
        log = self

        def apply(cls, *args, **kwargs):
            log.ops.append(name)
            try:
                return super(cls, cls).apply(*args, **kwargs)
            finally:
                log.ops.pop()
        return apply

    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st._cdata
        if key not in self.ignore and key not in self.storages:
            self.storages[key] = {"bytes": st.nbytes(), "module": self.modules[-1] if self.modules else "",
                                  "op": self.ops[-1] if self.ops else "?", "dtype": str(t.dtype).replace("torch.", ""),
                                  "shape": list(t.shape)}
        return t

    def _checkpoint(self, original):
        """``torch.utils.checkpoint.checkpoint`` that records its tensor arguments as saved (op "checkpoint"): the
        recomputation holds them (the GTU's gate, ``Tno.recompute_gate``), where the tensors saved inside it are
        dropped and go to its own hooks, not to this log's."""
        log = self

        def checkpoint(function, *args, **kwargs):
            log.ops.append("checkpoint")
            try:
                for a in args:
                    if isinstance(a, torch.Tensor):
                        log._pack(a)
            finally:
                log.ops.pop()
            return original(function, *args, **kwargs)
        return checkpoint

    def __enter__(self):
        import torch.utils.checkpoint
        self._stack.enter_context(unittest.mock.patch.object(
            torch.utils.checkpoint, "checkpoint", self._checkpoint(torch.utils.checkpoint.checkpoint)))
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter_module(name)))
            self._handles.append(module.register_forward_hook(self._exit_module))
        self._wrap_functions()
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._stack.close()
        for h in self._handles:
            h.remove()
        for cls, apply in self._functions:
            if apply is None:
                del cls.apply
            else:
                cls.apply = apply
        return False


def vocabulary(section: str, quick: bool) -> int:
    """The dictionary's size for a section's models: the causal ones' as it is, the masked ones' with the ``<mask>``
    symbol fairseq's masked LM task adds to it."""
    return (QUICK_VOCAB if quick else VOCAB) + (section == "masked")


def _layer_part(module: str) -> Optional[str]:
    """'encoder.layers.3.gtu.tno.rpe.linears.0' -> 'gtu.tno.rpe'; None outside the layers."""
    parts = module.split(".")
    if "layers" not in parts:
        return None
    inner = parts[parts.index("layers") + 2:]
    return ".".join(inner[:3]) if inner else "layer"


def build_config(section: str, arch: str, bound: Optional[str], n: int, quick: bool, precision: str):
    """The model of one configuration on the meta device (bounds: TNN with its TNOs replaced)."""
    from benchmarks.measure import FixedSpectrumTno, IdentityTno, build_tnn
    overrides = dict(QUICK_MODEL[section]) if quick else {}
    with torch.device("meta"):
        model = build_tnn(arch, vocabulary(section, quick), **overrides)
        layers = model.decoder.layers if section == "causal" else model.encoder.layers
        if bound:
            for layer in layers:
                layer.gtu.tno = FixedSpectrumTno(layer.gtu.tno, n) if bound == "fixed" else IdentityTno()
    if precision == "fp16":
        model.half()
    return model.train(), len(layers)


def forward_and_loss(model, section: str, batch: int, n: int, loss: str = "fused") -> torch.Tensor:
    """One training forward and its loss, on meta tensors. Causal: the model's own forward and the loss of every
    position. Masked: the encoder's layers on an unpadded batch (its forward checks the padding on the host, which the
    meta device cannot), the LM head on the 15% masked positions and their loss. ``loss``: "fused", the recipes'
    criteria (tnn_cross_entropy, tnn_masked_lm) as a GPU with Triton trains them, which keep the logits and each row's
    log-sum-exp; "fairseq", fairseq's cross_entropy and masked_lm, which keep the fp32 log-softmax."""
    tokens = torch.zeros(batch, n, dtype=torch.long, device="meta")
    if section == "causal":
        logits, _ = model(tokens)
        target = torch.zeros(batch * n, dtype=torch.long, device="meta")
    else:
        enc = model.encoder
        x = enc.dropout(enc.embed_scale * enc.embed_tokens(tokens))
        if enc.layernorm_embedding is not None:
            x = enc.layernorm_embedding(x)
        for layer in enc.layers:
            x = layer(x, None)
        if enc.final_norm is not None:
            x = enc.final_norm(x)
        masked = max(1, round(MASKED_FRACTION * batch * n))
        rows = torch.zeros(masked, dtype=torch.long, device="meta")  # stands for the masked positions
        logits = enc.lm_head(x.reshape(batch * n, -1).index_select(0, rows))
        target = torch.zeros(masked, dtype=torch.long, device="meta")
    logits = logits.reshape(-1, logits.shape[-1])
    if loss == "fused":
        from fairseq_tnn.ops.cross_entropy import SoftmaxCrossEntropy
        return SoftmaxCrossEntropy.apply(logits, target, 1)
    return F.nll_loss(F.log_softmax(logits, dim=-1, dtype=torch.float32), target, reduction="sum")


def account(section: str, key: str, arch: str, bound, n: int, batch: int, quick: bool, precision: str,
            loss_way: str = "fused") -> Dict:
    model, num_layers = build_config(section, arch, bound, n, quick, precision)
    params = list(model.parameters()) + list(model.buffers())
    log = SavedTensorLog(model, ignore=params)
    with log, unittest.mock.patch.dict(logits.ALIGN, {"meta": logits.ALIGN["cuda"]}):  # padded as on a GPU
        loss = forward_and_loss(model, section, batch, n, loss_way)
    assert loss.requires_grad
    tokens = batch * n
    parts, outside = defaultdict(int), defaultdict(int)
    for rec in log.storages.values():
        part = _layer_part(rec["module"])
        if part is None:
            outside[f"{rec['module'] or 'loss'} {rec['op']}"] += rec["bytes"]
        else:
            parts[(part, rec["op"], rec["dtype"])] += rec["bytes"]
    activations = sum(r["bytes"] for r in log.storages.values())
    n_params = sum(p.numel() for p in model.parameters())
    resident = n_params * RESIDENT_BYTES[precision]
    return {"key": key, "label": LABELS[key], "arch": arch, "bound": bound, "layers": num_layers,
            "vocab": vocabulary(section, quick),
            "parameters": n_params, "activations_mib": activations / MIB, "resident_mib": resident / MIB,
            "total_mib": (activations + resident) / MIB,
            "layer_bytes_per_token": sum(parts.values()) / num_layers / tokens,
            "parts": [{"part": p, "op": op, "dtype": dt, "bytes_per_token_layer": b / num_layers / tokens}
                      for (p, op, dt), b in sorted(parts.items(), key=lambda kv: -kv[1])],
            "outside_layers_mib": {k: v / MIB for k, v in sorted(outside.items(), key=lambda kv: -kv[1])}}


def run(quick: bool, precision: str, loss_way: str = "fused") -> List[Dict]:
    groups = []
    for section, n, batch in (QUICK_GROUPS if quick else FULL_GROUPS):
        configs = [account(section, key, arch, bound, n, batch, quick, precision, loss_way)
                   for key, arch, _, bound in CONFIGS[section]
                   if key not in NOT_ACCOUNTED and (not quick or key in QUICK_KEYS)]
        tnn = next(c for c in configs if c["key"] == "tnn6")
        bound = next(c for c in configs if c["key"] == "bound_identity")
        for c in configs:
            c["total_vs_tnn"] = c["total_mib"] / tnn["total_mib"]
            c["total_vs_no_mixing"] = c["total_mib"] / bound["total_mib"]
            c["layer_vs_no_mixing"] = c["layer_bytes_per_token"] / bound["layer_bytes_per_token"]
            # the SKI paper's memory figure, where it gives one (its other figures are speed-ups)
            paper = re.search(r"memory ([0-9.]+x)", PAPER.get((section, n, c["key"], "tnn6"), ""))
            c["paper_memory_vs_tnn"] = paper.group(1) if paper else ""
            measured = MEASURED_GPU_PEAK_MIB.get((section, n, c["key"]))
            if measured and not quick:
                c["measured_gpu_peak_mib_before"] = measured
        groups.append({"section": section, "n": n, "batch": batch, "configs": configs})
    return groups


def markdown(result: Dict) -> str:
    meta = result["meta"]
    out = [f"# Activation memory of one training step ({meta['precision']}, vocabulary {meta['vocab']}; the masked "
           f"models' {meta['vocab'] + 1} with <mask>)", "",
           f"torch {meta['torch']}, meta device; `{meta['command']}`. The loss: {LOSS_WORDS[meta['loss']]}.", "",
           "Activations: the tensors autograd saves for the backward (storages, parameters excluded). Resident: "
           f"parameters, gradients and optimizer state ({RESIDENT_BYTES[meta['precision']]} bytes per parameter). "
           "Layer: a TNN layer's saved bytes per token.", "",
           "| section | batch x n | configuration | activations MiB | resident MiB | sum MiB | vs TNN | "
           "vs no mixing | layer B / token | layer vs no mixing | paper (memory vs TNN) |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for g in result["groups"]:
        for c in g["configs"]:
            out.append(f"| {g['section']} | {g['batch']} x {g['n']} | {c['label']} | {c['activations_mib']:.0f} | "
                       f"{c['resident_mib']:.0f} | {c['total_mib']:.0f} | {c['total_vs_tnn']:.2f}x | "
                       f"{c['total_vs_no_mixing']:.2f}x | {c['layer_bytes_per_token']:.0f} | "
                       f"{c['layer_vs_no_mixing']:.2f}x | {c['paper_memory_vs_tnn']} |")
    g = result["groups"][-1]
    out += ["", f"## Inside one layer ({g['section']}, {g['batch']} x {g['n']}): bytes saved per token", "",
            "| configuration | part | operator | dtype | bytes / token |", "|---|---|---|---|---:|"]
    for c in g["configs"]:
        for p in c["parts"]:
            out.append(f"| {c['label']} | {p['part']} | {p['op']} | {p['dtype']} | {p['bytes_per_token_layer']:.1f} |")
    out += ["", "## Outside the layers (MiB)", "", "| configuration | module and operator | MiB |", "|---|---|---:|"]
    for c in g["configs"][:1]:
        for k, v in c["outside_layers_mib"].items():
            out.append(f"| {c['label']} | {k} | {v:.1f} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", choices=sorted(RESIDENT_BYTES), default="fp16",
                   help="fp16: fairseq's --fp16 recipe (default); fp32")
    p.add_argument("--quick", action="store_true", help="tiny models and sizes (a smoke test)")
    p.add_argument("--loss", choices=list(LOSS_WORDS), default="fused",
                   help="fused: the recipes' criteria as a GPU trains them, which keep the logits (default); fairseq: "
                        "fairseq's cross_entropy and masked_lm, which keep the fp32 log-softmax")
    add_out_options(p, "results/bench-memory")
    a = p.parse_args(argv)
    refuse_overwrite(p, a, "memory.json")
    import fairseq_tnn
    fairseq_tnn.register()  # registers the models
    t0 = time.time()
    groups = run(a.quick, a.precision, a.loss)
    meta = {"precision": a.precision, "loss": a.loss, "vocab": QUICK_VOCAB if a.quick else VOCAB,
            "torch": torch.__version__,
            "command": "python benchmarks/memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "seconds": round(time.time() - t0, 1)}
    result = {"meta": meta, "groups": groups}
    md = markdown(result)
    os.makedirs(a.out, exist_ok=True)  # only now: a run that fails leaves no empty folder behind
    write_results(a.out, "memory", result, md)
    print(md)
    return result


if __name__ == "__main__":
    main()
