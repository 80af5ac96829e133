"""--tnn-compile: torch.compile per TNN layer. Compiled == eager (fp32, relative 1e-5, forward and
gradients) for all five TNO kinds, with no graph break inside a layer; a wt103 model's identical layers
share one compilation (as many graphs for 7 or 12 layers as for 1); checkpoints load in either mode; new lengths recompile a bounded number of times. A layer whose compilation fails runs eagerly
with a warning (--tnn-compile, i.e. fallback) or stops the run (--tnn-compile strict): tested with a
real failure (inductor given a C++ compiler that does not exist, as on a machine without one) and an
injected one (inductor's code generation raising for the backward graph only). Compiling changes no
process-wide torch setting and no private nn.Module attribute."""
import argparse
import copy
import logging
import re

import pytest
import torch
from torch._dynamo.utils import counters

from helpers import (LM_TRAIN, USER_DIR, assert_compiled_matches_eager, assert_masks_differ, cli, lm_train_cmd,
                     mlm_train_cmd, region_dropout_masks, rel, run)
from fairseq_tnn.models import compile as compiling
from fairseq_tnn.models.compile import (COMPILE_RECOMPILE_LIMIT, TnnCompileError, compile_error, compile_layers,
                                        compile_logger, is_compiled)
from fairseq_tnn.models.build import build_arch
from fairseq_tnn.models.config import compile_mode

KINDS = {"tnn causal": "tnn_lm_tiny", "fd causal": "fd_tnn_lm_tiny", "tnn bidirectional": "tnn_mlm_tiny",
         "fd bidirectional": "fd_tnn_mlm_tiny", "ski": "ski_tnn_mlm_tiny"}


def layers_of(model):
    return model.decoder.layers if hasattr(model, "decoder") else model.encoder.layers


def torch_settings():
    """The process-wide settings of dynamo (recompile_limit among them), inductor and functorch."""
    import torch._functorch.config
    import torch._inductor.config
    return [config.get_config_copy() for config in (torch._dynamo.config, torch._inductor.config,
                                                     torch._functorch.config)]


def assert_nothing_private_set(model):
    """No module has nn.Module's private compiled call (what nn.Module.compile sets)."""
    assert all(m._compiled_call_impl is None for m in model.modules())


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_compiled_layer_equals_eager(kind):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_arch(KINDS[kind], 50)
    eager = layers_of(model)[0]
    compiled = copy.deepcopy(eager)
    compile_layers(torch.nn.ModuleList([compiled]))
    # the whole layer is one graph: no break in the FFT convolutions or their hand-written backwards
    explain = torch._dynamo.explain(copy.deepcopy(eager))(torch.randn(2, 40, 64))
    assert explain.graph_break_count == 0, explain.break_reasons
    counters.clear()
    for n in (40, 40, 23):  # a second call reuses the graph; a new length compiles once more
        assert_compiled_matches_eager(eager, compiled, torch.randn(2, n, 64))
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert rel(pc.grad, pe.grad) < 1e-5, name
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    # compiled, not fallen back to eager
    assert compile_error(compiled) is None and is_compiled(compiled)
    assert_nothing_private_set(compiled)
    # the compiled module has the eager module's parameter names: checkpoints are interchangeable
    assert list(compiled.state_dict()) == list(eager.state_dict())


@pytest.mark.slow
def test_compiled_ski_layer_with_the_convolution_band_equals_eager(monkeypatch):
    """SKI-TNO's band by torch's depthwise convolution (``BAND_METHOD`` "conv1d", the GPU's method,
    benchmarks/ski_band.py) compiles into the layer's one graph, inside the GTU's checkpointed gate, and the compiled
    layer computes what the eager one does: output, input gradient and every parameter's gradient."""
    from fairseq_tnn.ops import ski
    monkeypatch.setitem(ski.BAND_METHOD, "cpu", "conv1d")
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = layers_of(build_arch("ski_tnn_mlm_tiny", 50))[0]
    compiled = copy.deepcopy(eager)
    compile_layers(torch.nn.ModuleList([compiled]))
    explain = torch._dynamo.explain(copy.deepcopy(eager))(torch.randn(2, 40, 64))
    assert explain.graph_break_count == 0, explain.break_reasons
    # the convolution's band, not the GEMM's, in the checkpointed gate's body (--ski-backward recompute, the
    # default): the checkpoint traced, not a graph break
    assert "tag_activation_checkpoint" in explain.graphs[0].code
    assert any("conv1d" in m.code for m in explain.graphs[0].modules() if isinstance(m, torch.fx.GraphModule))
    for n in (40, 23):
        assert_compiled_matches_eager(eager, compiled, torch.randn(2, n, 64))
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert rel(pc.grad, pe.grad) < 1e-5, name
    assert compile_error(compiled) is None and is_compiled(compiled)


