"""The torch-only core: `pip install .` without the fairseq extra requires torch alone, and the README's
example of the layers in a plain PyTorch model runs, as written, from that install in a fresh interpreter
where importing fairseq fails."""
import sys

from helpers import ROOT, command_env, doc_blocks, execute, install_core

# Put first on the path of the interpreter under test: every import of fairseq or fairseq_cli fails, as where
# fairseq is not installed.
BLOCKER = '''import sys
class NoFairseq:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fairseq", "fairseq_cli"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoFairseq())
'''
DRIVER = '''import runpy, sys
runpy.run_path("example.py", run_name="__main__")
import fairseq_tnn, fairseq_tnn.ops.fd, fairseq_tnn.ops.ski, fairseq_tnn.ops.toeplitz
print("package:", fairseq_tnn.__file__)
print("fairseq imported:", sorted(m for m in sys.modules if m.split(".")[0] in ("fairseq", "fairseq_cli")))
try:
    import fairseq
except ImportError as e:
    print("import fairseq:", e)
'''



def test_the_core_requires_torch_alone_and_the_readme_example_runs_without_fairseq(tmp_path):
    site, meta = install_core(tmp_path)
    requires = meta.get_all("Requires-Dist")
    assert [r for r in requires if "extra ==" not in r] == ["torch>=2.6"], requires
    # the plugin's part, as an extra, with the torch its compiled layers need
    assert {'fairseq-fixed==0.12.3.1; extra == "fairseq"', 'torch>=2.10; extra == "fairseq"'} <= set(requires), requires

    code, = doc_blocks(ROOT / "README.md", "python", "## The layers in your own PyTorch model")
    run_dir = tmp_path / "run"  # not the repository: fairseq_tnn comes from the install
    (run_dir / "blocker").mkdir(parents=True)
    (run_dir / "blocker" / "sitecustomize.py").write_text(BLOCKER)
    (run_dir / "example.py").write_text(code)
    (run_dir / "driver.py").write_text(DRIVER)
    env = command_env(PYTHONPATH=f"{run_dir / 'blocker'}:{site}")
    status, out, err = execute([sys.executable, "driver.py"], env, 300, cwd=run_dir)
    assert status == 0, out + err
    lines = out.splitlines()
    # the four models of the example, each an untrained one: the loss of about uniform predictions over its
    # 1,000 symbols, ln 1000 = 6.91, and the TNO's output shaped as its input (8, 256, 192)
    rows = [line.split() for line in lines[:4]]
    assert [r[:2] for r in rows] == [["tnn", "causal"], ["fd", "causal"], ["fd", "bidirectional"],
                                      ["ski", "bidirectional"]], out
    for r in rows:
        assert abs(float(r[3]) - 6.91) < 0.5 and " ".join(r[4:]) == "(8, 256, 192)", out
    assert lines[4] == f"package: {site / 'fairseq_tnn' / '__init__.py'}", out
    assert lines[5] == "fairseq imported: []", out
    assert lines[6] == "import fairseq: No module named 'fairseq'", out
