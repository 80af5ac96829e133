"""Every file of a checkpoint save is replaced whole or not at all (the ``atomic-checkpoint-copies`` and
``durable-checkpoint-write`` rows of the table in ``__init__``).

fairseq 0.12's ``checkpoint_utils.save_checkpoint`` writes the first file of a save with
``torch_persistent_save`` (to ``<file>.tmp``, renamed over ``<file>``) and then copies it to the save's other
names (``checkpoint_best.pt``, ``checkpoint_last.pt``, ...) with ``PathManager.copy``, which is
``shutil.copyfile``: it truncates the destination, then writes it. A run killed during that copy (a
preemption, a node failure, a full disk; about a second for a Wikitext-103 checkpoint with its optimizer state,
more on a network filesystem) left ``checkpoint_last.pt`` cut, and the automatic resume of a requeued job or of
``RESUME=1`` stopped at it. Neither step synced the data to the disk, so a crash of the machine soon after a
save could also leave a renamed file without its contents.

Here every file of a save is written to ``<file>.tmp`` in its own directory, synced to the disk (``fsync``),
renamed over ``<file>`` (``os.replace``: atomic on a POSIX filesystem), and the directory is synced so that the
rename itself survives a crash. At every instant each file of the save is the previous one or the new one,
whole; a kill leaves at most a ``.tmp`` file beside it, which the next save replaces. Paths that fairseq hands
to iopath (remote storage; iopath is not installed with the plugin) and ``--write-checkpoints-asynchronously``
keep fairseq's own code.
"""
import functools
import os
import shutil


def sync_directory(folder: str):
    """fsync a directory, so that the renames in it are on the disk (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_whole(path: str, write):
    """Make ``path`` by ``write(tmp)`` (which writes the file ``tmp``) at ``<path>.tmp``, sync it to the disk and
    rename it over ``path``; the temporary file is removed when ``write`` fails."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, path)
    sync_directory(os.path.dirname(os.path.abspath(path)))


def path_manager(original):
    """fairseq's ``PathManager`` as ``checkpoint_utils`` uses it, with ``copy`` of a local file replacing the
    destination whole (:func:`replace_whole`) instead of truncating and rewriting it."""

    class PathManager(original):
        @staticmethod
        def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
            if original.path_requires_pathmanager(src_path) or original.path_requires_pathmanager(dst_path):
                return original.copy(src_path, dst_path, overwrite)
            if not overwrite and os.path.lexists(dst_path):
                raise FileExistsError(f"cannot copy {src_path} to {dst_path}: it exists (overwrite=False)")
            replace_whole(dst_path, functools.partial(shutil.copyfile, src_path))
            return True

    PathManager.__qualname__ = PathManager.__name__ = original.__name__
    PathManager.__doc__ = original.__doc__
    return PathManager


def persistent_save(original):
    """fairseq's ``torch_persistent_save`` with the written file synced to the disk before it replaces the old one
    (:func:`replace_whole`); fairseq's ``_torch_persistent_save`` (torch.save, retried) writes it."""
    from fairseq import checkpoint_utils

    @functools.wraps(original)
    def torch_persistent_save(obj, filename, async_write: bool = False):
        if async_write or checkpoint_utils.PathManager.path_requires_pathmanager(filename):
            return original(obj, filename, async_write)

        def write(tmp):
            with open(tmp, "wb") as f:
                checkpoint_utils._torch_persistent_save(obj, f)

        replace_whole(filename, write)

    return torch_persistent_save