@pytest.mark.slow
def test_compiled_layer_takes_a_planned_kernel_length():
    """A planned generation's ``kernel_length`` goes through a compiled causal FD layer as an argument: the
    compiled layer equals the eager one with and without it, at two input lengths, with no graph break."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = layers_of(build_arch("fd_tnn_lm_tiny", 50).eval())[0]
    compiled = copy.deepcopy(eager)
    compile_layers(torch.nn.ModuleList([compiled]))
    x = torch.randn(2, 21, 64)
    explain = torch._dynamo.explain(copy.deepcopy(eager))(x, None, 40)
    assert explain.graph_break_count == 0, explain.break_reasons
    with torch.no_grad():
        for n, length in ((20, 40), (21, 40), (20, None), (20, 48)):
            ye, yc = eager(x[:, :n], None, length), compiled(x[:, :n], None, length)
            assert rel(yc, ye) < 1e-5, (n, length)
        assert rel(eager(x[:, :20], None, 40), eager(x[:, :20])) > 1e-4  # the argument matters
    assert compile_error(compiled) is None


WT103 = ["tnn_lm_wt103", "fd_tnn_lm_wt103", "ski_tnn_mlm_wt103"]


def wt103_narrow(arch, layers=None):
    """A wt103 preset at width 64 (a narrow RPE and GLU), with its real number of layers or ``layers``."""
    side = "encoder" if "mlm" in arch else "decoder"
    overrides = {f"{side}_embed_dim": 64, "glu_dim": 64, "dropout": 0.0}
    if "ski" not in arch:
        overrides["rpe_dim"] = 16
    if layers is not None:
        overrides[f"{side}_layers"] = layers
    torch.manual_seed(0)
    return build_arch(arch, 50, **overrides)


def update_and_validate(model, tokens):
    """One training forward and backward, then one validation forward: the graphs each compiles."""
    counters.clear()
    model.train()
    y = model(tokens)[0]
    y.sum().backward()
    train = counters["stats"]["unique_graphs"]
    model.eval()
    with torch.no_grad():
        model(tokens)
    return y.detach(), (train, counters["stats"]["unique_graphs"] - train)


@pytest.mark.slow
@pytest.mark.parametrize("arch", WT103)
def test_identical_layers_share_their_compiled_graphs(arch):
    """A wt103 model's stack of identical layers compiles the graphs of one layer, once (one for a training
    update, forward and backward, and one for a validation forward): as many as a 1-layer stack, where a
    compilation per layer would multiply the compile time by the depth. Compiled equals eager, the output and
    every parameter's gradient, at the model's real depth (width 64)."""
    tokens = torch.randint(4, 50, (2, 32))
    torch._dynamo.reset()
    one = wt103_narrow(arch, layers=1)
    compile_layers(layers_of(one))
    _, one_layer = update_and_validate(one, tokens)
    torch._dynamo.reset()
    eager = wt103_narrow(arch)
    compiled = copy.deepcopy(eager)
    assert len(layers_of(compiled)) in (7, 12)
    compile_layers(layers_of(compiled))
    yc, all_layers = update_and_validate(compiled, tokens)
    assert all_layers == one_layer == (1, 1), (all_layers, one_layer)
    assert all(is_compiled(layer) for layer in layers_of(compiled))
    ye, _ = update_and_validate(eager, tokens)
    assert rel(yc, ye) < 1e-5
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert rel(pc.grad, pe.grad) < 1e-5, name


@pytest.mark.slow
def test_tnn_compile_trains_and_checkpoint_loads_in_either_mode(data_bin, tmp_path):
    """fairseq-train --tnn-compile learns; its checkpoint scores the same with and without compilation, and so does
    one that says it was trained with --tnn-cuda-graphs, here on the CPU."""
    save = tmp_path / "ck"
    log = run([cli("fairseq-train"), data_bin, *LM_TRAIN, "--arch", "fd_tnn_lm_tiny", "--tnn-compile",
               "--tokens-per-sample", 64, "--batch-size", 8, "--max-update", 12, "--save-dir", save,
               "--no-epoch-checkpoints", "--validate-interval-updates", 12, "--dropout", 0.0])
    assert re.search(r"num_updates[ =]12", log), log[-3000:]
    assert "runs eagerly" not in log, log[-3000:]  # compiled, no silent fallback
    ckpt = torch.load(save / "checkpoint_last.pt", weights_only=False)
    assert ckpt["cfg"]["model"]["tnn_compile"] == "fallback"
    # a checkpoint written before the modes existed says tnn_compile: true, which still means compiled
    ckpt["cfg"]["model"]["tnn_compile"] = True
    torch.save(ckpt, save / "old.pt")
    # one trained on a GPU with --tnn-cuda-graphs says so too: it scores anywhere (evaluation runs no graphs)
    ckpt["cfg"]["model"]["tnn_compile"], ckpt["cfg"]["model"]["tnn_cuda_graphs"] = "fallback", True
    torch.save(ckpt, save / "graphs.pt")
    ppls = []
    for path, overrides in (("old.pt", "{}"), ("checkpoint_last.pt", "{'tnn_compile': False}"), ("graphs.pt", "{}"),
                            ("graphs.pt", "{'tnn_compile': False}")):
        # the validation's batches (valid, 8 x 64): the compiled run reuses the training's compiled graphs
        log = run([cli("fairseq-eval-lm"), data_bin, "--user-dir", USER_DIR, "--cpu", "--path", save / path,
                   "--gen-subset", "valid", "--tokens-per-sample", 64, "--batch-size", 8, "--num-workers", 0,
                   "--model-overrides", overrides])
        m = re.search(r"Perplexity: ([0-9.]+)", log)
        assert m, log[-3000:]
        ppls.append(float(m.group(1)))
    assert all(abs(p - ppls[1]) <= 1e-4 * ppls[1] for p in ppls), ppls


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fallback", "strict"])
def test_compiling_changes_no_process_wide_setting(mode):
    """Building, training and evaluating a compiled model leaves torch's process-wide settings (dynamo's
    recompile_limit among them) as they were, and sets no private nn.Module attribute: the compiled forward is
    the layer's own ``forward`` attribute; the state_dict keys are the eager model's."""
    settings = torch_settings()
    torch.manual_seed(0)
    model = build_arch("tnn_lm_tiny", 50, tnn_compile=mode)
    assert list(model.state_dict()) == list(build_arch("tnn_lm_tiny", 50).state_dict())
    model(torch.randint(4, 50, (2, 24)))[0].sum().backward()
    with torch.no_grad():
        model.eval()(torch.randint(4, 50, (2, 24)))
    assert all(is_compiled(layer) for layer in model.decoder.layers)
    assert_nothing_private_set(model)
    assert torch_settings() == settings


class PowerOfTwo(torch.nn.Module):
    """A layer that, like the FFT convolutions, computes a python int from the length (a power of two), so
    that each length compiles a graph of its own. Cheap to compile."""

    def forward(self, x):
        return x * (1 << (x.shape[1] - 1).bit_length())


@pytest.mark.slow
@pytest.mark.parametrize("takes_limit", [True, False], ids=["torch.compile's argument", "older torch"])
def test_many_lengths_compile_past_torchs_default_limit(takes_limit, monkeypatch):
    """Eleven lengths compile eleven graphs, which the layers share, none run eagerly, though torch's
    process-wide recompile_limit (8) is left as it is: the layers' limit is torch.compile's argument, or on a
    torch whose torch.compile has none, dynamo's setting patched for the layers' calls only."""
    if takes_limit and not compiling.TORCH_COMPILE_TAKES_LIMIT:
        pytest.skip("this torch's torch.compile takes no recompile_limit argument")
    monkeypatch.setattr(compiling, "TORCH_COMPILE_TAKES_LIMIT", takes_limit)
    torch._dynamo.reset()
    settings = torch_settings()
    assert torch._dynamo.config.recompile_limit < 11 <= COMPILE_RECOMPILE_LIMIT
    layers = torch.nn.ModuleList([PowerOfTwo(), PowerOfTwo()])
    compile_layers(layers, "strict")
    counters.clear()
    for n in range(1, 12):
        x = torch.randn(2, 2 ** n)
        for layer in layers:
            assert torch.equal(layer(x), x * 2 ** n)
    assert counters["stats"]["unique_graphs"] == 11, dict(counters["stats"])
    assert counters["frames"]["total"] == counters["frames"]["ok"] == 11, dict(counters["frames"])
    assert all(is_compiled(layer) for layer in layers)
    assert torch_settings() == settings


def test_a_copy_of_a_compiled_stack_runs_its_own_parameters():
    """copy.deepcopy (fairseq's --ema) of compiled layers: the copies' compiled forwards call the copies, and the
    copied stack falls back (or not) on its own."""
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    compile_layers(layers, "fallback", "decoder.layers")
    copied = copy.deepcopy(layers)
    for layer, original in zip(copied, layers):
        assert is_compiled(layer) and layer.forward.layer is layer
        assert layer.forward.stack is copied[0].forward.stack is not original.forward.stack
        assert layer.forward.compiled is original.forward.compiled  # the class's compiled function, shared


# --- a layer whose compilation fails ---

NO_CXX = "/nonexistent/bin/c++"  # inductor's C++ compiler on CPU (torch._inductor.config.cpp.cxx, $CXX)


@pytest.fixture
def no_cxx(monkeypatch, tmp_path):
    """Inductor configured with a C++ compiler that does not exist, and no cached kernels to fall back
    on: compiling a layer on CPU then fails inside inductor, as on a machine without a compiler."""
    import torch._inductor.config as inductor_config
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))  # what it leaves on error
    torch._dynamo.reset()
    with inductor_config.patch({"cpp.cxx": (None, NO_CXX), "force_disable_caches": True}):
        yield
    torch._dynamo.reset()


@pytest.fixture
def failing_backward_codegen(monkeypatch, tmp_path):
    """Inductor's code generation raising for backward graphs only (forward graphs compile as usual)."""
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config
    original = compile_fx.fx_codegen_and_compile

    def codegen(*args, **kwargs):
        if kwargs.get("is_backward"):
            raise RuntimeError("injected: backward code generation failed")
        return original(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "fx_codegen_and_compile", codegen)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    torch._dynamo.reset()
    with inductor_config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


def eager_and_fallback(arch):
    torch.manual_seed(0)
    eager = build_arch(arch, 50)
    compiled = copy.deepcopy(eager)
    layers = layers_of(compiled)
    compile_layers(layers, "fallback", "decoder.layers")
    return eager, compiled, layers


def check_falls_back(caplog, error_pattern):
    settings = torch_settings()
    eager, compiled, layers = eager_and_fallback("tnn_lm_tiny")
    forwards = [vars(layer)["forward"] for layer in layers]
    tokens = torch.randint(4, 50, (2, 24))
    with caplog.at_level(logging.WARNING, logger=compile_logger.name):
        for _ in range(2):  # the second call runs eagerly at once: no second warning
            ye, yc = eager(tokens)[0], compiled(tokens)[0]
            ye.sum().backward()
            yc.sum().backward()  # the failure arose in the forward call, not here
    assert rel(yc, ye) < 1e-6
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert rel(pc.grad, pe.grad) < 1e-6, name
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.name == compile_logger.name]
    # one warning, naming the layer, the error and the layers that now run eagerly: the whole stack, whose
    # layers share the failing code (layer 1 is not compiled again only to fail)
    assert len(warnings) == 1, warnings
    assert re.search(r"--tnn-compile: compiling decoder\.layers\.0 failed: .*" + error_pattern + r".*Running eagerly "
                     r"from now on .*: decoder\.layers\.0, decoder\.layers\.1 \(2 of 2 layers of decoder\.layers",
                     warnings[0]), warnings
    [error] = {compile_error(layer) for layer in layers}  # both layers run eagerly, for the one reason
    assert error.startswith("compiling decoder.layers.0 failed: ") and error in warnings[0]
    # the stack runs eagerly, decided by the stack: no layer rewired its sibling
    assert not any(is_compiled(layer) for layer in layers)
    assert [vars(layer)["forward"] for layer in layers] == forwards
    assert_nothing_private_set(compiled)
    assert torch_settings() == settings


