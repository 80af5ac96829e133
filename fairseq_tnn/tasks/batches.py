"""The training batches of a run, the same whichever epoch a process starts in: a resumed run trains on exactly
the batches of the uninterrupted run, in every later epoch too.

fairseq 0.12 (``FairseqTask.get_batch_iterator``) makes the batches of a split once and keeps them for every later
epoch (the iterator is cached; ``rebuild_batches`` is off): which blocks go together is drawn with the blocks'
order under the seed ``seed + epoch`` of that first build, and each epoch only shuffles the batches' order (under
``seed + epoch``). An uninterrupted run builds them in epoch 1. A run resumed from a checkpoint of epoch N > 1
built them in epoch N, from another draw: the causal task's blocks (``MonolingualDataset.ordered_indices``
permutes them under that seed) went into other batches, and from the resume on the run trained on other data
than the run it continued. Here a cached iterator's batches are always made as in epoch 1, with the seed
that epoch gets; the iterator and the dataset then start in the epoch asked for, so the checkpoint's iterator
state (epoch, batches done) picks up where the uninterrupted run was. Iterators fairseq makes anew each epoch
(sharded data, ``--update-epoch-batch-itr``, ``disable_iterator_cache``) are made as fairseq makes them: their
batches already depend on the epoch alone.

Data-loading workers: with ``--num-workers`` > 0 fairseq keeps its workers across epochs (``persistent_workers``),
each holding the copy of the dataset it got when it started, so a dataset's ``set_epoch`` in the trainer never
reaches them. The masked task's items depend on the epoch (``MaskTokensDataset`` draws each block's mask from
the seed, the epoch and the index): an uninterrupted run kept the masks of its first epoch in every epoch, a
resumed run those of the epoch it resumed in. Tasks whose items depend on the epoch (``items_follow_epoch``)
therefore get workers that start afresh each epoch, with the dataset at that epoch: the masks change every
epoch (RoBERTa's dynamic masking, what fairseq's masked LM means to do), and the same whichever epoch a run
starts in.
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
            iterator.epoch = epoch
            dataset.set_epoch(epoch)
        if self.items_follow_epoch and iterator.persistent_workers:
            iterator.persistent_workers = False
        return iterator
