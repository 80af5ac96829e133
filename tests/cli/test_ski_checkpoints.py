"""SKI-TNN checkpoints across --ski-lowrank: a checkpoint saved before the option existed (no ``version`` entries,
no ``ski_lowrank`` in its config) loads through fairseq as 'sum' and computes what it computed; a new one keeps
the mode it was trained with, and the training length that scales its low rank."""
import torch

from helpers import mlm_train_cmd, run

COMMON = dict(arch="ski_tnn_mlm_tiny", max_update=2, batch_size=4, no_last_checkpoints=False)


def load(path, data_bin, **overrides):
    from fairseq import checkpoint_utils
    import fairseq_tnn
    fairseq_tnn.register()
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(path)], arg_overrides={"data": str(data_bin), **overrides})
    return models[0].eval(), cfg


def features(model, tokens):
    with torch.no_grad():
        return model(tokens, features_only=True)[0]


def make_old(src, dst):
    """What the code before --ski-lowrank wrote: the same weights, no version buffers, no ski_lowrank field."""
    state = torch.load(src, map_location="cpu", weights_only=False)
    state["model"] = {k: v for k, v in state["model"].items() if not k.endswith("tno.version")}
    del state["cfg"]["model"]["ski_lowrank"]
    torch.save(state, dst)


def test_old_and_new_ski_checkpoints_through_fairseq(data_bin, tmp_path):
    run(mlm_train_cmd(data_bin, save_dir=tmp_path / "sum", ski_lowrank="sum", **COMMON))
    run(mlm_train_cmd(data_bin, save_dir=tmp_path / "mean", **COMMON))
    make_old(tmp_path / "sum" / "checkpoint_last.pt", tmp_path / "old.pt")
    tokens = torch.randint(4, 100, (2, 40))

    summed, cfg = load(tmp_path / "sum" / "checkpoint_last.pt", data_bin)
    assert cfg.model.ski_lowrank == "sum"
    old, old_cfg = load(tmp_path / "old.pt", data_bin)
    assert "ski_lowrank" not in old_cfg.model or old_cfg.model.ski_lowrank in (None, "mean")
    tnos = [m for m in old.modules() if type(m).__name__ == "SkiTno"]
    assert tnos and all(t.lowrank == "sum" for t in tnos)
    torch.testing.assert_close(features(old, tokens), features(summed, tokens), rtol=0, atol=0)

    mean, cfg = load(tmp_path / "mean" / "checkpoint_last.pt", data_bin)
    assert cfg.model.ski_lowrank == "mean"
    assert all(m.lowrank == "mean" for m in mean.modules() if type(m).__name__ == "SkiTno")
    # the low rank's scale is the training length's (the task's --tokens-per-sample), kept when the checkpoint is
    # scored at another length (fairseq-validate --model-overrides "{'tokens_per_sample': ...}")
    trained = cfg.task.tokens_per_sample
    longer, longer_cfg = load(tmp_path / "mean" / "checkpoint_last.pt", data_bin, tokens_per_sample=4 * trained)
    assert longer_cfg.task.tokens_per_sample == 4 * trained
    for model in (mean, longer):
        tnos = [m for m in model.modules() if type(m).__name__ == "SkiTno"]
        assert tnos and all(int(t.lowrank_length) == trained for t in tnos)
    torch.testing.assert_close(features(longer, tokens), features(mean, tokens), rtol=0, atol=0)
