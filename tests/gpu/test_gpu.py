"""On a CUDA GPU (skipped without one, as in CI): every wt103 architecture trains through fairseq-train
in fp16 and bf16 (autocast, and fairseq's --bf16 with its flat fp32 master copy), compiled layers equal eager ones on the GPU (alone, and in a model that hands them their spectra),
and so do compiled layers run as CUDA graphs
(--tnn-cuda-graphs), gradient accumulation included, in a stack and through fairseq-train; evaluation at
14,336 tokens is finite in fp16, eager fp16 training on padded batches never overflows, and the causal models are
causal in fp32.

Run on a GPU machine with ``python -m pytest tests/gpu/test_gpu.py`` (FAIRSEQ_BIN names the fairseq CLIs
when they are not beside that Python, and PYTHON the Python the scripts run, as on a machine set up from
wheels: ``FAIRSEQ_BIN=/tmp/site/bin PYTHON=python3``)."""
import copy
import math
import re
import sys

import pytest
import torch

from helpers import (USER_DIR, assert_compiled_matches_eager, assert_masks_differ, cli, rank0_updates,
                     region_dropout_masks, rel, run, wt103_presets)
from fairseq_tnn.models.compile import STACK_REGIONS, compile_layers, is_compiled, run_layers, stack_spectra
from fairseq_tnn.models.build import build_arch
from fairseq_tnn.recipe import CAUSAL_TASK, MASKED_TASK

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CAUSAL = wt103_presets("tnn_lm")  # fairseq's registry of our archs
MASKED = wt103_presets("tnn_mlm")


def small(arch):
    # three layers: a region of the stack's graphs reused twice (with two, inductor's faulty reuse of a region's
    # inputs passed the tests by the chance of the layout on the CPU; docs/performance.md)
    return {"decoder_layers": 3} if arch in CAUSAL else {"encoder_layers": 3}


