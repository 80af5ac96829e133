"""``python -m fairseq_tnn export CHECKPOINT DEST``: a fairseq checkpoint of a plugin model (causal ``tnn_lm_*``
or masked ``tnn_mlm_*``: TNN, FD-TNN, SKI-TNN) as a folder that loads with torch alone
(``fairseq_tnn.pretrained``): the weights as safetensors, config.json, vocab.json and the tokenizer files the
data was encoded with.

The checkpoint is loaded as fairseq loads it (its task set up on its data directory, for the dictionary; the
plugin's upgrades of old checkpoints applied), so the folder computes what the checkpoint computes. The tokenizer
is found beside the data, as scripts/prepare-corpus.sh leaves it (spm.model, or encoder.json and vocab.bpe in the
data directory), in the checkpoint's own --bpe options, or given with --tokenizer. Refused, with one line and
before anything is written: a checkpoint that is not a plugin model, a destination that holds anything but an
exported model, a data directory without dict.txt, a tokenizer that cannot be found or does not match the
dictionary.
"""
import argparse
import json
import shutil
from pathlib import Path
from typing import List, Optional, Tuple

from .common import CommandError, abs_path, run_main, say

TOKENIZER_HELP = ("the tokenizer the data was encoded with: a sentencepiece model (spm.model), or a directory "
                  "holding spm.model, or encoder.json and vocab.bpe (GPT-2's BPE); default: found beside the data")


def parse(argv: List[str], prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description="Export a fairseq checkpoint of a TNN model to a folder that "
                                                       "loads with torch alone (fairseq_tnn.pretrained).")
    p.add_argument("checkpoint", help="a checkpoint of tnn_lm_* or tnn_mlm_* (checkpoint_best.pt)")
    p.add_argument("dest", help="the folder to write: new, empty, or an earlier export (replaced)")
    p.add_argument("--data", help="the binarised data directory holding the dictionary (dict.txt); default: the "
                                  "checkpoint's own (its task's data)")
    p.add_argument("--tokenizer", help=TOKENIZER_HELP)

    def error(message):  # argparse's own refusals as this command's one line, exit 2
        raise CommandError(message)
    p.error = error
    return p.parse_args(argv)


def read_checkpoint(path: Path):
    """The checkpoint's config (fairseq's, upgraded from an argparse Namespace where old), its model's name and
    class, and the number of rows of its embeddings (its vocabulary's size). Refuses a file that is not a plugin
    model's checkpoint."""
    import fairseq_tnn
    fairseq_tnn.register()  # the plugin's models, and its patches for loading checkpoints with torch >= 2.6
    from fairseq import checkpoint_utils
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY
    from fairseq_tnn.models.tnn_lm import TnnLanguageModel
    from fairseq_tnn.models.tnn_mlm import TnnMaskedLMModel
    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    except Exception as e:  # noqa: BLE001  (any unreadable file: named, with the loader's reason)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CommandError(f"cannot read {path} as a fairseq checkpoint: {reason}")
    cfg = state.get("cfg") if isinstance(state, dict) else None
    name = getattr(getattr(cfg, "model", None), "_name", None) if cfg is not None else None
    cls = MODEL_REGISTRY.get(name) or ARCH_MODEL_REGISTRY.get(name)
    if cls not in (TnnLanguageModel, TnnMaskedLMModel):
        raise CommandError(f"{path} holds a {name or 'model of no known architecture'} model, not one of the "
                           "plugin's (tnn_lm_*, tnn_mlm_*: python -m fairseq_tnn.options lists their options); "
                           "export takes only those")
    key = ("decoder" if cls is TnnLanguageModel else "encoder") + ".embed_tokens.weight"
    weights = state.get("model") or {}
    if key not in weights:
        raise CommandError(f"{path} holds a {name} config but no {key} among its weights: not a complete checkpoint")
    return cfg, name, cls, weights[key].shape[0]


def data_dir(cfg, option: Optional[str]) -> Path:
    given = option is not None
    path = abs_path(option) if given else Path(str(getattr(cfg.task, "data", "") or "").split(":")[0])
    if not (path / "dict.txt").is_file():
        where = f"--data {path}" if given else f"the checkpoint's data directory {path}"
        raise CommandError(f"{where} holds no dict.txt (the dictionary the model was trained with): give the "
                           "binarised data directory with --data DIR")
    return path


def tokenizer_kind(symbols: List[str], specials: set) -> str:
    """gpt2 where the dictionary's words are GPT-2 token ids (numbers), else sentencepiece."""
    words = [s for i, s in enumerate(symbols) if i not in specials and not s.startswith("madeupword")]
    return "gpt2" if words and all(s.isdigit() for s in words) else "sentencepiece"


