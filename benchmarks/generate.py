"""Generation speed: fairseq's sequence generator with the incremental (cached) TNN decoder against
fairseq's uncached path, which re-runs the whole network on the whole prefix for every new token.

    .venv/bin/python benchmarks/generate.py [--quick] [--out results/generate] [--device cpu|cuda]
                                            [--archs tnn_lm_wt103 fd_tnn_lm_wt103] [--prompt 16] [--tokens 1024]
                                            [--uncached-positions 16 128 256 512 768 1024] [--force]

Writes ``generate.json``, ``generate.md`` and ``generate.png`` (time of each new token against its
position, cached and uncached) into ``--out``.

Models: the registered archs at their published sizes (random weights: speed does not depend on them),
a 50,264-symbol dictionary (Wikitext-103's GPT-2 vocabulary), fp32, eval mode, batch 1, greedy search
(beam 1), a random prompt of ``--prompt`` tokens, then ``--tokens`` new tokens (end of sentence
forbidden until then with min_len, so every run produces exactly that many).

Method.
* cached: one whole ``SequenceGenerator.generate`` call, planned as the ``tnn_language_modeling`` task
  plans it (``decoding_length``). The decoder's calls are time-stamped: the time of the token at
  position t is the interval between the call for t and the call for t + 1 (the network step plus the
  generator's search step). Tokens per second = new tokens / wall time of the whole call.
* uncached: fairseq's own non-incremental path (``EnsembleModel.has_incremental = False``: every step
  calls the decoder on the whole prefix and keeps the last position). Over 1,024 new tokens of a
  published-size model that takes far too long on a small CPU (the step at position t costs t times the
  per-token network, including t x vocabulary output logits), so unless ``--uncached-positions all``,
  single uncached steps are timed at the given positions (prefixes of the cached run's own tokens,
  decoder call + log-softmax of the last position, as the generator does; median of 3) and the total
  time of the uncached generation is the trapezoidal integral of those step times over positions
  ``prompt .. prompt + tokens - 1``. Each timed step's most likely next token is checked against the
  token the cached run chose there (greedy: they must agree).
* memory: each configuration runs in a forked child; the peak resident set size of the child above its
  resident size after building the model (Linux VmHWM, reset first), and on CUDA
  ``torch.cuda.max_memory_allocated`` above the model's. The cache itself is, per sequence and layer,
  d1 = expand_ratio x d floats of the TNO input v per position; each layer also keeps its time kernel,
  d1 floats per position of the planned length, shared by the batch (both listed as ``cache_*``).
"""
import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

WT103_VOCAB = 50264
MIB = 2.0 ** 20


from benchmarks.measure import _proc_status_kib  # noqa: E402  (one reader of /proc/self/status)


def _reset_hwm():
    try:  # Linux >= 4.0: reset VmHWM to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def build(arch: str, vocab: int, device: str):
    import fairseq_tnn
    fairseq_tnn.register()  # registers the archs
    from fairseq_tnn.models.build import build_arch
    torch.manual_seed(0)
    model = build_arch(arch, vocab).to(device).eval()
    return model


def make_generator(model, prompt: int, tokens: int):
    from fairseq.sequence_generator import SequenceGenerator
    total = prompt + tokens
    # max_len = max_len_b (max_len_a = 0): prompt + new tokens, then the forced end of sentence
    return SequenceGenerator([model], model.decoder.dictionary, beam_size=1, max_len_a=0, max_len_b=total,
                             min_len=total)


