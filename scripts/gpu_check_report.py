#!/usr/bin/env python
"""The report of scripts/gpu_check.sh (python -m fairseq_tnn gpu-check, which runs the parts; this describes
the machine, writes the padded dictionary and turns the parts' outputs into report.md and report.json).

    python scripts/gpu_check_report.py environment OUT.json     # GPU, driver, CUDA, torch, fairseq, Python
    python scripts/gpu_check_report.py dictionary TEXT SIZE OUT # TEXT's symbols padded to SIZE (specials included)
    python scripts/gpu_check_report.py report OUT_DIR           # report.md and report.json; exit 1 if a part failed

The report reads OUT_DIR/parts.tsv (one line per part, written by the gpu-check command: name, exit status,
seconds, time limit, log file, kind) and, per kind of part, its outputs: the junit XML of the tests, trainer.json
of a benchmark, train.log of a training run. A part passed when its command exited 0 and its outputs
say nothing failed; a compiled training run also fails if any of its layers fell back to eager, and the
compiled runs of a preset (and on a GPU its CUDA-graph runs) must agree with its eager run on the final
validation loss (AGREEMENT, relative).
"""
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGREEMENT = 0.02  # compiled vs eager final validation loss: |a - b| / b at most this
TAIL_LINES = 25
TIMED_OUT = (124, 137)  # timeout(1): the limit was reached (124), or the part was killed after it (137)
FALLBACK = re.compile(r"--tnn-compile: compiling (\S+) failed: (.*)")


# ---------------------------------------------------------------- environment

def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(path):
    """What the report says about the machine and the software, as JSON."""
    import torch
    env = {"python": platform.python_version(), "python_executable": sys.executable, "platform": platform.platform(),
           "cpu_cores": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available()}
    try:
        import fairseq
        env["fairseq"] = fairseq.__version__
        env["fairseq_path"] = os.path.dirname(fairseq.__file__)
    except Exception as err:  # reported, and the environment part fails
        env["fairseq"] = None
        env["fairseq_error"] = f"{type(err).__name__}: {err}"
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)
        env["cudnn"] = torch.backends.cudnn.version()
        if shutil.which("nvidia-smi"):
            env["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[0:1]
            env["driver"] = env["driver"][0] if env["driver"] else None
    env["git_commit"] = _run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]) or None
    env["git_dirty"] = bool(_run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"]))
    for name in ("FAIRSEQ_BIN", "PYTHONPATH"):
        env[name] = os.environ.get(name)
    with open(path, "w") as f:
        json.dump(env, f, indent=1)
    print(json.dumps(env, indent=1))
    if env["fairseq"] is None:
        sys.exit(f"gpu_check_report.py: error: fairseq does not import: {env['fairseq_error']}")


# ---------------------------------------------------------------- the padded dictionary

def dictionary(text, size, path):
    """fairseq's dictionary of TEXT's symbols (by count), padded with placeholder words to SIZE symbols
    (fairseq's 4 specials included), for fairseq-preprocess --srcdict: the output softmax of a realistic size."""
    from fairseq.data import Dictionary
    d = Dictionary()
    with open(text) as f:
        for line in f:
            for word in line.split():
                d.add_symbol(word)
    d.finalize(padding_factor=1)
    if len(d) > size:
        sys.exit(f"gpu_check_report.py: error: {text} has {len(d)} symbols, more than the {size} asked for")
    i = 0
    while len(d) < size:
        d.add_symbol(f"madeupword{i:05d}", n=0)
        i += 1
    d.save(path)


# ---------------------------------------------------------------- reading the parts' outputs

def tail(path, n=TAIL_LINES):
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in f.readlines()[-n:]]
    except OSError:
        return []


def read_parts(out):
    parts = []
    with open(os.path.join(out, "parts.tsv")) as f:
        for line in f:
            name, code, seconds, limit, log, kind, extra = (line.rstrip("\n").split("\t") + [""] * 7)[:7]
            parts.append({"name": name, "exit_code": int(code), "seconds": float(seconds), "limit_s": int(limit),
                          "log": log, "kind": kind, "extra": extra})
    return parts


