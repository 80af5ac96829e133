"""The training batches of a run, the same whichever epoch a process starts in: a resumed run trains on exactly
the batches of the uninterrupted run, in every later epoch too.

fairseq 0.12 (``FairseqTask.get_batch_iterator``) makes the batches of a split once and keeps them for every later
epoch (its iterator is cached; ``rebuild_batches`` is off): which blocks go together is drawn, with the blocks'
order, under the seed ``seed + epoch`` of that first build, and each epoch then only shuffles the batches' order
(under ``seed + epoch``). An uninterrupted run builds them in epoch 1. A run resumed from a checkpoint of epoch
N > 1 built them in epoch N, from another draw (the causal task's ``MonolingualDataset.ordered_indices``
permutes the blocks under that seed): from the resume on it trained on other batches than the run it
continued. Here the batches of a cached iterator are always made as in epoch 1 (with epoch 1's seed under
``--update-ordered-indices-seed`` too); the iterator and the dataset are then set to the epoch asked for, and
the checkpoint's iterator state (epoch, batches done) goes on from there as in the uninterrupted run. Iterators
fairseq makes anew each epoch (sharded data, ``--update-epoch-batch-itr``, ``disable_iterator_cache``) are
left as fairseq makes them: their batches depend on their own epoch only.

Data-loading workers: with ``--num-workers`` > 0 fairseq keeps its workers for the whole run
(``persistent_workers``), each with the copy of the dataset it got when it started, so a later ``set_epoch``
never reaches them. The masked task's items depend on the epoch (``MaskTokensDataset`` draws each block's mask
from the seed, the epoch and the index): an uninterrupted run reused the masks of its first epoch in every
epoch, a resumed run those of the epoch it resumed in. For tasks whose items depend on the epoch
(``items_follow_epoch``) the workers start afresh each epoch, with the dataset at that epoch: the masks change
every epoch (the dynamic masking fairseq's masked LM means to do), the same with or without workers and
whichever epoch a run starts in.
"""
import inspect
import logging

from fairseq.tasks import FairseqTask

logger = logging.getLogger(__name__)

_SIGNATURE = inspect.signature(FairseqTask.get_batch_iterator)


class ResumableBatchesMixin:
    """Mix into a FairseqTask (before the fairseq base class)."""

    # whether the task's dataset items depend on the epoch (set_epoch), so that data-loading workers must see it
    items_follow_epoch = False

    def get_batch_iterator(self, dataset, *args, **kwargs):
        call = _SIGNATURE.bind(self, dataset, *args, **kwargs)
        call.apply_defaults()
        options = dict(call.arguments)
        del options["self"]
        epoch = options["epoch"]
        cached = (not options["disable_iterator_cache"] and not options["update_epoch_batch_itr"]
                  and not getattr(self.cfg, "rebuild_batches", False) and self.can_reuse_epoch_itr(dataset))
        if not cached or epoch <= 1 or dataset in self.dataset_to_epoch_iter:
            iterator = super().get_batch_iterator(**options)
        else:
            seed = getattr(self.cfg or self.args, "seed")  # the run's --seed (a legacy task has args, no cfg)
            if options["seed"] == seed + epoch:  # the trainer's --update-ordered-indices-seed
                options["seed"] = seed + 1
            logger.info(f"making the batches of epoch {epoch} as in epoch 1, as an uninterrupted run has them")
            iterator = super().get_batch_iterator(**{**options, "epoch": 1})
            # the run is in `epoch`: fairseq's checkpoint loader moves the iterator to the batch it stopped at
            iterator.epoch = epoch
            dataset.set_epoch(epoch)
        if self.items_follow_epoch and getattr(iterator, "persistent_workers", False):
            iterator.persistent_workers = False
        return iterator
