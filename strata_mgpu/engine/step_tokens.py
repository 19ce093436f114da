"""A step's drawn tokens on their way from the device to the host: the only per-step copy back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata_mgpu.engine.device_sampler import Draw, TokenLogprobs
from strata_mgpu.stage.device import HostCopy


@dataclass
class StepTokens:
    """Tokens [N] drawn by one engine step; token i belongs to rows[i]. `send` starts the copies without
    waiting; `wait` blocks until the ids are on the host, `logprobs` until the logprob table is."""

    rows: list[Any]  # the requests, in token order
    copy: HostCopy  # the ids [N] int64 on their way to the host
    n_decode_rows: int  # the last n rows came from the decode step
    t_decode: float  # perf_counter() when the decode step was launched
    faults_before: int  # the runner's `silent_faults` before the step was launched
    logprob_rows: list[int] = field(default_factory=list)  # rows with a logprob entry, in the table's order
    top_counts: list[int] = field(default_factory=list)  # alternatives each of those rows asked for
    logprob_copy: HostCopy | None = None  # [L, 1 + 2K] fp64: see `device_sampler.Draw`
    _ids: list[int] | None = None

    @classmethod
    def send(cls, rows: list[Any], drawn: Draw, n_decode_rows: int, t_decode: float, faults_before: int
             ) -> StepTokens:
        tokens = drawn.tokens
        assert tokens.dim() == 1 and tokens.shape[0] == len(rows)
        table = HostCopy(drawn.logprobs) if drawn.logprobs is not None else None
        return cls(rows, HostCopy(tokens), n_decode_rows, t_decode, faults_before, drawn.logprob_rows,
                   drawn.top_counts, table)

    def wait(self) -> list[int]:
        if self._ids is None:
            self._ids = self.copy.wait().tolist()
        return self._ids

    def logprobs(self) -> dict[int, TokenLogprobs]:
        """Row index -> its token's logprobs, for the rows that asked; blocks like `wait`."""
        if self.logprob_copy is None:
            return {}
        ids = self.wait()
        table = self.logprob_copy.wait().tolist()
        out = {}
        for row, n_top, entry in zip(self.logprob_rows, self.top_counts, table, strict=True):
            k = (len(entry) - 1) // 2
            top = tuple((int(entry[1 + j]), entry[1 + k + j]) for j in range(n_top))
            out[row] = TokenLogprobs(token=ids[row], logprob=entry[0], top=top)
        return out
