"""scripts/plot_kernels.py: the kernels it draws are the operators the model applies (checked against each TNO's
forward), the CLI on a checkpoint and --init-study, and its bad-input errors."""
import json
import sys

import pytest
import torch

from helpers import SCRIPTS, mlm_train_cmd, run, script_module


def plot_kernels():
    return script_module("plot_kernels")


@pytest.mark.parametrize("kind,causal", [("tnn", True), ("tnn", False), ("fd", True), ("fd", False), ("ski", False)])
def test_drawn_matrices_are_the_operator_the_tno_applies(kind, causal):

    from fairseq_tnn.modules.tno import build_tno

    torch.manual_seed(0)
    d, n, channels = 6, 37, [0, 2, 5]
    tno = build_tno(kind, d, causal, **(dict(ski_rank=8, ski_taps=5) if kind == "ski" else dict(rpe_dim=16, rpe_layers=2))).double()
    k = plot_kernels().layer_kernels(tno, n, channels)
    x = torch.randn(2, n, d, dtype=torch.float64)
    y = tno(x)  # (2, n, d)
    dense = torch.einsum("cij,bjc->bic", torch.as_tensor(k["matrix"]), x[:, :, channels])
    torch.testing.assert_close(dense, y[:, :, channels], rtol=1e-6, atol=1e-8)
    lags = k["lags"].tolist()
    assert lags == list(range(-(n - 1), n))
    if kind != "ski":  # Toeplitz: the impulse response is every diagonal of the matrix
        m = torch.as_tensor(k["matrix"])
        for lag in (0, 3, -4, n - 1, -(n - 1)):
            diag = torch.diagonal(m, offset=-lag, dim1=1, dim2=2)  # entries with i - j = lag
            torch.testing.assert_close(diag, torch.as_tensor(k["impulse"][:, lags.index(lag)])[:, None].expand_as(diag))
        if causal:
            assert abs(k["impulse"][:, : n - 1]).max() < 1e-9  # nothing at negative lags
    else:
        parts = k["parts"]
        torch.testing.assert_close(torch.as_tensor(parts["band"] + parts["lowrank"]), torch.as_tensor(k["matrix"]))
        assert abs(parts["band"][:, 0, 5:]).max() == 0  # the band holds the m = 5 centred taps only


@pytest.fixture(scope="module")
def ski_checkpoint(data_bin, tmp_path_factory):
    save = tmp_path_factory.mktemp("ski")
    run(mlm_train_cmd(data_bin, arch="ski_tnn_mlm_tiny", sample_break_mode="none", tokens_per_sample=48, batch_size=4,
                      max_update=1, save_dir=save, disable_validation=True))
    return save / "checkpoint_last.pt"


@pytest.mark.runs_doc(r'^python scripts/plot_kernels\.py checkpoints/\S+ ')
def test_checkpoint_figures_and_json(ski_checkpoint, tmp_path, capsys):
    out = tmp_path / "k"
    log = run([sys.executable, SCRIPTS / "plot_kernels.py", ski_checkpoint, "--channels", 1, 3, "--out", out])
    assert "layer 0: ski TNO, bidirectional, channels [1, 3], n=48" in log
    report = json.loads((out / "kernels.json").read_text())
    assert report["length"] == 48 and [x["layer"] for x in report["layers"]] == [0, 1]
    layer = report["layers"][1]
    assert layer["kind"] == "ski" and layer["channels"] == [1, 3] and len(layer["impulse"]) == 2
    assert len(layer["omega"]) == len(layer["magnitude"][0]) == len(layer["phase"][0])
    assert len(layer["matrix_first_column"]) == 48 and set(layer["ski_parts"]) == {"band", "lowrank", "sum"}
    import matplotlib.image

    for name in ("layer0.png", "layer1.png", "layer0-ski-parts.png", "layer1-ski-parts.png"):
        png = matplotlib.image.imread(out / name)
        assert png.std() > 0.01, name
    # an existing --out is refused, untouched; --force replaces it (in process: the command line's code path)
    main = plot_kernels().main
    before = (out / "kernels.json").read_bytes()
    with pytest.raises(SystemExit) as exc:
        main([str(ski_checkpoint), "--layers", "1", "--out", str(out)])
    text = f"{exc.value.code} {capsys.readouterr().err}"
    assert exc.value.code == 2 and "already exists; refusing to overwrite" in text, text[-2000:]
    assert (out / "kernels.json").read_bytes() == before
    main([str(ski_checkpoint), "--layers", "1", "--length", "20", "--out", str(out), "--force"])
    assert not (out / "layer0.png").exists() and json.loads((out / "kernels.json").read_text())["length"] == 20


def test_bad_input_is_refused_before_anything_is_written(ski_checkpoint, tmp_path, capsys):
    out = tmp_path / "never"
    not_tnn = tmp_path / "transformer.pt"
    state = torch.load(ski_checkpoint, map_location="cpu", weights_only=False)
    state["cfg"]["model"]["_name"] = "transformer_lm"
    torch.save(state, not_tnn)
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint\n")
    cases = [
        ([not_tnn], "holds a 'transformer_lm' model, not a TNN"),
        ([text], "is not a fairseq checkpoint"),
        ([tmp_path / "missing.pt"], "checkpoint not found"),
        ([ski_checkpoint, "--layers", 2], "--layers 2 is out of range: the model has 2 TNO layers (0..1)"),
        ([ski_checkpoint, "--channels", 0, 4096], "--channels 4096 is out of range"),
        ([ski_checkpoint, "--channels", -1], "must be distinct integers >= 0"),
        ([ski_checkpoint, "--init-study"], "give either a checkpoint or --init-study"),
    ]
    main = plot_kernels().main  # in process: the same code path as the command line, without a fresh interpreter
    for args, message in cases:
        with pytest.raises(SystemExit) as exc:
            main([str(a) for a in args] + ["--out", str(out)])
        text = f"{exc.value.code} {capsys.readouterr().err}"
        assert exc.value.code == 2 and message in text, (args, text[-2000:])  # bad input: status 2
        assert not out.exists()


def test_init_study_reproduces_the_smoothness_and_decay_figures(tmp_path):
    out = tmp_path / "init"
    log = run([sys.executable, SCRIPTS / "plot_kernels.py", "--init-study", "--length", 256, "--out", out])
    report = json.loads((out / "init-study.json").read_text())
    assert list(report["activations"]) == ["relu", "silu", "gelu"] and report["causal"] is True
    for act, r in report["activations"].items():
        env = r["decay_envelope"]
        assert len(env) == 256 and env[0] == max(env)
        # the impulse responses decay: by lag 64 they are below 1% of lag 0's, and stay there
        assert max(env[64:]) < 0.01 * env[0], act
        assert f"{act}: |k[t]| stays below 1e-3 of its maximum from lag {r['decay_lag_1e-3']} on" in log
    for name in ("init-relu.png", "init-silu.png", "init-gelu.png", "init-decay.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
