"""--tnn-compile: ``torch.compile`` of a built model's stack of TNN layers, each layer in place, with the fallback
to eager layers when compiling fails. The models' ``build_model`` calls :func:`compile_layers` once the model is
built; the layers themselves know nothing of it."""
import contextlib
import inspect
import logging
from typing import Iterable, Optional

import torch
import torch._functorch.config
from torch import nn

from ..modules.layers import layer_spectra
from ..modules.tno.base import require
from ..ops import fast
from .config import COMPILE_MODES, compile_mode, cuda_graphs

logger = logging.getLogger(__name__)
# The compile warning's logger: a child of fairseq-train's logger, to whose handlers fairseq_cli.train gives
# its --log-file (train.log), so the warning reaches that file as well as the console, like fairseq-train's own
# lines, without adding a handler anywhere.
compile_logger = logging.getLogger("fairseq_cli.train." + __name__)

# torch.compile keeps one graph per sequence length the layers see (more precisely, per FFT size:
# the lengths that share one reuse a graph). Training sees one length (--sample-break-mode none)
# or the few the batches are padded to; evaluation one per block length. Past this many graphs
# torch runs the layers eagerly (still correct), instead of its default 8. Passed to torch.compile
# for the layers' compiled forward only (its recompile_limit argument); the process-wide default
# (torch._dynamo.config.recompile_limit) is left as it is.
COMPILE_RECOMPILE_LIMIT = 64
# torch.compile takes recompile_limit in recent torch (2.13 here); an older torch (the GPU machine's 2.11, say) gets
# dynamo's own setting, patched for the layers' calls only (recompile_limit, once cache_size_limit).
TORCH_COMPILE_TAKES_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


def _compile_options() -> dict:
    return {"recompile_limit": COMPILE_RECOMPILE_LIMIT} if TORCH_COMPILE_TAKES_LIMIT else {}


def _older_torch_limit():
    """Around a compiled layer's call: nothing, or on an older torch dynamo's limit patched for the call."""
    if TORCH_COMPILE_TAKES_LIMIT:
        return contextlib.nullcontext()
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    return torch._dynamo.config.patch(**{name: COMPILE_RECOMPILE_LIMIT})


@contextlib.contextmanager
def _compiling():
    """Around a call of a compiled function of the layers: their backward compiled with their forward (not lazily at
    the first backward), so that a failure to compile the backward also arises in the call, where it is handled (a
    private functorch setting, with no public equivalent: patched for the call only, so the user's other compiled
    models keep torch's default); and on an older torch the recompile limit (``_older_torch_limit``)."""
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True), _older_torch_limit():
        yield


# Two of inductor's memory reuses made the stack's graphs' gradients wrong (torch 2.13 and 2.11, on the CPU; the
# outputs were right). Its static memory planning reuses a buffer once its last user is done, and does not see that a
# region's outputs may alias its inputs (a layer that saves its input for its backward returns it among the tensors
# the backward takes): with the model's edges, the final norm's output was written over the last layer's saved input,
# and the causal model's gradients from that layer down were 1% off. And a reused region's backward may write over its
# inputs in place, as donated buffers by the enclosing graph's numbering, which is not the region's
# (pytorch/pytorch#192840): the masked stack's RPE gradients were 2-4e-4 off, edges or not. The stack's graphs
# therefore compile without either (``_graph_settings``): each buffer is freed where its last user is done, which on a
# GPU gives the memory back to the caching allocator (or, while CUDA graphs record, to their pool), whose next
# allocation of the size takes it unless a tensor (the saved one) still holds it. So memory is reused as before where
# it is free, and the replayed graphs pay nothing for the allocations (docs/performance.md).
GRAPH_INDUCTOR_SETTINGS = {"allow_buffer_reuse": False, "inplace_buffers": False}