@pytest.mark.slow
def test_compile_failure_runs_the_layer_eagerly(no_cxx, caplog):
    """No working C++ compiler: one warning names the layer, the error and the layers that run eagerly,
    which give the eager model's outputs and gradients."""
    check_falls_back(caplog, r"InvalidCxxCompiler: No working C\+\+ compiler found .*" + re.escape(NO_CXX))


@pytest.mark.slow
def test_backward_compile_failure_runs_the_layer_eagerly(failing_backward_codegen, caplog):
    """The backward graph is compiled with the forward one, so its failure too arises in the layer's
    call and falls back there, instead of killing loss.backward()."""
    check_falls_back(caplog, r"injected: backward code generation failed")


@pytest.mark.slow
def test_strict_compile_failure_stops_naming_the_layer(no_cxx):
    settings = torch_settings()
    torch.manual_seed(0)
    model = build_arch("tnn_mlm_tiny", 50, tnn_compile="strict")
    with pytest.raises(TnnCompileError, match=r"--tnn-compile strict: compiling encoder\.layers\.0 failed: "
                                              r"InductorError: InvalidCxxCompiler: No working C\+\+ compiler"):
        model(torch.randint(4, 50, (2, 24)))
    assert_nothing_private_set(model)
    assert torch_settings() == settings


