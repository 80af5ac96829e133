"""The training recipes, in one place: the paper's Wikitext-103 recipe (causal and masked) with its environment
knobs, the distributed settings CPU ranks need, and the small recipes of the tests and the benchmarks.

Standard library only (no torch, no fairseq): the commands that build training command lines
(fairseq_tnn/commands/train.py, behind scripts/train.sh and scripts/slurm/train.sbatch) import it to print a
dry run or refuse a bad knob in a fraction of a second. A recipe is a dict {option: value} in command-line
order, option names with underscores for dashes; ``fairseq_options`` turns it into fairseq-train arguments.

    recipe.CAUSAL_PRESETS, recipe.MASKED_PRESETS      the presets (registered archs) scripts/train.sh takes
    recipe.kind(preset)                               "causal" or "masked" (RecipeError for another name)
    recipe.KNOBS                                      the paper recipe's environment knobs (defaults, checks, help)
    recipe.paper(preset, data, save_dir, world, env)  the paper's recipe: Paper(kind, update_freq, args)
    recipe.cpu_ranks(world, init_method, rank)        the distributed settings of a CPU rank on stock fairseq
    recipe.TEST_CAUSAL, TEST_MASKED, NO_LR_SCHEDULE   the tests' tiny recipes (tests/helpers.py)
    recipe.benchmark(kind, arch, tokens_per_sample)   benchmarks/trainer.py's recipe
    recipe.QUALITY                                    benchmarks/quality.py's recipe
    recipe.SMOKE, recipe.SMOKE_ARGS                   the CPU smoke recipe (scripts/demo.sh, prepare-corpus)
    recipe.fairseq_options(recipe, overrides)         {name: value} -> ["--name", "value", ...]

The paper's recipe, per kind (docs/references.md#published-configurations: Qin et al., "Toeplitz Neural Network
for Sequence Modeling", ICLR 2023; docs/references.md#ski-tnn-and-fd-tnn: Moreno, Mei, Walters, "SKI to go
Faster", NeurIPS 2023, whose appendix gives the FD-TNN learning rates):
  causal (tnn_language_modeling, tnn_cross_entropy: fairseq's cross_entropy loss in one pass each way; tied
  embeddings come from the preset):
    adam (0.9, 0.98), weight decay 0.2, clip 1.0, lr 5e-4 (FD-TNN 1e-3), inverse_sqrt,
    4000 warmup updates from 1e-7, 128 sequences x 512 tokens per update, --sample-break-mode none
  masked (tnn_masked_lm, masked_lm):
    adam (0.9, 0.98) eps 1e-6, weight decay 0.2, clip 1.0, lr 5e-4 (FD-TNN 1e-3), polynomial_decay,
    3000 warmup updates, 512 sequences x 512 tokens per update, --sample-break-mode complete
    Lines longer than a block (tokens_per_sample - 1 pieces): as in the RoBERTa-style fairseq pipeline
    the authors trained with, each becomes one oversized block that training drops; the plugin logs how
    many ("N of M blocks of the train split ... dropped") and logs the metric dropped_blocks with every
    training line. --skip-invalid-size-inputs-valid-test (passed here) drops them from validation too.
    OVERSIZED=error refuses such data before any work (--oversized-blocks error).
  both: 50,000 updates, dropout 0.1 (preset), json logs, tensorboard, checkpoints in the run directory.
Its knobs, with their defaults and checks, are KNOBS below (``python -m fairseq_tnn train --help`` lists them).
update-freq = SEQS_PER_UPDATE / (BATCH_PER_GPU x world size), so the tokens per update do not depend on the
number of processes; a remainder is an error.
"""
import os
import re
from typing import Dict, List, Mapping, NamedTuple, Optional

from fairseq_tnn.commands.common import CommandError, Knob, is_pos_int, read_knobs

CAUSAL_PRESETS = ("tnn_lm_wt103", "tnn_lm_wt103_rpe3", "fd_tnn_lm_wt103", "tnn_lm_tiny", "fd_tnn_lm_tiny")
MASKED_PRESETS = ("tnn_mlm_wt103", "tnn_mlm_wt103_rpe3", "fd_tnn_mlm_wt103", "ski_tnn_mlm_wt103", "tnn_mlm_tiny",
                  "fd_tnn_mlm_tiny", "ski_tnn_mlm_tiny")