def sample_for(prompt_tokens: torch.Tensor, eos: int):
    src = torch.cat([torch.tensor([eos], device=prompt_tokens.device), prompt_tokens])[None]
    return {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([src.shape[1]], device=src.device)}}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_cached(model, prompt_tokens, tokens: int, device: str) -> Dict:
    """One whole cached generation; per-position times from time-stamped decoder calls."""
    dec = model.decoder
    gen = make_generator(model, len(prompt_tokens), tokens)
    stamps, forward = [], dec.forward

    def stamped(*args, **kwargs):
        _sync(device)
        stamps.append(time.perf_counter())
        return forward(*args, **kwargs)

    dec.forward = stamped
    try:
        hypos, t0, wall = timed_generate(gen, model, prompt_tokens, tokens, device)
    finally:
        dec.forward = forward
    out = hypos[0][0]["tokens"]  # prompt + new tokens + </s>
    stamps.append(t0 + wall)
    # call i processes position i (the i-th token after </s>): positions prompt .. prompt + tokens - 1 are the
    # steps that predict a new token
    step_ms = [(stamps[i + 1] - stamps[i]) * 1e3 for i in range(len(stamps) - 1)]
    p = len(prompt_tokens)
    return dict(wall_s=wall, tokens_per_s=tokens / wall, tokens=out[:-1].tolist(),
                positions=list(range(p, p + tokens)), step_ms=step_ms[p:p + tokens])


def uncached_step(model, prefix: torch.Tensor, device: str):
    """fairseq's non-incremental step: the decoder on the whole prefix, log-softmax of the last position."""
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        logits, _ = model.decoder(prefix[None])
        lprobs = model.get_normalized_probs((logits[:, -1:], None), log_probs=True)
        _sync(device)
        return (time.perf_counter() - t0) * 1e3, int(lprobs[0, -1].argmax())


def timed_generate(gen, model, prompt_tokens, tokens: int, device: str):
    """(hypotheses, start time, wall seconds) of one generation of ``tokens`` after the prompt."""
    from fairseq_tnn.models.tnn_lm import decoding_length
    eos = model.decoder.dictionary.eos()
    with torch.no_grad(), decoding_length([model], len(prompt_tokens) + tokens + 1):
        _sync(device)
        t0 = time.perf_counter()
        hypos = gen.generate([model], sample_for(prompt_tokens, eos), prefix_tokens=prompt_tokens[None],
                             bos_token=eos)
        _sync(device)
        return hypos, t0, time.perf_counter() - t0


def run_uncached_full(model, prompt_tokens, tokens: int, device: str) -> Dict:
    gen = make_generator(model, len(prompt_tokens), tokens)
    gen.model.has_incremental = False  # fairseq's own switch: re-run the whole prefix every step
    hypos, _, wall = timed_generate(gen, model, prompt_tokens, tokens, device)
    return dict(wall_s=wall, tokens_per_s=tokens / wall, tokens=hypos[0][0]["tokens"][:-1].tolist())