def candidates(kind: str, tokenizer: Optional[str], data: Path, cfg) -> Tuple[List[Path], str]:
    """Where to look for the tokenizer files (directories, or one spm.model), and how to say where we looked."""
    if tokenizer is not None:
        return [abs_path(tokenizer)], f"--tokenizer {tokenizer}"
    places = [data]
    bpe = getattr(cfg, "bpe", None)
    if bpe is not None and kind == "sentencepiece" and getattr(bpe, "sentencepiece_model", None):
        places.append(Path(str(bpe.sentencepiece_model)))
    if bpe is not None and kind == "gpt2" and getattr(bpe, "gpt2_encoder_json", None):
        places.append(Path(str(bpe.gpt2_encoder_json)).parent)
    return places, "beside the data (" + ", ".join(map(str, places)) + ")"


def find_tokenizer(kind: str, places: List[Path], where: str, given: bool) -> Path:
    """The directory holding the ``kind`` tokenizer's files (a given spm.model: its own path)."""
    from fairseq_tnn.pretrained.tokenizers import GPT2_FILES, SPM_FILE
    names = (SPM_FILE,) if kind == "sentencepiece" else GPT2_FILES
    for place in places:
        if kind == "sentencepiece" and place.is_file():
            return place
        if place.is_dir() and all((place / n).is_file() for n in names):
            return place
    need = "a sentencepiece model (spm.model)" if kind == "sentencepiece" else "GPT-2's encoder.json and vocab.bpe"
    if given:
        raise CommandError(f"{where}: no {' and '.join(names)} there; the dictionary's symbols need {need} "
                           f"(--tokenizer: {TOKENIZER_HELP})")
    raise CommandError(f"no tokenizer found {where}: the dictionary's symbols need {need}; give it with "
                       f"--tokenizer PATH ({TOKENIZER_HELP.split(': ', 1)[1].split('; default')[0]})")


def check_tokenizer(kind: str, path: Path, symbols: List[str], specials: set) -> None:
    """Refuse a tokenizer whose symbols are not the dictionary's: some of the dictionary's words (not its
    specials or fillers) are not pieces of the sentencepiece model / ids of GPT-2's encoder."""
    from fairseq_tnn.pretrained.tokenizers import read_spm_model
    words = [s for i, s in enumerate(symbols) if i not in specials and not s.startswith("madeupword")]
    if kind == "sentencepiece":
        try:
            known = {p for p, _, _ in read_spm_model(path)["pieces"]}
        except Exception:  # noqa: BLE001
            raise CommandError(f"--tokenizer {path} is not a sentencepiece model file") from None
    else:
        try:
            known = {str(i) for i in json.loads((path / "encoder.json").read_text(encoding="utf-8")).values()}
        except (OSError, ValueError, AttributeError):
            raise CommandError(f"{path / 'encoder.json'} is not GPT-2's encoder.json (a JSON object of ids)") from None
    missing = [w for w in words if w not in known]
    if missing:
        raise CommandError(f"the tokenizer {path} does not match the dictionary: {len(missing)} of its "
                           f"{len(words)} words are not among its symbols (e.g. {', '.join(map(repr, missing[:3]))}); "
                           "give the tokenizer the data was encoded with (--tokenizer)")


def model_config(model, cfg, name: str, causal: bool, kind: str, dtype: str) -> dict:
    """config.json: every hyperparameter the torch-only model needs, read from the loaded fairseq model (so an
    old checkpoint's upgrades, e.g. a SKI layer loading as --ski-lowrank sum, are what is written)."""
    import dataclasses
    from fairseq_tnn.models.config import compile_mode
    from fairseq_tnn.pretrained import FORMAT, FORMAT_VERSION
    m = cfg.model
    stack = model.decoder if causal else model.encoder
    tno = stack.layers[0].gtu.tno
    settings = dataclasses.asdict(tno.settings)
    if "ski_lowrank" in settings:
        settings["ski_lowrank"] = tno.lowrank
    settings = {k: (str(v) if not isinstance(v, (int, float, bool)) else v) for k, v in settings.items()}
    first = stack.layers[0]
    config = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "model_type": "causal" if causal else "masked",
        "arch": name,
        "embed_dim": stack.embed_tokens.embedding_dim,
        "layers": len(stack.layers),
        "expand_ratio": first.gtu.d1 // stack.embed_tokens.embedding_dim,
        "glu_dim": first.glu.out_proj.in_features,
        "gtu_activation": str(m.gtu_activation),
        "glu_activation": str(m.glu_activation),
        "norm_type": str(m.norm_type),
        "norm_position": str(m.norm_position),
        "dropout": float(m.dropout),
        "no_scale_embedding": bool(m.no_scale_embedding),
        "tno_type": tno.name,
        "tno": settings,
        "training_length": int(cfg.task.tokens_per_sample),
        "vocab_size": stack.embed_tokens.num_embeddings,
        "tokenizer": kind,
        "torch_dtype": dtype,
        # what the checkpoint was trained with, for the record (the exported model runs its layers eagerly)
        "trained_with": {"task": str(cfg.task._name), "sample_break_mode": str(cfg.task.sample_break_mode),
                         "tnn_compile": compile_mode(m)},
    }
    if causal:
        config["share_input_output_embed"] = stack.output_projection is None
    else:
        config["layernorm_embedding"] = stack.layernorm_embedding is not None
    return config


