"""The fused softmax cross-entropy (``fairseq_tnn/ops/cross_entropy.py``, Triton kernels) against fairseq's computation,
the loss and the logits' gradient, on every device (the CPU under Triton's interpreter, CUDA where present); and the
``tnn_cross_entropy`` criterion (``fairseq_tnn/criterions/cross_entropy.py``) against fairseq's ``cross_entropy``."""

import pytest
import torch

from helpers import compile_for_hopper, require_triton

from fairseq_tnn.ops import cross_entropy as ce
from fairseq_tnn.ops import fast, toeplitz_direct


@pytest.fixture(autouse=True)
def triton_kernels(request, monkeypatch):
    """Triton, and on the CPU its interpreter, with the kernels let run there (``CPU_INTERPRETED``)."""
    require_triton(request, device_less_on_cpu=False)
    monkeypatch.setattr(ce, "CPU_INTERPRETED", True)


def _case(rows, vocab, dtype, device, ignored=(), seed=0, spread=4.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * spread).to(device=device, dtype=dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    for r in ignored:
        target[r] = 1  # the padding symbol, ignore_index below
    return logits, target.to(device)


def _loss_and_grad(fn, logits, target, ignore_index, g):
    leaf = logits.detach().clone().requires_grad_()
    loss = fn(leaf, target, ignore_index)
    loss.backward(torch.tensor(g, device=logits.device))
    return loss.detach(), leaf.grad


# vocabularies: one step of the row's pass, several with a ragged last one (BLOCK lowered to 64 below), and the tail
@pytest.mark.parametrize("vocab", [50, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_cross_entropy_equals_fairseqs(device, monkeypatch, dtype, vocab):
    """The loss in fp32 to rounding, and the logits' gradient within one rounding of their dtype, with padding rows
    left out and a loss scale (fp16 training's) as the summed loss's gradient."""
    monkeypatch.setattr(ce, "BLOCK", 64)
    logits, target = _case(37, vocab, dtype, device, ignored=(3, 20))
    assert ce.supports(logits)
    loss, grad = _loss_and_grad(ce.cross_entropy_sum, logits, target, 1, 128.0)
    ref_loss, ref_grad = _loss_and_grad(ce.reference_cross_entropy_sum, logits, target, 1, 128.0)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0), (loss, ref_loss)
    eps = {torch.float32: 1e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    assert (grad.float() - ref_grad.float()).abs().max() <= 2 * eps * 128.0
    assert torch.equal(grad[3], torch.zeros_like(grad[3])) and torch.equal(grad[20], torch.zeros_like(grad[20]))
    if dtype == torch.float32:  # softmax - onehot sums to 0 along a scored row
        assert grad.sum(-1).abs().max() < 1e-4 * 128.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_at_the_causal_recipes_shape(device, dtype):
    """The causal wt103 update's logits (8 x 512 rows, 50,264 symbols) on a GPU, at the kernels' own block size: the
    loss in fp32 to rounding, the gradient within one rounding of the logits' dtype (at the CPU's interpreter this
    shape would take hours: its smaller cases above)."""
    if device == "cpu":
        pytest.skip("the wt103 shape runs on CUDA only (Triton's interpreter takes a program at a time)")
    logits, target = _case(8 * 512, 50264, dtype, device, ignored=(5, 4000))
    loss, grad = _loss_and_grad(ce.cross_entropy_sum, logits, target, 1, 128.0)
    ref_loss, ref_grad = _loss_and_grad(ce.reference_cross_entropy_sum, logits, target, 1, 128.0)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0), (loss, ref_loss)
    eps = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    assert (grad.float() - ref_grad.float()).abs().max() <= 2 * eps * 128.0


def test_rows_with_a_stride_and_all_ignored(device, monkeypatch):
    """Logits whose rows are spaced wider than the vocabulary (a slice of a wider tensor) give the loss of their
    compact copy; a batch whose every target is padding loses 0 with a zero gradient."""
    monkeypatch.setattr(ce, "BLOCK", 64)
    wide, target = _case(9, 150, torch.float32, device)
    logits = wide[:, :100]
    target = target % 100
    assert logits.stride(0) == 150
    loss, grad = _loss_and_grad(ce.cross_entropy_sum, logits, target, 1, 1.0)
    ref_loss, ref_grad = _loss_and_grad(ce.reference_cross_entropy_sum, logits.contiguous(), target, 1, 1.0)
    assert torch.allclose(loss, ref_loss, rtol=1e-6) and torch.allclose(grad, ref_grad, atol=1e-6)
    loss, grad = _loss_and_grad(ce.cross_entropy_sum, logits, torch.ones_like(target), 1, 1.0)
    assert loss.item() == 0.0 and not grad.any()


def test_a_target_outside_the_vocabulary_gives_nan(device):
    """Where the dense nll_loss stops the device (an assert), the fused loss is NaN, which fairseq's trainer refuses,
    with no wait of the host for the device; ignored targets (-100 too) are not read."""
    logits, target = _case(4, 30, torch.float32, device)
    target[2] = 30
    assert torch.isnan(ce.cross_entropy_sum(logits, target, 1))
    target[2] = -100
    loss = ce.cross_entropy_sum(logits, target, -100)
    keep = torch.tensor([0, 1, 3], device=logits.device)
    assert torch.allclose(loss, ce.reference_cross_entropy_sum(logits[keep], target[keep], -100), rtol=1e-6)


def test_where_the_fused_kernels_run(monkeypatch):
    """fp64 logits, the references and (off the tests) the CPU take fairseq's computation; a malformed call is
    refused, naming the shapes."""
    logits = torch.randn(3, 10)
    assert ce.supports(logits) == toeplitz_direct.INTERPRETED
    assert not ce.supports(logits.double())
    with fast.references():
        assert not ce.supports(logits)
    monkeypatch.setattr(ce, "CPU_INTERPRETED", False)
    assert not ce.supports(logits)
    with pytest.raises(ValueError, match=r"logits \(rows, vocab\) and target \(rows,\), got \(3, 10\) and \(2,\)"):
        ce.cross_entropy_sum(logits, torch.zeros(2, dtype=torch.long), 1)


def test_kernels_checked_once_at_first_use(monkeypatch, caplog):
    """The kernels are tried against fairseq's computation once per process and dtype before their first real call,
    under no_grad too (validation may call first); kernels that fail or give a wrong result leave fairseq's
    computation, with a warning naming why."""
    monkeypatch.setattr(ce, "_WORKS", {})
    logits, target = _case(5, 40, torch.float32, "cpu")
    with torch.no_grad():
        loss = ce.cross_entropy_sum(logits, target, 1)
    assert ce._WORKS == {(torch.float32, "cpu"): True}
    assert torch.allclose(loss, ce.reference_cross_entropy_sum(logits, target, 1), rtol=1e-6)
    monkeypatch.setattr(ce, "_WORKS", {})
    wrong = ce.SoftmaxCrossEntropy.backward
    monkeypatch.setattr(ce.SoftmaxCrossEntropy, "backward",
                        staticmethod(lambda ctx, grad: (wrong(ctx, grad)[0] * 1.5, None, None)))
    calls = []
    apply = ce.SoftmaxCrossEntropy.apply
    monkeypatch.setattr(ce.SoftmaxCrossEntropy, "apply", lambda *a: calls.append(1) or apply(*a))
    with caplog.at_level("WARNING", logger=ce.__name__):
        loss, grad = _loss_and_grad(ce.cross_entropy_sum, logits, target, 1, 1.0)
        ce.cross_entropy_sum(logits, target, 1)
    assert ce._WORKS == {(torch.float32, "cpu"): False} and len(calls) == 1  # the check's call alone
    assert "tnn_cross_entropy: the fused loss's kernels do not work for torch.float32 logits on cpu (RuntimeError: " \
           "the fused loss and gradient differ from fairseq's by" in caplog.text
    ref_loss, ref_grad = _loss_and_grad(ce.reference_cross_entropy_sum, logits, target, 1, 1.0)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)


def test_running_out_of_memory_is_not_a_failure_of_the_kernels(monkeypatch):
    """Out of memory during the first-use check is raised as the reference would raise it, and the check is made
    again at the next call: the process does not give up the fused kernels for it."""
    monkeypatch.setattr(ce, "_WORKS", {})
    logits, target = _case(5, 40, torch.float32, "cpu")
    apply = ce.SoftmaxCrossEntropy.apply

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
    monkeypatch.setattr(ce.SoftmaxCrossEntropy, "apply", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        ce.cross_entropy_sum(logits, target, 1)
    assert ce._WORKS == {}
    monkeypatch.setattr(ce.SoftmaxCrossEntropy, "apply", apply)
    assert torch.allclose(ce.cross_entropy_sum(logits, target, 1), ce.reference_cross_entropy_sum(logits, target, 1),
                          rtol=1e-6)
    assert ce._WORKS == {(torch.float32, "cpu"): True}


def test_meta_logits_give_the_shapes_of_the_loss_and_gradient():
    """On the meta device (benchmarks/memory.py's accounting) the fused loss runs no kernel: an fp32 scalar, and a
    gradient of the logits' shape and dtype; it keeps the logits and the rows' lse for its backward."""
    logits = torch.empty(6, 50, dtype=torch.float16, device="meta", requires_grad=True)
    target = torch.zeros(6, dtype=torch.long, device="meta")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.shape, t.dtype)) or t, lambda t: t):
        loss = ce.SoftmaxCrossEntropy.apply(logits, target, 1)
    assert loss.device.type == "meta" and loss.shape == () and loss.dtype == torch.float32
    assert saved == [((6, 50), torch.float16), ((6,), torch.long), ((6,), torch.float32)]
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad.device.type == "meta" and grad.shape == (6, 50) and grad.dtype == torch.float16


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_logits_on_another_gpu_than_the_current_one(monkeypatch):
    """The kernels launch on the logits' GPU, not the current one: logits on the second GPU while the first is
    current give fairseq's loss and gradient, and the check is made for that GPU."""
    monkeypatch.setattr(ce, "_WORKS", {})
    assert torch.cuda.current_device() == 0
    logits, target = _case(40, 3000, torch.float16, "cuda:1")
    loss, grad = _loss_and_grad(ce.cross_entropy_sum, logits, target, 1, 128.0)
    ref_loss, ref_grad = _loss_and_grad(ce.reference_cross_entropy_sum, logits, target, 1, 128.0)
    assert ce._WORKS == {(torch.float16, "cuda:1"): True}
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0)
    assert (grad.float() - ref_grad.float()).abs().max() <= 2 * 2 ** -10 * 128.0


