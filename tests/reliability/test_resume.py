"""A resumed run equals the uninterrupted run at every update, past the first epoch too, and a save that a kill
interrupts cannot spoil the resume.

On a corpus of 60 lines (7 causal updates per epoch, 4 masked), three epochs run uninterrupted; then the same
command resumes from its checkpoints in the middle of epoch 2, at the end of epoch 2 and in the middle of epoch 3
(each copied alone into a new run directory as checkpoint_last.pt: the directory a run killed right after that
save leaves). Every later loss and validation loss the resumed run logs, and its final parameters bit for bit,
are the uninterrupted run's: in one process (fairseq-train, causal and masked, the masked one with a
data-loading worker) and in two (the CPU launcher). Then fairseq-train is SIGKILLed while a save copies its
first file to checkpoint_last.pt, and `RESUME=1 bash scripts/train.sh` resumes without any flag; and a run
whose checkpoint_last.pt is unreadable or missing goes on from the newest readable checkpoint beside it (one
process and two), or stops naming each file when none can be read."""
import hashlib
import os
import re
import shutil

import pytest
import torch

from helpers import BIN, ROOT, SCRIPTS, cli, lm_train_cmd, mlm_train_cmd, run, sh

EPOCHS = 3
# {kind: (updates per epoch, [checkpoints to resume from: mid-epoch 2, end of epoch 2, mid-epoch 3])}
LAYOUT = {"causal": (7, ["checkpoint_2_9.pt", "checkpoint2.pt", "checkpoint_3_15.pt"]),
          "masked": (4, ["checkpoint_2_6.pt", "checkpoint2.pt", "checkpoint_3_9.pt"])}
# the masked recipe with a data-loading worker, as train.sh's recipe (NUM_WORKERS=1): its masks depend on the epoch
WORKERS = {"causal": 0, "masked": 1}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 60 training, 20 validation and 5 test lines of data/sample, binarised by scripts/preprocess.sh."""
    root = tmp_path_factory.mktemp("corpus")
    text = root / "text"
    text.mkdir()
    for split, n in (("train", 60), ("valid", 20), ("test", 5)):
        with open(ROOT / "data/sample" / f"{split}.bpe") as f:
            (text / f"{split}.bpe").write_text("".join(next(f) for _ in range(n)))
    run(["bash", SCRIPTS / "preprocess.sh", text, root / "bin"], env={"FAIRSEQ_BIN": str(BIN)})
    return root / "bin"


def train_cmd(kind, data, save_dir, *extra):
    """The three-epoch run: batches of 4, a checkpoint every 3 updates and at each epoch's end (all kept),
    validation at each epoch's end, every update logged."""
    build = lm_train_cmd if kind == "causal" else mlm_train_cmd
    return build(data, *extra, batch_size=4, max_epoch=EPOCHS, save_dir=save_dir, save_interval_updates=3,
                 log_interval=1, num_workers=WORKERS[kind], no_epoch_checkpoints=None)


def losses(log):
    """{update: loss as logged} of the per-update lines, and {update: validation loss} (3 decimals, as logged),
    from fairseq's simple or json log lines."""
    train, valid = {}, {}
    for line in log.splitlines():
        fields = dict(re.findall(r'"?(\w+)"?(?:=|: "| )([0-9.]+)', line.partition("|")[2]))
        if "| train_inner |" in line:
            train[int(fields["num_updates"])] = fields["loss"]
        elif "| valid |" in line:
            valid[int(fields.get("valid_num_updates", fields.get("num_updates")))] = fields.get("valid_loss",
                                                                                             fields.get("loss"))
    return train, valid


def parameters_of(checkpoint):
    return torch.load(checkpoint, map_location="cpu")["model"]


def parameters(save_dir):
    return parameters_of(save_dir / "checkpoint_last.pt")


def assert_same_parameters(a, b):
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, [(n, (a[n] - b[n]).abs().max().item()) for n in different]