@pytest.mark.runs_doc(r'^(FAIRSEQ_BIN=\S+ )?python3? -m pytest tests/gpu/test_gpu\.py')
@pytest.mark.parametrize("precision", ["--fp16", "--bf16-autocast", "--bf16"])
@pytest.mark.parametrize("arch", CAUSAL + MASKED)
def test_fairseq_train_on_gpu(data_bin, tmp_path, arch, precision):
    causal = arch in CAUSAL
    layers = ["--decoder-layers" if causal else "--encoder-layers", 2]
    log = run([cli("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--arch", arch, *layers, precision,
               "--task", "tnn_language_modeling" if causal else "tnn_masked_lm",
               "--criterion", CAUSAL_TASK["criterion"] if causal else MASKED_TASK["criterion"],
               "--sample-break-mode", "none" if causal else "complete", "--tokens-per-sample", 128,
               "--batch-size", 8, "--optimizer", "adam", "--lr", "0.001", "--max-update", 40, "--seed", 1,
               "--save-dir", tmp_path / "ck", "--log-format", "simple", "--log-interval", 10, "--num-workers", 0,
               "--no-epoch-checkpoints", "--validate-interval-updates", 20,
               "--tnn-compile", "strict"])  # strict: a compilation failure fails the test instead of running eagerly
    assert "gpu_peak_mb" in log, log[-3000:]
    losses = [float(x) for x in re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", log)]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], log[-3000:]


def test_the_logged_peak_is_torchs_max_memory_allocated():
    """The plugin's gpu_peak_mb reads the allocator's nested statistics (fairseq_tnn/tasks/step_metrics.py): the same
    number as torch.cuda.max_memory_allocated, before and after a reset and a larger allocation."""
    from fairseq_tnn.tasks.step_metrics import peak_allocated
    x = torch.empty(2 ** 22, device="cuda")
    assert peak_allocated() == torch.cuda.max_memory_allocated() > 0
    torch.cuda.reset_peak_memory_stats()
    before = peak_allocated()
    y = torch.empty(2 ** 24, device="cuda")
    assert peak_allocated() == torch.cuda.max_memory_allocated() >= before + y.numel() * 4
    del x, y


def test_the_benchmarks_peak_is_the_updates_not_the_memory_between_them(tmp_path):
    """gpu_profile's peak memory of a configuration's timed updates: fairseq's Trainer resets the allocator's peak at
    the end of every train_step, so without the benchmark holding the resets off (benchmarks/measure.py
    peak_memory_held) the peak read after the updates was what stays allocated between them. The peak must hold at
    least the update's fp16 logits beyond that."""
    from benchmarks import gpu_profile
    from benchmarks import trainer as tr
    section, n, batch = "causal", 64, 4
    data = tr._dictionary_dir(str(tmp_path), tr.QUICK_VOCAB)
    row = gpu_profile.measure("tnn6", "tnn_lm_wt103", None, section, n, batch, "cuda", "fp16", True, data, 2, False,
                              False, None, print)
    logits_mib = batch * n * tr.QUICK_VOCAB * 2 / 2 ** 20
    assert row["peak_mib"] >= row["resting_mib"] + logits_mib, (row["peak_mib"], row["resting_mib"], logits_mib)


@pytest.mark.parametrize("arch", CAUSAL + MASKED)
def test_compiled_equals_eager_on_gpu(arch):
    torch.manual_seed(0)
    model = build_arch(arch, 1000, dropout=0.0, **small(arch)).cuda()
    stack = model.decoder if arch in CAUSAL else model.encoder
    eager = stack.layers[0]
    compiled = copy.deepcopy(eager)
    compile_layers(torch.nn.ModuleList([compiled]))
    width = stack.embed_tokens.embedding_dim  # 512 causal, 768 masked
    for n in (512, 1000):
        assert_compiled_matches_eager(eager, compiled, torch.randn(2, n, width, device="cuda"))


@pytest.mark.parametrize("arch", CAUSAL + MASKED)
def test_compiled_model_equals_eager_on_gpu(arch):
    """A 3-layer model with compiled layers against the same eager model, training mode, through the model's own
    loop: on a GPU the compiled layers take their spectra from the model (``stack_spectra``: the RPEs of the stack as
    one batched MLP, outside the graphs), which the per-layer test above does not exercise. Output and every
    parameter's gradient."""
    torch.manual_seed(0)
    eager = build_arch(arch, 1000, dropout=0.0, **small(arch)).cuda()
    model = copy.deepcopy(eager)
    stack = model.decoder if arch in CAUSAL else model.encoder
    compile_layers(stack.layers, "strict", "layers")
    tokens = torch.randint(4, 1000, (2, 512), device="cuda")
    spectra = list(stack_spectra(stack.layers, torch.zeros(2, 512, 8, device="cuda")))
    assert all(s is not None for s in spectra) == ("ski" not in arch), arch
    ye, yc = eager(tokens)[0], model(tokens)[0]
    g = torch.randn_like(ye)
    ye.backward(g)
    yc.backward(g)
    assert rel(yc, ye) < 1e-5
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
        assert pe.grad is not None and pc.grad is not None, name
        assert rel(pc.grad, pe.grad) < 1e-4, (name, float(rel(pc.grad, pe.grad)))
    assert all(is_compiled(layer) for layer in stack.layers)


@pytest.mark.parametrize("arch", CAUSAL + MASKED)
def test_cuda_graphs_equal_eager_with_gradient_accumulation(arch):
    """A 3-layer stack compiled with --tnn-cuda-graphs against the same eager stack, training mode, through the
    models' loop (``run_layers``): outputs, input gradients and parameter gradients, over updates of one micro-batch
    and of two (gradients accumulated, as --update-freq 2 does, where the first micro-batch's gradients must survive
    the second's graph replays); the whole stack's forward one graph, its backward another, each layer a region of it
    where the torch has them (``STACK_REGIONS``: compiling them did not fail over to one graph of every layer)."""
    torch.manual_seed(0)
    model = build_arch(arch, 1000, dropout=0.0, **small(arch)).cuda()
    stack = model.decoder if arch in CAUSAL else model.encoder
    eager = stack.layers
    graphs = copy.deepcopy(eager)
    compile_layers(graphs, "strict", "layers", cuda_graphs=True)
    assert graphs[0].forward.stack.graphs is not None
    width = stack.embed_tokens.embedding_dim
    for update, micro_batches in enumerate([1, 2, 2, 1]):
        for p in list(eager.parameters()) + list(graphs.parameters()):
            p.grad = None  # as fairseq's optimizers do between updates
        for _ in range(micro_batches):
            x = torch.randn(2, 512, width, device="cuda")
            xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
            ye, yg = run_layers(eager, xe), run_layers(graphs, xg)
            assert rel(yg, ye) < 1e-5, ("output", update, float(rel(yg, ye)))
            g = torch.randn_like(ye)
            ye.backward(g)
            g_handed = g.clone()
            yg.backward(g)
            # the graphs leave their input and the gradient they are handed as they were: inductor's code for a
            # region's backward overwrites the region's inputs where it no longer needs them, the stack's output
            # gradient among them (torch 2.11 and 2.13, CPU); here the graph's own copy of it takes that
            assert torch.equal(g, g_handed) and torch.equal(xg.detach(), x), update
            assert rel(xg.grad, xe.grad) < 1e-5, ("input gradient", update, float(rel(xg.grad, xe.grad)))
        # parameter gradients sum over every position and the batch, in another order on the GPU than eagerly: 1e-4
        # (a stale or overwritten gradient is off by order 1)
        for (name, pe), pg in zip(eager.named_parameters(), graphs.parameters()):
            assert rel(pg.grad, pe.grad) < 1e-4, (name, update, float(rel(pg.grad, pe.grad)))
    assert all(is_compiled(layer) for layer in graphs)
    assert graphs[0].forward.stack.regions == STACK_REGIONS


@pytest.mark.parametrize("arch", CAUSAL + MASKED)
def test_cuda_graphs_with_the_models_edges_equal_eager(arch, monkeypatch):
    """The model, 3 layers, with --tnn-cuda-graphs against the same eager model, training mode, from the tokens: the
    stack's graphs then hold the model's edges too (``GRAPH_EDGES``: the embedding, and the causal model's final norm
    and output layer); the logits or masked features, and every parameter's gradient (the embedding's among them:
    the graphs' output), over updates of one micro-batch and of two, the masked model with padding and at a second
    length (a length bucket: its own graphs, again with the regions and the edges, ``GRAPH_SHAPES``). The forward
    pairs its rows as the recipe's batches (8 or 16 rows) make it do (``PAIRED_FORWARD_MIN_ROWS``, lowered to
    1 for the test's 2), with its constants built anew: in the ninth GPU run that path first built them while the graphs
    recorded, and the capture refused their copies from the host."""
    from collections import OrderedDict

    from fairseq_tnn.models import compile as compiling
    from fairseq_tnn.ops import fast, toeplitz
    monkeypatch.setattr(toeplitz, "PAIRED_FORWARD_MIN_ROWS", 1)
    monkeypatch.setattr(fast, "_CACHE", OrderedDict())
    torch.manual_seed(0)
    eager = build_arch(arch, 1000, dropout=0.0, **small(arch)).cuda()
    model = copy.deepcopy(eager)
    causal = arch in CAUSAL
    part = model.decoder if causal else model.encoder
    compile_layers(part.layers, "strict", "layers", cuda_graphs=True)
    stack = part.layers[0].forward.stack
    for update, (micro_batches, n) in enumerate([(1, 512), (2, 512), (2, 512 if causal else 384), (1, 512)]):
        for p in list(eager.parameters()) + list(model.parameters()):
            p.grad = None
        for _ in range(micro_batches):
            tokens = torch.randint(4, 1000, (2, n), device="cuda")
            if not causal:
                tokens[1, -37:] = part.padding_idx
            if causal:
                ye, yg = eager(tokens)[0], model(tokens)[0]
            else:
                ye, yg = eager.encoder.extract_features(tokens)[0], part.extract_features(tokens)[0]
            assert rel(yg, ye) < 1e-5, ("output", update, float(rel(yg, ye)))
            g = torch.randn_like(ye)
            g[tokens.eq(1)] = 0
            ye.backward(g)
            yg.backward(g)
        for (name, pe), pg in zip(eager.named_parameters(), model.parameters()):
            if pe.grad is not None:
                assert rel(pg.grad, pe.grad) < 1e-4, (name, update, float(rel(pg.grad, pe.grad)))
    assert stack.edges == compiling.GRAPH_EDGES and stack.regions == STACK_REGIONS and stack.error is None


def test_the_direct_band_in_ski_tnns_compiled_layers_and_graphs_equals_eager(monkeypatch):
    """SKI-TNO's band by the Triton kernels (``BAND_METHOD["cuda"] = "triton"``, ops/band_direct.py), the low rank in
    them (``ski.FUSE_LOWRANK``, its default): eagerly the same masked features and gradients as the convolution's band
    followed by the FFT's low rank, and compiled (its custom operators inside the layers' graphs, the gate recomputed in
    the backward) and in the stack's CUDA graphs the same as eager, over two updates."""
    from fairseq_tnn.ops import ski
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the reference's convolution in full fp32
    torch.manual_seed(0)
    reference = build_arch("ski_tnn_mlm_wt103", 1000, dropout=0.0, encoder_layers=3).cuda()
    eager, model = copy.deepcopy(reference), copy.deepcopy(reference)
    compile_layers(model.encoder.layers, "strict", "layers", cuda_graphs=True)
    for update in range(2):
        tokens = torch.randint(4, 1000, (2, 512), device="cuda")
        tokens[1, -37:] = 1
        g = torch.randn(2, 512, 768, device="cuda")
        g[tokens.eq(1)] = 0
        outputs = []
        for method, net in (("conv1d", reference), ("triton", eager), ("triton", model)):
            monkeypatch.setitem(ski.BAND_METHOD, "cuda", method)
            net.zero_grad(set_to_none=True)
            y = net.encoder.extract_features(tokens)[0]
            y.backward(g)
            outputs.append((y.detach(), {k: p.grad for k, p in net.named_parameters() if p.grad is not None}))
        (y_ref, grads_ref), *others = outputs
        for which, (y, grads) in zip(("eager", "graphed"), others):
            assert rel(y, y_ref) < 1e-5, (which, update, float(rel(y, y_ref)))
            assert grads.keys() == grads_ref.keys(), which
            for name in grads:
                assert rel(grads[name], grads_ref[name]) < 1e-4, (which, name, float(rel(grads[name], grads_ref[name])))
    assert model.encoder.layers[0].forward.stack.error is None


@pytest.mark.skipif(not STACK_REGIONS, reason="this torch compiles no stack regions (STACK_REGIONS)")
def test_dropout_in_the_stacks_regions_draws_a_new_mask_per_layer_and_update():
    """The stack's CUDA graphs compile each layer as one region, stamped out for each layer (``STACK_REGIONS``): in the
    graphs' mode each layer's call and each update (a graph replay) draws its own dropout mask."""
    assert_masks_differ(region_dropout_masks("cuda", mode="reduce-overhead"))


@pytest.mark.parametrize("section,arch", [("causal", "tnn_lm_wt103"), ("masked", "fd_tnn_mlm_wt103"),
                                          ("masked", "ski_tnn_mlm_wt103")])
def test_bf16_trains_a_flat_master_copy_with_cuda_graphs(tmp_path, section, arch):
    """fairseq's --bf16 on CUDA (fairseq_tnn/patches/bf16.py) with the stack's CUDA graphs: bf16 weights, one flat fp32
    master tensor (fairseq keeps bf16's per parameter) and no loss scaler; every weight its master weight rounded
    after each update, and finite losses."""
    from benchmarks import trainer as tr
    torch.manual_seed(0)
    trainer = tr.build_trainer(section, arch, None, 128, "cuda", "bf16w", tr.GRAPHS,
                               tr._dictionary_dir(str(tmp_path), 64), True, width=64)
    losses = [trainer.train_step([tr.synthetic_sample(section, 128, 4, 64, seed=i, device="cuda")])["loss"]
              for i in range(4)]
    opt = trainer.optimizer
    assert opt.has_flat_params and opt.scaler is None and all(math.isfinite(x) for x in losses), losses
    (flat,) = opt.fp32_params.values()
    offset = 0
    for name, p in trainer.model.named_parameters():
        assert p.dtype == (torch.float32 if ".rpe." in name else torch.bfloat16), name
        assert torch.equal(p.detach(), flat[offset:offset + p.numel()].view_as(p).to(p.dtype)), name
        offset += p.numel()


@pytest.mark.parametrize("arch", ["tnn_lm_wt103", "ski_tnn_mlm_wt103"])
def test_fairseq_train_with_cuda_graphs_equals_compiled(data_bin, tmp_path, arch):
    """fairseq-train --fp16 --update-freq 2 with --tnn-cuda-graphs and without (compiled either way, dropout 0): the
    same validation losses, and the graphs run (fewer kernel launches is the point; here: no fallback, no error)."""
    causal = arch in CAUSAL
    losses = {}
    for graphs in (False, True):
        log = run([cli("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--arch", arch,
                   "--decoder-layers" if causal else "--encoder-layers", 2, "--fp16", "--dropout", "0",
                   "--task", "tnn_language_modeling" if causal else "tnn_masked_lm",
                   "--criterion", CAUSAL_TASK["criterion"] if causal else MASKED_TASK["criterion"],
                   "--sample-break-mode", "none" if causal else "complete", "--tokens-per-sample", 128,
                   "--batch-size", 4, "--update-freq", 2, "--optimizer", "adam", "--lr", "0.001", "--max-update", 30,
                   "--seed", 1, "--save-dir", tmp_path / f"ck{int(graphs)}", "--log-format", "simple",
                   "--log-interval", 10, "--num-workers", 0, "--no-epoch-checkpoints", "--validate-interval-updates", 10,
                   "--tnn-compile", "strict", *(["--tnn-cuda-graphs"] if graphs else [])])
        losses[graphs] = [float(x) for x in re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", log)]
        assert len(losses[graphs]) >= 3 and all(math.isfinite(x) for x in losses[graphs]), log[-3000:]
    assert losses[True] == pytest.approx(losses[False], rel=2e-3), losses


def ddp_on_one_gpu(data_bin, save_dir, graphs):
    """fairseq-train as two ranks of torch's DistributedDataParallel (fairseq's ``--ddp-backend pytorch_ddp``, what a
    run on several GPUs trains with) on this machine's first GPU: torchrun starts the ranks and gloo joins them (NCCL
    refuses two ranks on one device), both on device 0. fp16, dropout 0, --update-freq 2 (the first micro-batch under
    DDP's ``no_sync``, its gradients surviving the second's graph replay), ``--bucket-cap-mb 4``: DDP's buckets smaller
    than a layer's 6.2 MB of fp16 weights, so that dynamo cuts the stack's graph between the layers as it cuts a wt103
    model's at fairseq's 25 MB (tests/modules/test_compile_ddp.py). Returns rank 0's {update: loss}, and the log."""
    log = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", 2, "--standalone",
               "-m", "fairseq_cli.train", data_bin, "--user-dir", USER_DIR, "--arch", "tnn_lm_wt103",
               "--decoder-layers", 2, "--fp16", "--dropout", "0", "--task", "tnn_language_modeling",
               "--criterion", CAUSAL_TASK["criterion"], "--sample-break-mode", "none", "--tokens-per-sample", 128,
               "--batch-size", 4, "--update-freq", 2, "--optimizer", "adam", "--lr", "0.001", "--max-update", 12,
               "--seed", 1, "--save-dir", save_dir, "--log-format", "simple", "--log-interval", 1, "--num-workers", 0,
               "--no-epoch-checkpoints", "--disable-validation", "--tnn-compile", "strict",
               *(["--tnn-cuda-graphs"] if graphs else []),
               "--distributed-world-size", 2, "--distributed-rank", "${local_rank}", "--distributed-init-method",
               "env://", "--distributed-no-spawn", "--distributed-backend", "gloo", "--ddp-backend", "pytorch_ddp",
               "--bucket-cap-mb", 4, "--device-id", 0], env={"OMP_NUM_THREADS": "1"})
    return {update: loss for update, (loss, _) in rank0_updates(log).items()}, log


def test_cuda_graphs_under_distributed_data_parallel_equal_compiled(data_bin, tmp_path):
    """--tnn-cuda-graphs under DistributedDataParallel (scripts/train.sh leaves it off on several GPUs until this
    passes, fairseq_tnn/recipe.py's CUDA_GRAPHS): two ranks, compiled with the stack's graphs and without, lose the same
    at every update. DDP's hooks all-reduce each gradient as the graphed backward hands it to autograd, out of the
    graphs' memory, which the next replay reuses."""
    compiled, log = ddp_on_one_gpu(data_bin, tmp_path / "compiled", graphs=False)
    assert "training on 2 devices" in log and sorted(compiled) == list(range(1, 13)), log[-3000:]
    graphs, log = ddp_on_one_gpu(data_bin, tmp_path / "graphs", graphs=True)
    assert "training on 2 devices" in log and sorted(graphs) == list(range(1, 13)), log[-3000:]
    assert "--tnn-cuda-graphs:" not in log and "--tnn-compile:" not in log, log[-3000:]  # no fallback's warning
    # fp16, the stack as one graph against each layer's own: its kernels fuse differently; losses logged to 3 decimals
    for update in compiled:
        assert graphs[update] == pytest.approx(compiled[update], rel=2e-3, abs=2e-3), (update, compiled, graphs)


@pytest.mark.parametrize("arch", ["tnn_lm_wt103", "tnn_mlm_wt103"])
def test_eager_fp16_training_on_padded_batches(data_bin, tmp_path, arch):
    """fairseq-train --fp16 with eager layers on batches with padding (causal: --sample-break-mode eos; masked:
    complete): updates do not overflow (a new model's zero vectors at the padding made NaN gradients in fp16 until the
    RMS norm held its eps there: ops/norm.py, ``dtype_eps``), and the validation loss falls."""
    causal = arch in CAUSAL
    log = run([cli("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--arch", arch,
               "--decoder-layers" if causal else "--encoder-layers", 2, "--fp16",
               "--task", "tnn_language_modeling" if causal else "tnn_masked_lm",
               "--criterion", CAUSAL_TASK["criterion"] if causal else MASKED_TASK["criterion"],
               "--sample-break-mode", "eos" if causal else "complete", "--tokens-per-sample", 128,
               "--batch-size", 8, "--optimizer", "adam", "--lr", "0.001", "--max-update", 30, "--seed", 1,
               "--save-dir", tmp_path / "ck", "--log-format", "simple", "--log-interval", 10, "--num-workers", 0,
               "--no-epoch-checkpoints", "--validate-interval-updates", 15])
    # every update overflowed before (the loss scale would reach fairseq's minimum after some 20); a new model's
    # first updates may overflow once or twice at the initial scale of 128 on their own
    assert log.count("gradient overflow") <= 3, log[-3000:]
    losses = [float(x) for x in re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", log)]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], log[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("arch", CAUSAL + MASKED)
def test_fp16_evaluation_at_14336_tokens(arch):
    torch.manual_seed(0)
    model = build_arch(arch, 1000, **small(arch)).cuda().half().eval()
    tokens = torch.randint(4, 1000, (1, 14336), device="cuda")
    with torch.no_grad():
        logits = model(tokens)[0]
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", CAUSAL)
def test_causal_in_fp32_on_gpu(arch):
    """A changed token at t moves no output before t by more than 1e-4 relative."""
    torch.manual_seed(0)
    model = build_arch(arch, 1000, dropout=0.0, **small(arch)).cuda().eval()
    tokens = torch.randint(4, 1000, (2, 1024), device="cuda")
    changed = tokens.clone()
    t = 700
    changed[:, t] = (changed[:, t] + 1 - 4) % 996 + 4
    with torch.no_grad():
        a, b = model(tokens)[0], model(changed)[0]
    assert rel(b[:, :t], a[:, :t]) < 1e-4
    assert rel(b[:, t:], a[:, t:]) > 1e-4  # the change does reach the later positions


def test_the_benchmarks_batches_are_pinned_as_fairseqs_loader_leaves_them():
    """benchmarks/trainer.py's batch for a GPU: the same values as the CPU's, every tensor in pinned memory (fairseq's
    DataLoader pins its batches), so that the Trainer's move to the GPU does not wait for the queued kernels."""
    from benchmarks import trainer as tr
    for section in ("causal", "masked"):
        cpu, pinned = (tr.synthetic_sample(section, 64, 2, 100, device=d) for d in ("cpu", "cuda"))
        tensors = [(k, v) for k, v in pinned.items() if torch.is_tensor(v)] + list(pinned["net_input"].items())
        assert all(v.is_pinned() and v.device.type == "cpu" for _, v in tensors), [k for k, v in tensors]
        assert all(torch.equal(v, cpu[k] if k in cpu else cpu["net_input"][k]) for k, v in tensors)
        assert ("masked_positions" in pinned) == (section == "masked")