def _criteria():
    import fairseq_tnn
    fairseq_tnn.register()
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.criterions.cross_entropy import CrossEntropyCriterion
    from fairseq_tnn.criterions.cross_entropy import TnnCrossEntropyCriterion
    from fairseq_tnn.models.build import VocabTask, dictionary_of_size
    assert CRITERION_REGISTRY["tnn_cross_entropy"] is TnnCrossEntropyCriterion
    task = VocabTask(dictionary_of_size(300))
    return TnnCrossEntropyCriterion(task, sentence_avg=False), CrossEntropyCriterion(task, sentence_avg=False)


def _lm_sample(device, pad, rows=3, n=16, vocab=300):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, vocab, (rows, n), generator=g)
    target = torch.roll(tokens, -1, 1)
    target[-1, -4:] = pad  # a right-padded last sequence
    return {"net_input": {"src_tokens": tokens.to(device), "src_lengths": torch.full((rows,), n, device=device)},
            "target": target.to(device), "ntokens": int(target.ne(pad).sum()), "nsentences": rows}


def _gradients(criterion, model, sample):
    model.zero_grad()
    loss, sample_size, logging = criterion(model, sample)
    loss.backward()
    return loss.detach(), sample_size, logging, {k: p.grad.clone() for k, p in model.named_parameters()
                                                  if p.grad is not None}


