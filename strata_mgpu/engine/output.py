"""The host's side of a step: its drawn tokens turned into text, stops, outputs and ends.

`OutputProcessor.land(step)` waits for a step's tokens on the host, then for each row still
running: the prompt's timings end at its first token; the token is detokenized and fed to the
stop strings; EOS (unless ignored), a stop string or `max_tokens` finish the request, else its
text (possibly empty, mid-character) goes to its callback. A row already done when its token
lands (it stopped, or was aborted, after the step was launched) drops the token: the one-step-late
stop. An error of the device work surfaces in the wait and ends the step's rows.

`finish` is the one way a request ends: its KV is freed by dropping the reference, its draw state
goes back to the sampler, its `Timings` close, the per-request log line and the finish metric
are written, and (unless it was aborted) its last output is sent. Calls come from the engine's
thread.
"""

from __future__ import annotations

import logging
import time

from strata_mgpu.engine.device_sampler import BatchSampler
from strata_mgpu.engine.metrics import EngineMetrics
from strata_mgpu.engine.request import Failure, Phase, Request, RequestOutput
from strata_mgpu.engine.step_tokens import StepTokens
from strata_mgpu.model.tokenizer import Tokenizer

log = logging.getLogger("strata.engine")


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, sampler: BatchSampler, metrics: EngineMetrics):
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.metrics = metrics
        self._t_landed = 0.0  # when the last step's tokens reached the host

    def land(self, step: StepTokens) -> None:
        """Wait for the step's tokens, then text, stops and outputs."""
        try:
            ids = step.wait()
        except Exception as e:  # an error of the device work surfaces here
            self.fail(step.rows, Failure.of(e))
            return
        now = time.perf_counter()
        n_decoded = 0
        first_decode_row = len(step.rows) - step.n_decode_rows
        for i, (req, token) in enumerate(zip(step.rows, ids, strict=True)):
            if req.phase is Phase.DONE:  # stopped or aborted after this step was launched
                continue
            if not req.t_prompt_done:
                self._prompt_done(req, now)
            n_decoded += i >= first_decode_row
            self._accept(req, token)
        if step.n_decode_rows:
            # steps overlap: one launched before the last landing is timed from it, so no time counts twice
            dt = max(now - max(step.t_decode, self._t_landed), 1e-9)
            self.metrics.decode_seconds.inc(dt)
            self.metrics.decode_tps.set(n_decoded / dt)
        self._t_landed = now

    def fail(self, reqs: list[Request], why: Failure) -> None:
        """End the requests of a failed call that have not ended otherwise."""
        for r in reqs:
            if r.phase is not Phase.DONE:
                self.finish(r, "error", error=why.message, error_status=why.status)

    def _prompt_done(self, req: Request, now: float) -> None:
        """The prompt's first token has reached the host: the prompt's timings end here."""
        req.t_prompt_done = now
        req.timings.prompt_n = len(req.prompt)
        req.timings.prompt_ms = 1e3 * (now - req.t_first_chunk)
        self.metrics.prefill_tps.set(len(req.prompt) / max(now - req.t_first_chunk, 1e-9))

    def _accept(self, req: Request, token: int) -> None:
        """A new token for `req`: emit its text, or finish on EOS, a stop string or the limit."""
        req.generated.append(token)
        self.metrics.generated_tokens.inc()
        if token in self.tokenizer.eot_ids and not req.params.ignore_eos:
            self.finish(req, "stop", tail=req.stops.flush())
            return
        text, stopped = req.stops.feed(req.detok.push(token))
        if stopped:
            self.finish(req, "stop", text=text, token=token)
        elif len(req.generated) >= req.params.max_tokens:
            text += req.stops.feed(req.detok.flush())[0] + req.stops.flush()
            self.finish(req, "length", text=text, token=token)
        else:  # also with no text (mid-character): every token is reported once
            req.on_output(_output(req, text, [token]))

    def finish(self, req: Request, reason: str, *, text: str = "", token: int | None = None, tail: str = "",
               error: str | None = None, error_status: int = 500, notify: bool = True) -> None:
        """End `req` for `reason` ('stop', 'length', 'abort' or 'error'); `notify=False`: no last output."""
        was_queued = req.phase is Phase.WAITING
        req.phase = Phase.DONE
        req.kv = None  # frees the cache now
        req.last_token = None
        if req.draw is not None:
            self.sampler.close(req.draw)
        end = time.perf_counter()
        if req.t_prompt_done:
            req.timings.predicted_n = len(req.generated)
            req.timings.predicted_ms = 1e3 * (end - req.t_prompt_done)
        self.metrics.requests.labels(finish_reason=reason).inc()
        t = req.timings
        if was_queued:
            log.info("%s: prompt %d tok, queued %.1f ms, finish %s before it started", req.id, len(req.prompt),
                     1e3 * (end - req.t_submit), reason)
        else:
            log.info("%s: queued %.1f ms, prompt %d tok %.1f ms (%.1f tok/s), decode %d tok %.1f ms (%.1f tok/s), "
                     "finish %s", req.id, t.queue_ms, t.prompt_n, t.prompt_ms, t.as_dict()["prompt_per_second"],
                     t.predicted_n, t.predicted_ms, t.as_dict()["predicted_per_second"], reason)
        if notify:
            out = _output(req, text + tail, [token] if token is not None else [])
            out.finished, out.finish_reason, out.error, out.timings = True, reason, error, req.timings
            out.error_status = error_status
            req.on_output(out)


def _output(req: Request, text: str, tokens: list[int]) -> RequestOutput:
    return RequestOutput(request_id=req.id, text=text, token_ids=tokens, n_prompt_tokens=len(req.prompt),
                         n_generated=len(req.generated))
