"""``python -m fairseq_tnn gpu-check`` (scripts/gpu_check.sh): everything a CUDA GPU can check, in one command and
one report. The parts run in order, each in a process group of its own under a time limit, its output in its own
log; one line per part goes to OUT/parts.tsv, and scripts/gpu_check_report.py turns those lines and the parts'
outputs into OUT/report.md and OUT/report.json. What each part runs is described in scripts/gpu_check.sh's header.
Standard library only: on a GPU machine set up from wheels this runs under the python that PYTHON names."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from fairseq_tnn.commands.common import (ROOT, CommandError, Knob, abs_path, cpus, fairseq_bin, invocation, is_count,
                                         knobs_help, quote_cmd, read_knobs, run_main, say)

PARTS = ("environment", "profile", "tests", "bench-fp16", "bench-bf16", "data", "train")
# time limits (seconds): on one H100 they add up to 20 minutes; toy sizes on a loaded CPU get more room.
# Measured on one H100 (torch 2.11, 2026-11-25): tests 290 s with the compile tests failing fast (more with them
# compiling), bench-fp16 past 300 s, bench-bf16 past 120 s, a compiled 200-update run 89-114 s. profile: 177-215 s
# on one H200 (2026-11-26; eager about 2 minutes, compiled and CUDA graphs the rest); it writes its results after
# every configuration, so a run stopped at the limit still reports what it measured. train: each of its runs.
LIMITS = {"environment": 45, "profile": 420, "tests": 600, "bench-fp16": 480, "bench-bf16": 300, "data": 45,
          "train": 180}
QUICK_LIMITS = {"environment": 600, "profile": 900, "tests": 900, "bench-fp16": 900, "bench-bf16": 900, "data": 600,
                "train": 900}
GRACE_S = 30  # a part past its limit gets SIGINT (pytest still writes its results), SIGKILL this much later
TIMED_OUT, KILLED = 124, 137  # the exit statuses of a part stopped at its limit, as timeout(1) gives them
WIKITEXT_SYMBOLS = 50264  # the full check's dictionary size (Wikitext-103's)


def is_flag(value: str) -> bool:
    return value in ("0", "1")


def empty_or_count(value: str) -> bool:
    return value == "" or is_count(value)


KNOBS = [
    Knob("OUT", "results/gpu-check", "the report's directory (--out DIR); an existing one is refused unless FORCE"),
    Knob("FORCE", "0", "1: delete an existing OUT first (--force)", check=is_flag, allowed="0 or 1 (--force sets 1)"),
    Knob("CPU", "0", "1: the same parts on the CPU, fp32 instead of fp16 (--cpu); 0 refuses a machine without a "
         "CUDA GPU", check=is_flag, allowed="0 or 1 (--cpu sets 1)"),
    Knob("QUICK", "0", "1: toy sizes (--quick): small models, few updates, a few test files, one training preset "
         "(ski_tnn_mlm_tiny), the first benchmark on the causal FD-TNN and the transformer only, the bf16 one on the "
         "masked FD-TNN only; CPU=1 QUICK=1 is what CI runs", check=is_flag, allowed="0 or 1 (--quick sets 1)"),
    Knob("ONLY", "", "these parts only, comma-separated (--only; environment always runs); empty: every part"),
    Knob("PYTEST_ARGS", "", "the tests part's pytest arguments, split as a shell splits them (--pytest), instead of "
         "tests/ops tests/modules tests/models tests/gpu (--quick: a few quick files of each and tests/gpu)"),
    Knob("LIMITS", "", "time limits, space-separated PART=SECONDS (each --limit adds one; train: each of its runs); "
         "a part past its limit is stopped, its whole process group, and reported as timed out. Defaults: "
         + " ".join(f"{p}={s}" for p, s in LIMITS.items()) + "; QUICK=1: "
         + " ".join(f"{p}={s}" for p, s in QUICK_LIMITS.items())),
    Knob("TEST_WORKERS", "", "pytest-xdist processes for the tests part when pytest-xdist is installed (0: none); "
         "empty: half the cores, at most 8 (QUICK=1: 0)", check=empty_or_count,
         allowed="a whole number (0: no worker processes)"),
]
# Read by common.fairseq_bin and lib.sh's hand_over, not by read_knobs
FAIRSEQ_KNOBS = ["FAIRSEQ_BIN [<repo>/.venv/bin]  the directory of the fairseq commands (fairseq-preprocess)",
                 "PYTHON [$FAIRSEQ_BIN/python]  the python this command runs under, and runs each part with; on a "
                 "machine set up from wheels (docs/references.md#gpu-machine-without-network): "
                 "PYTHONPATH=/tmp/site:$PWD "
                 "FAIRSEQ_BIN=/tmp/site/bin PYTHON=python3 bash scripts/gpu_check.sh"]
FLAGS = "[--out DIR] [--force] [--cpu] [--quick] [--only PART,...] [--pytest \"ARGS\"] [--limit PART=SECONDS]..."
# flag -> the knob it sets (a flag wins over the environment); the switches set 1
SWITCHES = {"--force": "FORCE", "--cpu": "CPU", "--quick": "QUICK"}
VALUED = {"--out": ("OUT", "a directory"), "--only": ("ONLY", "a comma-separated list of parts: " + " ".join(PARTS)),
          "--pytest": ("PYTEST_ARGS", "the pytest arguments, as one word")}


def usage(prog: str) -> str:
    return f"usage: {invocation(prog)} {FLAGS}"


def help_text(prog: str) -> str:
    lines = [usage(prog), "",
             "Runs the parts, in this order, each under a time limit, going on past a part that fails: "
             + " ".join(PARTS) + " (what each runs: scripts/gpu_check.sh's header). Writes OUT/report.md and "
             "OUT/report.json beside each part's log and outputs.",
             "Exit status: 0 every part passed; 1 a part failed (report.md says which and why); 2 bad usage, no GPU "
             "without --cpu, or an existing --out without --force.", "",
             "flags (each sets a knob, and wins over the environment): --out DIR (OUT), --force (FORCE=1), --cpu "
             "(CPU=1), --quick (QUICK=1), --only PART,... (ONLY), --pytest \"ARGS\" (PYTEST_ARGS), --limit "
             "PART=SECONDS (adds to LIMITS; may be repeated)",
             knobs_help(KNOBS), *(f"  {line}" for line in FAIRSEQ_KNOBS)]
    return "\n".join(lines)


class Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


class Check:
    """One run of the check: the settings read, the parts run in order (run_part), then the report."""

    def __init__(self, prog: str, knobs: Mapping[str, str], only: List[str], limits: Dict[str, int],
                 pytest_args: List[str], python: str, bin_dir: Path, out: Path):
        self.prog, self.knobs, self.only, self.pytest_args = prog, knobs, only, pytest_args
        self.python, self.bin, self.out = python, bin_dir, out
        self.cpu, self.quick = knobs["CPU"] == "1", knobs["QUICK"] == "1"
        self.device = "cpu" if self.cpu else "cuda"
        self.limit = {**(QUICK_LIMITS if self.quick else LIMITS), **limits}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc: Optional[subprocess.Popen] = None

    def wanted(self, part: str) -> bool:
        return part == "environment" or not self.only or part in self.only

    def run_part(self, name: str, slug: str, kind: str, extra: str, log: str, cmd: Sequence,
                 env: Optional[Mapping[str, str]] = None) -> None:
        """cmd (from the repository) in a process group of its own under slug's time limit, its output in log
        (relative to OUT); one line in parts.tsv: name, exit status, seconds, limit, log, kind, extra (the part's
        outputs, for the report). Past the limit the group gets SIGINT, and SIGKILL GRACE_S later; the part's
        exit status is then 124 (137 if it had to be killed), as timeout(1) gives."""
        limit = self.limit[slug]
        path = self.out / log
        path.parent.mkdir(parents=True, exist_ok=True)
        say(self.prog, f"{name} (limit {limit} s; log: {path})")
        t0 = time.monotonic()
        with open(path, "wb") as f:
            self.proc = subprocess.Popen([str(a) for a in cmd], cwd=ROOT, env={**self.env, **(env or {})},
                                         stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            try:
                code = self.proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                code = self.stop_group(signal.SIGINT)
            self.proc = None
        code = 128 - code if code < 0 else code
        secs = f"{time.monotonic() - t0:.1f}"
        with open(self.out / "parts.tsv", "a") as f:
            f.write("\t".join(map(str, (name, code, secs, limit, log, kind, extra))) + "\n")
        say(self.prog, f"{name}: exit {code} after {secs} s" + ("" if code == 0 else f" (see {path})"))

    def stop_group(self, sig: int) -> int:
        """Stop the running part's process group: sig, SIGKILL GRACE_S later if its first process still runs,
        and SIGKILL to whatever of the group is left. The exit status as timeout(1) gives it."""
        proc, code = self.proc, TIMED_OUT
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=GRACE_S)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            code = KILLED
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group
        except ProcessLookupError:
            pass
        proc.wait()
        return code

    def run(self) -> None:
        py, out, quick, device = self.python, self.out, self.quick, self.device
        self.run_part("environment", "environment", "environment", "", "environment.log",
                      [py, "scripts/gpu_check_report.py", "environment", out / "environment.json"])

        if self.wanted("profile"):  # benchmarks/gpu_profile.py: issue 39's measurement
            # toy sizes: three configurations, none compiled (the benchmark parts compile on CPU)
            quick_args = ["--quick", "--timed", "1", "--configs", "fd3", "ski", "bound_identity", "--compiled"]
            self.run_part("profile (where an update's time goes)", "profile", "profile", "profile", "profile/run.log",
                          [py, "benchmarks/gpu_profile.py", "--device", device, "--precision",
                           "fp32" if self.cpu else "fp16", "--out", out / "profile", *(quick_args if quick else [])])

        if self.wanted("tests"):
            if self.pytest_args:
                selection = self.pytest_args
            elif quick:
                # a few quick files of each layer (without their tests that start processes), and tests/gpu
                # (skipped without a GPU)
                selection = ["tests/ops/test_circulant.py", "tests/modules/test_tno_registry.py",
                             "tests/models/test_tno_config.py", "tests/gpu", "-m", "not slow",
                             "-k", "not options_command and not without_fairseq"]
            else:
                selection = ["tests/ops", "tests/modules", "tests/models", "tests/gpu"]
            workers = self.knobs["TEST_WORKERS"]
            workers = int(workers) if workers else 0 if quick else min(cpus() // 2, 8)
            xdist = []
            if workers > 0 and subprocess.run([py, "-c", "import xdist"], stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL).returncode == 0:
                xdist = ["-n", str(workers), "--dist", "load"]
            self.run_part("tests", "tests", "tests", "tests/junit.xml", "tests/pytest.log",
                          [py, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "--strict-markers",
                           f"--junitxml={out / 'tests/junit.xml'}", *xdist, *selection],
                          env={"FAIRSEQ_BIN": str(self.bin)})

        # benchmarks/run.py --device: whole updates through fairseq's Trainer. fairseq's --fp16 needs a GPU
        first = "fp32" if self.cpu else "fp16"
        if quick:
            common = ["--quick", "--rounds", "2", "--per-round", "1", "--warmup", "1"]
            # one model compiled per part in CI: the causal FD-TNN in fp32 (beside fairseq's transformer), the
            # masked one in bf16 (SKI-TNN's compiled training is the train part's)
            configs_first, sections_first = ["fd3", "transformer"], ["--sections", "causal"]
            configs_bf16, sections_bf16 = ["fd3"], ["--sections", "masked"]
        else:
            common = ["--rounds", "3", "--per-round", "2", "--warmup", "3"]
            configs_first, sections_first = ["tnn6", "fd3", "ski", "bound_identity", "transformer"], []
            configs_bf16, sections_bf16 = ["tnn6", "fd3", "ski", "bound_identity"], []
        if self.wanted("bench-fp16"):
            self.run_part(f"benchmark {first} (eager and compiled)", "bench-fp16", "benchmark", f"bench-{first}",
                          f"bench-{first}/run.log",
                          [py, "benchmarks/run.py", "--device", device, "--precision", first, "--configs",
                           *configs_first, *sections_first, "--modes", "eager", "compiled", "--no-plots", "--out",
                           out / f"bench-{first}", *common])
        if self.wanted("bench-bf16"):
            self.run_part("benchmark bf16 (compiled)", "bench-bf16", "benchmark", "bench-bf16", "bench-bf16/run.log",
                          [py, "benchmarks/run.py", "--device", device, "--precision", "bf16", "--configs",
                           *configs_bf16, *sections_bf16, "--modes", "compiled", "--no-plots", "--out",
                           out / "bench-bf16", *common])

        # the bundled sample, binarised (the full check: with Wikitext-103's dictionary size)
        data_bin = out / "data" / "bin"
        if self.wanted("data") or self.wanted("train"):
            if quick:
                self.run_part("data (data/sample binarised)", "data", "data", "", "data/preprocess.log",
                              ["bash", "scripts/preprocess.sh", "data/sample", data_bin],
                              env={"FAIRSEQ_BIN": str(self.bin)})
            else:
                # one process group: the padded dictionary, then fairseq-preprocess with it
                script = ('set -euo pipefail\n'
                          '"$1" scripts/gpu_check_report.py dictionary data/sample/train.bpe "$4" '
                          '"$3/dict.padded.txt"\n'
                          '"$2/fairseq-preprocess" --only-source --srcdict "$3/dict.padded.txt" '
                          '--trainpref data/sample/train.bpe --validpref data/sample/valid.bpe '
                          '--testpref data/sample/test.bpe --destdir "$3/bin" --workers 4')
                self.run_part(f"data (data/sample, dictionary padded to {WIKITEXT_SYMBOLS:,} symbols)", "data", "data",
                              "", "data/preprocess.log",
                              ["bash", "-c", script, "_", py, self.bin, out / "data", WIKITEXT_SYMBOLS])

        if self.wanted("train"):  # scripts/train.sh, compiled and eager
            if quick:
                # one preset: the paper's SKI-TNN; the compiled training of a causal tiny model through
                # fairseq-train is tests/modules/test_compile.py's, so CI does not compile it twice
                presets = ["ski_tnn_mlm_tiny"]
                knobs = {"MAX_UPDATE": "8", "TOKENS_PER_SAMPLE": "32", "LOG_INTERVAL": "2",
                         "VALIDATE_INTERVAL_UPDATES": "8", "WARMUP_UPDATES": "4"}
                extra = ["--max-valid-steps", "4"]
            else:
                presets = ["fd_tnn_lm_wt103", "ski_tnn_mlm_wt103"]
                knobs = {"MAX_UPDATE": "200", "LOG_INTERVAL": "20", "VALIDATE_INTERVAL_UPDATES": "100",
                         "WARMUP_UPDATES": "50"}
                extra = []
            for preset in presets:
                # one process, the per-GPU batch of the recipe as the whole update (update-freq 1); the masked
                # recipe's --sample-break-mode complete would give the sample's short lines tens of lengths, each
                # compiled anew: blocks of the full length instead, as on Wikitext-103
                masked = "mlm" in preset
                batch = 4 if quick else 16 if masked else 8
                kind_extra = ["--sample-break-mode", "none"] if masked else []
                # on a GPU also compiled with CUDA graphs (CUDA_GRAPHS=1), which the report compares with eager too
                for mode in ("compiled", "eager") if self.cpu else ("graphs", "compiled", "eager"):
                    env = {**knobs, "NPROC": "1", "CPU": self.knobs["CPU"], "PRECISION": first,
                           "TNN_COMPILE": "0" if mode == "eager" else "1", "CUDA_GRAPHS": "1" if mode == "graphs" else "0",
                           "BATCH_PER_GPU": str(batch),
                           "SEQS_PER_UPDATE": str(batch), "SAVE_ROOT": str(out / "train"),
                           "RUN_NAME": f"{preset}-{mode}", "NUM_WORKERS": "0", "FAIRSEQ_BIN": str(self.bin),
                           "PYTHON": py}
                    self.run_part(f"train {preset} {mode}", "train", "train", f"train/{preset}-{mode}",
                                  f"train/{preset}-{mode}.log",
                                  ["bash", "scripts/train.sh", preset, data_bin, "--no-save", *kind_extra, *extra],
                                  env=env)


def parse_flags(argv: Sequence[str], env: Mapping[str, str], prog: str):
    """The flags over the environment: the knobs' environment with each flag's knob set, or an exit status (the
    usage and a message on stderr: 2; --help on stdout: 0)."""
    env = dict(env)
    limits = [env.get("LIMITS", "")]
    out_given = None
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(help_text(prog))
            return 0
        if arg in SWITCHES:
            env[SWITCHES[arg]] = "1"
        elif arg in VALUED or arg == "--limit":
            knob, needs = VALUED.get(arg, ("LIMITS", "PART=SECONDS"))
            if not args or (arg == "--pytest" and not args[0]):
                return usage_error(prog, f"{arg} needs {needs}")
            value = args.pop(0)
            if arg == "--limit":
                limits.append(value)
            else:
                env[knob] = value
                if arg == "--out":
                    out_given = value
        else:
            return usage_error(prog, f"unknown argument '{arg}'")
    env["LIMITS"] = " ".join(x for x in limits if x)
    if out_given == "":
        raise CommandError("OUT must name a directory (--out DIR), not ''")
    return env


def usage_error(prog: str, message: str) -> int:
    print(f"{usage(prog)}\n{message}", file=sys.stderr)
    return 2


def main(argv: List[str], prog: str) -> int:
    try:
        return run_main(prog, lambda: check(argv, prog))
    except KeyboardInterrupt:  # before the first part (the checks) or while the report is written
        print(f"{prog}: error: interrupted", file=sys.stderr)
        return 130


def check(argv: List[str], prog: str) -> int:
    env = parse_flags(argv, os.environ, prog)
    if isinstance(env, int):
        return env
    knobs = read_knobs(KNOBS, env)
    limits: Dict[str, int] = {}
    for entry in knobs["LIMITS"].split():
        m = re.fullmatch(r"([a-z0-9-]+)=([1-9][0-9]*)", entry)
        if not m:
            raise CommandError(f"LIMITS / --limit '{entry}' is invalid: must be PART=SECONDS, SECONDS a positive "
                               "integer")
        if m[1] not in PARTS:
            raise CommandError(f"LIMITS / --limit '{entry}': unknown part '{m[1]}'; parts: {' '.join(PARTS)}")
        limits[m[1]] = int(m[2])
    only = [p for p in re.split(r"[,\s]+", knobs["ONLY"]) if p]
    for p in only:
        if p not in PARTS:
            raise CommandError(f"ONLY / --only '{knobs['ONLY']}': unknown part '{p}'; parts: {' '.join(PARTS)}")
    try:
        pytest_args = shlex.split(knobs["PYTEST_ARGS"])
    except ValueError as e:
        raise CommandError(f"PYTEST_ARGS / --pytest '{knobs['PYTEST_ARGS']}' does not split into arguments: {e}")

    bin_dir = fairseq_bin(env)
    python = env.get("PYTHON") or str(bin_dir / "python")
    if shutil.which(python) is None:
        raise CommandError(f"PYTHON={python} is not an executable (set up .venv with scripts/setup.sh, or set PYTHON "
                           "and FAIRSEQ_BIN; docs/references.md#gpu-machine-without-network)")
    out = abs_path(knobs["OUT"])
    if out.exists() and knobs["FORCE"] != "1":
        raise CommandError(f"--out {out} already exists; refusing to overwrite it (--force deletes it first, or "
                           "choose another --out)")
    if knobs["CPU"] != "1":
        has_gpu = subprocess.run([python, "-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
        if not has_gpu:
            raise CommandError(f"no CUDA GPU is visible to torch ({python}): this check is for a GPU machine. --cpu "
                               "runs the same parts on the CPU (--cpu --quick: toy sizes, a few minutes)")
    if out.exists() or out.is_symlink():
        if out.is_dir() and not out.is_symlink():
            shutil.rmtree(out)
        else:
            out.unlink()
    try:
        out.mkdir(parents=True)
    except OSError as e:
        raise CommandError(f"cannot create --out {out}: {e.strerror}", 1)

    set_knobs = [f"{k}={os.environ[k]}" for k in ("OUT", "FORCE", "CPU", "QUICK", "ONLY", "PYTEST_ARGS", "LIMITS")
                 if os.environ.get(k)]
    command = quote_cmd([*set_knobs, *shlex.split(invocation(prog)), *argv])
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t_start = time.time()
    (out / "parts.tsv").write_text("")
    run = Check(prog, knobs, only, limits, pytest_args, python, bin_dir, out)
    handlers = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        run.run()
    except Interrupted:
        if run.proc is not None:
            try:
                os.killpg(run.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        raise CommandError(f"interrupted; the parts done so far are in {out} (no report written)", 130)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)

    seconds = int(time.time() - t_start)
    with open(out / "run.json", "w") as f:
        json.dump({"command": command, "started": started, "seconds": float(seconds), "device": run.device,
                   "quick": run.quick, "only": knobs["ONLY"] or None}, f, indent=1)
    code = subprocess.run([python, ROOT / "scripts" / "gpu_check_report.py", "report", out], env=run.env).returncode
    if code not in (0, 1):
        raise CommandError(f"writing the report failed (exit {code})", 1)
    say(prog, f"report: {out / 'report.md'} ({seconds} s)")
    return code