def _same_as_fairseqs(fused, stock, model, sample):
    """``fused`` criterion's loss, sample size, logging output and every parameter's gradient against ``stock``'s on
    ``sample``; returns the sample size and fairseq's loss and gradients."""
    loss, size, logging, grads = _gradients(fused, model, sample)
    ref_loss, ref_size, ref_logging, ref_grads = _gradients(stock, model, sample)
    assert size == ref_size and logging.keys() == ref_logging.keys()
    assert torch.allclose(loss, ref_loss, rtol=1e-5) and torch.allclose(logging["loss"], ref_logging["loss"], rtol=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) > 5
    for k in grads:
        assert torch.allclose(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6), k
    return size, ref_loss, ref_grads


def test_the_criterion_equals_fairseqs_cross_entropy(device, monkeypatch):
    """``--criterion tnn_cross_entropy`` on a tnn_lm_tiny model: fairseq's loss, sample size and logging output, and
    every parameter's gradient; with the kernels off (the CPU's training), the same to the bit."""
    from fairseq_tnn.models.build import build_arch
    monkeypatch.setattr(ce, "BLOCK", 128)
    fused, stock = _criteria()
    model = build_arch("tnn_lm_tiny", 300, dropout=0.0).to(device)
    sample = _lm_sample(device, fused.padding_idx)
    size, ref_loss, ref_grads = _same_as_fairseqs(fused, stock, model, sample)
    monkeypatch.setattr(ce, "CPU_INTERPRETED", False)
    if device == "cpu":
        loss, _, _, grads = _gradients(fused, model, sample)
        assert torch.equal(loss, ref_loss) and all(torch.equal(grads[k], ref_grads[k]) for k in grads)


