"""tools.profile_helper's trace summary on a hand-made Chrome trace (the profiling itself needs CUDA)."""

from __future__ import annotations

import pytest

from strata_mgpu.tools.profile_helper import can_wait, describe, describe_host, host_use, stream_use


def kernel(name: str, ts: float, dur: float, device: int = 0, stream: int = 7, cat: str = "kernel", **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"device": device, "stream": stream,
                                                                                 **args}}


def test_streams_busy_time_gaps_and_categories():
    trace = {"traceEvents": [
        kernel("void copy_f32_wide(...)", 0, 10),
        kernel("dequant_bf16<12>", 5, 20),  # overlaps the copy: merged into one busy stretch 0-25
        kernel("sm90_xmma_gemm_bf16", 40, 30),  # a 15 us gap before it
        kernel("Memcpy HtoD (Pinned -> Device)", 0, 50, stream=13, cat="gpu_memcpy", bytes=2_000_000),
        kernel("attn_split<128>", 0, 8, device=1, stream=7),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99, "args": {}},  # host: ignored
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3, "args": {}},  # not a duration event
    ]}
    uses = stream_use(trace)
    assert [(u.device, u.stream) for u in uses] == [(0, 7), (0, 13), (1, 7)]
    compute, upload, other = uses
    assert compute.intervals == [(0, 25), (40, 70)]
    assert compute.busy_us == 55 and compute.span_us == 70 and compute.gaps == [15]
    assert dict(compute.by_category) == {"hand-over copies": 10, "dequantize": 20, "GEMM": 30}
    assert upload.h2d_bytes == 2_000_000 and dict(upload.by_category) == {"host-to-device copies": 50}
    assert dict(other.by_category) == {"attention": 8}
    lines = describe(uses)
    assert len(lines) == 3 and "idle gaps 0.0 ms (largest 0.01)" in lines[0] and "0.00 GB up" in lines[1]


def test_an_empty_trace_has_no_streams():
    assert stream_use({"traceEvents": []}) == []
    assert describe([]) == []


@pytest.mark.parametrize("name, cat, want", [("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", "other copies"),
                                             ("elementwise_kernel", "kernel", "other kernels")])
def test_other_work_is_named_as_such(name, cat, want):
    (use,) = stream_use({"traceEvents": [kernel(name, 0, 1, cat=cat)]})
    assert dict(use.by_category) == {want: 1}


def test_host_calls_and_when_the_host_ran_out_of_work():
    api = lambda name, ts, dur, cat="cuda_runtime": {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    trace = {"traceEvents": [
        api("cudaLaunchKernel", 100, 5), api("cudaLaunchKernel", 110, 5), api("cuLaunchKernel", 120, 4, "cuda_driver"),
        api("cudaFree", 130, 300), api("cudaStreamWaitEvent", 440, 2), api("cudaDeviceSynchronize", 442, 400),
        kernel("gemm", 105, 400), kernel("Memcpy HtoD", 200, 700, stream=13, cat="gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999, "args": {}},  # not an API call
    ]}
    use = host_use(trace)
    assert use.calls["cudaLaunchKernel"] == (2, 10) and use.calls["cuLaunchKernel"] == (1, 4)
    assert use.waiting == {"cudaFree": (1, 300), "cudaDeviceSynchronize": (1, 400)}
    assert use.last_call_end_us == 342 and use.last_gpu_end_us == 800  # from the first event, at 100
    first, second = describe_host(use)
    assert "last CUDA call at 0.3 ms" in first and "finished at 0.8 ms" in first
    assert second == "  host calls that can wait for the device: cudaDeviceSynchronize 1 x 0.4 ms, cudaFree 1 x 0.3 ms"
    assert describe_host(host_use({"traceEvents": []}))[1].endswith("none")


@pytest.mark.parametrize("name, waits", [("cudaDeviceSynchronize", True), ("cudaFree", True), ("cuMemUnmap", True),
                                         ("cudaMemcpy", True), ("cudaMemcpyAsync", False), ("cudaEventQuery", False),
                                         ("cudaStreamWaitEvent", False), ("cudaLaunchKernel", False),
                                         ("cudaFreeAsync", False), ("cudaMallocAsync", False),
                                         ("cudaMemcpyPeer", True), ("cudaMemcpyPeerAsync", False)])
def test_which_calls_can_wait_for_the_device(name, waits):
    assert can_wait(name) is waits