def test_compile_modes_from_configs_and_the_command_line():
    for value, mode in ((False, None), (None, None), (True, "fallback"), ("fallback", "fallback"),
                        ("strict", "strict")):
        assert compile_mode(argparse.Namespace(tnn_compile=value)) == mode, value
    for value in ("yes", "True", 1):
        with pytest.raises(ValueError, match=r"--tnn-compile=.* is invalid: must be fallback or strict"):
            compile_mode(argparse.Namespace(tnn_compile=value))
    with pytest.raises(ValueError, match=r"--tnn-compile='eager' is invalid"):
        build_arch("tnn_lm_tiny", 50, tnn_compile="eager")
    with pytest.raises(ValueError, match=r"--tnn-compile='on' is invalid: must be one of"):
        compile_layers(torch.nn.ModuleList([torch.nn.Linear(2, 2)]), "on")


@pytest.mark.parametrize("args", [["--tnn-compile", "eager"], ["--tnn-compile"]])
def test_bad_tnn_compile_value_refused_by_name(data_bin, tmp_path, args):
    """A value outside the choices is refused by the parser, naming the option; so is the data directory
    written right after a bare --tnn-compile (which would otherwise be taken as its value)."""
    cmd = lm_train_cmd(data_bin, "--save-dir", tmp_path / "ck")
    cmd = [cmd[0], *args, *cmd[1:]]  # fairseq-train [--tnn-compile [eager]] DATA ...
    log = run(cmd, expect_ok=False)
    bad = args[1] if len(args) == 2 else str(data_bin)
    assert re.search(r"argument --tnn-compile: invalid choice: '" + re.escape(bad) + r"' \(choose from "
                     r"'?fallback'?, '?strict'?\)", log), log[-3000:]


def train_without_cxx(data_bin, tmp_path, *compile_args, expect_ok=True):
    cmd = lm_train_cmd(data_bin, *compile_args, "--max-update", 4, "--validate-interval-updates", 4,
                       "--save-dir", tmp_path / "ck", "--no-epoch-checkpoints", "--log-file", tmp_path / "train.log")
    env = {"CXX": NO_CXX, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}
    return run(cmd, expect_ok=expect_ok, env=env)


@pytest.mark.slow
def test_fairseq_train_continues_eagerly_when_compilation_fails(data_bin, tmp_path):
    """fairseq-train --tnn-compile on a machine whose compiler is missing: one warning, in the output and
    in train.log, names the layer, the error and the layers that run eagerly; the training completes."""
    log = train_without_cxx(data_bin, tmp_path, "--tnn-compile")
    train_log = (tmp_path / "train.log").read_text()  # fairseq writes its log file's lines unformatted
    assert ("WARNING | fairseq_cli.train.fairseq_tnn.models.compile | --tnn-compile: compiling decoder.layers.0 failed"
            in log), log[-3000:]
    for text in (log, train_log):
        assert re.search(r"--tnn-compile: compiling decoder\.layers\.0 failed: InductorError: InvalidCxxCompiler: No "
                         r"working C\+\+ compiler.* Running eagerly from now on .*: decoder\.layers\.0, "
                         r"decoder\.layers\.1 \(2 of 2 layers", text), text[-3000:]
        assert len(re.findall(r"--tnn-compile: compiling decoder\.layers\.\d failed", text)) == 1, text[-3000:]
    assert re.search(r"valid on 'valid' subset \| loss [0-9.]+", log) and "done training" in log, log[-3000:]


@pytest.mark.slow
def test_fairseq_train_strict_stops_when_compilation_fails(data_bin, tmp_path):
    log = train_without_cxx(data_bin, tmp_path, "--tnn-compile", "strict", expect_ok=False)
    assert re.search(r"TnnCompileError: --tnn-compile strict: compiling decoder\.layers\.0 failed: InductorError: "
                     r"InvalidCxxCompiler: No working C\+\+ compiler", log), log[-3000:]
    assert "done training" not in log


@pytest.mark.parametrize("args, error", [
    (["--tnn-cuda-graphs"], r"--tnn-cuda-graphs=True is invalid: needs --tnn-compile"),
    (["--tnn-compile", "strict", "--tnn-cuda-graphs"], r"--tnn-cuda-graphs=True is invalid: needs a CUDA GPU")])
def test_cuda_graphs_refused_without_compile_or_gpu(data_bin, tmp_path, args, error):
    """--tnn-cuda-graphs without --tnn-compile, or where torch sees no GPU (this CPU machine): refused by name before
    training starts; nothing is written."""
    if "GPU" in error and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    log = run(lm_train_cmd(data_bin, *args, "--save-dir", tmp_path / "ck"), expect_ok=False)
    assert re.search(error, log), log[-3000:]
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").iterdir())


