"""The plugin's patches to fairseq (fairseq_tnn/patches/): each one's fingerprint is that of the installed
fairseq's code (a fairseq whose patched code changed fails here, naming the patch to review), a changed or
missing fairseq function is reported by a warning naming the patch, installing twice changes nothing, importing
the plugin's ops and modules after fairseq installs nothing (registering does), the checkpoint loader's
Namespace allowance holds during its own loads only, it reports damaged files (and only errors of reading them)
as CheckpointReadError and a refused object as CheckpointRefusedError, and docs/design.md names exactly the
patches in the code."""
import argparse
import atexit
import importlib
import json
import logging
import re
import subprocess
import sys

import numpy
import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import progress_bar as progress_bar_module

from fairseq_tnn import patches, register
from fairseq_tnn.distributed.threads import gloo_threads
from fairseq_tnn.patches import base, checkpoint_loader, stop_prefetch_at_exit
from helpers import ROOT

register()  # the plugin as fairseq loads it (--user-dir): models, tasks and patches
BY_NAME = {p.name: p for p in patches.PATCHES}


def bound(patch):
    owner, name = base.owner_and_name(patch.replaces)
    return getattr(owner, name)


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.name)
def test_fingerprint_is_the_installed_fairseqs(patch):
    found = base.fingerprint(base.resolve(patch.checks))
    assert found == patch.fingerprint, (
        f"fairseq's {patch.checks} changed (fingerprint {found}, patch {patch.name} was written for "
        f"{patch.fingerprint}): check whether the fix is still needed and still right ({patch.why}), then update "
        "its fingerprint and versions in fairseq_tnn/patches/__init__.py")


def test_the_plugin_installed_every_patch_and_installing_again_changes_nothing(monkeypatch):
    replaced = [p for p in patches.PATCHES if p.replaces and p.needed()]
    assert all(base.bound(p.replaces, p.name) for p in replaced)  # stacked ones (train_step, state_dict) included
    before = {p.name: bound(p) for p in replaced}
    exit_handlers = [stop_prefetch_at_exit.stop_background_consumers]  # atexit's list as the plugin left it (it has no getter)
    monkeypatch.setattr(atexit, "register", exit_handlers.append)
    monkeypatch.setattr(atexit, "unregister", lambda f: exit_handlers.remove(f) if f in exit_handlers else None)
    for _ in range(2):
        statuses = patches.install()
        assert all(statuses[p.name] == "already installed" for p in replaced), statuses
        assert {p.name: bound(p) for p in replaced} == before
        assert exit_handlers == [stop_prefetch_at_exit.stop_background_consumers]  # registered once however often installed
    assert set(statuses.values()) <= {"already installed", "installed", "not needed"}


def _rank_main(cfg, exits):
    """distributed_main's ``main`` for the test below: holds the groups as fairseq-train does (torch.distributed.nn
    imported once the default group exists, as torch._dynamo imports it when fairseq builds the optimizer; fairseq's
    global group in a reference cycle, as the trainer's legacy DDP holds it), and writes whether this rank's process
    group is initialized and how many gloo threads run, now and when the interpreter exits (atexit runs after
    distributed_main has returned)."""
    rank = cfg.distributed_training.distributed_rank
    importlib.import_module("torch.distributed.nn")
    cycle = {"group": distributed_utils.get_global_group()}
    cycle["self"] = cycle

    def record(when):
        with open(exits, "a") as log:
            log.write(f"{rank} {when} {torch.distributed.is_initialized()} {len(gloo_threads())}\n")

    record("main")
    atexit.register(record, "exit")


def test_the_process_group_is_destroyed_where_fairseq_spawns_its_ranks(tmp_path):
    """fairseq's own start of one process per GPU (``torch.multiprocessing.spawn(fn=distributed_main, ...)`` in
    call_main) pickles what fairseq.distributed.utils holds as ``distributed_main``: the patch's function, by name,
    and the spawned ranks run it. Two gloo ranks spawned so on the CPU: each runs fairseq's distributed_main (the
    groups alive in ``main``, held as fairseq-train holds them) and exits with its groups destroyed and their threads
    stopped (``destroy-process-group``)."""
    import pickle
    from fairseq.dataclass.configs import FairseqConfig
    from omegaconf import OmegaConf
    from fairseq_tnn.patches import destroy_group_at_end
    assert distributed_utils.distributed_main is destroy_group_at_end.distributed_main
    assert pickle.loads(pickle.dumps(distributed_utils.distributed_main)) is destroy_group_at_end.distributed_main
    # fairseq's config as fairseq-train builds it (convert_namespace_to_omegaconf: a plain container, the choices as
    # strings), not the dataclass's defaults, which are its classes: setting those would change them for every test
    cfg = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(FairseqConfig), resolve=True, enum_to_str=True))
    cfg.common.cpu, cfg.model = True, {}
    cfg.distributed_training.distributed_world_size = 2
    cfg.distributed_training.distributed_backend = "gloo"
    cfg.distributed_training.distributed_init_method = f"file://{tmp_path / 'rendezvous'}"
    cfg.distributed_training.distributed_rank = None
    exits = tmp_path / "exits.txt"
    torch.multiprocessing.start_processes(distributed_utils.distributed_main,
                                          args=(_rank_main, cfg, {"exits": str(exits)}), nprocs=2, join=True,
                                          start_method="spawn")
    records = sorted(line.rsplit(" ", 1) for line in exits.read_text().splitlines())
    assert [when for when, _ in records] == ["0 exit False", "0 main True", "1 exit False", "1 main True"], records
    assert [int(threads) > 0 for _, threads in records] == [False, True, False, True], records


