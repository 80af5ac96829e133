"""The plugin's fixes of fairseq 0.12: one module each, and the table of them, :data:`PATCHES`, that
:func:`install` walks.

:func:`install` runs when the plugin registers its models and tasks with fairseq
(``fairseq_tnn.plugin.register``: ``--user-dir``, importing ``fairseq_tnn.models`` / ``.tasks``, or
``fairseq_tnn.register()``); importing the package ``fairseq_tnn``, its ops or its modules changes nothing.
Each row (a :class:`~.base.Patch`) names the fairseq code the fix was written against and that code's
fingerprint (a sha256 of its source). Before a fix rebinds anything, the fingerprint of the installed code is
checked; when it differs (another fairseq release, a fairseq that fixed the bug itself) a warning names the fix,
the code and both fingerprints, and the fix is skipped or still applied, as its ``on_mismatch`` says. Installing
again changes nothing. Each fix's module says why in full; tests/reliability/test_patches.py checks the
fingerprints against the installed fairseq.
"""
from . import (atomic_save, bf16, broadcast_unpickle, checkpoint_loader, config_snapshot, destroy_group_at_end,
               device_overflow, fp16_syncs, masked_positions, multi_tensor_optim, numpy2_compat_long, packed_state,
               progress_bar_log_file, seed, stop_prefetch_at_exit, update_stats)
from .base import Patch

FAIRSEQ = "fairseq 0.12.3.1 (fairseq-fixed)"