def child(conn, cfg: Dict):
    """One configuration in a forked process: timings and peak memory."""
    try:
        torch.set_num_threads(cfg["threads"])
        device = cfg["device"]
        model = build(cfg["arch"], cfg["vocab"], device)
        dec = model.decoder
        g = torch.Generator().manual_seed(1)
        prompt_tokens = torch.randint(dec.dictionary.nspecial, len(dec.dictionary), (cfg["prompt"],), generator=g)
        prompt_tokens = prompt_tokens.to(device)
        import gc
        gc.collect()
        _reset_hwm()
        rss0 = _proc_status_kib("VmRSS:")
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        res = {"arch": cfg["arch"], "mode": cfg["mode"]}
        if cfg["mode"] == "cached":
            res.update(run_cached(model, prompt_tokens, cfg["tokens"], device))
        elif cfg["mode"] == "uncached_full":
            res.update(run_uncached_full(model, prompt_tokens, cfg["tokens"], device))
        else:  # uncached steps at given positions, on the cached run's tokens
            seq = torch.tensor(cfg["reference_tokens"], device=device)
            eos = dec.dictionary.eos()
            full = torch.cat([torch.tensor([eos], device=device), seq])
            from fairseq_tnn.models.tnn_lm import decoding_length
            steps = []
            with decoding_length([model], cfg["prompt"] + cfg["tokens"] + 1):
                for pos in cfg["positions"]:
                    prefix = full[: pos + 1]  # </s> and tokens 0 .. pos - 1: predicts the token at pos
                    times, pred = [], None
                    for _ in range(cfg["repeats"]):
                        ms, pred = uncached_step(model, prefix, device)
                        times.append(ms)
                    steps.append(dict(position=pos, step_ms=statistics.median(times), all_ms=times,
                                      agrees=pred == int(seq[pos])))
            res["steps"] = steps
        res["rss_peak_mib"] = (_proc_status_kib("VmHWM:") - rss0) / 1024.0
        if device == "cuda":
            res["cuda_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
        layers = dec.layers
        d1 = layers[0].gtu.d1
        planned = cfg["prompt"] + cfg["tokens"] + 1
        res["cache_v_kib_per_token_layer"] = d1 * 4 / 1024.0
        res["cache_v_mib"] = len(layers) * d1 * planned * 4 / MIB
        res["cache_kernel_mib"] = len(layers) * d1 * planned * 4 / MIB
        res["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
        res["layers"], res["d1"] = len(layers), d1
        conn.send(res)
    except BaseException as e:  # report, never hang the parent
        import traceback
        conn.send({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
    finally:
        conn.close()


def in_child(cfg: Dict) -> Dict:
    ctx = mp.get_context("fork")
    parent, kid = ctx.Pipe(duplex=False)
    p = ctx.Process(target=child, args=(kid, cfg))
    p.start()
    kid.close()
    res = parent.recv()
    p.join()
    if "error" in res:
        raise RuntimeError(f"{cfg['arch']} {cfg['mode']} failed:\n{res['error']}")
    return res


def trapezoid(xs: List[float], ys: List[float]) -> float:
    return sum((xs[i + 1] - xs[i]) * (ys[i + 1] + ys[i]) / 2 for i in range(len(xs) - 1))


def linear_fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def analyse(arch: str, cached: Dict, uncached: Dict, prompt: int, tokens: int) -> Dict:
    pos, ms = cached["positions"], cached["step_ms"]
    a, b = linear_fit(pos, ms)
    # growth check: the per-token time over the last eighth of the positions against the first eighth;
    # at most linear growth means this ratio stays at most the ratio of the positions (here ~ n / prompt)
    k = max(1, len(ms) // 8)
    first, last = statistics.median(ms[:k]), statistics.median(ms[-k:])
    first_pos, last_pos = statistics.median(pos[:k]), statistics.median(pos[-k:])
    # median time per eighth of the positions (the plot's trend without the shared machine's noise)
    bins = [(statistics.median(pos[i:i + k]), statistics.median(ms[i:i + k])) for i in range(0, len(ms), k)]
    if "steps" in uncached:
        xs = [s["position"] for s in uncached["steps"]]
        ys = [s["step_ms"] for s in uncached["steps"]]
        uncached_s = trapezoid(xs, ys) / 1e3 if len(xs) > 1 else ys[0] * tokens / 1e3
        estimated = True
        agree = all(s["agrees"] for s in uncached["steps"])
    else:
        uncached_s, estimated = uncached["wall_s"], False
        agree = uncached["tokens"] == cached["tokens"]
    return dict(
        arch=arch, params_m=cached["params_m"], layers=cached["layers"], d1=cached["d1"],
        cached_tokens_per_s=cached["tokens_per_s"], cached_wall_s=cached["wall_s"],
        uncached_tokens_per_s=tokens / uncached_s, uncached_wall_s=uncached_s, uncached_estimated=estimated,
        speedup=uncached_s / cached["wall_s"], same_tokens=agree,
        cached_ms_first=first, cached_ms_last=last, position_first=first_pos, position_last=last_pos,
        growth_ratio=last / first, position_ratio=last_pos / first_pos,
        linear_fit_ms=[a, b], binned_ms=bins,
        # at most linear: no eighth's median time exceeds the first eighth's scaled by the ratio of positions
        at_most_linear=all(t <= first * p / first_pos for p, t in bins),
        cached_rss_peak_mib=cached["rss_peak_mib"], uncached_rss_peak_mib=uncached["rss_peak_mib"],
        cached_cuda_peak_mib=cached.get("cuda_peak_mib"), uncached_cuda_peak_mib=uncached.get("cuda_peak_mib"),
        cache_v_kib_per_token_layer=cached["cache_v_kib_per_token_layer"], cache_v_mib=cached["cache_v_mib"],
        cache_kernel_mib=cached["cache_kernel_mib"])


def markdown(result: Dict) -> str:
    m = result["meta"]
    lines = [f"# Generation: cached vs uncached ({m['device']}, {m['threads']} threads)", "",
             f"{m['prompt']}-token prompt, then {m['tokens']} new tokens, batch 1, greedy; vocabulary {m['vocab']}; "
             f"fp32; {m['platform']}; torch {m['torch']}.", "",
             "| model | params (M) | cached tok/s | uncached tok/s | speed-up | cached ms/token first -> last eighth "
             "| peak RSS cached / uncached (MiB) | cache: v per token and layer | v total | kernels |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in result["results"]:
        unc = f"{r['uncached_tokens_per_s']:.2f}" + (" (est.)" if r["uncached_estimated"] else "")
        lines.append(
            f"| {r['arch']} | {r['params_m']:.2f} | {r['cached_tokens_per_s']:.1f} | {unc} | {r['speedup']:.1f}x | "
            f"{r['cached_ms_first']:.2f} -> {r['cached_ms_last']:.2f} (positions {r['position_first']:.0f} -> "
            f"{r['position_last']:.0f}) | {r['cached_rss_peak_mib']:.0f} / {r['uncached_rss_peak_mib']:.0f} | "
            f"{r['cache_v_kib_per_token_layer']:.1f} KiB | {r['cache_v_mib']:.1f} MiB | "
            f"{r['cache_kernel_mib']:.1f} MiB |")
    lines += ["", "Targets" + (" (--quick: the speed targets are the full run's)" if m["quick"] else "") + ":", ""]
    for t in result["targets"]:
        lines.append(f"- {'met' if t['ok'] else 'MISSED'}: {t['name']}: {t['detail']}")
    if any(r["uncached_estimated"] for r in result["results"]):
        lines += ["", "(est.): uncached single steps timed at positions "
                  f"{', '.join(map(str, m['uncached_positions']))} (median of {m['repeats']}), total = trapezoidal "
                  "integral over all positions; each timed step's greedy choice agrees with the cached run's token: "
                  + ", ".join(f"{r['arch']} {'yes' if r['same_tokens'] else 'NO'}" for r in result["results"]) + "."]
    return "\n".join(lines) + "\n"


def targets(result: Dict) -> List[Dict]:
    """The targets of the run: for every model, cached and uncached choose the same tokens; and, in the full run
    only (not --quick, whose tiny models and 48 tokens leave too little for the cache to win), cached decoding at
    least 10x faster than uncached and its time per token at most linear in the position."""
    out = []
    for r in result["results"]:
        out.append(dict(name=f"{r['arch']}: uncached and cached choose the same tokens", ok=r["same_tokens"],
                        detail="yes" if r["same_tokens"] else "no"))
        if result["meta"]["quick"]:
            continue
        out.append(dict(name=f"{r['arch']}: cached >= 10x faster than uncached over {result['meta']['tokens']} tokens",
                        ok=r["speedup"] >= 10, detail=f"{r['speedup']:.1f}x"))
        out.append(dict(name=f"{r['arch']}: per-token time grows at most linearly with the position",
                        ok=r["at_most_linear"],
                        detail=f"x{r['growth_ratio']:.2f} from position {r['position_first']:.0f} to "
                               f"{r['position_last']:.0f} (positions x{r['position_ratio']:.1f}); median ms per "
                               "eighth of the positions: " + ", ".join(f"{t:.1f}" for _, t in r["binned_ms"])
                               + f"; linear fit {r['linear_fit_ms'][0]:.2f} ms + "
                               f"{r['linear_fit_ms'][1] * 1e3:.2f} us/position"))
    return out


def plot(result: Dict, raw: Dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arch, runs in raw.items():
        line, = ax.plot(runs["cached"]["positions"], runs["cached"]["step_ms"], lw=0.8, label=f"{arch} cached")
        if "steps" in runs["uncached"]:
            xs = [s["position"] for s in runs["uncached"]["steps"]]
            ys = [s["step_ms"] for s in runs["uncached"]["steps"]]
            ax.plot(xs, ys, "o--", color=line.get_color(), label=f"{arch} uncached (timed steps)")
    ax.set(yscale="log", xlabel="position of the new token", ylabel="ms per new token",
           title=f"Generation, {result['meta']['device']}: time of each new token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, 48 tokens, uncached run in full (smoke test)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "generate"))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--archs", nargs="+", default=None)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--uncached-positions", nargs="+", default=None,
                    help="positions at which single uncached steps are timed, or 'all' for a full uncached run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads, the same for both paths (default 1: on a shared machine more threads than "
                         "free cores make every step wait)")
    ap.add_argument("--force", action="store_true", help="overwrite existing results in --out")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    archs = args.archs or (["tnn_lm_tiny", "fd_tnn_lm_tiny"] if args.quick else ["tnn_lm_wt103", "fd_tnn_lm_wt103"])
    tokens = args.tokens or (48 if args.quick else 1024)
    vocab = 1000 if args.quick else WT103_VOCAB
    if args.prompt < 1 or tokens < 2:
        ap.error("--prompt must be >= 1 and --tokens >= 2")
    positions = args.uncached_positions or (["all"] if args.quick else ["16", "128", "256", "512", "768", "1024"])
    full_uncached = positions == ["all"]
    if not full_uncached:
        try:
            positions = sorted({int(p) for p in positions})
        except ValueError:
            ap.error(f"--uncached-positions: integers or 'all', got {positions}")
        # positions of new tokens run from prompt to prompt + tokens - 1
        positions = sorted({min(max(p, args.prompt), args.prompt + tokens - 1) for p in positions}
                           | {args.prompt, args.prompt + tokens - 1})
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "generate.json")
    if os.path.exists(out_json) and not args.force:
        ap.error(f"{out_json} exists; pass --force to overwrite")

    results, raw = [], {}
    for arch in archs:
        base = dict(arch=arch, vocab=vocab, prompt=args.prompt, tokens=tokens, device=args.device,
                    threads=args.threads)
        print(f"generate: {arch}: cached, {tokens} tokens", flush=True)
        cached = in_child(dict(base, mode="cached"))
        print(f"generate: {arch}: cached {cached['tokens_per_s']:.1f} tok/s; uncached "
              f"{'in full' if full_uncached else f'steps at {positions}'}", flush=True)
        if full_uncached:
            uncached = in_child(dict(base, mode="uncached_full"))
        else:
            uncached = in_child(dict(base, mode="uncached_steps", positions=positions, repeats=args.repeats,
                                     reference_tokens=cached["tokens"]))
        raw[arch] = {"cached": cached, "uncached": uncached}
        results.append(analyse(arch, cached, uncached, args.prompt, tokens))
    result = dict(
        meta=dict(device=args.device, threads=args.threads, prompt=args.prompt, tokens=tokens, vocab=vocab,
                  quick=args.quick, uncached_positions=positions if not full_uncached else "all",
                  repeats=args.repeats, platform=platform.platform(), torch=torch.__version__,
                  cpu_count=os.cpu_count()),
        results=results)
    result["targets"] = targets(result)
    result["per_position"] = {a: {"cached_positions": r["cached"]["positions"],
                                  "cached_step_ms": [round(x, 4) for x in r["cached"]["step_ms"]],
                                  "uncached_steps": r["uncached"].get("steps")} for a, r in raw.items()}
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(args.out, "generate.md"), "w") as f:
        f.write(md)
    plot(result, raw, os.path.join(args.out, "generate.png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
