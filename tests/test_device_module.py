"""Every stream and event of the package goes through the device module (`stage/device.py` and the
stream backends of `stage/streams.py`), where the ordering twin sees it: anywhere else, a
`torch.cuda.Stream`, `torch.cuda.Event` or a raw stream operation fails this test, naming the line."""

from __future__ import annotations

import ast
from pathlib import Path

import strata_mgpu

PACKAGE = Path(strata_mgpu.__file__).parent
DEVICE_MODULE = {"stage/device.py", "stage/streams.py"}
# torch.cuda's names that make, select or order streams and events, or capture work on a stream
STREAM_NAMES = {"Event", "Stream", "ExternalStream", "stream", "StreamContext", "current_stream",
                "default_stream", "set_stream", "graph"}
# methods of torch's streams, events and tensors that order work between streams (DeviceContext's
# own methods of these names are how the rest of the package asks for them)
STREAM_METHODS = {"wait_event", "wait_stream", "record_stream"}
# The kernel launcher reads the current stream to queue CuPy's launches where torch's would go
# (the twin sees the work, as it sees any op, through the stream the caller made current).
ALLOWED = {("kernels/nvrtc.py", "current_stream")}


def _is_torch_cuda(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name)
            and node.value.id == "torch")


def _is_context(node: ast.AST) -> bool:
    """`ctx`, `self.ctx`, `stage.ctx`: a DeviceContext, whose methods are the device module's API."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name == "ctx" or name.endswith("_ctx")


def stream_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of every stream or event made or ordered outside the device module's API."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in STREAM_NAMES and _is_torch_cuda(node.value):
            found.append((node.lineno, f"torch.cuda.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STREAM_METHODS
              and not _is_context(node.func.value)):
            found.append((node.lineno, f".{node.func.attr}()"))
    return sorted(found)


def test_streams_and_events_only_in_the_device_module():
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in DEVICE_MODULE:
            continue
        outside += [f"{rel}:{line} {what}" for line, what in stream_uses(path.read_text())
                    if (rel, what.removeprefix("torch.cuda.")) not in ALLOWED]
    assert outside == [], "streams and events outside stage/device.py and stage/streams.py:\n" + "\n".join(outside)


def test_the_check_finds_what_it_looks_for():
    """Each form the test forbids, in a snippet, is found (so a pass above means something)."""
    snippet = """
import torch
e = torch.cuda.Event(enable_timing=True)
s = torch.cuda.Stream(device)
with torch.cuda.stream(s):
    pass
torch.cuda.current_stream(device).wait_event(e)
x.record_stream(s)
s.wait_stream(other)
ctx.wait_stream(s)
self.ctx.record_stream(x)
"""
    assert stream_uses(snippet) == [(3, "torch.cuda.Event"), (4, "torch.cuda.Stream"), (5, "torch.cuda.stream"),
                                    (7, ".wait_event()"), (7, "torch.cuda.current_stream"), (8, ".record_stream()"),
                                    (9, ".wait_stream()")]