def test_cuda_graphs_layers_evaluate_and_run_on_the_cpu_as_plain_compiled_layers():
    """With cuda_graphs the stack holds one more compiled function, its whole training forward, used only while it
    trains on a CUDA tensor (``run_layers``): on the CPU (and in evaluation) the loop calls each layer's plain compiled
    forward, which computes what the eager layer does, and no graph step begins."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = layers_of(build_arch("tnn_lm_tiny", 50, dropout=0.0))
    eager = copy.deepcopy(layers[0])
    compile_layers(layers, "strict", "decoder.layers", cuda_graphs=True)
    forward = layers[0].forward
    assert forward.stack.graphs is not None and layers[1].forward.compiled is forward.compiled  # shared by the stack
    x = torch.randn(2, 16, 64)
    assert not forward.stack.trains_on_cuda(layers[0], x)
    assert_compiled_matches_eager(eager, layers[0], x)
    assert forward.stack.fresh == []  # no graph step began


def test_a_graph_step_moves_the_gradients_of_the_step_before_out_of_the_graphs_memory(monkeypatch):
    """begin_graph_step: parameters whose .grad was None when a step began get their gradient (which the graphs'
    backward wrote into memory the next step's replay reuses) copied out at the next step, values kept, so that
    gradient accumulation (--update-freq > 1) adds into memory of its own; gradients that existed before the step
    began (already copies) and those an optimizer reset to None are left as they are. One multi-tensor copy per
    dtype (a TNN layer's RPE weights stay fp32 beside fp16 ones; CUDA's multi-tensor kernels take one dtype)."""
    layers = torch.nn.ModuleList([torch.nn.Linear(3, 4), torch.nn.Linear(4, 3).double()])
    compile_layers(layers, "strict", "layers", cuda_graphs=True)
    calls = []
    foreach_mul = torch._foreach_mul
    monkeypatch.setattr(torch, "_foreach_mul", lambda ts, x: calls.append({t.dtype for t in ts}) or foreach_mul(ts, x))
    forward = layers[0].forward
    params = list(layers.parameters())
    params[0].grad = torch.ones_like(params[0])  # existed before the step: not the graphs'
    forward.stack.begin_graph_step()
    assert forward.stack.fresh == params[1:]
    written = {}
    for p in params[1:]:  # the step's backward writes them
        p.grad = torch.randn_like(p)
        written[p] = p.grad
    params[3].grad = None  # say, an optimizer's zero_grad in between
    forward.stack.begin_graph_step()
    assert sorted(calls, key=str) == [{torch.float32}, {torch.float64}], calls  # params[1] and params[2]
    for p in params[1:3]:
        assert p.grad is not written[p] and p.grad.data_ptr() != written[p].data_ptr()
        assert torch.equal(p.grad, written[p])
    assert torch.equal(params[0].grad, torch.ones_like(params[0])) and params[3].grad is None
    assert forward.stack.fresh == [params[3]]


@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "fd_tnn_mlm_tiny", "ski_tnn_mlm_tiny"])
def test_cuda_graphs_train_the_whole_stack_as_one_compiled_function(arch, monkeypatch):
    """--tnn-cuda-graphs (``CUDA_GRAPHS_MODE``): while the model trains on a CUDA device (here the
    CPU stands in for one, where torch.compile records no graph), its loop (``run_layers``) calls one compiled function
    for the whole stack, spectra included, and the model's edges around it (its embedding, and the causal model's
    final norm and output layer: ``GRAPH_EDGES``), once per forward, each call beginning a graph step, and no layer's
    own compiled forward; output and every parameter's gradient are the eager model's, over updates of one micro-batch
    and of two (gradients accumulated), the masked model with padding. Evaluation, and a loop that asks for every layer's
    output, call the layers one by one. SKI's band is computed as on a GPU (``BAND_METHOD``), where the stack's graphs
    run: its CPU GEMM's autograd.Function keeps torch 2.11 from compiling the stack's layers as regions."""
    from fairseq_tnn.ops import ski
    monkeypatch.setitem(ski.BAND_METHOD, "cpu", ski.BAND_METHOD["cuda"])
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = build_arch(arch, 50, dropout=0.0)
    model = copy.deepcopy(eager)
    layers = layers_of(model)
    compile_layers(layers, "strict", "layers", cuda_graphs=True)
    stack = layers[0].forward.stack
    assert stack.graphs is not None
    monkeypatch.setattr(compiling.CompiledStack, "trains_on_cuda",  # the CPU stands in for a CUDA device
                        lambda self, layer, x: self.error is None and layer.training and torch.is_grad_enabled())
    stack_calls, layer_calls, steps = [], [], []
    graphs = stack.graphs
    stack.graphs = lambda *args: stack_calls.append((args[1].dtype, args[5:])) or graphs(*args)
    call = compiling.CompiledForward.__call__
    monkeypatch.setattr(compiling.CompiledForward, "__call__",
                        lambda self, *args, **kwargs: layer_calls.append(self.name) or call(self, *args, **kwargs))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    masked = not hasattr(model, "decoder")
    edges = model.encoder if masked else model.decoder
    for update, micro_batches in enumerate([1, 2]):
        for p in list(eager.parameters()) + list(model.parameters()):
            p.grad = None
        for _ in range(micro_batches):
            tokens = torch.randint(4, 50, (2, 16))
            if masked:
                tokens[1, -5:] = model.encoder.padding_idx
            y, ye = model(tokens)[0], eager(tokens)[0]
            assert rel(y, ye) < 1e-5, ("output", update, float(rel(y, ye)))
            g = torch.randn_like(y)
            g[tokens.eq(1)] = 0  # as fairseq's criteria: no loss at padding (an all-zero input of RMS norms there)
            y.backward(g)
            ye.backward(g)
        for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
            assert pe.grad is not None and rel(pc.grad, pe.grad) < 1e-5, (name, update, float(rel(pc.grad, pe.grad)))
    # the model's edges in the graphs (GRAPH_EDGES): the tokens in, the embedding's gradient among the graphs'
    assert stack_calls == [(torch.int64, (edges,))] * 3 and len(steps) == 3 and layer_calls == [], (stack_calls,
                                                                                                   layer_calls)
    assert any(p is edges.embed_tokens.weight for p in stack.params) and len({id(p) for p in stack.params}) == len(
        stack.params)
    x = torch.randn(2, 16, 64)
    compiling.run_layers(layers, x, inner_states=[])  # every layer's output asked for
    model.eval()
    with torch.no_grad():
        model(tokens)
    assert len(stack_calls) == 3 and layer_calls == [f"layers.{i}" for i in range(len(layers))] * 2, layer_calls
    assert all(is_compiled(layer) for layer in layers)


def region_backend(graphs: list):
    """A torch.compile backend, AOT autograd without a compiler (``aot_eager``), that appends to ``graphs``, for each
    graph it is given, the subgraphs its regions call (``torch.compiler.nested_compile_region``'s ``invoke_subgraph``
    calls) and the shapes of its int64 inputs (the tokens, where the model's edges are in the graph)."""
    def backend(gm, example_inputs):
        graphs.append(([n.args[0].target for n in gm.graph.nodes
                        if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph],
                       [tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor) and x.dtype == torch.int64]))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    return backend