def updates_of(checkpoint):
    return torch.load(checkpoint, map_location="cpu")["optimizer_history"][-1]["num_updates"]


def assert_continues(reference, log, after):
    """The run that logged `log` trained every update after `after`, with the reference's losses."""
    (ref_train, ref_valid), (train, valid) = losses(reference), losses(log)
    assert sorted(train) == [u for u in sorted(ref_train) if u > after], log[-3000:]
    assert train == {u: ref_train[u] for u in train}
    assert valid and valid == {u: ref_valid[u] for u in valid}


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """{kind: (save dir, log)} of the three-epoch run of each recipe, uninterrupted."""
    root = tmp_path_factory.mktemp("uninterrupted")
    out = {}
    for kind in ("causal", "masked"):
        log = run(train_cmd(kind, corpus, root / kind))
        per_epoch, _ = LAYOUT[kind]
        assert sorted(losses(log)[0]) == list(range(1, EPOCHS * per_epoch + 1)), log[-3000:]
        out[kind] = root / kind, log
    return out


@pytest.mark.parametrize("kind", ["causal", "masked"])
@pytest.mark.parametrize("where", ["mid-epoch-2", "end-of-epoch-2", "mid-epoch-3"])
def test_a_run_resumed_in_a_later_epoch_equals_the_uninterrupted_run(corpus, uninterrupted, tmp_path, kind, where):
    reference_dir, reference = uninterrupted[kind]
    checkpoint = reference_dir / LAYOUT[kind][1][["mid-epoch-2", "end-of-epoch-2", "mid-epoch-3"].index(where)]
    save_dir = tmp_path / "resumed"
    save_dir.mkdir()
    shutil.copyfile(checkpoint, save_dir / "checkpoint_last.pt")
    after = updates_of(checkpoint)
    log = run(train_cmd(kind, corpus, save_dir))
    assert re.search(rf"Loaded checkpoint \S*checkpoint_last\.pt \(epoch \d @ {after} updates\)", log), log[-3000:]
    assert "written in another layout" not in log  # today's checkpoint: its optimizer state is handed on as it is
    assert_continues(reference, log, after)
    assert_same_parameters(parameters(save_dir), parameters(reference_dir))


