"""What the direct Toeplitz product's inner loop costs, read from its code for an H100 / H200 (no GPU needed).

    python benchmarks/kernel_code.py --rev 3e14c05 --out results/kernel-code     # this tree beside a commit (about 6 s)

Triton compiles ``fairseq_tnn/ops/toeplitz_direct.py``'s product kernel (``_apply_kernel``) to PTX and machine code
for sm_90, here on the CPU (its compiler and ptxas; never its interpreter, whatever ``TRITON_INTERPRET`` says), as
the product launches it at each of the paper's shapes in fp16 (the tile sizes and rows per program the module
chooses for that shape), T and its transpose. For each, the loop over the tiles of T: its PTX instructions (the
basic block that holds the tensor-core products, one iteration of the loop, per thread), of which global loads
(plain and asynchronous copies to shared memory, as Triton pipelines the input's tile), tensor-core products
(``mma``) and integer and predicate arithmetic (the tile's addresses and masks), and the size of the machine code;
compiled as Triton's launcher specializes the kernel at that shape (16-byte aligned tensors, integers divisible by
16). With ``--rev REV``, the module as it was at that commit is compiled beside this tree's, side by side (its
kernel's arguments read from its own signature). Static counts, before ptxas's scheduling: they say what the loop
asks of the GPU's integer units and load path beside its products, not how long it takes, which only a GPU measures
(``benchmarks/toeplitz_direct.py``). Writes ``kernel_code.json`` and ``kernel_code.md``.
"""
import argparse
import collections
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List

os.environ.pop("TRITON_INTERPRET", None)  # compiled, as a GPU runs it: read before Triton is imported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.measure import add_out_options, refuse_overwrite, spelled, write_results  # noqa: E402

MODULE = "fairseq_tnn/ops/toeplitz_direct.py"
# (label, rows a channel, n, causal): the paper's per-GPU shapes, as fft_bytes.py and toeplitz_direct.py take them
SHAPES = [("causal 8 x 512", 8, 512, True), ("bidirectional 16 x 512", 16, 512, False),
          ("bidirectional 4 x 2048", 4, 2048, False)]
ASYNC_COPIES = ("cp.async.cg", "cp.async.ca")  # global to shared memory, 16 bytes through L2 only / any through L1
INTEGER_OPS = ("add", "sub", "mul", "mad", "neg", "setp", "selp", "and", "or", "xor", "not", "shl", "shr", "cvt",
               "min", "max")


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loop_body(ptx: str) -> List[str]:
    """The opcodes of the PTX basic block with the most tensor-core products (the tile loop's body), predicates and
    inline-assembly braces stripped, labels, directives and comments left out."""
    blocks = re.split(r"\n\$L__BB\d+_\d+:", ptx)
    body = max(blocks, key=lambda b: len(re.findall(r"\b(?:mma|wgmma)\.", b)))
    ops = []
    for line in body.splitlines():
        text = line.strip().lstrip("{").strip()
        if text.startswith("@"):
            text = text.split(None, 1)[1] if " " in text else ""
        if text and not text.startswith(("//", ".", "}", "$")) and not text.endswith(":"):
            ops.append(text.split()[0].rstrip(";"))
    return ops


