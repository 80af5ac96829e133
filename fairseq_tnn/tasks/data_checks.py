"""Checks on a binarised split before a task uses it, so that bad data stops with a
clear message instead of a crash deep in a stack trace or a silently wrong number.

- an empty split is an error;
- token ids beyond the dictionary (data binarised with another dict.txt) are an error;
- with a sentence-respecting ``--sample-break-mode`` (complete, complete_doc, eos), a line
  longer than one block is an error when ``check_line_length`` is set (fairseq would turn
  it into one oversized block, drop it from training with a warning and abort validation
  unless told to skip it); the masked LM task instead drops such blocks by default and
  counts them (``tnn_masked_lm.py``);
- a split shorter than one block is fine: it is one short block, scored in full.
"""
import os

import numpy as np
from fairseq import utils
from fairseq.data import data_utils


def split_path(data: str, split: str, epoch: int = 1) -> str:
    paths = utils.split_paths(data)
    return os.path.join(paths[(epoch - 1) % len(paths)], split)


def check_tokens_per_sample(value: int, minimum: int = 1):
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"--tokens-per-sample={value!r} is invalid: must be an integer >= {minimum}")


def check_split(path: str, dictionary, tokens_per_sample: int, break_mode: str, reserved: int = 0,
                check_line_length: bool = True, hint: str = ""):
    """Validate the binarised split at ``path`` (no extension). ``reserved``: tokens the
    task adds to each block (1 for the masked LM's <s>). ``check_line_length``: refuse a line
    longer than a block in the sentence-respecting break modes; ``hint``: more advice for its
    message."""
    empty = ValueError(f"the split {path}.bin is empty: it has no tokens; re-run fairseq-preprocess on a non-empty "
                       "text file or remove the split from --valid-subset / --gen-subset")
    # fairseq cannot even open an empty .bin (numpy refuses to mmap it): check its size first
    if os.path.isfile(path + ".bin") and os.path.getsize(path + ".bin") == 0:
        raise empty
    dataset = data_utils.load_indexed_dataset(path, None)
    if dataset is None:
        raise FileNotFoundError(f"dataset not found: {path}.bin / {path}.idx (run fairseq-preprocess first)")
    if len(dataset) == 0 or int(dataset.sizes.sum()) == 0:
        raise empty
    buffer = getattr(dataset, "_bin_buffer", None)
    index = getattr(dataset, "_index", None)
    if buffer is not None and index is not None:
        top = int(np.frombuffer(buffer, dtype=index.dtype).max())
        if top >= len(dictionary):
            raise ValueError(
                f"{path}.bin holds token id {top} but the dictionary has only {len(dictionary)} symbols: the data "
                "was binarised with a different dict.txt; binarise it with this dictionary (fairseq-preprocess "
                "--srcdict) or use the data-bin it came with")
    if check_line_length and break_mode in ("complete", "complete_doc", "eos"):
        limit = tokens_per_sample - reserved
        longest = int(dataset.sizes.max())
        if longest > limit:
            line = int(np.argmax(dataset.sizes)) + 1
            raise ValueError(
                f"--tokens-per-sample={tokens_per_sample} is too small for --sample-break-mode {break_mode}: line {line} "
                f"of {path} has {longest} tokens (eos included) and a block holds at most {limit}; raise "
                f"--tokens-per-sample to at least {longest + reserved}, or use --sample-break-mode none"
                + hint)
    return dataset
