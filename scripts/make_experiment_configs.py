#!/usr/bin/env python
"""Write configs/experiments/<preset>.yaml, the fairseq-hydra-train config of each of the paper's presets,
from the one source of truth: the command `bash scripts/train.sh <preset> <data-bin>` runs (the recipe,
fairseq_tnn/recipe.py) and the registered arch <preset> (fairseq_tnn/models/).

    .venv/bin/python scripts/make_experiment_configs.py            # (re)write all of them
    .venv/bin/python scripts/make_experiment_configs.py --check    # exit 1 naming every file that differs

How: train.sh's dry run on --gpus GPUs (8) with the recipe's defaults gives the fairseq-train command line;
fairseq's own parser turns it into the config fairseq-train would train with (the arch filling in the
model); each section keeps the fields the command line sets or that differ from fairseq's defaults, and
the model section every field the arch sets. fairseq-hydra-train composes the yaml before it imports the plugin, so the
model is written out field by field with `_name: tnn_lm` or `tnn_mlm`. Paths become the relative ones the
hydra configs use (checkpoints/<preset>), and task.data and common.user_dir are left for the command
line (???). Presets: the paper's, i.e. those of fairseq_tnn/recipe.py that do not end in _tiny.
"""
import argparse
import dataclasses
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "configs" / "experiments"
REGENERATE = ".venv/bin/python scripts/make_experiment_configs.py"
SECTIONS = ("common", "task", "model", "criterion", "optimizer", "lr_scheduler", "optimization", "dataset",
            "checkpoint")
MISSING = "???"


def recipe_presets():
    """The paper's presets, from fairseq_tnn/recipe.py's lists (this checkout's package)."""
    sys.path.insert(0, str(ROOT))
    import fairseq_tnn
    from fairseq_tnn import recipe
    fairseq_tnn.register()  # fairseq skips --user-dir for a package already imported: registered here instead
    return [p for p in recipe.PRESETS if not p.endswith("_tiny")]


def train_sh_argv(preset, gpus, work):
    """The fairseq-train arguments of `bash scripts/train.sh <preset>` on `gpus` processes, recipe defaults
    only (none of the caller's environment knobs): data dir `work/data`, save root `work/checkpoints`."""
    data = work / "data"
    data.mkdir(exist_ok=True)
    (data / "dict.txt").touch()  # train.sh checks that the data is binarised; nothing reads it here
    env = {"PATH": os.environ["PATH"], "PYTHON": sys.executable, "DRY_RUN": "1", "NPROC": str(gpus),
           "SAVE_ROOT": str(work / "checkpoints")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "train.sh"), preset, str(data)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"make_experiment_configs.py: error: train.sh {preset} failed:\n{proc.stderr}")
    argv = shlex.split(proc.stdout)
    return argv[argv.index("--") + 1:] if "--" in argv else argv[1:]  # without the launcher / fairseq-train


def plain(node):
    from omegaconf import OmegaConf
    return OmegaConf.to_container(node, resolve=False, enum_to_str=True)


def dataclass_defaults(cls):
    from omegaconf import OmegaConf
    return plain(OmegaConf.structured(cls))


def section_defaults(section, name):
    """fairseq's defaults for one config section: the registered dataclass of `name`, or FairseqConfig's."""
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY
    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.models import MODEL_DATACLASS_REGISTRY
    from fairseq.optim import OPTIMIZER_DATACLASS_REGISTRY
    from fairseq.optim.lr_scheduler import LR_SCHEDULER_DATACLASS_REGISTRY
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    registry = {"task": TASK_DATACLASS_REGISTRY, "model": MODEL_DATACLASS_REGISTRY,
                "criterion": CRITERION_DATACLASS_REGISTRY, "optimizer": OPTIMIZER_DATACLASS_REGISTRY,
                "lr_scheduler": LR_SCHEDULER_DATACLASS_REGISTRY}.get(section)
    if registry is not None:
        return dataclass_defaults(registry[name])
    return dataclass_defaults({f.name: f.type for f in dataclasses.fields(FairseqConfig)}[section])


def arch_fields(arch):
    """The model fields the arch preset sets (the arch applied to an empty namespace)."""
    from fairseq.models import ARCH_CONFIG_REGISTRY
    ns = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](ns)
    return {k for k, v in vars(ns).items() if v is not None}


