"""A fix of fairseq (:class:`Patch`) and how it is checked against the installed fairseq (:func:`fingerprint`)."""
import dataclasses
import hashlib
import importlib
import inspect
import logging
import textwrap
from typing import Any, Callable, Optional

import numpy
import torch

logger = logging.getLogger("fairseq_tnn.patches")

MARK = "fairseq_tnn_patch"  # attribute of every object install() binds: the name of its patch
ORIGINAL = "fairseq_tnn_original"  # ... and the fairseq object it replaced


def fingerprint(obj) -> str:
    """The first 16 hex digits of the sha256 of ``obj``'s source, dedented, with trailing spaces and
    blank lines dropped (so re-indenting or blank lines do not count; any other edit does)."""
    lines = textwrap.dedent(inspect.getsource(obj)).splitlines()
    text = "\n".join(line.rstrip() for line in lines if line.strip())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def owner_and_name(path: str):
    """``"fairseq.module:Class.attr"`` -> (the object holding ``attr``, ``"attr"``)."""
    module, _, qualname = path.partition(":")
    *parents, name = qualname.split(".")
    owner = importlib.import_module(module)
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def replacements(obj):
    """The patches' replacements stacked on one fairseq object, outermost first (``obj`` itself, if a patch bound
    it, then the one it wrapped ...), and beneath them fairseq's original as the last item."""
    while getattr(obj, MARK, None):
        yield obj
        obj = getattr(obj, ORIGINAL)
    yield obj


_OWNERS = {}  # path -> owner_and_name(path): modules and classes stay, what they hold is read at each call


def bound(path: str, patch: str) -> bool:
    """Whether the patch named ``patch`` has replaced the object at ``"module:qualname"`` (among any stacked there)."""
    held = _OWNERS.get(path)
    if held is None:
        held = _OWNERS[path] = owner_and_name(path)
    owner, name = held
    return any(getattr(obj, MARK, None) == patch for obj in replacements(getattr(owner, name, None)))


def resolve(path: str):
    """The object at ``"module:qualname"``; for one patches replaced, fairseq's original (a classmethod's
    function), however many patches are stacked on it."""
    owner, name = owner_and_name(path)
    *_, obj = replacements(getattr(owner, name))
    return obj.__func__ if isinstance(obj, classmethod) else obj


def _mark(new, patch: str, original) -> None:
    """Label ``new`` as ``patch``'s replacement of ``original``; a classmethod's function too, which is what its
    class hands out (a bound method reads its attributes from its function)."""
    for obj in (new, new.__func__) if isinstance(new, classmethod) else (new,):
        setattr(obj, MARK, patch)
        setattr(obj, ORIGINAL, original)


def _version(package: str) -> str:
    return getattr(importlib.import_module(package), "__version__", "unknown")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One fix of fairseq.

    ``checks``: the fairseq code (``"module:qualname"``) the fix was written against; ``fingerprint``: its
    :func:`fingerprint` in the fairseq release named in ``versions``. ``replaces``: what install() rebinds
    to ``replacement(original)`` (two fixes of one object stack, the later one wrapping the earlier);
    ``None`` for a fix that rebinds nothing of fairseq's, whose ``action`` then does it (idempotent itself).
    ``on_mismatch``: ``"skip"`` (fairseq's own code keeps running) or ``"apply"`` (the fix does not depend on
    the code it checks). ``needed``: False where the fix has nothing to do (e.g. numpy < 2 still has the alias).
    """
    name: str
    why: str
    versions: str
    checks: str
    fingerprint: str
    on_mismatch: str
    replaces: Optional[str] = None
    replacement: Optional[Callable[[Any], Any]] = None
    action: Optional[Callable[[], None]] = None
    needed: Callable[[], bool] = lambda: True

    def __post_init__(self):
        if self.on_mismatch not in ("skip", "apply"):
            raise ValueError(f"patch {self.name}: on_mismatch={self.on_mismatch!r}; allowed: 'skip', 'apply'")
        rebinds = self.replaces is not None and self.replacement is not None and self.action is None
        acts = self.replaces is None and self.replacement is None and self.action is not None
        if not (rebinds or acts):
            raise ValueError(f"patch {self.name}: give replaces with replacement, or action alone")

    def installed(self) -> bool:
        if self.replaces is None:
            return False  # an action is idempotent: installing it again changes nothing
        return bound(self.replaces, self.name)

    def install(self) -> str:
        """Check and apply this fix; returns what happened: "installed", "already installed", "not needed",
        "skipped" (the code differs and on_mismatch is "skip", or it is missing) or "installed despite a
        mismatch"."""
        if not self.needed():
            return "not needed"
        if self.installed():
            return "already installed"
        try:
            found = fingerprint(resolve(self.checks))
        except (ImportError, AttributeError, OSError, TypeError) as err:
            logger.warning("fairseq_tnn patch %s not installed: cannot read %s (%s: %s); it was written for %s",
                           self.name, self.checks, type(err).__name__, err, self.versions)
            return "skipped"
        mismatch = found != self.fingerprint
        if mismatch:
            logger.warning(
                "fairseq_tnn patch %s: %s is not the code it was written for (source fingerprint %s, expected %s; "
                "written for %s; installed: fairseq %s, torch %s, numpy %s); %s", self.name, self.checks, found,
                self.fingerprint, self.versions, _version("fairseq"), torch.__version__, numpy.__version__,
                "not installed: fairseq's own code runs" if self.on_mismatch == "skip" else "installed anyway")
            if self.on_mismatch == "skip":
                return "skipped"
        if self.replaces is None:
            self.action()
        else:
            owner, name = owner_and_name(self.replaces)
            original = inspect.getattr_static(owner, name)  # a classmethod as the class holds it, not bound
            new = self.replacement(original)
            _mark(new, self.name, original)
            setattr(owner, name, new)
        return "installed despite a mismatch" if mismatch else "installed"
