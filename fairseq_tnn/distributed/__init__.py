"""Multi-process training: the launcher (``python -m fairseq_tnn.distributed.launch``) and the check the
tasks run at start-up (``check.check_joined``). This package imports neither: ``-m`` must find the
launcher not yet imported."""
