"""fairseq's data-prefetch threads stopped before the interpreter finalizes (the ``stop-prefetch-at-exit`` row of
the table in ``__init__``)."""
import atexit
import queue
import threading
import time

from fairseq.data import iterators as iterators_module


def stop_background_consumers(timeout: float = 10.0) -> None:
    """Stop fairseq's data-prefetch threads before the interpreter finalizes.

    ``BufferedIterator`` (``--data-buffer-size``, default 10) fills its queue from a daemon
    ``BackgroundConsumer`` thread. An iterator left unfinished (``--max-valid-steps``, or an epoch cut
    by ``--max-update``) leaves that thread building batches when ``fairseq-train`` returns. Once
    CPython finalizes, a daemon thread that asks for the GIL is ended with ``pthread_exit``; when that
    happens inside torch's C++ (a ``torch.from_numpy`` storage's deleter re-acquiring the GIL under
    ``~TensorImpl``), the forced unwind crosses a ``noexcept`` destructor and the process aborts with
    "terminate called without an active exception" (exit code 134) after training has finished (seen
    intermittently with stock fairseq 0.12 and torch 2.13 too). atexit handlers run before
    finalization: each live consumer is told to stop after its current item (``_max_len = 0``, which
    fairseq checks after every put) and its queue is drained until it ends, ``timeout`` seconds at most.
    """
    consumers = [t for t in threading.enumerate()
                 if isinstance(t, iterators_module.BackgroundConsumer) and t.is_alive()]
    deadline = time.monotonic() + timeout
    for consumer in consumers:
        consumer._max_len = 0
        while consumer.is_alive() and time.monotonic() < deadline:
            try:
                while True:  # unblock a put() waiting on a full queue
                    consumer._queue.get_nowait()
            except queue.Empty:
                pass
            consumer.join(0.01)


def register_at_exit() -> None:
    atexit.unregister(stop_background_consumers)  # registered once however often installed
    atexit.register(stop_background_consumers)