def test_the_criterion_leaves_other_log_probabilities_to_fairseq(monkeypatch):
    """A model whose log-probabilities are not the plain log-softmax of its logits (its own get_normalized_probs, as
    an adaptive softmax's), or a loss per token (reduce=False), get fairseq's computation, not the fused one."""
    from fairseq_tnn.criterions.cross_entropy import plain_log_softmax
    from fairseq_tnn.models.build import build_arch
    fused, stock = _criteria()
    model = build_arch("tnn_lm_tiny", 300, dropout=0.0)
    assert plain_log_softmax(model)
    monkeypatch.setattr(ce, "_WORKS", {(torch.float32, "cpu"): True})  # the first-use check passed: calls below count
    sample = _lm_sample("cpu", fused.padding_idx)
    calls = []
    monkeypatch.setattr(ce.SoftmaxCrossEntropy, "apply", lambda *a: calls.append(a) or torch.tensor(0.0))
    fused(model, sample)
    assert len(calls) == 1
    per_token, _ = fused.compute_loss(model, model(**sample["net_input"]), sample, reduce=False)
    assert per_token.shape == (48,) and len(calls) == 1
    tempered = type(model.decoder).get_normalized_probs
    monkeypatch.setattr(type(model.decoder), "get_normalized_probs",
                        lambda self, out, log_probs, sample=None: tempered(self, (out[0] / 2, *out[1:]), log_probs))
    assert not plain_log_softmax(model)
    loss, _, _ = fused(model, sample)
    assert len(calls) == 1 and torch.equal(loss, stock(model, sample)[0])


def _masked_criteria():
    import fairseq_tnn
    fairseq_tnn.register()
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.criterions.masked_lm import MaskedLmConfig, MaskedLmLoss
    from fairseq_tnn.criterions.masked_lm import TnnMaskedLmLoss
    from fairseq_tnn.models.build import VocabTask, dictionary_of_size
    assert CRITERION_REGISTRY["tnn_masked_lm"] is TnnMaskedLmLoss
    task = VocabTask(dictionary_of_size(300))
    cfg = MaskedLmConfig(tpu=False)  # as fairseq resolves its default, common.tpu
    return TnnMaskedLmLoss(cfg, task), MaskedLmLoss(cfg, task)