def region_calls(arch, layers=3, pad=False, edges=False):
    """The regions (``torch.compiler.nested_compile_region``'s ``invoke_subgraph`` calls) in the graph dynamo traces
    for the stack's training forward (``_stack_forward``) of ``arch`` at width 64 with ``layers`` layers, and the
    distinct subgraphs they call; the graph runs through AOT autograd without a compiler (``aot_eager``). With
    ``edges``, from the tokens, the model's edges in the graph (``GRAPH_EDGES``)."""
    side = "encoder" if "mlm" in arch else "decoder"
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_arch(arch, 50, **{f"{side}_embed_dim": 64, f"{side}_layers": layers, "dropout": 0.0})
    graphs = []

    x = torch.randn(2, 16, 64, requires_grad=True)
    pad_mask = torch.zeros(2, 16, dtype=torch.bool)
    pad_mask[1, -3:] = True
    part = getattr(model, side)
    if edges:
        x = torch.randint(4, 50, (2, 16))
    y = torch.compile(compiling._stack_forward, backend=region_backend(graphs))(
        part.layers, x, pad_mask if pad else None, None, True, *([part] if edges else []))
    y.sum().backward()
    return [target for regions, _ in graphs for target in regions]


@pytest.mark.skipif(not compiling.STACK_REGIONS, reason="this torch compiles no stack regions (STACK_REGIONS)")
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_stacks_graphs_compile_identical_layers_as_one_region(kind, monkeypatch):
    """--tnn-cuda-graphs compiles the stack's forward as one function (``_stack_forward``), each layer in it a region
    compiled once and stamped out for each identical layer (``STACK_REGIONS``), so that the compile time does not grow
    with the depth: three layers make three calls of one subgraph, for every kind of TNO, with padding and with the
    model's edges in the graph (``GRAPH_EDGES``), under each torch that has regions (2.11 compares the regions'
    graphs: ``REGION_INPUT_COPIES``). SKI's band is computed as on a GPU, the only device the stack's graphs run on
    (``BAND_METHOD``; on the CPU its banded GEMM is an autograd.Function, whose graphs torch 2.11 cannot compare)."""
    from fairseq_tnn.ops import ski
    monkeypatch.setitem(ski.BAND_METHOD, "cpu", ski.BAND_METHOD["cuda"])
    arch = KINDS[kind]
    for pad in [False] + ([True] if "mlm" in arch else []):
        for edges in [False, True]:
            calls = region_calls(arch, pad=pad, edges=edges)
            assert len(calls) == 3 and len(set(calls)) == 1, (pad, edges, calls)


@pytest.mark.skipif(not compiling.STACK_REGIONS, reason="this torch compiles no stack regions (STACK_REGIONS)")
@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "fd_tnn_mlm_tiny"])
def test_the_stacks_graphs_keep_their_regions_and_edges_at_each_new_shape(arch, monkeypatch, caplog):
    """The stack's graphs meet several shapes in training (a masked model's length buckets, an epoch's smaller last
    batch): each compiles a graph of its own (``GRAPH_SHAPES``: static shapes), again with the layers as regions and
    the model's edges inside, with no warning, and equal to the eager model, output and every gradient. With dynamo's
    default (a frame's second shape compiled with symbolic sizes), torch 2.13 failed to stamp out the masked model's
    regions at its second length (``KeyError``), and the stack fell back to no edges and then no regions for the rest
    of the run (``aot_eager`` here: the failure was dynamo's)."""
    side = "encoder" if "mlm" in arch else "decoder"
    graphs = []
    monkeypatch.setattr(compiling, "CUDA_GRAPHS_MODE", {"backend": region_backend(graphs)})
    monkeypatch.setattr(compiling.CompiledStack, "trains_on_cuda",  # the CPU stands in for a CUDA device
                        lambda self, layer, x: self.error is None and layer.training and torch.is_grad_enabled())
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = build_arch(arch, 50, dropout=0.0, **{f"{side}_layers": 3})
    model = copy.deepcopy(eager)
    layers = layers_of(model)
    compile_layers(layers, "strict", f"{side}.layers", cuda_graphs=True)
    stack = layers[0].forward.stack
    shapes = [(2, 16), (2, 24), (3, 24), (2, 32), (2, 16)]
    with caplog.at_level(logging.WARNING, logger=compile_logger.name):
        for b, n in shapes:
            tokens = torch.randint(4, 50, (b, n))
            if side == "encoder":
                tokens[1, -5:] = model.encoder.padding_idx
            for p in list(eager.parameters()) + list(model.parameters()):
                p.grad = None
            y, ye = model(tokens)[0], eager(tokens)[0]
            assert rel(y, ye) < 1e-5, ((b, n), float(rel(y, ye)))
            g = torch.randn_like(y)
            g[tokens.eq(1)] = 0
            y.backward(g)
            ye.backward(g)
            for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
                assert rel(pc.grad, pe.grad) < 1e-5, ((b, n), name, float(rel(pc.grad, pe.grad)))
            assert stack.regions and stack.edges and stack.error is None, (b, n)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    # one graph per new shape (the last shape is the first's again), each with its three layers as one region
    regions = [r for r, _ in graphs]
    assert len(regions) == len(set(shapes)) and all(len(r) == 3 and len(set(r)) == 1 for r in regions), regions


