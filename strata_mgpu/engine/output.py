"""The host's side of a step: its drawn tokens turned into text, stops, outputs and ends.

A row already done when its token lands (it stopped, or was aborted, after the step was
launched) drops the token: the one-step-late stop. An error of the device work surfaces in the
wait and ends the step's rows; so does a failure the device went on past (`silent_faults`).
`finish` is the one way a request ends. Calls come from the engine's thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from strata_mgpu.engine.device_sampler import BatchSampler, TokenLogprobs
from strata_mgpu.engine.metrics import EngineMetrics
from strata_mgpu.engine.prefix_cache import PrefixCache
from strata_mgpu.engine.request import Failure, Phase, Request, RequestOutput
from strata_mgpu.engine.step_tokens import StepTokens
from strata_mgpu.model.kv_pool import BlockTable
from strata_mgpu.model.tokenizer import Tokenizer

log = logging.getLogger("strata.engine")
# what a request whose step failed without raising is told (HTTP 500: nothing the client did)
SILENT_FAULT = Failure("the device's work for this request failed without an error of its own (the host's cores "
                       "did not answer an expert hand-over), so its last tokens may be wrong: it was ended; retry it",
                       500)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, sampler: BatchSampler, metrics: EngineMetrics,
                 prefix: PrefixCache | None = None):
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.metrics = metrics
        self.prefix = prefix
        self._t_landed = 0.0  # when the last step's tokens reached the host

    def land(self, step: StepTokens, silent_faults: Callable[[], int]) -> None:
        """Wait for the step's tokens, then text, stops and outputs. `silent_faults`: the runner's count,
        read once the tokens are here; past the count before the step, the step's requests end with an
        error rather than take tokens that may be wrong."""
        try:
            ids = step.wait()
            logprobs = step.logprobs()
        except Exception as e:  # an error of the device work surfaces here
            self.fail(step.rows, Failure.of(e))
            return
        if silent_faults() > step.faults_before:
            log.error("a step's device work failed without raising (an expert hand-over to the host's cores); its "
                      "%d requests end with an error", len(step.rows))
            self.fail(step.rows, SILENT_FAULT)
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
            self._accept(req, token, logprobs.get(i))
        if step.n_decode_rows:
            # steps overlap: one launched before the last landing is timed from it, so no time counts twice
            dt = max(now - max(step.t_decode, self._t_landed), 1e-9)
            self.metrics.decode_seconds.inc(dt)
            self.metrics.decode_tps.set(n_decoded / dt)
        self._t_landed = now

    def fail(self, reqs: list[Request], why: Failure) -> None:
        for r in reqs:
            if r.phase is not Phase.DONE:
                self.finish(r, "error", error=why.message, error_status=why.status)

    def _prompt_done(self, req: Request, now: float) -> None:
        req.t_prompt_done = now
        req.timings.cache_n = req.n_cached
        req.timings.prompt_n = len(req.prompt) - req.n_cached  # computed, as llama-server counts it
        req.timings.prompt_ms = 1e3 * (now - req.t_first_chunk)
        self.metrics.prefill_tps.set(req.timings.prompt_n / max(now - req.t_first_chunk, 1e-9))

    def _accept(self, req: Request, token: int, logprobs: TokenLogprobs | None = None) -> None:
        req.generated.append(token)
        self.metrics.generated_tokens.inc()
        if token in self.tokenizer.eot_ids and not req.params.ignore_eos:
            self.finish(req, "stop", tail=req.stops.flush())
            return
        if logprobs is not None:
            req.draw_state.landed_logprobs.append(logprobs)
        grammar_ended = _grammar_ends(req, token)
        text, stopped = req.stops.feed(req.detok.push(token))
        if stopped:
            self.finish(req, "stop", text=text, token=token)
        elif grammar_ended or len(req.generated) >= req.params.max_tokens:
            text += req.stops.feed(req.detok.flush())[0] + req.stops.flush()
            self.finish(req, "stop" if grammar_ended else "length", text=text, token=token)
        else:  # also with no text (mid-character): every token is reported once
            self._notify(req, _output(req, text, [token]))

    def finish(self, req: Request, reason: str, *, text: str = "", token: int | None = None, tail: str = "",
               error: str | None = None, error_status: int = 500, notify: bool = True) -> None:
        """End `req` for `reason` ('stop', 'length', 'abort' or 'error'): its blocks kept, KV freed, draw
        state given back, log line written; `notify=False`: no last output."""
        was_queued = req.phase is Phase.WAITING
        req.phase = Phase.DONE
        self._keep_blocks(req, reason)
        self.release(req)
        req.last_token = None
        if req.draw is not None:
            self.sampler.close(req.draw)
        end = time.perf_counter()
        if req.t_prompt_done:
            req.timings.predicted_n = len(req.generated)
            req.timings.predicted_ms = 1e3 * (end - req.t_prompt_done)
        self.metrics.requests.labels(finish_reason=reason).inc()
        if was_queued:
            log.info("%s: prompt %d tok, queued %.1f ms, finish %s before it started", req.id, len(req.prompt),
                     1e3 * (end - req.t_submit), reason)
        else:
            log.info("%s", request_line(req, reason))
        if notify:
            out = _output(req, text + tail, [token] if token is not None else [])
            out.finished, out.finish_reason, out.error, out.timings = True, reason, error, req.timings
            out.error_status = error_status
            self._notify(req, out)

    def _notify(self, req: Request, out: RequestOutput) -> None:
        """A callback that raises (its client's event loop closed under a late output, say) ends its
        request without another answer, logged; the engine goes on."""
        try:
            req.on_output(out)
        except Exception:
            log.warning("%s: its output callback raised; the request ends here", req.id, exc_info=True)
            if req.phase is not Phase.DONE:
                self.finish(req, "abort", notify=False)

    def _keep_blocks(self, req: Request, reason: str) -> None:
        """The prefix cache indexes the full blocks of a request that ended normally (the last token drawn
        has no KV row); an aborted or failed one's none (its last forward may not have run)."""
        table = req.cacheable_table  # None for a request longer than the pool: its table is a two-tier ring
        if self.prefix is not None and reason in ("stop", "length") and req.kv is not None and table is not None:
            tokens = [*req.prompt, *req.generated]
            self.prefix.insert(table, tokens, min(req.kv.length, len(tokens)), req.states)

    def release(self, req: Request) -> None:
        """The request's sequence and its blocks given back (at its end, or a preemption)."""
        req.kv = None
        if req.table is not None:
            self.give_back(req.table)
            req.table = None

    def give_back(self, table: BlockTable) -> None:
        """A table's references back to the pool; the prefix cache's blocks it held become reclaimable."""
        ids = list(table.ids)
        table.free()
        if self.prefix is not None:
            self.prefix.released(ids)


def request_line(req: Request, reason: str) -> str:
    """The per-request log line, with a rate only where there is one to speak of (a decode of one token
    is the prompt's first, drawn by it)."""
    t = req.timings
    prompt = f"prompt {t.prompt_n} tok"
    if t.cache_n:
        prompt += f" (+{t.cache_n} cached)"
    prompt += f" {t.prompt_ms:.1f} ms"
    if t.prompt_n >= 2 and t.prompt_ms >= 1:
        prompt += f" ({t.as_dict()['prompt_per_second']:.1f} tok/s)"
    decode = f"decode {t.predicted_n} tok {t.predicted_ms:.1f} ms"
    if t.predicted_n >= 2 and t.predicted_ms >= 1:
        decode += f" ({t.as_dict()['predicted_per_second']:.1f} tok/s)"
    return f"{req.id}: queued {t.queue_ms:.1f} ms, {prompt}, {decode}, finish {reason}"


def _grammar_ends(req: Request, token: int) -> bool:
    """The request's grammar (if any) advanced by its token: True once nothing but the end can follow.
    A token it refuses (only end-of-sequence under ignore_eos can be one) ends the request too."""
    grammar = req.draw_state.grammar
    if grammar is None:
        return False
    if not grammar.accept(token):
        log.warning("%s: its grammar refused token %d (%s); the request ends there", req.id, token,
                    grammar.error or "no reason given")
        return True
    return grammar.done


def _output(req: Request, text: str, tokens: list[int]) -> RequestOutput:
    logprobs = None
    if req.params.logprobs is not None and req.draw is not None:
        logprobs, req.draw.landed_logprobs = req.draw.landed_logprobs, []
    return RequestOutput(request_id=req.id, text=text, token_ids=tokens, n_prompt_tokens=len(req.prompt),
                         n_generated=len(req.generated), logprobs=logprobs)
