"""Loading progress shown with rich, shared by the server's loader and the CLI."""

from __future__ import annotations

from collections.abc import Callable

from rich.progress import Progress, TaskID


def layer_bars(bar: Progress) -> Callable[[str, int, int], None]:
    """One bar per `what` of `on_progress(what, done, total)`; each call is one more layer (`done` is
    not read: a later stage's loaders count from its first layer's global index)."""
    bars: dict[str, TaskID] = {}

    def on_progress(what: str, _done: int, total: int) -> None:
        if what not in bars:
            bars[what] = bar.add_task(what, total=total)
        bar.advance(bars[what])

    return on_progress
