"""A clear message for a checkpoint that cannot be read.

fairseq reads every checkpoint through ``fairseq.checkpoint_utils.load_checkpoint_to_cpu``
(resuming in fairseq-train, loading in fairseq-eval-lm / fairseq-validate). A truncated or
corrupted file makes torch raise a low-level error ("failed finding central directory",
EOFError, ...). This wraps that one function so the error names the file and, when it is
in a checkpoint directory, the older checkpoints that can be passed to ``--restore-file``.
Nothing is written or deleted: the failed attempt leaves every checkpoint as it was.
"""
import functools
import glob
import os

from fairseq import checkpoint_utils


class CheckpointReadError(RuntimeError):
    pass


def older_checkpoints(path: str):
    """The other checkpoint files beside ``path``, newest first."""
    folder = os.path.dirname(os.path.abspath(path))
    others = [p for p in glob.glob(os.path.join(folder, "checkpoint*.pt")) if os.path.abspath(p) != os.path.abspath(path)]
    return sorted(others, key=os.path.getmtime, reverse=True)


def _wrap(load):
    if getattr(load, "_fairseq_tnn_wrapped", False):
        return load

    @functools.wraps(load)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        try:
            return load(path, *args, **kwargs)
        except (FileNotFoundError, KeyboardInterrupt, MemoryError):
            raise
        except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError, ... for a bad file
            message = (f"cannot read checkpoint {path} ({type(err).__name__}: {err}); the file is truncated or "
                       "corrupted (e.g. the run or the disk failed while it was written).")
            candidates = older_checkpoints(path)
            if candidates:
                message += (" To resume from an older checkpoint, pass it with --restore-file, e.g. --restore-file "
                            f"{candidates[0]} (others here: {', '.join(os.path.basename(c) for c in candidates[1:4]) or 'none'}).")
            raise CheckpointReadError(message) from err

    load_checkpoint_to_cpu._fairseq_tnn_wrapped = True
    return load_checkpoint_to_cpu


checkpoint_utils.load_checkpoint_to_cpu = _wrap(checkpoint_utils.load_checkpoint_to_cpu)
