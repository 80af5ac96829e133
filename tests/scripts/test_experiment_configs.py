"""configs/: the hydra experiment configs written by scripts/make_experiment_configs.py from train.sh's recipe
(the same fields fairseq would train with), fairseq-hydra-train with the local launcher, the SLURM launcher's tasks."""
import re
import shutil
import sys

import pytest
import yaml

from helpers import ROOT, SCRIPTS, USER_DIR, cli, dry_train, ok, run, sh, wt103_presets

CAUSAL = wt103_presets("tnn_lm")
EXPERIMENTS = CAUSAL + wt103_presets("tnn_mlm")


def compose_experiment(name, overrides=()):
    from fairseq.dataclass.initialize import add_defaults, hydra_init
    from hydra import compose, initialize_config_dir

    import fairseq_tnn

    fairseq_tnn.register()  # registers the models whose dataclasses add_defaults merges

    hydra_init(name)  # as fairseq-hydra-train does: the yaml is validated against FairseqConfig
    with initialize_config_dir(config_dir=str(ROOT / "configs" / "experiments"), version_base="1.1"):
        cfg = compose(config_name=name, overrides=["task.data=/data", f"common.user_dir={USER_DIR}", *overrides])
    add_defaults(cfg)
    return cfg


GENERATOR = SCRIPTS / "make_experiment_configs.py"


def test_experiment_yamls_are_what_the_generator_writes():
    """configs/experiments/*.yaml are generated from train.sh's recipe and the registered archs, never edited by
    hand: a recipe or arch change without regenerating fails here, naming the command that regenerates them."""
    assert sorted(p.stem for p in (ROOT / "configs/experiments").glob("*.yaml")) == sorted(EXPERIMENTS)
    rc, out, err = sh([sys.executable, GENERATOR, "--check"], {"MAX_UPDATE": "7", "NPROC": "3", "LR": "1"})  # knobs ignored
    assert rc == 0, f"configs/experiments/ is stale:\n{err[-3000:]}"
    assert out == ""


def test_generator_check_names_a_stale_config_and_the_command(tmp_path):
    for experiment in ("tnn_lm_wt103", "ski_tnn_mlm_wt103"):
        shutil.copy(ROOT / "configs/experiments" / f"{experiment}.yaml", tmp_path)
    stale = tmp_path / "ski_tnn_mlm_wt103.yaml"
    stale.write_text(stale.read_text().replace("ski_rank: 32", "ski_rank: 16"))
    rc, out, err = sh([sys.executable, GENERATOR, "--check", "--out-dir", tmp_path, "tnn_lm_wt103", "ski_tnn_mlm_wt103"])
    assert rc == 1 and f"{stale}: differs" in err and "tnn_lm_wt103.yaml" not in err, err
    assert "regenerate with: .venv/bin/python scripts/make_experiment_configs.py" in err
    assert "ski_rank: 16" in stale.read_text()  # --check writes nothing
    out, _ = ok([sys.executable, GENERATOR, "--out-dir", tmp_path, "ski_tnn_mlm_wt103"])
    assert stale.read_text() == (ROOT / "configs/experiments/ski_tnn_mlm_wt103.yaml").read_text()
    rc, _, err = sh([sys.executable, GENERATOR, "--check", "tnn_lm_tiny"])
    assert rc == 2 and "unknown preset 'tnn_lm_tiny'" in err and "ski_tnn_mlm_wt103" in err


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_yaml_equals_train_sh_recipe(data_bin, tmp_path, experiment):
    """Every field fairseq would train with, from the yaml (model written out) vs from train.sh (arch preset):
    the generator's output means what train.sh's command means."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    def plain(node):
        return OmegaConf.to_container(node, resolve=True, enum_to_str=True)

    yml = compose_experiment(experiment)
    argv = dry_train(experiment, data_bin, NPROC="8", SAVE_ROOT=str(tmp_path))[6:]
    cli_cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), input_args=argv))
    ignore = {"task": {"data"}, "model": {"_name"}, "checkpoint": {"save_dir"},
              "common": {"log_file", "tensorboard_logdir"}}
    for section in ("task", "model", "criterion", "optimizer", "lr_scheduler", "optimization", "dataset", "checkpoint",
                    "common"):
        a, b = plain(yml[section]), plain(cli_cfg[section])
        diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if k not in ignore.get(section, ()) and a.get(k) != b.get(k)}
        assert not diff, (section, diff)
    assert plain(yml.model)["_name"] == ("tnn_lm" if experiment in CAUSAL else "tnn_mlm")
    assert yml.checkpoint.save_dir == f"checkpoints/{experiment}"
    assert yml.model.get("tno_type") == cli_cfg.model.tno_type


@pytest.mark.runs_doc(r'^fairseq-hydra-train --config-dir configs/experiments ')
def test_hydra_experiment_trains_two_updates_with_the_local_launcher(data_bin, tmp_path):
    log = run([cli("fairseq-hydra-train"), "--config-dir", ROOT / "configs" / "experiments", "--config-name",
               "ski_tnn_mlm_wt103", f"task.data={data_bin}", f"common.user_dir={USER_DIR}",
               f"hydra.searchpath=[file://{ROOT / 'configs'}]", "hydra/launcher=local", f"hydra.run.dir={tmp_path / 'run'}",
               # the GPU recipe's, off on the CPU
               "common.cpu=true", "common.fp16=false", "model.tnn_compile=false", "model.tnn_cuda_graphs=false",
               "model.encoder_embed_dim=32", "model.encoder_layers=1",
               "model.ski_rank=8", "model.ski_taps=5", "task.tokens_per_sample=128", "dataset.batch_size=4",
               "optimization.update_freq=[1]", "optimization.max_update=2", "dataset.disable_validation=true",
               "dataset.num_workers=0", "common.log_interval=1", f"checkpoint.save_dir={tmp_path / 'ck'}",
               f"common.tensorboard_logdir={tmp_path / 'tb'}"])
    assert re.search(r'"num_updates": "2"', log), log[-3000:]
    assert (tmp_path / "ck" / "checkpoint_last.pt").exists()
    assert "'tno_type': ski" in log and "'ski_rank': 8" in log and "'encoder_layers': 1" in log


def test_the_slurm_launcher_starts_one_task_per_gpu():
    """configs/hydra/launcher/slurm.yaml (submitit, not installed here): fairseq on SLURM takes one task per GPU,
    each its rank from SLURM_PROCID (the local launcher runs in the test above)."""
    slurm = yaml.safe_load((ROOT / "configs/hydra/launcher/slurm.yaml").read_text())
    assert slurm["defaults"] == ["submitit_slurm"] and slurm["tasks_per_node"] == slurm["gpus_per_node"]