def pytest_results(part, out):
    """Counts and the failing tests' names: from the junit XML, or (no XML: killed) from the -v log."""
    xml = os.path.join(out, part["extra"])
    result = {"junit": part["extra"]}
    failing = []
    if os.path.exists(xml) and os.path.getsize(xml) > 0:
        root = ET.parse(xml).getroot()
        suites = [root] if root.tag == "testsuite" else list(root)
        counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        for case in root.iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                message = (bad.get("message") or "").strip().splitlines()
                failing.append({"test": name, "message": message[0][:300] if message else ""})
        result.update(counts)
        result["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    else:
        log = os.path.join(out, part["log"])
        text = open(log, errors="replace").read() if os.path.exists(log) else ""
        names = [m.group(1) or m.group(2) for m in
                 re.finditer(r"(?:^|\] )(?:FAILED|ERROR) (\S+::\S+)|^(\S+::\S+) (?:FAILED|ERROR)", text, re.M)]
        failing = [{"test": name, "message": ""} for name in dict.fromkeys(names)]
        result["note"] = "no junit XML (pytest did not finish): failing tests read from its log"
    result["failing"] = failing
    return result


def benchmark_results(part, out):
    path = os.path.join(out, part["extra"], "trainer.json")
    if not os.path.exists(path):
        return {"missing": os.path.relpath(path, out)}
    with open(path) as f:
        result = json.load(f)
    md = os.path.join(out, part["extra"], "trainer.md")
    return {"json": os.path.relpath(path, out), "meta": result["meta"], "groups": result["groups"],
            "ratios": result["ratios"], "memory_bounds": result.get("memory_bounds", []),
            "against_transformer": result.get("against_transformer", []),
            "markdown": open(md).read() if os.path.exists(md) else ""}


def profile_results(part, out):
    """benchmarks/gpu_profile.py's results: its JSON (the numbers) and Markdown (the tables)."""
    path = os.path.join(out, part["extra"], "gpu_profile.json")
    if not os.path.exists(path):
        return {"missing": os.path.relpath(path, out)}
    with open(path) as f:
        result = json.load(f)
    md = os.path.join(out, part["extra"], "gpu_profile.md")
    return {"json": os.path.relpath(path, out), "meta": result["meta"], "groups": result["groups"],
            "bandwidth_gbs": result.get("bandwidth_gbs"), "targets": result.get("targets", []),
            "not_compiled": result.get("not_compiled", []), "markdown": open(md).read() if os.path.exists(md) else ""}


def json_lines(path):
    out = []
    if not os.path.exists(path):
        return out
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{") and line.endswith("}"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


def training_results(part, out):
    """update_ms (median of the logged intervals after the first, which holds the compilation), the last
    validation loss, the updates done, and any layer that fell back to eager."""
    run_dir = os.path.join(out, part["extra"])
    log = os.path.join(run_dir, "train.log")
    records = json_lines(log)
    inner = [r for r in records if "update_ms" in r and "valid_loss" not in r and "train_loss" not in r]
    valid = [r for r in records if "valid_loss" in r]
    steady = [float(r["update_ms"]) for r in inner[1:]] or [float(r["update_ms"]) for r in inner]
    text = open(log, errors="replace").read() if os.path.exists(log) else ""
    fallbacks = [{"layer": m.group(1), "error": m.group(2)[:300]} for m in FALLBACK.finditer(text)]
    mode = part["name"].split()[-1]  # "train PRESET MODE": eager, compiled or graphs (compiled with CUDA graphs)
    result = {"train_log": os.path.relpath(log, out), "mode": mode, "compiled": mode != "eager",
              "update_ms": round(statistics.median(steady), 2) if steady else None,
              "update_ms_intervals": len(steady),
              "valid_loss": float(valid[-1]["valid_loss"]) if valid else None,
              "num_updates": int(float(valid[-1]["valid_num_updates"])) if valid and "valid_num_updates" in valid[-1] else None,
              "eager_fallback": fallbacks}
    peak = [float(r[k]) for r in inner for k in ("gpu_peak_mb", "max_rss_mb") if k in r]
    if peak:
        result["peak_mb"] = max(peak)
    return result


# ---------------------------------------------------------------- the report

def judge(part, out):
    """The part's status and reasons, from its exit status and its outputs."""
    reasons = []
    code = part["exit_code"]
    if code in TIMED_OUT:
        status = "timed out"
        reasons.append(f"stopped at its time limit of {part['limit_s']} s")
    elif code != 0:
        status = "failed"
        reasons.append(f"exit status {code}")
    else:
        status = "passed"
    kind = part["kind"]
    if kind == "tests":
        part["tests"] = pytest_results(part, out)
        if part["tests"]["failing"]:
            status = "failed" if status == "passed" else status
            reasons.append(f"{len(part['tests']['failing'])} failing tests")
    elif kind == "benchmark":
        part["benchmark"] = benchmark_results(part, out)
        if "missing" in part["benchmark"] and status == "passed":
            status, reasons = "failed", reasons + [f"no {part['benchmark']['missing']}"]
    elif kind == "profile":
        part["profile"] = profile_results(part, out)
        if "missing" in part["profile"] and status == "passed":
            status, reasons = "failed", reasons + [f"no {part['profile']['missing']}"]
    elif kind == "train":
        part["training"] = training_results(part, out)
        t = part["training"]
        if status == "passed" and t["valid_loss"] is None:
            status, reasons = "failed", reasons + ["no validation loss in train.log"]
        if t["compiled"] and t["eager_fallback"]:
            status = "failed"
            reasons.append("compiled run fell back to eager: " + "; ".join(
                f"{f['layer']}: {f['error']}" for f in t["eager_fallback"]))
    part["status"] = status
    part["reasons"] = reasons
    if status != "passed":
        part["log_tail"] = tail(os.path.join(out, part["log"]))
    return part


def agreement_checks(parts):
    """The compiled runs of each preset (compiled, and compiled with CUDA graphs where run) against its eager run:
    the same final validation loss, within AGREEMENT."""
    runs = {}
    for p in parts:
        if p["kind"] == "train" and p.get("training", {}).get("valid_loss") is not None:
            preset = p["name"].split()[1]
            runs.setdefault(preset, {})[p["training"].get("mode", "compiled" if p["training"]["compiled"] else "eager")] \
                = p["training"]
    checks = []
    for preset, modes in runs.items():
        if "eager" not in modes:
            continue
        b = modes["eager"]["valid_loss"]
        for mode in sorted(m for m in modes if m != "eager"):
            a = modes[mode]["valid_loss"]
            rel = abs(a - b) / abs(b) if b else float("inf")
            checks.append({"preset": preset, "mode": mode, "compiled": a, "eager": b, "relative_difference": round(rel, 5),
                           "tolerance": AGREEMENT, "status": "passed" if rel <= AGREEMENT else "failed"})
    return checks


def fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(report):
    env = report["environment"]
    lines = ["# GPU check", "",
             f"`{report['command']}`, {report['started']}; {'PASSED' if report['ok'] else 'FAILED'} "
             f"({report['failed']} of {len(report['parts'])} parts failed), {report['seconds']:.0f} s in all.", "",
             "## Machine and software", ""]
    gpu = ", ".join(env.get("gpus") or []) or "none (CPU run)"
    lines += [f"- GPU: {gpu}" + (f", {env['gpu_memory_gib']} GiB" if env.get("gpu_memory_gib") else ""),
              f"- driver: {env.get('driver') or '-'}; CUDA (torch): {env.get('cuda') or '-'}; cuDNN: {env.get('cudnn') or '-'}; "
              f"Triton: {env.get('triton') or '-'}",
              f"- torch {env.get('torch')}, fairseq {env.get('fairseq')}, Python {env.get('python')} "
              f"({env.get('python_executable')}); {env.get('cpu_cores')} CPU cores; {env.get('platform')}",
              f"- repository: {env.get('git_commit') or '-'}{' (with local changes)' if env.get('git_dirty') else ''}; "
              f"FAIRSEQ_BIN={env.get('FAIRSEQ_BIN') or '-'}, PYTHONPATH={env.get('PYTHONPATH') or '-'}", "",
             "## Parts", "", "| part | status | wall s | limit s | log |", "|---|---|---:|---:|---|"]
    for p in report["parts"]:
        lines.append(f"| {p['name']} | {p['status']} | {p['seconds']:.0f} | {p['limit_s']} | {p['log']} |")
    for c in report["agreement"]:
        lines.append(f"| {c.get('mode', 'compiled')} = eager, {c['preset']} | {c['status']} | - | - | validation loss "
                     f"{c['compiled']:.4f} vs {c['eager']:.4f} |")
    failed = [p for p in report["parts"] if p["status"] != "passed"]
    bad_checks = [c for c in report["agreement"] if c["status"] != "passed"]
    if failed or bad_checks:
        lines += ["", "## Failures", ""]
        for p in failed:
            lines += [f"### {p['name']}: {p['status']}", "", "; ".join(p["reasons"]), ""]
            for t in p.get("tests", {}).get("failing", []):
                lines.append(f"- `{t['test']}`" + (f": {t['message']}" if t["message"] else ""))
            if p.get("tests", {}).get("failing"):
                lines.append("")
            lines += [f"Last lines of {p['log']}:", "", "```", *p.get("log_tail", []), "```", ""]
        for c in bad_checks:
            lines += [f"### {c.get('mode', 'compiled')} = eager, {c['preset']}: failed", "",
                      f"final validation loss {c.get('mode', 'compiled')} {c['compiled']:.4f}, eager {c['eager']:.4f}: "
                      "relative difference "
                      f"{c['relative_difference']:.4f} > {c['tolerance']}", ""]
    tests = [p for p in report["parts"] if "tests" in p]
    if tests:
        lines += ["", "## Tests", ""]
        for p in tests:
            t = p["tests"]
            if "tests" in t:
                lines.append(f"- {p['name']}: {t['passed']} passed, {t['failures']} failed, {t['errors']} errors, "
                             f"{t['skipped']} skipped ({t['junit']})")
            else:
                lines.append(f"- {p['name']}: {t['note']}")
    for p in report["parts"]:
        if p.get("profile", {}).get("markdown"):
            md = p["profile"]["markdown"].replace("\n# ", "\n### ").replace("\n## ", "\n#### ")
            md = re.sub(r"^# ", "### ", md)
            lines += ["", f"## Profile: {p['name']}", "", md.strip()]
    for p in report["parts"]:
        if p.get("benchmark", {}).get("markdown"):
            md = p["benchmark"]["markdown"].replace("\n# ", "\n### ").replace("\n## ", "\n#### ")
            md = re.sub(r"^# ", "### ", md)
            lines += ["", f"## Benchmark: {p['name']}", "", md.strip()]
    trains = [p for p in report["parts"] if "training" in p]
    if trains:
        lines += ["", "## Training runs (scripts/train.sh)", "",
                  "update_ms: median of the logged intervals after the first (which holds the compilation).", "",
                  "| run | status | updates | update_ms | final validation loss | peak MB | layers fallen back to eager |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for p in trains:
            t = p["training"]
            eager = ", ".join(f["layer"] for f in t["eager_fallback"]) or "-"
            lines.append(f"| {p['name']} | {p['status']} | {t['num_updates'] if t['num_updates'] is not None else '-'} | "
                         f"{fmt(t['update_ms'])} | {fmt(t['valid_loss'], 4)} | {fmt(t.get('peak_mb'), 0)} | {eager} |")
    return "\n".join(lines) + "\n"


def report(out):
    with open(os.path.join(out, "run.json")) as f:
        run = json.load(f)
    env_path = os.path.join(out, "environment.json")
    env = json.load(open(env_path)) if os.path.exists(env_path) else {}
    parts = [judge(p, out) for p in read_parts(out)]
    checks = agreement_checks(parts)
    failed = sum(p["status"] != "passed" for p in parts) + sum(c["status"] != "passed" for c in checks)
    result = {"command": run["command"], "started": run["started"], "seconds": run.get("seconds", 0.0),
              "device": run["device"], "quick": run["quick"], "ok": failed == 0, "failed": failed,
              "environment": env, "parts": parts, "agreement": checks}
    md = markdown(result)
    for p in parts:  # the Markdown tables are in report.md; the JSON keeps the numbers
        p.get("benchmark", {}).pop("markdown", None)
        p.get("profile", {}).pop("markdown", None)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(md)
    return result


def main(argv):
    usage = ("usage: gpu_check_report.py environment OUT.json | dictionary TEXT SIZE OUT | report OUT_DIR")
    if len(argv) == 2 and argv[0] == "environment":
        environment(argv[1])
    elif len(argv) == 4 and argv[0] == "dictionary":
        dictionary(argv[1], int(argv[2]), argv[3])
    elif len(argv) == 2 and argv[0] == "report":
        result = report(argv[1])
        print(f"gpu_check: report in {os.path.join(argv[1], 'report.md')}: "
              f"{'all parts passed' if result['ok'] else str(result['failed']) + ' failed'}")
        sys.exit(0 if result["ok"] else 1)
    else:
        sys.exit(usage)


if __name__ == "__main__":
    main(sys.argv[1:])