@pytest.mark.slow
@pytest.mark.skipif(not compiling.STACK_REGIONS, reason="this torch compiles no stack regions (STACK_REGIONS)")
@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_fairseq_train_through_the_stacks_graphs_loses_what_the_compiled_layers_lose(kind, data_bin, tmp_path,
                                                                                      monkeypatch):
    """fairseq-train --tnn-compile strict --tnn-cuda-graphs through fairseq's Trainer, the CPU standing in for a CUDA
    device (no CUDA graph recorded; every compile by ``aot_eager``, to spare inductor's time): a causal model, and a
    masked one whose batches come padded to several length buckets, with --update-freq 2 and validations between
    updates, loses what the same run without the graphs loses, at every update and validation. The stack's graphs ran
    each training forward, compiled one graph per shape (the masked model's: two lengths at least), each with the three
    layers as one region and the model's edges (the tokens in), and nothing fell back (no warning)."""
    from fairseq_tnn.tasks import tnn_language_modeling, tnn_masked_lm
    compiled, steps = [], []
    options, backend = compiling._compile_options, region_backend(compiled)
    monkeypatch.setattr(compiling, "_compile_options", lambda: {**options(), "backend": backend})
    monkeypatch.setattr(compiling, "CUDA_GRAPHS_MODE", {})
    monkeypatch.setattr(compiling.CompiledStack, "trains_on_cuda",  # the CPU stands in for a CUDA device
                        lambda self, layer, x: self.error is None and layer.training and torch.is_grad_enabled())
    for task in (tnn_language_modeling, tnn_masked_lm):  # it needs CUDA
        monkeypatch.setattr(task, "check_cuda_graphs_for_training", lambda cfg: None)
    begin = compiling.CompiledStack.begin_graph_step
    monkeypatch.setattr(compiling.CompiledStack, "begin_graph_step", lambda self: steps.append(1) or begin(self))
    train_cmd, layers = (lm_train_cmd, "--decoder-layers") if kind == "causal" else (mlm_train_cmd, "--encoder-layers")
    losses = {}
    for graphs in (False, True):
        log = run(train_cmd(data_bin, layers, 3, "--dropout", 0, "--update-freq", 2, "--max-update", 12,
                            "--validate-interval-updates", 4, "--log-interval", 1, "--no-epoch-checkpoints",
                            "--save-dir", tmp_path / f"ck{int(graphs)}", "--tnn-compile", "strict",
                            *(["--tnn-cuda-graphs"] if graphs else [])))
        assert "--tnn-cuda-graphs:" not in log and "--tnn-compile:" not in log, log[-3000:]
        losses[graphs] = [float(x) for x in re.findall(r"(?:train_inner \|.*? loss=|valid on 'valid' subset \| loss )"
                                                       r"([0-9.]+)", log)]
        assert len(losses[graphs]) >= 15, log[-3000:]
    assert losses[True] == pytest.approx(losses[False], abs=2e-3), losses
    assert len(steps) == 2 * 12, len(steps)  # every training forward: 12 updates of 2 micro-batches
    stack_graphs = [g for g in compiled if g[0]]  # the stack's graphs are the ones with regions; the layers' own have none
    shapes = [tokens for _, tokens in stack_graphs]  # the tokens' (batch, length): one graph each
    assert all(len(t) == 1 for t in shapes) and len({t[0][1] for t in shapes}) >= (2 if kind == "masked" else 1), shapes
    assert len(set(map(tuple, shapes))) == len(shapes), shapes
    assert all(len(r) == 3 and len(set(r)) == 1 for r, _ in stack_graphs), stack_graphs


@pytest.mark.skipif(not compiling.STACK_REGIONS, reason="this torch compiles no stack regions (STACK_REGIONS)")
@pytest.mark.parametrize("mode", ["strict", "fallback"])
def test_the_stacks_graphs_compile_without_regions_where_the_regions_fail(mode, monkeypatch, caplog):
    """Where compiling the layers as regions of the stack's graph fails (here a graph break injected into the region,
    which dynamo refuses there), the stack compiles again with every layer's operations in its graph, in either
    mode, with one warning naming the stack and the error; the update then equals the eager model's, and later updates
    use the graph without regions (torch.compile's aot_eager backend here, to spare inductor's time)."""
    monkeypatch.setattr(compiling, "CUDA_GRAPHS_MODE", {"backend": "aot_eager"})
    monkeypatch.setattr(compiling.CompiledStack, "trains_on_cuda",  # the CPU stands in for a CUDA device
                        lambda self, layer, x: self.error is None and layer.training and torch.is_grad_enabled())

    @torch.compiler.nested_compile_region
    def breaking_region(*args):
        torch._dynamo.graph_break()
        return compiling._layer_forward(*args)

    monkeypatch.setattr(compiling, "_layer_region", breaking_region)
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = build_arch("tnn_lm_tiny", 50, dropout=0.0)
    model = copy.deepcopy(eager)
    layers = layers_of(model)
    compile_layers(layers, mode, "decoder.layers", cuda_graphs=True)
    stack = layers[0].forward.stack
    assert stack.regions
    for _ in range(2):
        tokens = torch.randint(4, 50, (2, 16))
        with caplog.at_level(logging.WARNING, logger=compile_logger.name):
            y = model(tokens)[0]
        assert rel(y, eager(tokens)[0]) < 1e-5
        y.sum().backward()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and re.match(  # first without the model's edges, which keeps the failing regions
        r"--tnn-cuda-graphs: compiling the graphs of decoder.layers with the model's edges \(the embedding before "
        r"the stack, what follows it after\) failed: UncapturedHigherOrderOpError: .*Compiling them without the "
        r"edges", warnings.pop(0)), warnings
    assert len(warnings) == 1 and re.match(
        r"--tnn-cuda-graphs: compiling the layers of decoder.layers as regions of the stack's graph failed: "
        r"UncapturedHigherOrderOpError: .*Compiling the stack with every layer in its graph instead", warnings[0]), warnings
    assert not stack.regions and not stack.edges and stack.error is None and all(is_compiled(layer) for layer in layers)


@pytest.mark.skipif(not compiling.STACK_REGIONS, reason="this torch compiles no stack regions (STACK_REGIONS)")
@pytest.mark.slow
def test_dropout_in_the_stacks_regions_draws_a_new_mask_per_layer_and_update():
    """A region compiled once and stamped out for each layer (``STACK_REGIONS``) draws its own dropout mask in each
    layer and each update (inductor, on the CPU; tests/gpu does the same with CUDA graphs)."""
    assert_masks_differ(region_dropout_masks("cpu"))


