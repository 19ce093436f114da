"""One host thread per stage of a split, each queuing its stage's work in the order it was given.

Why: a CUDA stream accepts about a thousand launches ahead of the device; past that, a launch
waits until the device drains one. A prompt chunk is more launches than that a stage, so one
thread queuing stage 0's chunk and then stage 1's waits on card 0 while card 1 idles. With a
thread each, a stage blocked on its own card's queue holds up nobody else.

A stage's task for a call waits (on the host) for the previous stage's task of the same call to
have queued its hand-over: the exchange's sends and receives pair up in call order. A task that
fails passes its error down the chain without touching its exchange, so every stage stays in
step for the next call. Without threads (`STRATA_STAGE_THREADS=0`, or CPU stages) each task runs
at once on the caller's thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from strata_mgpu.stage.device import DeviceContext

T = TypeVar("T")


def done_future(fn: Callable[[], T]) -> Future:
    f: Future = Future()
    try:
        f.set_result(fn())
    except BaseException as e:  # kept for whoever waits, as a thread's would be
        f.set_exception(e)
    return f


class StageWorkers:
    """A thread each for the stages of `contexts`, or none (`threaded` False)."""

    def __init__(self, contexts: Sequence[DeviceContext], threaded: bool):
        self.contexts = list(contexts)
        self.threaded = threaded
        self._pools = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"strata-stage{k}",
                                          initializer=_bind_device, initargs=(ctx.device,))
                       for k, ctx in enumerate(self.contexts)] if threaded else []

    def submit(self, k: int, fn: Callable[[], T], after: Future | None, inline: bool = False) -> Future:
        """Queue fn as stage k's next task, to run once `after` (the previous stage's task of the same
        call, or None) has finished; its error, if any, becomes this task's. `inline`: run it now on the
        caller's thread (call `idle()` first)."""
        if inline or not self.threaded:
            if after is not None and after.exception() is not None:
                return after
            return done_future(fn)
        # the caller's current stream on each card, so that "the caller" means the same in the task
        callers = [(ctx, ctx.current_stream()) for ctx in {c.device: c for c in self.contexts}.values()]
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()  # thread-local: carried
        own = self.contexts[k]

        def task() -> T:
            if after is not None:
                after.result()  # raises the upstream stage's error: this one's exchange stays untouched
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.inference_mode(inference))
                stack.enter_context(torch.set_grad_enabled(grad))
                for ctx, stream in callers:
                    stack.enter_context(ctx.use(stream))
                stack.enter_context(own.current())  # each stream above made its device current: the stage's last
                return fn()

        return self._pools[k].submit(task)

    def idle(self) -> None:
        """Wait until every stage has queued all it was given. Holds no finished task (a failed one's
        traceback would keep its tensors alive)."""
        for pool in self._pools:
            pool.submit(lambda: None).result()


def _bind_device(device: torch.device) -> None:
    if device.type == "cuda":  # CPU stages get threads only in tests of the ordering here
        torch.cuda.set_device(device)


def wait_all(futures: Sequence[Future]) -> None:
    """Wait for every future; raise the first error among them (in order)."""
    first: BaseException | None = None
    for f in futures:
        e = f.exception()
        if e is not None and first is None:
            first = e
    if first is not None:
        raise first