PRESETS = CAUSAL_PRESETS + MASKED_PRESETS
USER_DIR = os.path.dirname(os.path.realpath(__file__))  # this package: what --user-dir names

# The parts the recipes share. The criteria: fairseq's cross_entropy and masked_lm with their loss and gradient each one
# pass over the logits (fairseq_tnn/criterions/); FAIRSEQ_CAUSAL_CRITERION is fairseq's own, which
# benchmarks/trainer.py gives fairseq's transformer_lm (the comparison is with fairseq-train as it runs it).
FAIRSEQ_CAUSAL_CRITERION = "cross_entropy"
CAUSAL_TASK = {"task": "tnn_language_modeling", "criterion": "tnn_cross_entropy", "sample_break_mode": "none"}
MASKED_TASK = {"task": "tnn_masked_lm", "criterion": "tnn_masked_lm", "sample_break_mode": "complete"}
TASK = {"causal": CAUSAL_TASK, "masked": MASKED_TASK}
ADAM = {"optimizer": "adam", "adam_betas": "(0.9, 0.98)"}
PAPER_REGULARISATION = {"weight_decay": "0.2", "clip_norm": "1.0"}
PAPER_CAUSAL_SCHEDULE = {"lr": "5e-4", "lr_scheduler": "inverse_sqrt", "warmup_updates": "4000",
                         "warmup_init_lr": "1e-07"}
PAPER_MASKED_SCHEDULE = {"lr": "5e-4", "lr_scheduler": "polynomial_decay", "warmup_updates": "3000"}
FD_LR = "1e-3"  # FD-TNN's learning rate, both kinds (Moreno et al.'s appendix)
SCHEDULE = {"causal": PAPER_CAUSAL_SCHEDULE, "masked": PAPER_MASKED_SCHEDULE}

# scripts/train.sh's PRECISION: fairseq's --fp16 and --bf16, the plugin's --bf16-autocast, or none
PRECISIONS = ("fp16", "bf16", "bf16-autocast", "fp32")

# What CPU ranks need on stock fairseq (fairseq_tnn/distributed/launch.py explains why): the backends usable on
# CPU, each with its default first. The launcher and train.sbatch both build a CPU rank's settings with cpu_ranks().
CPU_BACKENDS = {"distributed_backend": ("gloo",), "ddp_backend": ("legacy_ddp", "no_c10d")}


def cpu_ranks(world, init_method: str, rank=None, given: Mapping = ()) -> Dict[str, object]:
    """The distributed settings of one CPU rank of world (rank None: the caller adds it per rank), in
    command-line order; a backend named in given (the user's) is left to the user."""
    settings = {"distributed_world_size": world}
    if rank is not None:
        settings["distributed_rank"] = rank
    settings.update({"distributed_init_method": init_method, "distributed_no_spawn": True})
    settings.update({name: choices[0] for name, choices in CPU_BACKENDS.items() if name not in given})
    return settings


def _is_int(text: str, least: int) -> bool:
    return re.fullmatch(r"-?[0-9]+", text) is not None and int(text) >= least


def _is_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _by_kind(causal: str, masked: str):
    return lambda known: causal if known["KIND"] == "causal" else masked


def _count(name: str, default: str, help_: str, least: int = 1) -> Knob:
    allowed = "a positive integer" if least == 1 else f"an integer >= {least}"
    return Knob(name, default, help_, check=lambda v: _is_int(v, least), allowed=allowed)


