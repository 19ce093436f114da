"""`strata serve`: check the model, start the HTTP server at once, load the weights behind it."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import uvicorn
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from strata_mgpu import env
from strata_mgpu.config import ServerConfig
from strata_mgpu.engine.build import build_runner, check_placement
from strata_mgpu.engine.engine import Engine
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import ModelSpec, spec_from_gguf
from strata_mgpu.model.tokenizer import Tokenizer, tokenizer_from_gguf
from strata_mgpu.server.app import ServerState, create_app
from strata_mgpu.split.runner import SplitError
from strata_mgpu.stage.device import DeviceError
from strata_mgpu.stage.pinned import PinError

log = logging.getLogger("strata.server")
DEMO_PRESET, DEMO_SEED, DEMO_NAME = "tiny", 0, "strata-demo"


def setup_logging() -> None:
    logging.basicConfig(level=env.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def demo_model_path() -> Path:
    """The built-in demo model, written into the cache directory the first time it is needed."""
    from strata_mgpu.model.synthetic import write_model

    path = env.cache_dir() / f"{DEMO_NAME}-{DEMO_PRESET}-seed{DEMO_SEED}.gguf"
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


def _load(state: ServerState, config: ServerConfig, f: GGUFFile, spec: ModelSpec, tokenizer: Tokenizer) -> None:
    console = Console(stderr=True)
    try:
        with Progress(TextColumn("[bold]loading[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as bar:
            tasks: dict[str, int] = {}

            def on_progress(what: str, done: int, total: int) -> None:
                if what not in tasks:
                    tasks[what] = bar.add_task(what, total=total)
                bar.update(tasks[what], completed=done)

            runner = build_runner(f, spec, config.placement, config.engine.chunk_size, cpu_reference=True,
                                  kv_tokens=config.engine.n_ctx(spec.context_length),
                                  on_progress=on_progress)
        engine = Engine(runner, tokenizer, config.engine)
        engine.start()
        state.engine = engine
        log.info("model %s ready: %d layers, %d experts (%d used), context %d, chunk %d", state.model_name,
                 spec.n_layers, spec.n_experts, spec.n_experts_used, engine.n_ctx, config.engine.chunk_size)
    except (DeviceError, PinError, SplitError) as e:  # the machine cannot hold it: say so in one line
        state.load_error = f"loading failed: {e}"
        log.error("loading %s failed: %s", config.model_path, e)
    except Exception as e:  # shown by /health and the log; the server keeps answering 503
        state.load_error = f"loading failed: {type(e).__name__}: {e}"
        log.exception("loading %s failed", config.model_path)


def serve(config: ServerConfig) -> None:
    setup_logging()
    f, spec, tokenizer = open_model(config.model_path)
    check_placement(config.placement, spec)
    state = ServerState(model_name=config.model_name, api_key=config.api_key)
    app = create_app(state)
    threading.Thread(target=_load, args=(state, config, f, spec, tokenizer), name="strata-load", daemon=True).start()
    log.info("serving %s as %r on http://%s:%d", config.model_path, config.model_name, config.host, config.port)
    uvicorn.run(app, host=config.host, port=config.port, log_level=env.log_level().lower(), access_log=False)
    if state.engine is not None:
        state.engine.shutdown()