def experiment(preset, gpus, work):
    """{section: {field: value}} of the preset's config, and facts for the header."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_NAME_REGISTRY
    from omegaconf import OmegaConf

    argv = train_sh_argv(preset, gpus, work)
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), input_args=argv))
    save_root = str(work / "checkpoints")
    model_name = ARCH_MODEL_NAME_REGISTRY[preset]
    arch = arch_fields(preset)
    flags = {a[2:].replace("-", "_") for a in argv if a.startswith("--")}  # what the command line says
    always = flags | {"_name", "data"}
    out = {}
    for section in SECTIONS:
        values = plain(cfg[section])
        defaults = section_defaults(section, model_name if section == "model" else values.get("_name"))
        keep = {}
        for key, value in values.items():
            default = defaults.get(key)
            if isinstance(default, str) and default.startswith("${"):
                # an interpolation of another field (task.seed = common.seed, lr_scheduler.total_num_update =
                # optimization.max_update): left to follow it unless the command line gives another value
                if value != OmegaConf.select(cfg, default[2:-1]):
                    keep[key] = value
                continue
            if key == "_name" and value is None:
                continue
            if key in always or (section == "model" and key in arch) or value != default:
                keep[key] = value
        out[section] = keep
    out["model"]["_name"] = model_name
    out["task"]["data"] = MISSING
    out["common"]["user_dir"] = MISSING
    del out["common"]["log_file"]  # fairseq-hydra-train logs to <hydra.run.dir>/hydra_train.log
    for fields in out.values():  # absolute paths of the dry run -> the configs' relative ones
        for key, value in fields.items():
            if isinstance(value, str) and value.startswith(save_root):
                fields[key] = "checkpoints" + value[len(save_root):]
    doc = " ".join((ARCH_CONFIG_REGISTRY[preset].__doc__ or preset).split())
    return out, {"doc": doc, "argv": argv}


def scalar(value):
    import yaml
    if value == MISSING:
        return MISSING
    text = yaml.safe_dump(value, default_flow_style=True, width=1_000_000).strip()
    return text[:-3].strip() if text.endswith("\n...") else text


def render(preset, gpus, work):
    cfg, info = experiment(preset, gpus, work)
    batch = cfg["dataset"].get("batch_size")
    freq = cfg["optimization"]["update_freq"][0]
    seqs, tokens = batch * freq * gpus, cfg["task"]["tokens_per_sample"]
    run_dir = cfg["checkpoint"]["save_dir"]
    head = [
        *textwrap.wrap(info["doc"], 110),
        f"GENERATED by scripts/make_experiment_configs.py from `bash scripts/train.sh {preset} <data-bin>` on",
        f"{gpus} GPUs (the recipe: fairseq_tnn/recipe.py) and the registered arch {preset}; do not edit by hand:",
        f"change those and run `{REGENERATE}` (tests/scripts/test_experiment_configs.py",
        "fails while this file differs from what it writes). fairseq-hydra-train composes this file before it",
        "imports the plugin, so the model is written out field by field instead of named by its arch.",
        f"  fairseq-hydra-train --config-dir configs/experiments --config-name {preset} \\",
        "    task.data=$PWD/data-bin/wikitext-103 common.user_dir=$PWD/fairseq_tnn",
        f"Batching: {seqs} sequences x {tokens} tokens per update = batch_size {batch} x update_freq {freq} x {gpus} GPUs;",
        f"on G GPUs set optimization.update_freq=[{seqs}/({batch}*G)] (one GPU: [{seqs // batch}]); "
        "distributed_world_size is all visible GPUs.",
        f"SLURM through hydra's submitit launcher (configs/hydra/launcher/slurm.yaml), e.g. 2 nodes x {gpus} GPUs:",
        f"  fairseq-hydra-train -m --config-dir configs/experiments --config-name {preset} \\",
        "    'hydra.searchpath=[file://'$PWD/configs']' hydra/launcher=slurm hydra.launcher.nodes=2 \\",
        f"    distributed_training.distributed_world_size={2 * gpus} distributed_training.distributed_port=29671 "
        f"optimization.update_freq=[{max(seqs // (batch * 2 * gpus), 1)}] \\",
        f"    task.data=$PWD/data-bin/wikitext-103 common.user_dir=$PWD/fairseq_tnn checkpoint.save_dir=$PWD/{run_dir}",
    ]
    lines = ["# " + line if line else "#" for line in head]
    lines += ["", "hydra:", "  run:",
              f"    dir: {run_dir}   # hydra_train.log (the json log) and .hydra/ go beside the checkpoints",
              "  job:", "    chdir: false   # relative paths below are the launch directory's"]
    for section in SECTIONS:
        lines += ["", f"{section}:"] + [f"  {key}: {scalar(value)}" for key, value in cfg[section].items()]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("presets", nargs="*", metavar="preset", help="presets to write (default: all the paper's)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming every file that differs")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help="where the yaml files go (default: %(default)s)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs the configs' update_freq is for (default: 8)")
    args = parser.parse_args()
    allowed = recipe_presets()
    bad = [p for p in args.presets if p not in allowed]
    if bad:
        parser.error(f"unknown preset {', '.join(map(repr, bad))}; choose from: {' '.join(allowed)}")
    if args.gpus < 1:
        parser.error(f"--gpus must be a positive integer, not {args.gpus}")
    presets = args.presets or allowed

    warnings.filterwarnings("ignore")  # hydra's deprecation notices from fairseq's config conversion
    logging.basicConfig(level=logging.WARNING)
    stale = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            path = args.out_dir / f"{preset}.yaml"
            text = render(preset, args.gpus, Path(tmp))
            if path.is_file() and path.read_text() == text:
                continue
            if args.check:
                stale.append(path)
            else:
                path.write_text(text)
                print(f"make_experiment_configs.py: wrote {path}")
    extra = [] if args.presets else sorted(
        set(args.out_dir.glob("*.yaml")) - {args.out_dir / f"{p}.yaml" for p in presets})
    if stale or extra:
        lines = [f"  {p}: differs from what scripts/train.sh's recipe and the registered arch give" for p in stale]
        lines += [f"  {p}: no preset generates it (delete it)" for p in extra]
        sys.exit("make_experiment_configs.py: error:\n" + "\n".join(lines) + f"\nregenerate with: {REGENERATE}")

if __name__ == "__main__":
    main()