PATCHES = (
    Patch(
        name="broadcast-unpickle",
        why="resuming a multi-process run with torch >= 2.6: fairseq's receiving ranks torch.load the broadcast "
            "checkpoint with weights_only=True and refuse its OmegaConf config; they unpickle what their own "
            "job's rank sent with weights_only=False",
        versions=f"{FAIRSEQ}; torch >= 2.6; any numpy",
        checks="fairseq.distributed.utils:_broadcast_object_slow",
        fingerprint="d76415381eb2472c",
        on_mismatch="skip",
        replaces="fairseq.distributed.utils:_broadcast_object_slow",
        replacement=lambda original: broadcast_unpickle.broadcast_object_slow,
    ),
    Patch(
        name="checkpoint-loader",
        why="old-style checkpoints (an argparse.Namespace config) load with torch >= 2.6, with Namespace "
            "allowed during fairseq's checkpoint loads only; a checkpoint torch.load cannot read is named, with "
            "the older ones to --restore-file from, and one whose object weights_only refuses, with that object "
            "and what the user can do",
        versions=f"{FAIRSEQ}; torch >= 2.6 (Namespace, refused objects), any torch (damaged files); any numpy",
        checks="fairseq.checkpoint_utils:load_checkpoint_to_cpu",
        fingerprint="58ce6e637a5284ee",
        on_mismatch="apply",  # it only wraps the call: any loader still gets the allowlist and the clear error
        replaces="fairseq.checkpoint_utils:load_checkpoint_to_cpu",
        replacement=checkpoint_loader.checkpoint_loader,
    ),
    Patch(
        name="resume-from-readable",
        why="fairseq-train resuming from checkpoint_last.pt stops when that file is unreadable and starts from "
            "update 0 when it is missing beside older checkpoints; it resumes from the newest readable one, "
            "with a warning, and stops naming every file only when none can be read",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.checkpoint_utils:load_checkpoint",
        fingerprint="fa5f56e0443af37c",
        on_mismatch="skip",  # it relies on how load_checkpoint picks checkpoint_last.pt and --restore-file
        replaces="fairseq.checkpoint_utils:load_checkpoint",
        replacement=checkpoint_loader.resume_from_readable,
    ),
    Patch(
        name="checkpoint-key-order",
        why="which layout of the parameters a checkpoint's optimizer state was written in (before the RPEs' weights "
            "were packed, before the layers' Linears were fused, as now) shows in the order of its model's keys, "
            "which load_checkpoint drops once the model has them; it is noted as the model loads, for "
            "packed-optimizer-state",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.trainer:Trainer.load_checkpoint",
        fingerprint="1c5a8a47fa41ef04",
        on_mismatch="apply",  # it only notes the keys of what the model loads, whatever loads it
        replaces="fairseq.trainer:Trainer.load_checkpoint",
        replacement=packed_state.record_key_order,
    ),
    Patch(
        name="packed-optimizer-state",
        why="a checkpoint written before the RPEs' weights were packed or the layers' Linears fused (fairseq_tnn "
            "2026-11-28) keeps an optimizer state per weight where fairseq's state is per parameter tensor, which torch "
            "refuses to load into the packed model, and a flat state (--fp16, --bf16 on a GPU) in another order of the "
            "weights where an RPE has LayerNorms, which torch loads misaligned; the state is handed to the optimizer in "
            "the model's layout, found by the weights' names",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.trainer:Trainer._build_optimizer",
        fingerprint="a2c97f3400ed3161",
        on_mismatch="apply",  # it only wraps the built optimizer's load_state_dict, whatever builds it
        replaces="fairseq.trainer:Trainer._build_optimizer",
        replacement=packed_state.build_optimizer,
    ),
    Patch(
        name="atomic-checkpoint-copies",
        why="save_checkpoint copies the first file of a save to checkpoint_best.pt, checkpoint_last.pt, ... with "
            "shutil.copyfile, which truncates the destination first: a kill during the copy left a cut "
            "checkpoint_last.pt; each copy goes to <file>.tmp, is fsynced and renamed over the file",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.checkpoint_utils:save_checkpoint",
        fingerprint="646286c29c92fe30",
        on_mismatch="apply",  # an atomic copy is still a copy, whatever the code that asks for it
        replaces="fairseq.checkpoint_utils:PathManager",
        replacement=atomic_save.path_manager,
    ),
    Patch(
        name="durable-checkpoint-write",
        why="torch_persistent_save renames <file>.tmp over the file without syncing it to the disk: after a crash "
            "of the machine the renamed file could be empty; it is fsynced before the rename, the directory after",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.checkpoint_utils:torch_persistent_save",
        fingerprint="a257ae8ee1c78765",
        on_mismatch="skip",
        replaces="fairseq.checkpoint_utils:torch_persistent_save",
        replacement=atomic_save.persistent_save,
    ),
    Patch(
        name="progress-bar-log-file",
        why="fairseq adds a --log-file handler per progress bar (one per epoch), writing epoch k's lines k "
            "times; the file gets one handler",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.logging.progress_bar:progress_bar",
        fingerprint="607974d1f80a77ab",
        on_mismatch="skip",
        replaces="fairseq.logging.progress_bar:progress_bar",
        replacement=progress_bar_log_file.one_file_handler,
    ),
    Patch(
        name="numpy2-compat-long",
        why="TokenBlockDataset's eos block index (every prompt, --sample-break-mode eos) uses np.compat.long, "
            "which numpy 2 removed; that one module's np is numpy plus the alias",
        versions=f"{FAIRSEQ}; any torch; numpy >= 2",
        checks="fairseq.data.token_block_dataset:TokenBlockDataset._build_slice_indices",
        fingerprint="4fc566fde3f632fe",
        on_mismatch="apply",  # numpy plus one alias changes nothing for code that no longer uses it
        replaces="fairseq.data.token_block_dataset:np",
        replacement=lambda original: numpy2_compat_long.NUMPY_FOR_TOKEN_BLOCK,
        needed=numpy2_compat_long.needed,
    ),
    Patch(
        name="stop-prefetch-at-exit",
        why="a data-prefetch thread still running at interpreter exit can abort the finished process (exit "
            "134); an atexit handler stops and drains each one",
        versions=f"{FAIRSEQ}; torch 2.x (seen with 2.13); any numpy",
        checks="fairseq.data.iterators:BackgroundConsumer",
        fingerprint="d67f79570225f44d",
        on_mismatch="skip",
        action=stop_prefetch_at_exit.register_at_exit,
    ),
    Patch(
        name="destroy-process-group",
        why="a rank that ends with its process groups' threads running can abort after training finished (gloo: "
            "\"terminate called without an active exception\", exit 134, a worker thread releasing a tensor while the "
            "interpreter finalizes); torch.distributed.nn is imported before the groups exist, and once fairseq's "
            "distributed_main has returned they are destroyed and their last references dropped",
        versions=f"{FAIRSEQ}; torch 2.x (seen with 2.13); any numpy",
        checks="fairseq.distributed.utils:distributed_main",
        fingerprint="ad315b6ea96a8647",
        on_mismatch="apply",  # it runs fairseq's function whole, then destroys what that leaves
        replaces="fairseq.distributed.utils:distributed_main",
        replacement=lambda original: destroy_group_at_end.distributed_main,
    ),
    Patch(
        name="fp16-grads-sync",
        why="--fp16 with flat master weights: the gradients' copy into the fp32 master copy as one "
            "torch._foreach_copy_ per device instead of one copy per parameter (the same values; host-bound GPU "
            "training)",
        versions=f"{FAIRSEQ}; torch >= 2.1 (_foreach_copy_); any numpy",
        checks="fairseq.optim.fp16_optimizer:_FP16OptimizerMixin._sync_fp16_grads_to_fp32",
        fingerprint="d36b84abf6260889",
        on_mismatch="skip",
        replaces="fairseq.optim.fp16_optimizer:_FP16OptimizerMixin._sync_fp16_grads_to_fp32",
        replacement=fp16_syncs.grads_sync,
    ),
    Patch(
        name="fp16-params-sync",
        why="--fp16 with flat master weights: the master weights' copy back into the fp16 model as one "
            "torch._foreach_copy_ per device instead of one copy per parameter (the same values)",
        versions=f"{FAIRSEQ}; torch >= 2.1 (_foreach_copy_); any numpy",
        checks="fairseq.optim.fp16_optimizer:_FP16OptimizerMixin._sync_fp32_params_to_fp16",
        fingerprint="015196491a1f430a",
        on_mismatch="skip",
        replaces="fairseq.optim.fp16_optimizer:_FP16OptimizerMixin._sync_fp32_params_to_fp16",
        replacement=fp16_syncs.params_sync,
    ),
    Patch(
        name="bf16-without-tpu",
        why="fairseq reads --bf16 as TPU training (it turns --tpu on, and the Trainer then fails asking torch_xla for "
            "a device); where torch_xla is not installed and --tpu is not on the command line, --bf16 trains on the "
            "GPU (or with --cpu the CPU): bf16 weights, an fp32 master copy and no loss scaler, fairseq's own bf16 "
            "path off a TPU",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.distributed.utils:call_main",
        fingerprint="0a9dd5c754d11bdb",
        on_mismatch="apply",  # it only changes the config before the launch reads it
        replaces="fairseq.distributed.utils:call_main",
        replacement=bf16.call_main,
    ),
    Patch(
        name="bf16-flat-master",
        why="--bf16 on CUDA: FP16Optimizer's fp32 master copy flat, as --fp16 keeps it (fairseq keeps bf16's per "
            "parameter, which suits a TPU), so the gradients' sync, the clipping and Adam's step each see one tensor",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.optim.fp16_optimizer:FP16Optimizer.build_optimizer",
        fingerprint="0d0165c79a35435a",
        on_mismatch="skip",
        replaces="fairseq.optim.fp16_optimizer:FP16Optimizer.build_optimizer",
        replacement=bf16.build_optimizer,
    ),
    Patch(
        name="fused-adam",
        why="--optimizer adam without apex: fairseq's Adam step as torch's fused multi-tensor Adam kernel (eps "
            "rescaled to fairseq's placement; the weight decay one _foreach_add_) instead of about 9 operations per "
            "parameter; the same update up to rounding, the same optimizer state; amsgrad and 16-bit weights keep "
            "fairseq's loop",
        versions=f"{FAIRSEQ}; torch >= 2.4 (_fused_adam_ on CPU and CUDA); any numpy",
        checks="fairseq.optim.adam:Adam.step",
        fingerprint="f4ad1267d83ca12f",
        on_mismatch="skip",
        replaces="fairseq.optim.adam:Adam.step",
        replacement=multi_tensor_optim.adam_step,
    ),
    Patch(
        name="foreach-grad-norm",
        why="gradient clipping of several gradients without apex: their total norm by one torch._foreach_norm per "
            "device instead of one norm and one copy per gradient (fp32 accumulation, as fairseq's)",
        versions=f"{FAIRSEQ}; torch >= 2.1 (_foreach_norm with dtype); any numpy",
        checks="fairseq.utils:clip_grad_norm_",
        fingerprint="b3446e45e8864b7c",
        on_mismatch="skip",
        replaces="fairseq.utils:clip_grad_norm_",
        replacement=multi_tensor_optim.clip_grad_norm,
    ),
    Patch(
        name="direct-seed",
        why="the Trainer's seed at every update seeds the CPU's and CUDA's generators directly instead of through "
            "torch.manual_seed, which also formats the Python stack for each backend not initialised (0.5-0.8 ms of "
            "host time per update on an H200); the same random numbers, and fairseq's own seed wherever another "
            "backend could draw them",
        versions=f"{FAIRSEQ}; torch 2.x; any numpy",
        checks="fairseq.trainer:Trainer._set_seed",
        fingerprint="a99d5dc2b2da10c1",
        on_mismatch="skip",
        replaces="fairseq.trainer:Trainer._set_seed",
        replacement=seed.set_seed,
    ),
    Patch(
        name="masked-lm-positions",
        why="the masked_lm criterion finds the masked tokens on the device (boolean-mask indexing in the criterion "
            "and in the model, forward and backward, a tensor sample size read by the Trainer and its meters): 10 "
            "waits of the host for a GPU an update; with a batch that names its masked positions (tnn_masked_lm's) "
            "and a model that takes them, it scores those positions and its sample size is their number (the same "
            "loss and gradients)",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.criterions.masked_lm:MaskedLmLoss.forward",
        fingerprint="62b8c4994a62ad2c",
        on_mismatch="skip",
        replaces="fairseq.criterions.masked_lm:MaskedLmLoss.forward",
        replacement=masked_positions.criterion_forward,
    ),
    Patch(
        name="update-stats-without-reads",
        why="after the optimizer step train_step logs the update with two reads of device values (isfinite of a "
            "gradient norm it has already checked, and the returned metrics' .item()), on a GPU each a wait for "
            "the optimizer's kernels; the norm is logged as it is and the metrics are returned as a mapping read "
            "when first looked into (fairseq-train only asks whether there is one): the same logs",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.trainer:Trainer._reduce_and_log_stats",
        fingerprint="d7245734c06fca26",
        on_mismatch="skip",  # it relies on train_step calling it with a gradient norm only once the norm is finite
        replaces="fairseq.trainer:Trainer._reduce_and_log_stats",
        replacement=update_stats.reduce_and_log_stats,
    ),
    Patch(
        name="config-snapshot",
        why="the Trainer reads its OmegaConf config some 40 times an update, at about 7 microseconds a read; during "
            "train_step its cfg is a read-only snapshot of the same values read as plain attributes (0.47 ms of a "
            "small model's update on the CI machine), anything the snapshot does not hold read from the config",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.trainer:Trainer.train_step",
        fingerprint="7f333d0bca617fa1",
        on_mismatch="skip",  # it relies on train_step building nothing from the whole config once the optimizer exists
        replaces="fairseq.trainer:Trainer.train_step",
        replacement=config_snapshot.train_step,
    ),
    Patch(
        name="config-snapshot-saves-the-config",
        why="a checkpoint saved during an update (fairseq's crash.pt) holds the Trainer's config itself, not the "
            "config-snapshot row's snapshot",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.trainer:Trainer.state_dict",
        fingerprint="5a784fb31d5f0ab1",
        on_mismatch="apply",  # it only hands the state_dict the config itself
        replaces="fairseq.trainer:Trainer.state_dict",
        replacement=config_snapshot.state_dict,
    ),
    Patch(
        name="fp16-overflow-on-device",
        why="--fp16 waits for the GPU after every backward: fairseq compares the gradient norm with the clipping "
            "threshold and checks it for an overflow on the host (4 reads), and the GPU then idles while the host "
            "launches the step, counts the update and prepares the next; the comparisons are made on the device, "
            "the overflow flag copied to the host behind an event, and train_step handed a finite stand-in norm",
        versions=f"{FAIRSEQ}; torch >= 2.4 (_fused_adam_'s found_inf); any numpy",
        checks="fairseq.optim.fp16_optimizer:_FP16OptimizerMixin.clip_grad_norm",
        fingerprint="bd2445a2d1276398",
        on_mismatch="skip",
        replaces="fairseq.trainer:Trainer.clip_grad_norm",
        replacement=device_overflow.clip_grad_norm,
    ),
    Patch(
        name="fp16-step-skipped-on-device",
        why="the step of an update whose overflow the device decides: fused Adam skips it on the device where the "
            "flag is set, and the loss scaler's update waits until the host has read the flag",
        versions=f"{FAIRSEQ}; torch >= 2.4 (_fused_adam_'s found_inf); any numpy",
        checks="fairseq.optim.fp16_optimizer:_FP16OptimizerMixin.step",
        fingerprint="508a962ec5251a88",
        on_mismatch="skip",
        replaces="fairseq.optim.fp16_optimizer:_FP16OptimizerMixin.step",
        replacement=device_overflow.step,
    ),
    Patch(
        name="overflow-known-before-an-update",
        why="the overflow flag of the update before is read as train_step begins (or as it ends, where fairseq-train "
            "logs, saves, validates or stops after it), and then fairseq's own bookkeeping done: the scaler's update "
            "and the statistics, or the overflow's (the count, the learning rate and Adam's steps as they were)",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.trainer:Trainer.train_step",
        fingerprint="7f333d0bca617fa1",
        on_mismatch="skip",  # it relies on train_step counting and logging an update whose norm it finds finite
        replaces="fairseq.trainer:Trainer.train_step",
        replacement=device_overflow.train_step,
    ),
    Patch(
        name="overflow-known-before-validation",
        why="a validation starts with the pending overflow flag read (its step, the weights it scores)",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.trainer:Trainer.begin_valid_epoch",
        fingerprint="0755959d2b480954",
        on_mismatch="apply",  # it only reads the flag first
        replaces="fairseq.trainer:Trainer.begin_valid_epoch",
        replacement=device_overflow.learn_first,
    ),
    Patch(
        name="overflow-known-before-a-save",
        why="a checkpoint holds the update count, loss scale and Adam steps with the pending overflow flag read",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.trainer:Trainer.state_dict",
        fingerprint="5a784fb31d5f0ab1",
        on_mismatch="apply",  # it only reads the flag first
        replaces="fairseq.trainer:Trainer.state_dict",
        replacement=device_overflow.learn_first,
    ),
)


def install() -> dict:
    """Check and install every patch of :data:`PATCHES` (idempotent); returns {name: what happened}."""
    return {patch.name: patch.install() for patch in PATCHES}