# The paper recipe's knobs, in the order they are read (a default may use those before it, and KIND and
# PRESET, the preset's). A default in brackets at the start of a help line is a function of those.
KNOBS = (
    _count("MAX_UPDATE", "50000", "updates to train (the masked schedule's length too)"),
    _count("TOKENS_PER_SAMPLE", "512", "tokens per sequence"),
    Knob("SEQS_PER_UPDATE", _by_kind("128", "512"),
         "[128 causal, 512 masked] sequences per update, all processes together (the paper's tokens per update)"),
    Knob("BATCH_PER_GPU", _by_kind("8", "16"), "[8 causal, 16 masked] sequences per process and step"),
    Knob("LR", lambda known: FD_LR if known["PRESET"].startswith("fd_") else SCHEDULE[known["KIND"]]["lr"],
         "[5e-4, FD-TNN 1e-3] peak learning rate", check=_is_number, allowed="a positive number"),
    _count("WARMUP_UPDATES", _by_kind(PAPER_CAUSAL_SCHEDULE["warmup_updates"], PAPER_MASKED_SCHEDULE["warmup_updates"]),
           "[4000 causal, 3000 masked] warm-up updates", least=0),
    _count("SEED", "1", "random seed", least=0),
    _count("NUM_WORKERS", "1", "data-loading worker processes per training process", least=0),
    _count("LOG_INTERVAL", "100", "updates between training log lines"),
    _count("VALIDATE_INTERVAL_UPDATES", "1000", "updates between validations (0: at the end of each epoch only)", 0),
    _count("SAVE_INTERVAL_UPDATES", "1000", "updates between checkpoints (0: at the end of each epoch only)", 0),
    _count("KEEP_INTERVAL_UPDATES", "2", "checkpoint_<epoch>_<update>.pt files kept (-1: all)", least=-1),
    Knob("CPU", "0", "1 trains on the CPU (--cpu, fp32, eager layers; several processes are gloo ranks)",
         check=lambda v: v in ("0", "1"), allowed="0 (train on GPUs) or 1 (train on the CPU)"),
    Knob("PRECISION", lambda known: "fp32" if known["CPU"] == "1" else "fp16",
         "[fp16 on GPU, fp32 with CPU=1] fp16 (--fp16) | bf16 (fairseq's --bf16: bf16 weights with an fp32 master "
         "copy, as --fp16 trains, without a loss scaler; 1.03x fp16's update time with the CUDA graphs, where bf16 "
         "autocast took 1.38x, and the same validation perplexity as fp32 and autocast to 0.1% in "
         "benchmarks/quality.py; docs/performance.md) | bf16-autocast (the plugin's --bf16-autocast: fp32 weights, "
         "bf16 autocast) | fp32", check=lambda v: v in PRECISIONS, allowed="fp16, bf16, bf16-autocast or fp32"),
    Knob("TNN_COMPILE", lambda known: "0" if known["CPU"] == "1" else "1",
         "[1 on GPU, 0 with CPU=1] 1 adds --tnn-compile (torch.compile per TNN layer; a layer whose compilation "
         "fails runs eagerly, with a warning), strict adds --tnn-compile strict (that failure stops the run)",
         check=lambda v: v in ("0", "1", "strict"),
         allowed="0 or 1 (--tnn-compile), or strict (--tnn-compile strict)"),
    Knob("CUDA_GRAPHS", lambda known: "1" if known["CPU"] == "0" and known["TNN_COMPILE"] != "0" else "0",
         "[1 on GPUs with TNN_COMPILE, else 0] 1 adds --tnn-cuda-graphs (the compiled layer stack trains as two CUDA "
         "graphs, its forward and its backward, instead of launching some thousand kernels; tnn_lm_wt103's update "
         "2.9x faster than eager on an H200, docs/performance.md), 0 leaves the compiled layers' kernels launched "
         "one by one. On several GPUs too: under DistributedDataParallel the graphs gave the gradients of the layers "
         "compiled without them on an H200 (two ranks on one GPU, the ninth GPU run), where the compiled layers "
         "without graphs trained slower than eager",
         check=lambda v: v in ("0", "1"), allowed="0 or 1 (--tnn-cuda-graphs)"),
    Knob("OVERSIZED", "drop", "masked presets: what happens to a line longer than a block, drop (counted in the "
         "log) or error (refused before any work)", choices=("drop", "error")),
)

# The tests' tiny causal recipe (tests/helpers.py: LM_OPTIONS): Adam with an inverse-sqrt schedule, on CPU.
TEST_CAUSAL = {
    "user_dir": USER_DIR, "cpu": True, **CAUSAL_TASK, "arch": "tnn_lm_tiny", "tokens_per_sample": 64,
    "batch_size": 8, **ADAM, "lr_scheduler": "inverse_sqrt", "warmup_updates": 10, "lr": "0.003",
    "log_format": "simple", "log_interval": 5, "seed": 1, "num_workers": 0,
}
# The tests' masked recipe (MLM_OPTIONS): whole lines per block ("complete"; the longest line of data/sample,
# 112 pieces + eos + bos, fits 128 tokens), Adam with its default betas at a constant rate, on CPU.
TEST_MASKED = {
    "user_dir": USER_DIR, "cpu": True, **MASKED_TASK, "arch": "tnn_mlm_tiny", "tokens_per_sample": 128,
    "batch_size": 8, "optimizer": "adam", "lr": "0.001", "log_format": "simple", "log_interval": 1, "seed": 1,
    "num_workers": 0, "no_epoch_checkpoints": True,
}
# Overrides that take the schedule out of the causal test recipe: a constant learning rate, Adam's default betas.
NO_LR_SCHEDULE = {"lr_scheduler": None, "warmup_updates": None, "adam_betas": None}