def _mlm_sample(device, pad, positions=True, rows=3, n=16, vocab=300):
    from fairseq_tnn.patches.masked_positions import add_masked_positions
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(4, vocab, (rows, n), generator=g)
    masked = torch.rand(rows, n, generator=g) < 0.3
    masked[:, 0] = True
    target = torch.where(masked, torch.randint(4, vocab, (rows, n), generator=g), torch.full_like(tokens, pad))
    sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.full((rows,), n)}, "target": target,
              "ntokens": int(masked.sum()), "nsentences": rows}
    if positions:  # as tnn_masked_lm collates its batches, on the CPU
        add_masked_positions(sample, pad)
    from fairseq.utils import apply_to_sample
    return apply_to_sample(lambda t: t.to(device), sample)


def test_the_masked_criterion_equals_fairseqs_masked_lm(device, monkeypatch):
    """``--criterion tnn_masked_lm`` on a tnn_mlm_tiny model and a batch naming its masked positions: fairseq's
    masked_lm loss, sample size (a Python int), logging output and every parameter's gradient, by the fused kernels
    (called once); with the kernels off (the CPU's training), the same to the bit. A batch without the positions
    (another task's) runs fairseq's code."""
    from fairseq_tnn.models.build import build_arch
    monkeypatch.setattr(ce, "BLOCK", 128)
    fused, stock = _masked_criteria()
    model = build_arch("tnn_mlm_tiny", 300, dropout=0.0).to(device)
    sample = _mlm_sample(device, fused.padding_idx)
    calls = []
    apply = ce.SoftmaxCrossEntropy.apply
    monkeypatch.setattr(ce.SoftmaxCrossEntropy, "apply", lambda *a: calls.append(a[0].shape) or apply(*a))
    size, ref_loss, ref_grads = _same_as_fairseqs(fused, stock, model, sample)
    assert calls[-1] == (sample["ntokens"], 300)  # the masked rows alone (after the first-use check's, if any)
    assert size == sample["ntokens"] and type(size) is int
    monkeypatch.setattr(ce, "CPU_INTERPRETED", False)
    if device == "cpu":
        calls.clear()
        loss, _, _, grads = _gradients(fused, model, sample)
        assert not calls and torch.equal(loss, ref_loss) and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
        monkeypatch.setattr(ce, "CPU_INTERPRETED", True)
        unnamed = _mlm_sample(device, fused.padding_idx, positions=False)
        loss, size, _, _ = _gradients(fused, model, unnamed)
        assert not calls and torch.is_tensor(size) and torch.equal(loss, stock(model, unnamed)[0])


COMPILE_FOR_HOPPER = r'''
from fairseq_tnn.ops import cross_entropy as ce
forward, backward = ce._kernels()
ints = {k: "i32" for k in ("vocab", "stride", "ignore_index")}
for dtype in ("fp16", "bf16", "fp32"):
    compile(forward, {"logits_ptr": "*" + dtype, "target_ptr": "*i64", "lse_ptr": "*fp32", "loss_ptr": "*fp32",
                      **ints}, {"BLOCK": ce.BLOCK})
    compile(backward, {"logits_ptr": "*" + dtype, "target_ptr": "*i64", "lse_ptr": "*fp32", "grad_loss_ptr": "*fp32",
                       "grad_ptr": "*" + dtype, "vocab": "i32", "stride": "i32", "grad_stride": "i32",
                       "ignore_index": "i32"}, {"BLOCK": ce.BLOCK})
print(json.dumps(built))
'''


def test_the_kernels_compile_for_a_hopper_gpu(tmp_path):
    """Without a GPU: the fused loss's forward and backward kernels for fp16, bf16 and fp32 logits (the recipes' loss on
    a GPU) compiled to machine code for an H100 / H200 (sm_90) by Triton's compiler and ptxas, in a process where Triton
    is not in its interpreter: the types and reductions the interpreter does not check."""
    (built,) = compile_for_hopper(COMPILE_FOR_HOPPER, tmp_path)
    assert len(built) == 6 and min(built) > 3_000, built  # 6 cubins of real code