# Run in a fresh interpreter: fairseq first, then the plugin's torch-only layers; what the patches rebind and
# fairseq's registries are the same objects afterwards, and none of the glue was imported. Then the plugin
# registers, and they change (the check sees the patches).
IMPORT_CHANGES_NOTHING = """
import importlib, inspect, json, sys
import fairseq, fairseq.models, fairseq.tasks
targets = json.loads(sys.argv[1])
def bound():  # each object as its owner holds it (a classmethod itself: getattr makes a new bound method each time)
    out = {}
    for path in targets:
        module, _, qualname = path.partition(":")
        owner = importlib.import_module(module)
        *parents, name = qualname.split(".")
        for part in parents:
            owner = getattr(owner, part)
        out[path] = id(inspect.getattr_static(owner, name))
    return out
def registries():
    return sorted(fairseq.models.ARCH_MODEL_REGISTRY), sorted(fairseq.tasks.TASK_REGISTRY)
before, registered = bound(), registries()
import fairseq_tnn, fairseq_tnn.ops.toeplitz, fairseq_tnn.ops.fd, fairseq_tnn.ops.ski, fairseq_tnn.modules
assert bound() == before, "importing fairseq_tnn.ops / .modules rebound fairseq code"
assert registries() == registered, "importing fairseq_tnn.ops / .modules registered something with fairseq"
glue = sorted(m for m in sys.modules
        if m.startswith(("fairseq_tnn.models", "fairseq_tnn.tasks", "fairseq_tnn.plugin", "fairseq_tnn.patches")))
assert not glue, glue
fairseq_tnn.register()
changed = sorted(p for p, i in bound().items() if i != before[p])
assert "tnn_lm" in fairseq.models.ARCH_MODEL_REGISTRY
print(json.dumps(changed))
"""


def test_importing_ops_and_modules_after_fairseq_changes_nothing():
    targets = [p.replaces for p in patches.PATCHES if p.replaces]
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHANGES_NOTHING, json.dumps(targets)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    changed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert changed == sorted({p.replaces for p in patches.PATCHES if p.replaces and p.needed()})  # register() does


def fake_progress_bar(iterator, *args, **kwargs):
    return iterator  # a fairseq whose progress_bar is not the code the patch was written for


def test_a_changed_fairseq_function_warns_naming_the_patch_and_keeps_fairseqs_code(monkeypatch, caplog):
    patch = BY_NAME["progress-bar-log-file"]
    assert patch.on_mismatch == "skip"
    monkeypatch.setattr(progress_bar_module, "progress_bar", fake_progress_bar)
    with caplog.at_level(logging.WARNING, logger=patches.__name__):
        assert patch.install() == "skipped"
    assert progress_bar_module.progress_bar is fake_progress_bar
    [record] = caplog.records
    for part in (patch.name, patch.checks, base.fingerprint(fake_progress_bar), patch.fingerprint,
                 "not installed: fairseq's own code runs"):
        assert part in record.getMessage()


def test_a_changed_loader_warns_and_the_wrapper_still_applies(monkeypatch, caplog, tmp_path):
    patch = BY_NAME["checkpoint-loader"]
    assert patch.on_mismatch == "apply"

    def changed_loader(path, arg_overrides=None, load_on_all_ranks=False):
        return {"model": torch.load(path)}

    monkeypatch.setattr(checkpoint_utils, "load_checkpoint_to_cpu", changed_loader)
    with caplog.at_level(logging.WARNING, logger=patches.__name__):
        assert patch.install() == "installed despite a mismatch"
    assert patch.name in caplog.text and "installed anyway" in caplog.text
    assert checkpoint_utils.load_checkpoint_to_cpu.fairseq_tnn_original is changed_loader
    empty = tmp_path / "checkpoint_last.pt"
    empty.write_bytes(b"")
    with pytest.raises(checkpoint_loader.CheckpointReadError, match=f"cannot read checkpoint {empty} .*EOFError"):
        checkpoint_utils.load_checkpoint_to_cpu(str(empty))


def test_missing_fairseq_code_warns_and_is_skipped(monkeypatch, caplog):
    patch = BY_NAME["broadcast-unpickle"]
    monkeypatch.delattr(distributed_utils, "_broadcast_object_slow")
    with caplog.at_level(logging.WARNING, logger=patches.__name__):
        assert patch.install() == "skipped"
    assert f"fairseq_tnn patch {patch.name} not installed: cannot read {patch.checks}" in caplog.text
    assert not hasattr(distributed_utils, "_broadcast_object_slow")


