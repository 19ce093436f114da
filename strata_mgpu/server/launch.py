"""`strata serve`: check the model and the address, start the HTTP server at once, load the weights
behind it, and on a stop signal end the loading between two layers before the process exits."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch
import uvicorn
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from strata_mgpu.config import ServerConfig
from strata_mgpu.engine.build import (
    PLACEMENT_ERRORS,
    DeviceError,
    build_runner,
    check_placement,
    cpu_budget_warning,
    resolve_devices,
)
from strata_mgpu.engine.engine import Engine
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import ModelSpec, spec_from_gguf
from strata_mgpu.model.tokenizer import Tokenizer, tokenizer_from_gguf
from strata_mgpu.progress import layer_bars
from strata_mgpu.server.app import ServerState, create_app
from strata_mgpu.server.body_limit import max_body_bytes

log = logging.getLogger("strata.server")
DEMO_PRESET, DEMO_SEED, DEMO_NAME = "tiny", 0, "strata-demo"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ListenError(Exception):
    """The server cannot listen where it was asked to (port taken, host unknown)."""


class Stopped(Exception):
    """A stop signal reached the main thread; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class LoadCancelled(Exception):
    """Raised between two layers inside the loader once the server is stopping."""


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # gguf's writer says what it writes at INFO
        logging.getLogger("gguf").setLevel(logging.WARNING)


def demo_model_path(cache_dir: Path) -> Path:
    """The built-in demo model, written into `cache_dir` the first time it is needed."""
    from strata_mgpu.model.synthetic import write_model

    path = cache_dir / f"{DEMO_NAME}-{DEMO_PRESET}-seed{DEMO_SEED}.gguf"
    if not path.exists():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        log.info("writing the demo model to %s", path)
        write_model(tmp, DEMO_PRESET, seed=DEMO_SEED)
        tmp.replace(path)  # atomic: a crash never leaves a half-written demo model behind
    return path


def open_model(path: Path) -> tuple[GGUFFile, ModelSpec, Tokenizer]:
    """Parse and validate the file and its tokenizer (fast; raises GGUFError on a bad file)."""
    f = GGUFFile(path)
    return f, spec_from_gguf(f), tokenizer_from_gguf(f)


def config_warnings(config: ServerConfig, spec: ModelSpec) -> list[str]:
    """Options the model or the machine cannot honour, each with what happens instead."""
    warnings = []
    ctx_size = config.engine.ctx_size
    if ctx_size is not None and ctx_size > spec.context_length:
        warnings.append(f"--ctx-size {ctx_size} is more than the model's context of {spec.context_length} tokens: "
                        f"sequences get {spec.context_length}")
    cpu_budget = cpu_budget_warning(config.placement)
    if cpu_budget:
        warnings.append(cpu_budget)
    hint = cuda_build_hint()
    if hint and config.placement.devices == ("auto",) and resolve_devices(config.placement)[0].type == "cpu":
        warnings.append(f"serving on the CPU: {hint}")
    return warnings


