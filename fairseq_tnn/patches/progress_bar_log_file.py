"""One ``--log-file`` handler however many progress bars (the ``progress-bar-log-file`` row of the table in
``__init__``)."""
import functools
import logging
import os

from fairseq.logging import progress_bar as progress_bar_module


def _has_file_handler(log: logging.Logger, path: str) -> bool:
    target = os.path.abspath(path)
    return any(isinstance(h, logging.FileHandler) and getattr(h, "baseFilename", None) == target
               for h in log.handlers)


def one_file_handler(original):
    """fairseq's ``progress_bar`` adds a new ``logging.FileHandler`` for ``--log-file`` to its module's
    logger every time it builds a progress bar (``fairseq_cli/train.py`` builds one per epoch), so epoch
    k's lines were written k times to the log file. This passes ``log_file`` on only when that logger has
    no handler for that file yet; everything else is fairseq's own function."""
    @functools.wraps(original)
    def progress_bar(iterator, log_format=None, log_interval=100, log_file=None, *args, **kwargs):
        if log_file is not None and _has_file_handler(progress_bar_module.logger, log_file):
            log_file = None  # already written to: a second handler would duplicate every line
        return original(iterator, log_format, log_interval, log_file, *args, **kwargs)

    return progress_bar