def export(args, prog: str) -> int:
    checkpoint = abs_path(args.checkpoint)
    dest = abs_path(args.dest)
    if not checkpoint.is_file():
        raise CommandError(f"checkpoint {args.checkpoint} is not a file")
    from fairseq_tnn.pretrained import check_destination
    try:
        check_destination(dest)
    except FileExistsError as e:
        raise CommandError(f"destination {e}") from None
    cfg, name, cls, rows = read_checkpoint(checkpoint)
    data = data_dir(cfg, args.data)

    import torch
    from fairseq import checkpoint_utils
    from fairseq.data import Dictionary
    from fairseq_tnn.models.tnn_lm import TnnLanguageModel
    from fairseq_tnn.pretrained import (CLASSES, CONFIG_FILE, FORMAT, VOCAB_FILE, WEIGHTS_FILE, TnnPretrained,
                                        Vocabulary, write_files)
    from fairseq_tnn.pretrained.safetensors import save_file
    from fairseq_tnn.pretrained.tokenizers import SPM_FILE, TOKENIZERS

    causal = cls is TnnLanguageModel
    # the dictionary as the task makes it (the masked task adds <mask>), checked before loading any weights
    dictionary = Dictionary.load(str(data / "dict.txt"))
    mask = dictionary.add_symbol("<mask>") if not causal else None
    specials = {dictionary.bos(), dictionary.pad(), dictionary.eos(), dictionary.unk()}
    if mask is not None:
        specials.add(mask)
    if rows != len(dictionary):
        raise CommandError(f"the checkpoint's embeddings have {rows} rows but {data / 'dict.txt'} gives "
                           f"{len(dictionary)} symbols{' with <mask>' if mask is not None else ''}: the dictionary "
                           "is not the one the model was trained with (--data names the data directory)")
    kind = tokenizer_kind(dictionary.symbols, specials)
    places, where = candidates(kind, args.tokenizer, data, cfg)
    tokenizer = find_tokenizer(kind, places, where, args.tokenizer is not None)
    spm_file = tokenizer if tokenizer.is_file() else tokenizer / SPM_FILE
    check_tokenizer(kind, spm_file if kind == "sentencepiece" else tokenizer, dictionary.symbols, specials)

    # as fairseq loads it, on the dictionary's directory; its layers eager (the check below runs the model)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data), "tnn_compile": False})
    model = models[0]
    vocab_dict = task.source_dictionary
    if list(vocab_dict.symbols) != list(dictionary.symbols):
        raise CommandError(f"the task's dictionary differs from {data / 'dict.txt'} read alone (an unexpected task "
                           f"{cfg.task._name})")
    weights = {k: v for k, v in model.state_dict().items() if not k.startswith("classification_heads.")}
    heads = sorted({k.split(".")[1] for k in model.state_dict() if k.startswith("classification_heads.")})
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in weights.values() if v.is_floating_point()})
    config = model_config(model, cfg, name, causal, kind, dtypes[0] if len(dtypes) == 1 else "mixed")
    vocab = Vocabulary(vocab_dict.symbols, vocab_dict.bos(), vocab_dict.pad(), vocab_dict.eos(), vocab_dict.unk(),
                       vocab_dict.index("<mask>") if not causal else None)
    tied = CLASSES[config["model_type"]].tied
    weights = {k: v.detach().cpu() for k, v in weights.items() if k not in tied}

    files = {CONFIG_FILE: lambda p: p.write_text(json.dumps(config, indent=2) + "\n"),
             VOCAB_FILE: lambda p: p.write_text(json.dumps(vocab.to_json(), ensure_ascii=False) + "\n",
                                                encoding="utf-8"),
             WEIGHTS_FILE: lambda p: save_file(weights, p, {"format": FORMAT, "source": checkpoint.name})}
    for fname in TOKENIZERS[kind].files:
        src = tokenizer if tokenizer.is_file() else tokenizer / fname
        files[fname] = lambda p, src=src: shutil.copyfile(src, p)
    dest.mkdir(parents=True, exist_ok=True)
    write_files(dest, files)
    # the export loads as written: the torch-only model's logits against the fairseq model's on a short input
    check = TnnPretrained.from_pretrained(dest)
    tokens = torch.tensor([[vocab.eos, *range(4, min(len(vocab), 36))]])
    with torch.no_grad():
        ours = check(tokens)
        model.eval()
        theirs = model(tokens)[0]
    err = ((ours - theirs).norm() / theirs.norm()).item()
    if not err < 1e-5:
        raise CommandError(f"the exported model's logits differ from the checkpoint's (relative {err:.2e}); {dest} is "
                           "not usable: please report this", code=1)
    say(prog, f"{checkpoint} ({name}, {config['model_type']}, {sum(v.numel() for v in weights.values()):,} weights, "
              f"{kind} tokenizer from {tokenizer}) -> {dest}: {', '.join(sorted(files))}; logits checked "
              f"(relative difference {err:.1e})")
    if heads:
        say(prog, f"not exported: the classification heads {', '.join(heads)} (the masked LM alone is)")
    return 0


def main(argv: List[str], prog: str) -> int:
    return run_main(prog, lambda: export(parse(argv, prog), prog))
