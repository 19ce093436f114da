"""Loading progress shown with rich: what `strata serve`, `bench` and `sweep` draw while a model's
layers load (the server's loader and the CLI share it)."""

from __future__ import annotations

from collections.abc import Callable

from rich.progress import Progress, TaskID


def layer_bars(bar: Progress) -> Callable[[str, int, int], None]:
    """`build_runner`'s `on_progress(what, done, total)` shown as one bar per `what` ('dense weights
    24-47 on cuda:1', ...). Each call is one more layer loaded: `done` is not read, since a later
    stage's loaders count from its first layer's global index (48/24 for layers 24-47)."""
    bars: dict[str, TaskID] = {}

    def on_progress(what: str, _done: int, total: int) -> None:
        if what not in bars:
            bars[what] = bar.add_task(what, total=total)
        bar.advance(bars[what])

    return on_progress