# benchmarks/trainer.py's recipe: the paper's causal optimizer and schedule (without the warm-up's initial rate,
# fairseq's default), for both kinds: what an update costs does not depend on the schedule.
BENCHMARK = {**ADAM, **PAPER_REGULARISATION, **PAPER_CAUSAL_SCHEDULE, "warmup_init_lr": None, "seed": "1",
             "distributed_world_size": "1", "dropout": "0.1"}

# benchmarks/quality.py's recipe (its command line sets lr, warmup_updates, max_update, seed, the intervals
# and cpu): every model the same, a lighter weight decay than the paper's at these small sizes.
QUALITY = {**ADAM, "lr": "1e-3", "lr_scheduler": "inverse_sqrt", "warmup_updates": "200", "clip_norm": "1.0",
           "weight_decay": "0.01", "dropout": "0.1", "max_update": "300", "seed": "1",
           "validate_interval_updates": "50", "validate_interval": "1000000", "log_format": "simple",
           "log_interval": "50", "num_workers": "0", "cpu": False}


# The CPU smoke recipe: the paper's causal recipe (paper() below) shortened to minutes on one CPU process, as
# scripts/train.sh's knobs (SMOKE) and fairseq-train options after the data (SMOKE_ARGS: a lighter weight decay
# than the paper's 0.2 at this size). scripts/demo.sh trains with it, and prepare-corpus prints it as the next
# step. 300 updates of 16 sequences x 128 tokens, a validation every 50 updates, the last checkpoint kept.
SMOKE = {"CPU": "1", "NPROC": "1", "MAX_UPDATE": "300", "TOKENS_PER_SAMPLE": "128", "SEQS_PER_UPDATE": "16",
         "BATCH_PER_GPU": "16", "LR": "0.003", "WARMUP_UPDATES": "50", "VALIDATE_INTERVAL_UPDATES": "50",
         "SAVE_INTERVAL_UPDATES": "100", "KEEP_INTERVAL_UPDATES": "1", "LOG_INTERVAL": "25", "NUM_WORKERS": "0"}
SMOKE_ARGS = ["--weight-decay", "0.01"]

# A bad preset or knob: the message names it, its value and what is allowed (the commands' one-line error, exit 2).
RecipeError = CommandError


class Paper(NamedTuple):
    kind: str  # "causal" or "masked"
    update_freq: int
    args: List[str]  # fairseq-train's arguments, the data directory first


def fairseq_options(recipe: Mapping, overrides: Optional[Mapping] = None) -> list:
    """fairseq command-line options from {name: value}, names with underscores for dashes (save_dir is
    --save-dir). An override replaces an option's value in place or adds it at the end; True makes a bare
    flag (cpu=True is --cpu), None or False leaves the option out. Values are passed as given."""
    args = []
    for name, value in {**recipe, **(overrides or {})}.items():
        if value is None or value is False:
            continue
        args.append("--" + name.replace("_", "-"))
        if value is not True:
            args.append(value)
    return args


def kind(preset: str) -> str:
    """"causal" or "masked"; a RecipeError listing the presets for any other name."""
    if preset in CAUSAL_PRESETS:
        return "causal"
    if preset in MASKED_PRESETS:
        return "masked"
    raise RecipeError(f"unknown preset '{preset}'; choose one of: {' '.join(PRESETS)}")