def launch_2_ranks(corpus, save_dir):
    """The three-epoch causal run through the CPU launcher with 2 ranks (each rank takes every other batch)."""
    train = train_cmd("causal", corpus, save_dir)[2:]  # fairseq-train's arguments after the data directory
    return run([cli("python"), "-m", "fairseq_tnn.distributed.launch", "--nproc", 2, "--cpu",
                "--log-dir", save_dir.parent / f"{save_dir.name}-ranks", "--", corpus, *train],
               env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def uninterrupted_2_ranks(corpus, tmp_path_factory):
    """(save dir, log) of the three-epoch causal run with 2 ranks, uninterrupted."""
    save_dir = tmp_path_factory.mktemp("two-ranks") / "uninterrupted"
    log = launch_2_ranks(corpus, save_dir)
    assert "training on 2 devices" in log, log[-3000:]
    # 7 batches of 4 blocks shared by 2 ranks: 4 updates per epoch
    assert sorted(losses(log)[0]) == list(range(1, EPOCHS * 4 + 1)), log[-3000:]
    return save_dir, log


@pytest.mark.slow
def test_two_processes_resumed_in_a_later_epoch_equal_the_uninterrupted_run(corpus, uninterrupted_2_ranks, tmp_path):
    """Resumed in the middle of epoch 2 through the CPU launcher with 2 ranks: the losses and the parameters are
    those of the uninterrupted 2-rank run."""
    reference_dir, reference = uninterrupted_2_ranks
    save_dir = tmp_path / "resumed"
    save_dir.mkdir()
    shutil.copyfile(reference_dir / "checkpoint_2_6.pt", save_dir / "checkpoint_last.pt")
    log = launch_2_ranks(corpus, save_dir)
    assert re.search(r"Loaded checkpoint \S*checkpoint_last\.pt \(epoch 2 @ 6 updates\)", log), log[-3000:]
    assert_continues(reference, log, 6)
    assert_same_parameters(parameters(save_dir), parameters(reference_dir))


# ------------------------------------------------------------------ a kill during a save

# Imported by fairseq-train as sitecustomize (from PYTHONPATH): when the save copies TNN_KILL_COPYING to a file
# named checkpoint_last*, half of it is written there and the process is SIGKILLed, as a preemption, a node
# failure or a full disk would stop it in the middle of the copy. Without the atomic copies the file written
# is checkpoint_last.pt itself.
KILL_DURING_COPY = """
import os, signal, sys

def _kill_during_copy(event, args):
    if event == "shutil.copyfile" and os.path.basename(args[0]) == os.environ["TNN_KILL_COPYING"] \\
            and os.path.basename(args[1]).startswith("checkpoint_last"):
        with open(args[0], "rb") as src, open(args[1], "wb") as dst:
            data = src.read()
            dst.write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

if "TNN_KILL_COPYING" in os.environ:
    sys.addaudithook(_kill_during_copy)
"""

# train.sh's smoke recipe on data/sample: 8 updates of 8 x 64 tokens, validation and a checkpoint every 4
TRAIN_SH = {"CPU": "1", "MAX_UPDATE": "8", "TOKENS_PER_SAMPLE": "64", "SEQS_PER_UPDATE": "8", "BATCH_PER_GPU": "8",
            "LR": "0.003", "WARMUP_UPDATES": "4", "SAVE_INTERVAL_UPDATES": "4", "VALIDATE_INTERVAL_UPDATES": "4",
            "LOG_INTERVAL": "1", "NUM_WORKERS": "0"}


def train_sh(data_bin, save_root, **env):
    return sh(["bash", SCRIPTS / "train.sh", "tnn_lm_tiny", data_bin, "--max-valid-steps", "2"],
              {**TRAIN_SH, "SAVE_ROOT": str(save_root), **env})


@pytest.mark.slow
def test_a_kill_while_a_save_copies_checkpoint_last_then_resume_without_a_flag(data_bin, tmp_path):
    """The run is killed in its save at update 8, after that save's first file (checkpoint_1_8.pt, the
    uninterrupted run's state at update 8) and during its copy to checkpoint_last.pt; resumed, it trains updates
    5 to 8 again, to the same losses and to checkpoint_1_8.pt's parameters bit for bit."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(KILL_DURING_COPY)
    pythonpath = os.pathsep.join(p for p in [str(hooks), os.environ.get("PYTHONPATH", "")] if p)
    code, killed, err = train_sh(data_bin, tmp_path, TNN_KILL_COPYING="checkpoint_1_8.pt", PYTHONPATH=pythonpath)
    run_dir = tmp_path / "tnn_lm_tiny"
    assert code != 0 and sorted(losses(killed)[0]) == list(range(1, 9)), killed[-3000:] + err[-3000:]
    uninterrupted = parameters_of(run_dir / "checkpoint_1_8.pt")  # written whole before the copies began
    code, resumed, err = train_sh(data_bin, tmp_path, RESUME="1")
    assert code == 0, resumed[-3000:] + err[-3000:]
    assert re.search(r"Loaded checkpoint \S*checkpoint_last\.pt \(epoch 1 @ 4 updates\)", resumed), resumed[-3000:]
    assert_continues(killed, resumed, 4)
    assert_same_parameters(parameters(run_dir), uninterrupted)


def test_a_failed_copy_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    """fairseq's save copies through checkpoint_utils.PathManager.copy: a copy that fails half-way (a full disk)
    leaves the destination as it was, and no temporary file."""
    from fairseq import checkpoint_utils

    import fairseq_tnn
    fairseq_tnn.register()
    old, new = os.urandom(100_000), os.urandom(200_000)
    (tmp_path / "checkpoint_last.pt").write_bytes(old)
    (tmp_path / "checkpoint_1_8.pt").write_bytes(new)

    def full_disk(src, dst, **kwargs):
        with open(src, "rb") as f, open(dst, "wb") as out:
            out.write(f.read()[:1000])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full_disk)
    with pytest.raises(OSError, match="No space left"):
        checkpoint_utils.PathManager.copy(str(tmp_path / "checkpoint_1_8.pt"), str(tmp_path / "checkpoint_last.pt"),
                                          overwrite=True)
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1_8.pt", "checkpoint_last.pt"]
    monkeypatch.undo()
    assert checkpoint_utils.PathManager.copy(str(tmp_path / "checkpoint_1_8.pt"),
                                             str(tmp_path / "checkpoint_last.pt"), overwrite=True)
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == new


# ------------------------------------------------------------------ no readable checkpoint_last.pt


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_dir_with(tmp_path, reference_dir, names, last=None):
    """A run directory holding the reference run's checkpoints `names`, oldest first (their modification times
    one minute apart), and checkpoint_last.pt with the bytes `last` (None: no checkpoint_last.pt)."""
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    for i, name in enumerate(names):
        shutil.copyfile(reference_dir / name, save_dir / name)
        os.utime(save_dir / name, (1_700_000_000 + 60 * i,) * 2)
    if last is not None:
        (save_dir / "checkpoint_last.pt").write_bytes(last)
    return save_dir


@pytest.mark.parametrize("last", ["cut-in-half", "missing"])
def test_without_a_readable_checkpoint_last_the_run_resumes_from_the_newest_readable_one(corpus, uninterrupted,
                                                                                        tmp_path, last):
    reference_dir, reference = uninterrupted["causal"]
    good = (reference_dir / "checkpoint_last.pt").read_bytes()
    save_dir = run_dir_with(tmp_path, reference_dir, ["checkpoint_1_6.pt", "checkpoint_2_12.pt"],
                            good[: len(good) // 2] if last == "cut-in-half" else None)
    log = run(train_cmd("causal", corpus, save_dir))
    why = "cannot read it \\(RuntimeError: .*\\)" if last == "cut-in-half" else "it does not exist"
    assert re.search(rf"WARNING .*{re.escape(str(save_dir / 'checkpoint_last.pt'))}: {why}; resuming from "
                     rf"{re.escape(str(save_dir / 'checkpoint_2_12.pt'))} instead", log), log[-3000:]
    assert re.search(r"Loaded checkpoint \S*checkpoint_2_12\.pt \(epoch 2 @ 12 updates\)", log), log[-3000:]
    assert_continues(reference, log, 12)
    assert_same_parameters(parameters(save_dir), parameters(reference_dir))


@pytest.mark.slow
def test_two_processes_without_a_readable_checkpoint_last_resume_from_the_newest_readable_one(uninterrupted_2_ranks,
                                                                                             corpus, tmp_path):
    """Rank 0 alone reads the checkpoint and broadcasts it: when it passes over the damaged checkpoint_last.pt,
    rank 1 receives the older checkpoint's state, and the run goes on as the uninterrupted one."""
    reference_dir, reference = uninterrupted_2_ranks
    good = (reference_dir / "checkpoint_last.pt").read_bytes()
    save_dir = run_dir_with(tmp_path, reference_dir, ["checkpoint_1_3.pt", "checkpoint_2_6.pt"], good[:len(good) // 2])
    log = launch_2_ranks(corpus, save_dir)
    assert re.search(r"checkpoint_last\.pt: cannot read it \(.*\); resuming from \S*checkpoint_2_6\.pt", log), \
        log[-3000:]
    assert re.search(r"Loaded checkpoint \S*checkpoint_2_6\.pt \(epoch 2 @ 6 updates\)", log), log[-3000:]
    assert_continues(reference, log, 6)
    assert_same_parameters(parameters(save_dir), parameters(reference_dir))


def test_an_unreadable_newest_checkpoint_is_passed_over_too(corpus, uninterrupted, tmp_path):
    reference_dir, reference = uninterrupted["causal"]
    save_dir = run_dir_with(tmp_path, reference_dir, ["checkpoint_2_12.pt", "checkpoint_3_15.pt"], b"garbage")
    (save_dir / "checkpoint_3_15.pt").write_bytes(b"")
    log = run(train_cmd("causal", corpus, save_dir))
    assert re.search(rf"{re.escape(str(save_dir / 'checkpoint_3_15.pt'))}: cannot read it \(EOFError.*\); resuming "
                     rf"from {re.escape(str(save_dir / 'checkpoint_2_12.pt'))} instead", log), log[-3000:]
    assert_continues(reference, log, 12)


def test_when_no_checkpoint_can_be_read_the_run_stops_naming_each_and_changes_nothing(corpus, uninterrupted,
                                                                                     tmp_path):
    reference_dir, _ = uninterrupted["causal"]
    save_dir = run_dir_with(tmp_path, reference_dir, ["checkpoint_1_6.pt"], b"garbage")
    (save_dir / "checkpoint_1_6.pt").write_bytes(b"")
    before = {p.name: sha(p) for p in save_dir.iterdir()}
    log = run(train_cmd("causal", corpus, save_dir), expect_ok=False)
    assert re.search(rf"CheckpointReadError: cannot resume from {re.escape(str(save_dir))}: no checkpoint there can be "
                     r"read \(checkpoint_last\.pt: UnpicklingError: .*; checkpoint_1_6\.pt: EOFError.*\)\. Start the run "
                     r"again", log), log[-3000:]
    assert "num_updates=1," not in log
    assert {p.name: sha(p) for p in save_dir.iterdir()} == before


# The layouts of the parameters the plugin's checkpoints have had before today's (2026-11-28): the RPEs' weights each
# apart and the GTU's and GLU's Linears two tensors each; then the RPEs packed and the Linears still apart.
EARLIER_LAYOUTS = ["before-the-rpe-packing", "before-the-fused-linears"]
# the tiny causal model with the RPE's norms of --rpe-norm-type layernorm (weights between its Linears, before the
# packing); {norm type: the options of that run}
NORMS = {"simplermsnorm": (), "layernorm": ("--rpe-norm-type", "layernorm")}


@pytest.fixture(scope="module")
def uninterrupted_layernorm(corpus, tmp_path_factory):
    """(save dir, log) of the three-epoch causal run with the RPEs' LayerNorms, uninterrupted."""
    save_dir = tmp_path_factory.mktemp("layernorm") / "uninterrupted"
    return save_dir, run(train_cmd("causal", corpus, save_dir, *NORMS["layernorm"]))


def model_of_layout(layout, norm, monkeypatch, vocab=100):
    """tnn_lm_tiny as the plugin built it in an earlier ``layout`` (``EARLIER_LAYOUTS``), from the modules' stand-ins of
    tests/modules: ``nn.Linear`` for ``FusedLinear``, and before the RPE packing an ``Rpe`` that does not pack."""
    from fairseq_tnn.models.build import build_arch
    from fairseq_tnn.modules import layers
    from fairseq_tnn.modules.rpe import Rpe
    with monkeypatch.context() as patch:
        patch.setattr(layers, "FusedLinear", torch.nn.Linear)
        if layout == "before-the-rpe-packing":
            patch.setattr(Rpe, "_pack", lambda self: None)
        return build_arch("tnn_lm_tiny", vocab, rpe_norm_type=norm)


def vocab_of(checkpoint):
    return checkpoint["model"]["decoder.embed_tokens.weight"].shape[0]


def written_in(checkpoint, layout, norm, monkeypatch, flat=False):
    """A checkpoint of today's model (its optimizer's state per parameter tensor, or flat) as the plugin wrote it in an
    earlier ``layout``: its model's keys in that model's order, and its optimizer's state one entry per parameter of
    that model (``flat``: one flat state, the values in that model's order of parameters, as ``--fp16`` keeps it on a
    GPU). Each Adam moment is moved by the models' own state_dicts: loaded into today's model as its parameters, saved
    under the weights' names, loaded into the earlier model and read from its parameters, so that nothing of
    fairseq_tnn/patches/packed_state.py is used."""
    from fairseq_tnn.models.build import build_arch
    vocab = vocab_of(checkpoint)
    now = build_arch("tnn_lm_tiny", vocab, rpe_norm_type=norm)
    before = model_of_layout(layout, norm, monkeypatch, vocab)
    now.load_state_dict(checkpoint["model"])
    before.load_state_dict(checkpoint["model"])
    weights = {key: value.clone() for key, value in before.state_dict().items()}  # in the earlier model's order
    state = checkpoint["last_optimizer_state"]
    (group,) = state["param_groups"]
    params = [p for p in now.parameters() if p.requires_grad]  # the optimizer's (fairseq leaves frozen ones out)
    if len(group["params"]) == 1:  # a flat state (--fp16 on a GPU): the parameters' values one after another
        (flat,) = state["state"].values()
        sizes = [p.numel() for p in params]
        values = {name: flat[name].split(sizes) for name in ("exp_avg", "exp_avg_sq")}
    else:
        assert len(group["params"]) == len(params)
        values = {name: [state["state"][k][name] for k in group["params"]] for name in ("exp_avg", "exp_avg_sq")}
    moments = {}
    for name in ("exp_avg", "exp_avg_sq"):
        with torch.no_grad():
            for p, v in zip(params, values[name]):
                p.copy_(v.view_as(p))
            before.load_state_dict(now.state_dict())
        moments[name] = [p.detach().clone() for p in before.parameters() if p.requires_grad]
    step = next(iter(state["state"].values()))["step"]
    if flat:
        entries = {0: {"step": step, **{name: torch.cat([m.flatten() for m in ms]) for name, ms in moments.items()}}}
    else:
        entries = {j: {"step": step, **{name: ms[j] for name, ms in moments.items()}}
                   for j in range(len(moments["exp_avg"]))}
    return {**checkpoint, "model": weights,
            "last_optimizer_state": {**state, "state": entries, "param_groups": [{**group, "params": list(entries)}]}}


def test_the_earlier_layouts_stand_ins_are_what_the_plugin_wrote(monkeypatch):
    """The order of a model's keys in each earlier layout's stand-in (and of its parameters) is what the plugin of
    that day wrote: the lists below are the first layer's keys of real checkpoints of ``tnn_lm_tiny --rpe-norm-type
    layernorm`` that the plugin at 234c0c0^ and at 64ea22a^ (the last commits of each layout) wrote on 2026-11-29.
    The LayerNorms' weights came between an RPE's input projection and its hidden Linears; they come after its
    Linears now."""
    rpe = "decoder.layers.0.gtu.tno.rpe."
    linears = [f"{rpe}{m}.{w}" for m in ("proj", "linears.0", "linears.1", "out") for w in ("weight", "bias")]
    norms = [f"{rpe}norms.{i}.{w}" for i in range(3) for w in ("weight", "bias")]
    ahead = ["decoder.embed_tokens.weight", "decoder.layers.0.gtu.uv_proj.weight", "decoder.layers.0.gtu.uv_proj.bias"]
    written = {"before-the-rpe-packing": ahead + linears[:2] + norms + linears[2:],
               "before-the-fused-linears": ahead + linears + norms}
    for layout, keys in written.items():
        model = model_of_layout(layout, "layernorm", monkeypatch)
        assert list(model.state_dict())[:len(keys)] == keys, layout
        params = keys if layout == "before-the-rpe-packing" else ahead + [f"{rpe}packed"] + norms
        assert [n for n, _ in model.named_parameters()][:len(params)] == params, layout


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("layout", EARLIER_LAYOUTS)
def test_a_checkpoint_from_before_the_packing_resumes_as_if_uninterrupted(corpus, uninterrupted, uninterrupted_layernorm,
                                                                         tmp_path, monkeypatch, layout, norm):
    """A checkpoint whose optimizer state lists packed weights apart (fp32 Adam keeps one state per parameter tensor;
    the plugin before the RPEs' weights were packed had 2 (layers + 2) tensors per RPE, and before the GTU's and GLU's
    Linears were fused two per Linear), with the RPEs' RMS norms (the presets') and with LayerNorms, whose weights
    came between the RPE's Linears: its state is handed to the optimizer in the packed model's layout
    (fairseq_tnn/patches/packed_state.py), and every later update and the final parameters are the uninterrupted
    run's, bit for bit. Without it torch refused the load."""
    reference_dir, reference = uninterrupted["causal"] if norm == "simplermsnorm" else uninterrupted_layernorm
    checkpoint = torch.load(reference_dir / "checkpoint_2_9.pt", map_location="cpu", weights_only=False)
    earlier = written_in(checkpoint, layout, norm, monkeypatch)
    # tnn_lm_tiny: 2 layers, each an RPE of 4 Linears (and 3 LayerNorms) and 4 Linears outside it
    norms = 12 if norm == "layernorm" else 0
    assert len(checkpoint["last_optimizer_state"]["param_groups"][0]["params"]) == 1 + 2 * 5 + norms + 2
    assert len(earlier["last_optimizer_state"]["param_groups"][0]["params"]) == (
        1 + 2 * (8 + 8) + norms + 2 if layout == "before-the-rpe-packing" else 1 + 2 * (1 + 8) + norms + 2)
    save_dir = tmp_path / "resumed"
    save_dir.mkdir()
    torch.save(earlier, save_dir / "checkpoint_last.pt")
    log = run(train_cmd("causal", corpus, save_dir, *NORMS[norm]))
    when = {"before-the-rpe-packing": "before the RPEs' weights were packed",
            "before-the-fused-linears": "before the GTU's and GLU's Linears were fused"}[layout]
    assert f"per-tensor states as the model's {1 + 2 * 5 + norms + 2} (written {when})" in log, log[-3000:]
    assert re.search(r"Loaded checkpoint \S*checkpoint_last\.pt \(epoch 2 @ 9 updates\)", log), log[-3000:]
    assert_continues(reference, log, 9)
    assert_same_parameters(parameters(save_dir), parameters(reference_dir))


@pytest.mark.parametrize("norm", list(NORMS))
def test_a_flat_state_of_an_earlier_layout_is_reordered_by_the_weights_names(corpus, uninterrupted,
                                                                            uninterrupted_layernorm, monkeypatch, norm):
    """The flat optimizer state of ``--fp16`` on a GPU (one fp32 tensor per moment, the values in the order of the
    model's parameters), written in an earlier layout: with the RPEs' LayerNorms before the RPE packing its values
    are in another order, which torch would load without a word; the patch hands the optimizer the values in the
    model's order, found by the order of the checkpoint's keys, and leaves a state in that order as it is (fairseq's
    loss scale kept). The flat state itself needs a GPU (fairseq's FP16Optimizer); its load is the same dict."""
    from fairseq_tnn.models.build import build_arch
    from fairseq_tnn.patches.packed_state import in_model_layout, layout
    reference_dir = (uninterrupted["causal"] if norm == "simplermsnorm" else uninterrupted_layernorm)[0]
    checkpoint = torch.load(reference_dir / "checkpoint_2_9.pt", map_location="cpu", weights_only=False)
    state = checkpoint["last_optimizer_state"]
    now = {name: torch.cat([state["state"][k][name].flatten() for k in state["param_groups"][0]["params"]])
           for name in ("exp_avg", "exp_avg_sq")}
    model = build_arch("tnn_lm_tiny", vocab_of(checkpoint), rpe_norm_type=norm)
    entries = layout(model, list(model.parameters()))
    for earlier_layout in EARLIER_LAYOUTS:
        earlier = written_in(checkpoint, earlier_layout, norm, monkeypatch, flat=True)
        flat = {**earlier["last_optimizer_state"], "loss_scale": 8.0}
        moved = norm == "layernorm" and earlier_layout == "before-the-rpe-packing"
        assert torch.equal(flat["state"][0]["exp_avg"], now["exp_avg"]) is not moved, earlier_layout
        out, what = in_model_layout(flat, entries, list(earlier["model"]))
        if not moved:
            assert out is None, earlier_layout
            continue
        assert what == "its flat state reordered from the checkpoint's order of weights"
        assert out["loss_scale"] == 8.0 and out["param_groups"] == flat["param_groups"]
        for name, values in now.items():
            assert torch.equal(out["state"][0][name], values), name
        assert out["state"][0]["step"] == flat["state"][0]["step"]
        # the checkpoint's order of keys is what tells: without it the state is handed on as it is
        assert in_model_layout(flat, entries, None) == (None, "")


def test_a_flat_fp16_state_of_an_earlier_layout_loads_into_fairseqs_trainer_in_the_models_order(tmp_path, monkeypatch):
    """fairseq's Trainer with ``--fp16``'s flat fp32 master copy and its flat Adam state (FP16Optimizer, on the CPU as
    tests/reliability/test_device_overflow.py runs it), a model whose RPEs have LayerNorms: 3 updates, then a save.
    The checkpoint is rewritten in the layout before the RPE packing, its flat moments in that model's order. A new
    Trainer loads it, another the checkpoint as saved: the same Adam state, and after 2 more updates each the same
    weights, bit for bit. Before the fix torch loaded the rewritten state as it was, the moments misaligned."""
    from benchmarks import trainer as tr
    from fairseq_tnn import register
    from fairseq_tnn.patches import device_overflow
    register()
    monkeypatch.setattr(device_overflow, "ON", ("cuda", "cpu"))  # the check on the device, on the CPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # FP16Optimizer's flat master copy on the CPU
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)  # fairseq's overflow handler's

    def trainer():
        torch.manual_seed(0)
        return tr.build_trainer("causal", "tnn_lm_tiny", None, 32, "cpu", "fp16", False,
                                tr._dictionary_dir(str(tmp_path), 64), False, extra=NORMS["layernorm"])

    def train(t, seeds):
        for seed in seeds:
            assert t.train_step([tr.synthetic_sample("causal", 32, 2, 64, seed=seed)]) is not None
        return torch.cat([p.detach().float().flatten() for p in t.model.parameters()])

    first = trainer()
    train(first, range(3))
    assert first.optimizer.has_flat_params
    first.consolidate_optimizer()  # as fairseq's checkpoint_utils.save_checkpoint calls them
    first.save_checkpoint(str(tmp_path / "today.pt"), {})
    checkpoint = torch.load(tmp_path / "today.pt", map_location="cpu", weights_only=False)
    earlier = written_in(checkpoint, "before-the-rpe-packing", "layernorm", monkeypatch, flat=True)
    (today,), (before,) = (c["last_optimizer_state"]["state"].values() for c in (checkpoint, earlier))
    assert not torch.equal(before["exp_avg"], today["exp_avg"])  # the same values, in another order
    torch.save(earlier, tmp_path / "earlier.pt")
    resumed = {}
    for name in ("today", "earlier"):
        t = trainer()
        t.load_checkpoint(str(tmp_path / f"{name}.pt"))
        (state,) = t.optimizer.fp32_optimizer.optimizer.state.values()
        assert torch.equal(state["exp_avg"], today["exp_avg"]) and torch.equal(state["exp_avg_sq"], today["exp_avg_sq"])
        resumed[name] = train(t, range(3, 5))
    assert torch.equal(resumed["earlier"], resumed["today"])