def test_a_patch_with_an_unknown_mismatch_policy_is_refused():
    with pytest.raises(ValueError, match="patch x: on_mismatch='warn'; allowed: 'skip', 'apply'"):
        base.Patch(name="x", why="", versions="", checks="m:f", fingerprint="", on_mismatch="warn",
                      action=lambda: None)


def test_namespace_is_allowed_in_fairseqs_checkpoint_loads_only(tmp_path):
    old = tmp_path / "old.pt"
    torch.save({"args": argparse.Namespace(arch="tnn_lm_tiny")}, old)
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(old)  # weights_only stays on everywhere else
    assert checkpoint_loader.checkpoint_loader(torch.load)(old)["args"].arch == "tnn_lm_tiny"
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(old)
    assert argparse.Namespace not in torch.serialization.get_safe_globals()


def test_an_unreadable_checkpoint_names_the_older_ones(tmp_path):
    for name in ("checkpoint_1_10.pt", "checkpoint_last.pt"):
        torch.save({"model": {}}, tmp_path / name)
    (tmp_path / "checkpoint_last.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint_loader.CheckpointReadError, match=r"--restore-file \S*checkpoint_1_10\.pt"):
        checkpoint_loader.checkpoint_loader(torch.load)(str(tmp_path / "checkpoint_last.pt"))


def damaged(kind: str, good: bytes) -> bytes:
    """A checkpoint file's bytes after the damage ``kind``."""
    return {"empty": b"", "garbage": b"not a checkpoint", "cut-in-half": good[: len(good) // 2],
            "cut-at-the-end": good[:-10], "first-bytes-overwritten": bytes(64) + good[64:]}[kind]


@pytest.mark.parametrize("kind", ["empty", "garbage", "cut-in-half", "cut-at-the-end", "first-bytes-overwritten"])
def test_a_damaged_file_is_a_checkpoint_read_error_through_fairseqs_loader(tmp_path, kind):
    """Whatever torch.load raises for the damage (EOFError, UnpicklingError, RuntimeError from the zip
    reader), fairseq's installed loader reports the file, as damaged."""
    patches.install()
    good = tmp_path / "good.pt"
    torch.save({"model": {"w": torch.ones(64, 64)}, "cfg": {"model": {"_name": "tnn_lm"}}}, good)
    path = tmp_path / "checkpoint_last.pt"
    path.write_bytes(damaged(kind, good.read_bytes()))
    damage = f"(?s)cannot read checkpoint {path} .*truncated or corrupted"
    with pytest.raises(checkpoint_loader.CheckpointReadError, match=damage) as info:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert type(info.value) is checkpoint_loader.CheckpointReadError  # not an object refused by weights_only


def test_an_object_weights_only_refuses_is_named_not_called_damage(tmp_path):
    """A readable checkpoint holding a numpy scalar, which torch.load(weights_only=True) refuses: the error names
    the refused global and the way to load a trusted file, and does not call the file damaged. The CLI's
    message, and that its advice loads the file: tests/reliability/test_reliability.py."""
    patches.install()
    path = tmp_path / "checkpoint_last.pt"
    torch.save({"model": {}, "extra_state": {"val_loss": numpy.float64(3.5)}}, path)
    with pytest.raises(checkpoint_loader.CheckpointRefusedError) as info:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    message = str(info.value)
    assert re.search(r"holds an object made by numpy\S*\.scalar, which torch\.load refuses", message), message
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1" in message and "trust" in message
    assert "truncated" not in message and "corrupted" not in message and "--restore-file" not in message


def test_errors_after_the_file_was_read_are_fairseqs_own(tmp_path):
    """fairseq's loader applies the overrides (--model-overrides) after torch.load has read the file: an
    override it rejects is omegaconf's error, not a damaged checkpoint; a missing file is FileNotFoundError."""
    from omegaconf.errors import ConfigKeyError
    patches.install()
    path = tmp_path / "checkpoint_last.pt"
    torch.save({"model": {}, "cfg": {"model": {"_name": "tnn_lm", "decoder_layers": 2}}}, path)
    with pytest.raises(ConfigKeyError, match="Missing key no_such_option") as info:
        checkpoint_utils.load_checkpoint_to_cpu(str(path), arg_overrides={"model": {"no_such_option": {"x": 1}}})
    assert not checkpoint_loader.raised_reading(info.value) and "cannot read checkpoint" not in str(info.value)
    with pytest.raises(FileNotFoundError, match="gone.pt"):
        checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "gone.pt"))


def design_table():
    """{patch name: its module} from the table of docs/design.md's "Patches to fairseq" section."""
    text = (ROOT / "docs/design.md").read_text()
    section = text.split("\n## Patches to fairseq\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if re.match(r"\| `[\w-]+`", line)]
    return {name: row[1].strip("`") for row in rows for name in re.findall(r"`([\w-]+)`", row[0])}


def test_the_design_docs_table_names_exactly_the_patches_and_their_modules():
    table = design_table()
    assert sorted(table) == sorted(BY_NAME), "docs/design.md's 'Patches to fairseq' table and PATCHES differ"
    for name, module in table.items():
        assert (ROOT / "fairseq_tnn/patches" / module).is_file(), (name, module)