def read(preset: str, env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The values of KNOBS for preset from env (default os.environ), checked, with KIND and PRESET."""
    return read_knobs(KNOBS, env, known={"PRESET": preset, "KIND": kind(preset)})


def paper(preset: str, data: str, save_dir: str, world: int = 1, env: Optional[Mapping[str, str]] = None,
          user_dir: str = USER_DIR) -> Paper:
    """The paper's recipe for preset on world processes, its knobs read from env (default os.environ): the
    fairseq-train arguments after the program, data first, checkpoints and logs in save_dir."""
    env = os.environ if env is None else env
    knobs = read(preset, env)
    kind_ = knobs["KIND"]
    if kind_ == "causal" and env.get("OVERSIZED"):
        raise RecipeError(f"OVERSIZED={env['OVERSIZED']} applies to the masked presets only (a causal preset's blocks "
                          f"are cut from the token stream, so none is oversized); unset it for {preset}")
    seqs, batch = knobs["SEQS_PER_UPDATE"], knobs["BATCH_PER_GPU"]
    if not (is_pos_int(seqs) and is_pos_int(batch) and is_pos_int(str(world))):
        raise RecipeError(f"SEQS_PER_UPDATE ({seqs}), BATCH_PER_GPU ({batch}) and the number of processes ({world}) "
                          "must be positive integers")
    per_step = int(batch) * int(world)
    if int(seqs) % per_step:
        raise RecipeError(f"SEQS_PER_UPDATE={seqs} is not divisible by BATCH_PER_GPU={batch} x {world} processes = "
                          f"{per_step}; change BATCH_PER_GPU or the number of processes")
    update_freq = int(seqs) // per_step
    cpu, precision, compile_ = knobs["CPU"], knobs["PRECISION"], knobs["TNN_COMPILE"]
    if cpu == "1" and precision == "fp16":
        raise RecipeError("CPU=1 trains in fp32 or bf16 (PRECISION=fp32, bf16 or bf16-autocast), not fp16")
    if knobs["CUDA_GRAPHS"] == "1" and (cpu == "1" or compile_ == "0"):
        raise RecipeError(f"CUDA_GRAPHS=1 runs the compiled layers as CUDA graphs on a GPU: it needs TNN_COMPILE=1 or "
                          f"strict and a GPU (here TNN_COMPILE={compile_}, CPU={cpu}); set CUDA_GRAPHS=0")
    lr, oversized, schedule = knobs["LR"], knobs["OVERSIZED"], SCHEDULE[kind_]

    options = {"user_dir": user_dir, "arch": preset, **TASK[kind_]}
    if kind_ == "causal":
        options.update({**ADAM, **PAPER_REGULARISATION, **schedule, "lr": lr, "warmup_updates": knobs["WARMUP_UPDATES"]})
    else:
        options.update({"skip_invalid_size_inputs_valid_test": True, "oversized_blocks": oversized, **ADAM,
                        "adam_eps": "1e-06", **PAPER_REGULARISATION, **schedule, "lr": lr,
                        "warmup_updates": knobs["WARMUP_UPDATES"], "total_num_update": knobs["MAX_UPDATE"]})
    options.update({
        "tokens_per_sample": knobs["TOKENS_PER_SAMPLE"], "batch_size": batch, "update_freq": str(update_freq),
        "max_update": knobs["MAX_UPDATE"], "fp16": precision == "fp16", "bf16": precision == "bf16",
        "bf16_autocast": precision == "bf16-autocast",
        "tnn_compile": {"0": False, "1": True, "strict": "strict"}[compile_],
        "tnn_cuda_graphs": knobs["CUDA_GRAPHS"] == "1",
        "seed": knobs["SEED"], "num_workers": knobs["NUM_WORKERS"], "save_dir": save_dir, "no_epoch_checkpoints": True,
        "validate_interval_updates": knobs["VALIDATE_INTERVAL_UPDATES"],
        "save_interval_updates": knobs["SAVE_INTERVAL_UPDATES"], "keep_interval_updates": knobs["KEEP_INTERVAL_UPDATES"],
        "log_format": "json", "log_interval": knobs["LOG_INTERVAL"], "log_file": f"{save_dir}/train.log",
        "tensorboard_logdir": f"{save_dir}/tensorboard", "cpu": cpu == "1",
    })
    return Paper(kind_, update_freq, [data, *fairseq_options(options)])


def benchmark(kind_: str, arch: str, tokens_per_sample: int) -> Dict:
    """benchmarks/trainer.py's recipe for one configuration (the caller adds precision, device and sizes); fairseq's
    transformer_lm with fairseq's own criterion."""
    criterion = FAIRSEQ_CAUSAL_CRITERION if arch == "transformer_lm" else TASK[kind_]["criterion"]
    return {"user_dir": USER_DIR, "arch": arch, "task": TASK[kind_]["task"], "criterion": criterion,
            "tokens_per_sample": str(tokens_per_sample), **BENCHMARK}
