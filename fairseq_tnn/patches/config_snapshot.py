"""fairseq's Trainer reading its config from plain attributes during an update (the ``config-snapshot`` rows of the
table in ``__init__``).

``Trainer.train_step`` and the methods it calls read the run's config, an OmegaConf ``DictConfig``, some 40 times an
update (``self.cfg.common.fp16``, ``self.cfg.optimization.clip_norm``, ``data_parallel_world_size`` ...), and each
attribute of a ``DictConfig`` goes through OmegaConf's node lookup, interpolation and validation: about 7 microseconds,
0.47 ms of a small model's update on the CI machine (``benchmarks/trainer_calls.py``, the config row), time in which a
GPU that has finished the previous update's kernels waits for the next.

During ``train_step`` the Trainer's ``cfg`` is a :class:`ConfigSnapshot` of it (and its learning-rate scheduler's
``cfg``, which ``step_update`` reads at every update, one of its own): the same values, resolved once, read as
plain attributes; a key it does not hold (a missing value, a key the config does not have) and any method (``get``,
``keys`` ...) is read from the config itself, as before. The snapshot is taken at the first update after the
optimizer and learning-rate scheduler exist (they are built from the config object itself) and kept while the
Trainer's config is the same object; fairseq changes no value of a Trainer's config after building it. A save during
the update (fairseq's ``crash.pt``, when an update fails) stores the config itself: ``Trainer.state_dict`` sees the
real one (the second row). Everything the update computes is unchanged (tests/reliability/test_config_snapshot.py).
"""
from omegaconf import DictConfig, OmegaConf

SNAPSHOT = "fairseq_tnn_config_snapshot"  # the Trainer's attribute that keeps its snapshot between updates


class ConfigSnapshot:
    """A read-only view of a ``DictConfig`` (``source``): each of its keys with a value, resolved, as an attribute, a
    nested ``DictConfig`` as a snapshot of its own; anything else is read from ``source``."""

    __slots__ = ("source", "_values")

    def __init__(self, source: DictConfig):
        values = {}
        for key in source.keys():
            if OmegaConf.is_missing(source, key):
                continue  # read from the source, which says it is missing
            value = source[key]
            values[key] = ConfigSnapshot(value) if isinstance(value, DictConfig) else value
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name):
        try:
            return self._values[name]
        except KeyError:
            return getattr(self.source, name)

    def __getitem__(self, key):
        try:
            return self._values[key]
        except KeyError:
            return self.source[key]

    def __contains__(self, key) -> bool:
        return key in self._values or key in self.source

    def __setattr__(self, name, value):
        raise AttributeError(f"a snapshot of the Trainer's config is read-only (set {name} on trainer.cfg between "
                             "updates)")

    def __repr__(self) -> str:
        return f"ConfigSnapshot({self.source!r})"


def _snapshot_of(owner, cfg: DictConfig) -> ConfigSnapshot:
    """The snapshot of ``cfg`` that ``owner`` keeps between updates, taken anew where its config is another object."""
    snapshot = owner.__dict__.get(SNAPSHOT)
    if snapshot is None or snapshot.source is not cfg:
        snapshot = ConfigSnapshot(cfg)
        owner.__dict__[SNAPSHOT] = snapshot
    return snapshot


def read(owner):
    """What to read ``owner``'s config from outside its update too (the Trainer's, between updates): the snapshot it
    keeps where that is of its config as it is now, else its config."""
    cfg = owner.__dict__.get("cfg")
    snapshot = owner.__dict__.get(SNAPSHOT)
    return snapshot if snapshot is not None and snapshot.source is cfg else cfg


def train_step(original):
    def train_step(self, samples, raise_oom=False):
        cfg = self.__dict__.get("cfg")
        if not isinstance(cfg, DictConfig) or self._optimizer is None or self._lr_scheduler is None:
            return original(self, samples, raise_oom)  # a snapshot already (a retry after OOM), or still building
        scheduler = self._lr_scheduler
        scheduler_cfg = scheduler.__dict__.get("cfg")
        self.cfg = _snapshot_of(self, cfg)
        if isinstance(scheduler_cfg, DictConfig):  # its step_update reads it at every update
            scheduler.cfg = _snapshot_of(scheduler, scheduler_cfg)
        try:
            return original(self, samples, raise_oom)
        finally:
            self.cfg = cfg
            if isinstance(scheduler_cfg, DictConfig):
                scheduler.cfg = scheduler_cfg

    return train_step


def state_dict(original):
    def state_dict(self):
        cfg = self.__dict__.get("cfg")
        if not isinstance(cfg, ConfigSnapshot):
            return original(self)
        self.cfg = cfg.source  # a checkpoint holds the config, not the snapshot
        try:
            return original(self)
        finally:
            self.cfg = cfg

    return state_dict
