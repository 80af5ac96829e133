"""Why do --tnn-cuda-graphs give rpe.proj.weight a zero gradient? Variants, one per process."""
import copy, inspect, sys, textwrap, time
import torch
from fairseq_tnn.models.build import build_arch
from fairseq_tnn.models.compile import compile_layers
from fairseq_tnn.ops import fast
import fairseq_tnn.ops.rpe as R

v = sys.argv[1]
if v == "D":  # x0 made contiguous before it is saved
    src = inspect.getsource(R.RpeMlp).replace(".expand(stacked, -1, 1)", ".expand(stacked, -1, 1).contiguous()")
    assert ".contiguous()" in src
    ns = dict(vars(R)); exec(textwrap.dedent(src), ns); R.RpeMlp = ns["RpeMlp"]
arch = sys.argv[2] if len(sys.argv) > 2 else "tnn_lm_wt103"
torch.manual_seed(0)
model = build_arch(arch, 1000, dropout=0.0, **({"encoder_layers": 2} if "mlm" in arch else {"decoder_layers": 2})).cuda()
stack = model.encoder if "mlm" in arch else model.decoder
eager = stack.layers
comp = copy.deepcopy(eager)
t0 = time.time()
if v == "P":  # bf16 autocast eager: the longest kernels
    from torch.profiler import profile, ProfilerActivity
    x = torch.randn(8, 512, stack.embed_tokens.embedding_dim, device="cuda", requires_grad=True)
    for i in range(4):
        with torch.autocast("cuda", torch.bfloat16):
            y = x
            for l in eager: y = l(y)
        y.float().sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.autocast("cuda", torch.bfloat16):
            y = x
            for l in eager: y = l(y)
        y.float().sum().backward()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    sys.exit()
compile_layers(comp, "strict", "layers", cuda_graphs=v != "A")
width = stack.embed_tokens.embedding_dim
ctx = fast.references() if v == "C" else torch.enable_grad()
with ctx:
    for update in range(4):
        for p in list(eager.parameters()) + list(comp.parameters()):
            p.grad = None
        x = torch.randn(2, 512, width, device="cuda")
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yg = xe, xg
        for l in eager: ye = l(ye)
        for l in comp: yg = l(yg)
        g = torch.randn_like(ye)
        ye.backward(g); yg.backward(g)
        out = float((ye - yg).norm() / ye.norm()); gin = float((xe.grad - xg.grad).norm() / xe.grad.norm())
        bad = [(n, round(float((pe.grad - pg.grad).norm() / pe.grad.norm()), 4)) for (n, pe), pg in
               zip(eager.named_parameters(), comp.parameters()) if float((pe.grad - pg.grad).norm() / pe.grad.norm()) > 1e-4]
        print(f"[{v} {arch}] update {update}: out {out:.1e} in-grad {gin:.1e} bad params {bad}", flush=True)
print(f"[{v}] {time.time() - t0:.0f} s", flush=True)