@contextlib.contextmanager
def _graph_settings():
    """Around a call of the stack's graphs (``run_layers``): ``_compiling`` and inductor's ``GRAPH_INDUCTOR_SETTINGS``,
    patched for the call only (the compilations it makes take them; inductor's caches key on them), and
    ``fast.cuda_graphs`` (the operators' constants built inside the graphs, the forward's rows paired)."""
    import torch._inductor.config
    with _compiling(), torch._inductor.config.patch(GRAPH_INDUCTOR_SETTINGS), fast.cuda_graphs():
        yield


def length_bucket(n: int) -> int:
    """The length a compiled bidirectional stack pads a batch of length ``n`` to: 8 buckets per octave
    (n rounded up to a multiple of 2^(floor(log2(n - 1)) - 3)), so at most 12.5% padding and about 8
    compilations per doubling of the length, where every batch length would otherwise compile anew."""
    if n <= 16:
        return n
    q = 1 << ((n - 1).bit_length() - 4)
    return -(-n // q) * q


class TnnCompileError(RuntimeError):
    """Compiling a layer failed under ``--tnn-compile strict``."""


def is_compile_error(err: BaseException) -> bool:
    """Whether ``err``, raised by a compiled layer's call, comes from compiling it: dynamo's errors
    (inductor's, a missing C++ compiler or Triton among them, reach the caller as dynamo's
    BackendCompilerFailed), inductor's own and Triton's. Anything else (a shape error, running out of
    memory) is the layer's and is raised as it is."""
    if isinstance(err, torch._dynamo.exc.TorchDynamoException):
        return True
    module = type(err).__module__ or ""
    return module.startswith("torch._inductor") or module.split(".")[0] == "triton"


def error_summary(err: BaseException) -> str:
    """One line: the error's type and the first paragraph of its message (dynamo's hints dropped)."""
    first = str(err).strip().split("\n\n")[0]
    text = " ".join(line.strip() for line in first.splitlines() if line.strip())
    if len(text) > 400:
        text = text[:400] + " ..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class CompiledStack:
    """What the compiled layers of one stack share: the mode, the stack's name and size, and why the stack runs
    eagerly (``error``; None while it runs compiled). The layers of a stack share their code and shapes, so when
    compiling one of them fails each would fail the same way, and trying costs a compilation per layer (up to
    minutes on a GPU): under ``fallback`` the first failure sends the whole stack to its eager forward."""

    def __init__(self, mode: str, name: str, size: int, params=(), graphs=None):
        self.mode, self.name, self.size = mode, name, size
        self.error = None
        # --tnn-cuda-graphs: the stack's parameters, and those whose gradient the graphs' backward of the step in
        # progress creates (their .grad was None when it began), see begin_graph_step
        self.params = list(params)
        self.fresh = []
        # --tnn-cuda-graphs: the whole stack's training forward compiled as one CUDA graph, and its backward as another
        # (run_layers calls it; CUDA_GRAPHS_MODE); None without the graphs
        self.graphs = graphs
        # whether the graphs compile each layer as a region (STACK_REGIONS); off once compiling them so failed
        # (run_layers then compiles the stack with every layer's operations in its graph, with a warning)
        self.regions = STACK_REGIONS
        # whether the graphs compute the model's edges around the stack (its embedding, and what follows the stack)
        # where the model hands them (GRAPH_EDGES, run_layers' ``edges``); off once compiling them so failed
        self.edges = GRAPH_EDGES
        self.covered = None  # the model part whose parameters ``cover`` added to ``params``

    def cover(self, edges: nn.Module) -> None:
        """The graphs compute ``edges`` too: their parameters join the ones whose gradients the graphs' backward
        creates (``begin_graph_step``); the layers' own, which ``edges`` holds as well, are not listed twice. Once per
        model part: ``run_layers`` asks at every training forward."""
        if self.covered is edges:
            return
        listed = {id(p) for p in self.params}
        self.params += [p for p in edges.parameters() if id(p) not in listed]
        self.covered = edges

    def begin_graph_step(self) -> None:
        """Before the stack's graphs run for a new training forward. The graphs' outputs live in memory that the
        next step's graphs reuse, and the gradients their backward hands to autograd are such outputs: a parameter
        whose .grad was None takes that memory as its .grad. fairseq's optimizers set .grad to None once an update
        is done, so with one forward and backward per update nothing outlives its step; with --update-freq > 1 the
        gradients of the step before still hold the sum so far, and are moved out (one copy) before this step
        reuses their memory, after which backward adds into the copies (one multi-tensor copy per gradient dtype: a
        CUDA multi-tensor operation over mixed dtypes, the fp16 weights' and the RPEs' fp32 ones, falls back to one
        per tensor). Then the new step is marked, so that the
        graphs' trees start from their root whatever the previous step left unfinished (a validation, a skipped
        backward)."""
        kept = {}
        for p in self.fresh:
            if p.grad is not None:
                kept.setdefault(p.grad.dtype, []).append(p)
        for params in kept.values():
            for p, g in zip(params, torch._foreach_mul([p.grad for p in params], 1.0)):
                p.grad = g
        self.fresh = [p for p in self.params if p.grad is None]
        torch.compiler.cudagraph_mark_step_begin()

    def trains_on_cuda(self, layer: nn.Module, x) -> bool:
        """Whether a call of ``layer`` on ``x`` (its input) is one the CUDA graphs run: the stack runs compiled and
        ``layer`` trains on a CUDA tensor with gradients on (not evaluation, generation or the CPU)."""
        return (self.error is None and layer.training and torch.is_grad_enabled() and isinstance(x, torch.Tensor)
                and x.is_cuda)

    def failed(self, layer_name: str, err: BaseException) -> None:
        """Compiling ``layer_name`` raised ``err``: under ``strict`` a TnnCompileError naming the layer; under
        ``fallback`` one warning naming the layer, the error and the layers that now run eagerly."""
        summary = error_summary(err)
        if self.mode == "strict":
            raise TnnCompileError(
                f"--tnn-compile strict: compiling {layer_name} failed: {summary} (--tnn-compile without a "
                f"value runs the layers eagerly instead)") from err
        self.error = f"compiling {layer_name} failed: {summary}"
        eager = [f"{self.name}.{i}" for i in range(self.size)]
        compile_logger.warning(
            f"--tnn-compile: compiling {layer_name} failed: {summary}. Running eagerly from now on (correct, "
            f"slower; --tnn-compile strict stops instead): {', '.join(eager)} ({len(eager)} of "
            f"{self.size} layers of {self.name}, which share the failing code)")
        logger.debug(f"--tnn-compile: the error compiling {layer_name}", exc_info=err)


class CompiledForward:
    """A compiled layer's ``forward``: an ordinary attribute of the layer (``compile_layers`` sets
    ``layer.forward`` to it), which shadows the class's ``forward`` that ``nn.Module.__call__`` calls. It calls
    the ``torch.compile``d class ``forward`` with the layer as its first argument, or, once its stack runs
    eagerly (:class:`CompiledStack`), the class's ``forward`` itself. (With --tnn-cuda-graphs a training forward on
    a CUDA device runs the stack's graphs instead, ``run_layers``, and calls no layer's forward.)"""

    def __init__(self, layer: nn.Module, name: str, stack: CompiledStack, compiled):
        # ``compiled``: the ``torch.compile``d class ``forward`` (the class's function, not a method bound to this
        # layer), one object shared by all layers of the stack (``compile_layers``). Dynamo caches its graphs on
        # the function's code object and guards them on the layer's parameters and buffers as inputs, not on the
        # layer's identity, so the stack's identical layers run one graph per input shape, compiled once; one
        # object also keeps the backend the cache entries were compiled with identical for every layer (dynamo
        # recompiles a frame called through a backend that differs from its cache entry's). A deep copy of the
        # layer (fairseq's --ema, copy.deepcopy in tests) copies this object with ``layer`` and ``stack`` mapped to
        # the copies and ``compiled`` shared (a function), and the shared compiled function then runs the copy's
        # parameters.
        self.compiled = compiled
        self.layer, self.name, self.stack = layer, name, stack

    def __call__(self, *args, **kwargs):
        if self.stack.error is None:
            try:
                with _compiling():
                    return self.compiled(self.layer, *args, **kwargs)
            except Exception as err:
                if not is_compile_error(err):
                    raise
                self.stack.failed(self.name, err)
        return type(self.layer).forward(self.layer, *args, **kwargs)


# The device types on which compiled layers take their TNOs' spectra from the model (``stack_spectra``: computed
# together, outside the layers' graphs) instead of computing each its own inside its graphs. A GPU waits on launches:
# with the spectra inside, a compiled causal TNN update launched 1,129 kernels against an eager one's 932 and took 47.5
# against 32.2 ms (H200, docs/performance.md), and FD-TNN's graph, with its Hilbert transform, took 45 s of inductor's
# code generation; outside, a layer's graphs run half the kernels (110 against 52 kernel calls, CPU code). The CPU
# waits on arithmetic instead, and the spectra inductor fuses inside the graphs are the faster there: a compiled
# update took 14-23% longer with them outside (benchmarks/stacked_spectra.py --compile; docs/performance.md).
SPECTRA_FROM_THE_MODEL = ("cuda",)


def stack_spectra(layers: nn.ModuleList, x: torch.Tensor, kernel_length: Optional[int] = None) -> Iterable:
    """What a model's loop hands each of its ``layers`` as its TNO's spectrum for the input ``x`` (b, n, d):
    ``layer_spectra`` (computed outside the layers, together while training), or None for each where compiled layers
    compute their own inside their graphs: off the devices of ``SPECTRA_FROM_THE_MODEL``. Eager layers (and a stack
    fallen back to them) always take ``layer_spectra``. (The stack's CUDA graphs compute the spectra inside them,
    ``_stack_forward``.)"""
    forward = vars(layers[0]).get("forward") if len(layers) else None
    if (isinstance(forward, CompiledForward) and forward.stack.error is None
            and x.device.type not in SPECTRA_FROM_THE_MODEL):
        return [None] * len(layers)
    return layer_spectra(layers, x.shape[1], kernel_length, x.device, x.dtype)


# How --tnn-cuda-graphs compiles the stack: its whole training forward, the layers' spectra computed together
# included, as one CUDA graph and its backward as another (``_stack_forward``, ``run_layers``), by inductor in
# torch.compile's reduce-overhead mode, which records each graph's kernels once and replays them with one launch. The
# host's cost per graph call (the launch, the graph trees' and AOT autograd's bookkeeping, dynamo's guards: some 1 ms
# per layer, forward and backward, in the fourth GPU run) is paid once an update instead of once per layer. Measured
# on an H200 (torch 2.11, causal TNN, 8 x 512, fp16, through fairseq's Trainer; the fifth GPU run,
# docs/performance.md): 15.3 ms an update, against 20.5 with each layer's own graphs (the scope used until then) and
# 37.5 eager; the stack's graphs of aten's own kernels unfused (torch.compile's "cudagraphs" backend) failed to
# compile there. Both alternatives were removed.
CUDA_GRAPHS_MODE = {"mode": "reduce-overhead"}
# Each shape the stack's graphs meet (a masked model's length buckets, a smaller last batch) compiles a graph of its
# own, with static shapes (torch.compile's ``dynamic=False``), as the CUDA graphs record one graph per shape anyway. By
# default dynamo compiles the second shape of a frame with symbolic sizes ("automatic dynamic"), and torch 2.13's
# dynamo then fails to stamp out a reused region (``KeyError`` in ``stamp_out_subgraph``, the region's sizes not bound
# in the enclosing graph): a masked model's second length bucket sent its stack's graphs to the fallbacks, without
# the model's edges and then without the regions, for the rest of the run (on the CPU, 2026-11-29;
# docs/performance.md).
GRAPH_SHAPES = {"dynamic": False}


def _layer_forward(layer: nn.Module, x: torch.Tensor, pad_mask: Optional[torch.Tensor], kernel_length: Optional[int],
                   spectrum) -> torch.Tensor:
    """One layer of ``_stack_forward``: its class forward (not its CompiledForward: the stack compiles as one)."""
    return type(layer).forward(layer, x, pad_mask, kernel_length, spectrum)


# Each layer of the stack's graphs as one region that inductor compiles once and stamps out for every layer alike
# (torch.compiler.nested_compile_region: dynamo traces each call and reuses the region's compiled code where the
# call's inputs match, its shapes, dtypes, strides and guards; a layer that differs gets a region of its own, so
# reuse is never wrong). Without it the stack's graph holds every layer's operations and inductor lowers, fuses and
# generates code for each, so the compile time grows with the depth: 35 s for causal TNN's 7 layers on an H200, 49 s
# for masked TNN's 12 (the sixth GPU run). On the CPU (torch 2.13, the wt103 presets at width 64) the regions took
# the stack's compile from 55-82 s to 37-47 s, a 12-layer stack in the time of a 7-layer one (docs/performance.md).
# torch 2.13 matches a region by its inputs and guards (``reuse_hash_fn`` marks it); torch 2.11, the GPU machines',
# compares each call's traced graph with the ones before instead, input metadata included, and could not compare
# graphs nested in a region's (an autograd.Function's, under torch.compile: the layers' FFT convolution is a custom
# operator there and their norm plain operations, ops/toeplitz.py and modules/norm.py). There the stack's spectra,
# views of one tensor at different storage offsets, are handed to the regions as copies (``REGION_INPUT_COPIES``),
# or every layer would differ from the one before.
STACK_REGIONS = hasattr(torch.compiler, "nested_compile_region")
REGION_INPUT_COPIES = STACK_REGIONS and "reuse_hash_fn" not in inspect.signature(
    torch.compiler.nested_compile_region).parameters
_layer_region = torch.compiler.nested_compile_region(_layer_forward) if STACK_REGIONS else _layer_forward


def _own_storage(spectrum):
    """A layer's spectrum argument with its tensors copied, each into storage of its own (``REGION_INPUT_COPIES``)."""
    if isinstance(spectrum, torch.Tensor):
        return spectrum.clone()
    return type(spectrum)(_own_storage(part) for part in spectrum) if isinstance(spectrum, tuple) else spectrum


# The model's edges inside the stack's CUDA graphs: where a model hands ``run_layers`` the part of it around the stack
# (``edges``: its embedding before, its final norm and output layer after), the graphs compute them too, so that the
# update's forward is one graph call from the tokens to the logits and its backward one from the logits' gradient to
# every parameter's. Outside the graphs those few operations cost the host more than their kernels cost the GPU: in the
# eighth GPU run's traced update (causal TNN, 8 x 512, H200) the embedding, its scale and dropout, the final norm and
# the output layer took some 0.7 ms of host time forward and, with their autograd nodes, 1.3 ms backward (traced
# times, which the tracer stretches about 2.3 times), in an update the host bounds (docs/performance.md). The loss
# stays the criterion's, and a masked model's head with it (it scores the masked positions, a number that changes
# from batch to batch). Where compiling the edges fails the graphs compile the stack alone again, with one warning.
GRAPH_EDGES = True


def _stack_forward(layers: nn.ModuleList, x: torch.Tensor, pad_mask: Optional[torch.Tensor],
                   kernel_length: Optional[int], regions: bool = False, edges: Optional[nn.Module] = None):
    """A stack's training forward as one function, for the CUDA graphs' torch.compile: the layers' spectra, computed
    together (``layer_spectra``), and each layer, as one compile region with ``regions`` (``STACK_REGIONS``; dynamo
    compiles a graph for each value); with ``edges`` (``GRAPH_EDGES``), ``x`` is the tokens, which
    ``edges.stack_input`` makes the stack's input, and the result ``edges.stack_output`` of the stack's output."""
    if edges is not None:
        x = edges.stack_input(x)
    layer_call = _layer_region if regions else _layer_forward
    for layer, spectrum in zip(layers, layer_spectra(layers, x.shape[1], kernel_length, x.device, x.dtype)):
        if regions and REGION_INPUT_COPIES:
            spectrum = _own_storage(spectrum)
        x = layer_call(layer, x, pad_mask, kernel_length, spectrum)
    return x if edges is None else edges.stack_output(x)


def run_layers(layers: nn.ModuleList, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None,
               kernel_length: Optional[int] = None, inner_states: Optional[list] = None,
               edges: Optional[nn.Module] = None) -> torch.Tensor:
    """A model's loop over its stack ``layers`` on ``x`` (b, n, d): each layer in turn, handed its spectrum
    (``stack_spectra``), each output appended to ``inner_states`` where it is a list; or, where the stack was compiled
    with CUDA graphs (``CUDA_GRAPHS_MODE``) and trains on a CUDA device, the stack's graphs (no ``inner_states``
    then: a call that asks for them loops). ``edges``: the model's part around the stack, a module with
    ``stack_input`` (its tokens to the stack's input, which is appended to ``inner_states`` first) and
    ``stack_output`` (the stack's output to the result); ``x`` is then the tokens, and the result stack_output's,
    computed inside the stack's graphs where they run (``GRAPH_EDGES``)."""
    forward = vars(layers[0]).get("forward") if len(layers) else None
    stack = forward.stack if isinstance(forward, CompiledForward) else None
    if stack is not None and stack.graphs is not None and inner_states is None and stack.trains_on_cuda(layers[0], x):
        if edges is not None:
            stack.cover(edges)
        while True:
            whole = edges is not None and stack.edges
            try:
                with _graph_settings():
                    stack.begin_graph_step()
                    if whole:
                        return stack.graphs(layers, x, pad_mask, kernel_length, stack.regions, edges)
                    y = stack.graphs(layers, x if edges is None else edges.stack_input(x), pad_mask, kernel_length,
                                     stack.regions)
                    return y if edges is None else edges.stack_output(y)
            except Exception as err:
                if not is_compile_error(err):
                    raise
                if whole:
                    stack.edges = False  # and again, the edges outside the graphs
                    compile_logger.warning(
                        f"--tnn-cuda-graphs: compiling the graphs of {stack.name} with the model's edges (the "
                        f"embedding before the stack, what follows it after) failed: {error_summary(err)}. Compiling "
                        f"them without the edges, which then run eagerly (slower to train)")
                    logger.debug(f"--tnn-cuda-graphs: the error compiling the edges around {stack.name}", exc_info=err)
                    continue
                if not stack.regions:
                    stack.failed(f"{stack.name} (as one CUDA graph)", err)  # under fallback: the loop, eagerly
                    break
                stack.regions = False  # and again, every layer's operations in the one graph
                compile_logger.warning(
                    f"--tnn-cuda-graphs: compiling the layers of {stack.name} as regions of the stack's graph failed: "
                    f"{error_summary(err)}. Compiling the stack with every layer in its graph instead (slower to "
                    f"compile, as fast to train)")
                logger.debug(f"--tnn-cuda-graphs: the error compiling the regions of {stack.name}", exc_info=err)
    if edges is not None:
        x = edges.stack_input(x)
        if inner_states is not None:
            inner_states.append(x)
    for layer, spectrum in zip(layers, stack_spectra(layers, x, kernel_length)):
        x = layer(x, pad_mask, kernel_length, spectrum)
        if inner_states is not None:
            inner_states.append(x)
    return x if edges is None else edges.stack_output(x)


def compile_error(layer: nn.Module):
    """Why a layer given to ``compile_layers`` runs eagerly (its stack failed to compile); None otherwise."""
    forward = vars(layer).get("forward")
    return forward.stack.error if isinstance(forward, CompiledForward) else None


def is_compiled(layer: nn.Module) -> bool:
    """Whether ``layer`` runs compiled (``compile_layers``, and its stack's compilation has not failed)."""
    return isinstance(vars(layer).get("forward"), CompiledForward) and compile_error(layer) is None


def compile_layers(layers: nn.ModuleList, mode: str = "strict", name: str = "layers", cuda_graphs: bool = False) -> None:
    """``torch.compile`` each layer's ``forward`` in place: ``layer.forward`` becomes a CompiledForward, a plain
    attribute of the layer. The parameters, submodules and state_dict keys stay those of the eager model
    (no ``_orig_mod.`` prefix), so checkpoints load in either mode. The layers of a class share one
    ``torch.compile``d function, and so its graphs: one compilation per input shape serves the whole stack
    (tests/modules/test_compile.py counts them).

    Nothing process-wide is changed and no private ``nn.Module`` attribute is set: the recompile limit is
    ``torch.compile``'s own argument (``recompile_limit``, which applies to these calls only; torch's global
    ``torch._dynamo.config.recompile_limit`` keeps its value), and the compiled function is held by the layer's
    ``forward`` attribute, which ``nn.Module.__call__`` calls as it would the class's (``nn.Module.compile``
    instead sets the private ``_compiled_call_impl``, which this code would have to override to fall back).
    The layer's hooks, if any, run eagerly around the compiled forward. Deleting the attribute
    (``del layer.forward``) makes the layer eager again. Why this and not: ``torch._dynamo.config.patch(
    recompile_limit=...)`` around each call (dynamo reads the limit when it compiles, inside the call, so it
    would work, but it is a private module's global, changed while the call runs); dynamic shapes (the FFT
    size is a Python int computed from the length, ``ops.toeplitz.next_fast_len``, so each size still needs a
    graph of its own); ``torch.compile(layer)`` (an OptimizedModule holding the layer as its submodule
    ``_orig_mod``: kept in the model, its keys get that prefix, and the layer's forward cannot call it without
    recursion).

    ``mode``: what a failure to compile a layer does (compilation happens at its first call, and again
    at each new length): ``strict`` raises TnnCompileError; ``fallback`` (fairseq's ``--tnn-compile``) runs
    the stack's layers eagerly from then on, with one warning (CompiledStack). ``name``: the stack's path in
    the model (``decoder.layers``), which names its layers in those messages. ``cuda_graphs`` (--tnn-cuda-graphs):
    while the stack trains on a CUDA device its whole forward runs as one CUDA graph and its backward as another
    (``CUDA_GRAPHS_MODE``, ``run_layers``; ``CompiledStack.begin_graph_step``: the gradients they leave)."""
    require(mode in COMPILE_MODES, "tnn_compile", mode, f"must be one of {list(COMPILE_MODES)}")
    stack_graphs = torch.compile(_stack_forward, **CUDA_GRAPHS_MODE, **GRAPH_SHAPES,
                                 **_compile_options()) if cuda_graphs else None
    stack = CompiledStack(mode, name, len(layers), layers.parameters() if cuda_graphs else (), stack_graphs)
    compiled = {}  # one torch.compile per layer class, shared by the stack's layers of that class
    for i, layer in enumerate(layers):
        cls = type(layer)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, **_compile_options())
        layer.forward = CompiledForward(layer, f"{name}.{i}", stack, compiled[cls])


def compile_per_config(cfg, layers: nn.ModuleList, name: str) -> None:
    """Compile a built model's stack ``layers`` (its path in the model: ``name``) as ``cfg.tnn_compile`` says
    (``config.compile_mode``): not at all, ``fallback`` or ``strict``; with CUDA graphs while training where
    ``cfg.tnn_cuda_graphs`` says so (``config.cuda_graphs``)."""
    mode, graphs = compile_mode(cfg), cuda_graphs(cfg)
    if mode is not None:
        compile_layers(layers, mode, name, cuda_graphs=graphs)