def cuda_build_hint() -> str | None:
    if torch.version.cuda is not None or not (Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi")):
        return None
    return ("torch is a CPU build; install a CUDA build to use the GPU "
            "(pip uninstall -y torch && pip install torch: PyPI's Linux wheel is the CUDA build)")


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port: a port in use or a host that does not resolve fails here, in one
    line, before anything loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn: a name binds its IPv4 address
    try:
        (family, kind, proto, _, address), *_ = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM,
                                                                   flags=socket.AI_PASSIVE)
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait TIME_WAIT
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class Loader:
    """Loads the weights in a thread while the server answers 503, then starts the engine. `stop()`
    makes the loader give up at its next layer and waits for it: the process must not exit while
    that thread is inside torch (the C++ runtime aborts the whole process then)."""

    def __init__(self, state: ServerState, config: ServerConfig, f: GGUFFile, spec: ModelSpec, tokenizer: Tokenizer):
        self.state, self.config, self.f, self.spec, self.tokenizer = state, config, f, spec, tokenizer
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._load, name="strata-load")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            log.info("stopping: the loader ends after its current layer")
            self._thread.join()

    def _on_progress(self, show: Callable[[str, int, int], None]) -> Callable[[str, int, int], None]:
        def on_progress(what: str, done: int, total: int) -> None:
            if self._stopping.is_set():
                raise LoadCancelled
            show(what, done, total)

        return on_progress

    def _load(self) -> None:
        state, config, spec = self.state, self.config, self.spec
        log.info("loading %s (/health answers 503 meanwhile)", config.model_path)
        started = time.perf_counter()
        try:
            with Progress(TextColumn("[bold]loading[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=Console(stderr=True)) as bar:
                runner = build_runner(self.f, spec, config.placement, config.engine.chunk_size, cpu_reference=True,
                                      kv_tokens=config.engine.kv_cells(spec.context_length),
                                      sequences=config.engine.max_running,
                                      on_progress=self._on_progress(layer_bars(bar)))
            if self._stopping.is_set():  # stopped after the last layer: no engine to start
                return
            engine = Engine(runner, self.tokenizer, config.engine)
            engine.start()
            options = state.chat_options(engine)  # the tool dialect, chosen once
            state.engine = engine
            log.info("model %s runs on %s; tool calls in the %s dialect", state.model_name, runner.describe(),
                     options.dialect.name)
            log.info("model %s ready: %d layers, %d experts (%d used), context %d, chunk %d (loaded in %.1f s)",
                     state.model_name, spec.n_layers, spec.n_experts, spec.n_experts_used, engine.n_ctx,
                     config.engine.chunk_size, time.perf_counter() - started)
        except LoadCancelled:
            log.info("loading %s stopped: the server is shutting down", config.model_path)
        except PLACEMENT_ERRORS as e:  # the machine cannot hold it: say so in one line
            state.load_error = f"loading failed: {e}"
            log.error("loading %s failed: %s", config.model_path, e)
        except Exception as e:  # shown by /health and the log; the server keeps answering 503
            state.load_error = f"loading failed: {type(e).__name__}: {e}"
            log.exception("loading %s failed", config.model_path)


class _StopSignal:
    """The stop signal seen, and the uvicorn server once it serves. uvicorn re-raises the signal from
    inside its event loop as it ends; raising there would tear the loop down mid-task, so the signal
    is only noted. Before uvicorn's own handlers are in place, the server is told to exit."""

    signum: int | None = None
    server: uvicorn.Server | None = None


def _on_stop_signal(signum: int, _frame: FrameType | None) -> None:
    _StopSignal.signum = signum
    if _StopSignal.server is None:
        raise Stopped(signum)
    _StopSignal.server.should_exit = True  # uvicorn checks it once started, before serving a request


def serve(config: ServerConfig) -> int:
    """Serve until a stop signal; the exit status: 128 + the signal (130 for Ctrl+C, 143 for SIGTERM,
    as a shell reports it) once the loader has ended and the engine stopped."""
    setup_logging(config.log_level)
    f, spec, tokenizer = open_model(config.model_path)
    try:
        check_placement(config.placement, spec)
    except DeviceError as e:
        hint = cuda_build_hint()
        raise DeviceError(f"{e}: {hint}" if hint and not torch.cuda.is_available() else str(e)) from None
    for warning in config_warnings(config, spec):
        log.warning(warning)
    config = dataclasses.replace(config, engine=config.engine.for_model(spec.context_length))  # resolved once
    sock = listening_socket(config.host, config.port)
    state = ServerState(model_name=config.model_name, api_key=config.api_key,
                        reasoning_format=config.reasoning_format, tool_call_parser=config.tool_call_parser,
                        lenient_json_schema=config.lenient_json_schema)
    app = create_app(state, max_body_bytes=max_body_bytes(config.engine.n_ctx(spec.context_length)))
    loader = Loader(state, config, f, spec, tokenizer)
    _StopSignal.signum, _StopSignal.server = None, None
    previous_handlers = {s: signal.signal(s, _on_stop_signal) for s in STOP_SIGNALS}
    try:
        loader.start()
        log.info("serving %s as %r on http://%s:%d", config.model_path, config.model_name, config.host,
                 sock.getsockname()[1])
        # No lifespan protocol: the app has no startup or shutdown hooks (the loader and the engine
        # are ours), and a second Ctrl+C would cancel uvicorn's lifespan task mid-wait and print its
        # traceback.
        server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level.lower(), access_log=False,
                                               lifespan="off"))
        _StopSignal.server = server
        try:
            server.run(sockets=[sock])
        finally:
            _StopSignal.server = None
        return 128 + _StopSignal.signum if _StopSignal.signum is not None else 0
    except Stopped as e:
        return 128 + e.signum
    finally:
        for s in STOP_SIGNALS:  # a second Ctrl+C must not cut the clean-up short and leave torch mid-call
            signal.signal(s, signal.SIG_IGN)
        loader.stop()
        if state.engine is not None:
            state.engine.shutdown()
        for s, handler in previous_handlers.items():
            signal.signal(s, handler)
        sock.close()