def measure(module, rows_per_program=None, load_bytes=None) -> List[Dict]:
    """Each shape's and sign's product kernel of ``module`` (a toeplitz_direct), compiled for sm_90 as Triton's
    launcher specializes it at that shape (``tt.divisibility`` 16 for the aligned pointers and integers).
    ``load_bytes``: the module's ``LOAD_BYTES`` (the copies of its fp16 layout), where it has one."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if rows_per_program is not None:
        module.ROWS_PER_PROGRAM = rows_per_program
    copied = hasattr(module, "LOAD_BYTES")  # the layout in shifted copies (since 2026-12-05), or one
    if copied and load_bytes is not None:
        module.LOAD_BYTES = load_bytes
    kernel = module._kernels()[0]
    params = inspect.signature(kernel.fn).parameters
    constexprs = {name for name, p in params.items() if "constexpr" in str(p.annotation)}
    rows_out = []
    for label, rows, n, causal in SHAPES:
        block_r = module._block_rows(rows)
        group = module._stacked(block_r, triton.cdiv(n, module.BLOCK_T), module.ROWS_PER_PROGRAM)
        for sign in (1, -1):
            constants = {"SIGN": sign, "CAUSAL": causal, "BLOCK_R": block_r, "GROUP": group,
                         "BLOCK_T": module.BLOCK_T, "PRECISION": "fp16"}
            if copied:
                constants["COPIES"] = module._copies(2)  # fp16 coefficients
            if "EVEN" in constexprs:
                constants["EVEN"] = module._even(rows, n, block_r, group)
            missing = constexprs - set(constants)
            if missing:
                raise SystemExit(f"kernel_code.py: {module.__file__}'s _apply_kernel takes compile-time arguments "
                                 f"this script does not know: {sorted(missing)}")
            signature = {name: ("constexpr" if name in constexprs else
                                "*fp32" if name == "scale_ptr" else "*fp16" if name.endswith("_ptr") else "i32")
                         for name in params}
            # what Triton's launcher assumes at this shape: 16-byte aligned tensors, and the integers it finds
            # divisible by 16 (the circulant's size as fft_conv pads it, the layout's row as _coefficients makes it)
            half = module.BLOCK_T * triton.cdiv(n, module.BLOCK_T)
            origin, stride = module._layout(n, causal) if copied else (half, 2 * half)
            values = {"rows": rows, "n": n, "size": 2 * n, "origin": origin, "stride": stride}
            unknown = [name for name in params if name not in constexprs and not name.endswith("_ptr")
                       and name not in values]
            if unknown:
                raise SystemExit(f"kernel_code.py: {module.__file__}'s _apply_kernel takes integers this script does "
                                 f"not know: {unknown}")
            attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(params)
                     if name not in constexprs and (name.endswith("_ptr") or values[name] % 16 == 0)}
            compiled = triton.compile(ASTSource(kernel, signature, constants, attrs),
                                      target=GPUTarget("cuda", 90, 32))
            ops = _loop_body(compiled.asm["ptx"])
            kinds = collections.Counter(op.split(".")[0] for op in ops)
            rows_out.append({"shape": label, "product": "T" if sign > 0 else "T^T", "rows_per_program": block_r * group,
                             "load_bytes": module.LOAD_BYTES if copied else 2, "loop_instructions": len(ops),
                             "global_loads": sum(1 for op in ops if op.startswith(("ld.global", *ASYNC_COPIES))),
                             "async_copies": sum(1 for op in ops if op.startswith(ASYNC_COPIES)),
                             "shared_stores": sum(1 for op in ops if op.startswith("st.shared")),
                             "mma": kinds["mma"] + kinds["wgmma"],
                             "mma_kind": "wgmma" if kinds["wgmma"] else "mma.sync" if kinds["mma"] else "none",
                             "integer_and_predicate": sum(kinds[k] for k in INTEGER_OPS),
                             "cubin_bytes": len(compiled.asm["cubin"])})
    return rows_out


def markdown(result: Dict) -> str:
    trees = list(result["trees"])
    widths = ", ".join(f"{t}: {result['trees'][t][0]['load_bytes']} bytes" for t in trees)
    out = ["# The direct product's tile loop, compiled for sm_90 (fp16)", "",
           f"`{result['command']}`; Triton {result['triton']}. Per thread and iteration of the loop over T's tiles: "
           "PTX instructions, of which global loads (in brackets those that are asynchronous copies to shared "
           "memory), stores to shared memory, tensor-core products and integer and predicate arithmetic; then the "
           f"kernel's machine code. Static counts, not times. The loads of T's tile ({widths}): `LOAD_BYTES`.", "",
           "| shape | product | rows a program | " + " | ".join(
               f"{t}: instructions | {t}: loads (async) | {t}: shared stores | {t}: mma | {t}: integer | "
               f"{t}: cubin bytes" for t in trees) + " |",
           "|---|---|---:|" + "---:|" * (6 * len(trees))]
    for i, row in enumerate(result["trees"][trees[0]]):
        cells = []
        for t in trees:
            r = result["trees"][t][i]
            cells += [str(r["loop_instructions"]), f"{r['global_loads']} ({r['async_copies']})",
                      str(r["shared_stores"]), str(r["mma"]), str(r["integer_and_predicate"]),
                      f"{r['cubin_bytes']:,}"]
        out.append(f"| {row['shape']} | {row['product']} | {row['rows_per_program']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", help=f"a commit whose {MODULE} is compiled beside this tree's")
    p.add_argument("--rows", type=int, help="the rows a program stacks (the module's ROWS_PER_PROGRAM, in each tree "
                                            "compiled; default: each module's own)")
    p.add_argument("--load-bytes", type=int, help="the bytes of T's tile a thread loads at once (the module's "
                                                  "LOAD_BYTES: 2, 4, 8 or 16, its fp16 layout in 1, 2, 4 or 8 "
                                                  "shifted copies; in each tree that has it, default its own; a tree "
                                                  "before it loads 2)")
    add_out_options(p, "results/kernel-code")
    a = p.parse_args(argv)
    if a.rows is not None and (a.rows < 16 or a.rows & (a.rows - 1)):
        p.error(f"--rows={a.rows} is invalid: must be a power of 2, at least 16 (a tensor-core product's least rows)")
    from fairseq_tnn.ops.toeplitz_direct import LOAD_BYTES_CHOICES
    if a.load_bytes is not None and a.load_bytes not in LOAD_BYTES_CHOICES:
        p.error(f"--load-bytes={a.load_bytes} is invalid: must be {spelled(LOAD_BYTES_CHOICES)} (a thread's loads "
                "of fp16 coefficients, one to eight elements)")
    refuse_overwrite(p, a, "kernel_code.json")
    try:
        import triton
    except ImportError:
        p.error("Triton is not installed (it ships with torch's CUDA builds): nothing to compile")
    old = None
    if a.rev:
        done = subprocess.run(["git", "show", f"{a.rev}:{MODULE}"], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            p.error(f"--rev={a.rev} is invalid: git cannot show its {MODULE} ({done.stderr.strip()})")
        old = done.stdout
    trees = {"this tree": measure(_load(os.path.join(ROOT, MODULE), "toeplitz_direct_tree"), a.rows, a.load_bytes)}
    if old is not None:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "toeplitz_direct_rev.py")
            with open(path, "w") as f:
                f.write(old)
            trees[a.rev] = measure(_load(path, "toeplitz_direct_rev"), a.rows, a.load_bytes)
    result = {"command": "python benchmarks/kernel_code.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "triton": triton.__version__, "trees": trees}
    md = markdown(result)
    os.makedirs(a.out, exist_ok=True)
    write_results(a.out, "kernel_code", result, md)
    print(md)
    return result


if __name__ == "__main__":
    main()
