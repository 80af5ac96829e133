"""The options of a registered TNN architecture, with their help and the values its preset gives them.

    python -m fairseq_tnn.options tnn_lm_wt103

``fairseq-train --arch tnn_lm_wt103 --help`` cannot list them: fairseq prints its help on the first of its
two parsing passes, before it adds the architecture's options. This builds fairseq's training parser the way
``fairseq-train`` does (the plugin as ``--user-dir``, the architecture's task), lets it add them, and prints
that group, each option with the value a ``fairseq-train --arch <arch>`` run would get.
"""
import argparse
import os
import sys

USER_DIR = os.path.dirname(os.path.abspath(__file__))
TASKS = {"tnn_lm": "tnn_language_modeling", "tnn_mlm": "tnn_masked_lm"}


def tnn_archs():
    """{architecture: its model's name} for every architecture of the plugin's models."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY
    import fairseq_tnn
    fairseq_tnn.register()
    return {arch: model for arch, model in ARCH_MODEL_NAME_REGISTRY.items() if model in TASKS}


def model_options(arch: str) -> str:
    from fairseq import options
    archs = tnn_archs()
    if arch not in archs:
        raise ValueError(f"--arch={arch!r} is not a TNN architecture: must be one of {sorted(archs)}")
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["DATA", "--user-dir", USER_DIR, "--task", TASKS[archs[arch]],
                                                "--arch", arch])
    group = next(g for g in parser._action_groups if g.title == "Model-specific configuration")
    formatter = parser._get_formatter()
    formatter.start_section(f"options of --arch {arch} (model {archs[arch]}, task {TASKS[archs[arch]]})")
    for action in group._group_actions:
        value = getattr(args, action.dest, None)
        shown = "not set" if value is None else value
        action.help = f"{action.help or ''} [{arch}: {shown}]".strip().replace("%", "%%")
    formatter.add_arguments(group._group_actions)
    formatter.end_section()
    return formatter.format_help()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fairseq_tnn.options", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("arch", help="a registered TNN architecture, e.g. tnn_lm_wt103, fd_tnn_lm_wt103, ski_tnn_mlm_wt103")
    a = p.parse_args(argv)
    try:
        text = model_options(a.arch)
    except ValueError as e:
        p.error(str(e))
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