@pytest.mark.slow
def test_cuda_graphs_whose_compile_fails_train_the_stack_eagerly(failing_backward_codegen, monkeypatch, caplog):
    """The whole stack compiled as one graph fails to compile (inductor's backward code generation, injected): the
    stack compiles again without the model's edges (one warning), then without its regions (one warning, where torch
    has them), and when that fails too, under
    fallback one warning names the stack, and the stack trains eagerly from then on, giving the eager model's output
    and gradients; under strict the error stops the run, naming the stack."""
    monkeypatch.setattr(compiling.CompiledStack, "trains_on_cuda",  # the CPU stands in for a CUDA device
                        lambda self, layer, x: self.error is None and layer.training and torch.is_grad_enabled())
    torch.manual_seed(0)
    eager = build_arch("tnn_lm_tiny", 50, dropout=0.0)
    model = copy.deepcopy(eager)
    layers = layers_of(model)
    compile_layers(layers, "fallback", "decoder.layers", cuda_graphs=True)
    tokens = torch.randint(4, 50, (2, 24))
    with caplog.at_level(logging.WARNING, logger=compile_logger.name):
        for _ in range(2):
            ye, yc = eager(tokens)[0], model(tokens)[0]
            ye.sum().backward()
            yc.sum().backward()
    assert rel(yc, ye) < 1e-6
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
        assert rel(pc.grad, pe.grad) < 1e-6, name
    warnings = [r.getMessage() for r in caplog.records if r.name == compile_logger.name]
    assert re.search(r"compiling the graphs of decoder\.layers with the model's edges .* failed: .*injected",
                     warnings.pop(0)), warnings  # first with the model's edges, then without
    if compiling.STACK_REGIONS:  # first with the layers as regions, then without
        assert len(warnings) == 2 and re.search(r"compiling the layers of decoder\.layers as regions of the stack's "
                                                r"graph failed: .*injected", warnings.pop(0)), warnings
    assert len(warnings) == 1 and re.search(r"compiling decoder\.layers \(as one CUDA graph\) failed: .*injected: "
                                            r"backward code generation failed", warnings[0]), warnings
    assert not any(is_compiled(layer) for layer in layers)
    strict = copy.deepcopy(eager)
    compile_layers(layers_of(strict), "strict", "decoder.layers", cuda_graphs=True)
    with pytest.raises(TnnCompileError, match=r"compiling decoder\.layers \(as one CUDA graph\) failed"):
        strict(tokens)


@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "fd_tnn_mlm_tiny"])
def test_compiled_layers_apply_the_spectra_the_model_computes_on_a_gpu(arch, monkeypatch):
    """On a GPU (``SPECTRA_FROM_THE_MODEL``; here the CPU added to it) a compiled stack's layers are handed their TNO's
    spectrum by the model (``stack_spectra``), so that their graphs hold the FFT convolution and not the RPE, its FFT
    or FD's Hilbert transform (launched once per layer, they made a compiled TNN update launch more kernels than an
    eager one on an H200): while training, views of one stacked tensor (the RPEs as one batched MLP); in evaluation,
    each layer's own. The model computes what the eager model does, output and every gradient. On the CPU by default,
    None: the graphs compute their spectra inside."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = build_arch(arch, 50, dropout=0.0)
    model = copy.deepcopy(eager)
    layers = layers_of(model)
    compile_layers(layers, "strict", "layers")
    handed = []
    call = compiling.CompiledForward.__call__
    monkeypatch.setattr(compiling.CompiledForward, "__call__",
                        lambda self, *args, **kwargs: handed.append(args[3]) or call(self, *args, **kwargs))
    tokens = torch.randint(4, 50, (2, 16))
    x = torch.randn(2, 16, 64)
    assert compiling.stack_spectra(layers, x) == [None] * len(layers)  # the CPU: inside the graphs
    monkeypatch.setattr(compiling, "SPECTRA_FROM_THE_MODEL", ("cpu", "cuda"))
    y = model(tokens)[0]
    y.pow(2).mean().backward()
    assert len(handed) == len(layers) >= 2 and all(s is not None for s in handed)
    bases = {s[0]._base.data_ptr() for s in handed}
    assert len(bases) == 1 and all(s[0].requires_grad for s in handed), bases
    ye = eager(tokens)[0]
    ye.pow(2).mean().backward()
    assert rel(y, ye) < 1e-5
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
        assert pe.grad is not None and rel(pc.grad, pe.grad) < 1e-5, name
    handed.clear()
    model.eval()
    with torch.no_grad():
        model(tokens)
    assert len(handed) == len(layers) and all(s is not None and not s[0].requires_grad for s in handed)
    assert all(is_compiled(layer) for layer in layers)


@pytest.mark.slow
@pytest.mark.parametrize("arch,edges", [("tnn_lm_tiny", True), ("fd_tnn_mlm_tiny", False), ("fd_tnn_mlm_tiny", True)])
def test_the_stacks_graphs_give_the_eager_gradients_through_inductor(arch, edges):
    """The stack's training forward as the CUDA graphs compile it (``_stack_forward``, three layers as regions where
    torch has them, inductor under ``_graph_settings``), with and without the model's edges, against the eager model:
    the output and every parameter's gradient. Inductor's memory planning reused a buffer a region's saved input still
    lived in, and a region's backward overwrote inputs of its own that the caller still needed: with their defaults
    the causal model's gradients with its edges were 1% off, the masked stack's RPE gradients 2-4e-4 off with or
    without them (torch 2.13; ``GRAPH_INDUCTOR_SETTINGS``)."""
    side = "encoder" if "mlm" in arch else "decoder"
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = build_arch(arch, 50, dropout=0.0, **{f"{side}_layers": 3})
    model = copy.deepcopy(eager)
    part, eager_part = getattr(model, side), getattr(eager, side)
    tokens = torch.randint(4, 50, (2, 16))
    pad_mask = tokens.eq(1) if side == "encoder" else None
    with compiling._graph_settings():
        stack = torch.compile(compiling._stack_forward)
        if edges:
            y = stack(part.layers, tokens, pad_mask, None, compiling.STACK_REGIONS, part)
        else:
            y = part.stack_output(stack(part.layers, part.stack_input(tokens), pad_mask, None, compiling.STACK_REGIONS))
    ye = compiling.run_layers(eager_part.layers, tokens, pad_mask, edges=eager_part)
    assert rel(y, ye) < 1e-6
    g = torch.randn_like(y)
    y.backward(g)
    ye.backward(g)
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
        if pe.grad is not None or side == "decoder":
            assert rel(pc.grad, pe.grad) < 1e-5, (name, float(rel(pc.grad, pe.grad)))
