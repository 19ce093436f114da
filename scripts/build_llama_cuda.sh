#!/usr/bin/env bash
# llama-bench with CUDA for sm_90, built on the CPU machine (nvcc, no GPU, no cuBLAS there) and carried to
# the GPU machine as .llamacuda/llamacuda.tar.xz for gpu_session.sh's step llamahyb: the comparison
# figures of docs/BENCHMARKS.md then cost no device minutes. About 75 minutes on 2 cores at `nice 19`.
# Usage (repo root): bash scripts/build_llama_cuda.sh /path/to/llama_cpp_python-0.3.36.tar.gz
set -euo pipefail
SDIST=$1
WORK=${WORK:-/tmp/llcuda}
mkdir -p "$WORK" && tar xzf "$SDIST" -C "$WORK"
SRC=$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)
# cuBLAS from its wheel (the CPU machine's toolkit has nvcc and cudart only); the driver is a stub the
# GPU machine's libcuda.so.1 replaces at load
python3 -m pip download -q --no-deps nvidia-cublas -d "$WORK"
python3 -m zipfile -e "$WORK"/nvidia_cublas-*.whl "$WORK/cublas"
LIB=$WORK/cublas/nvidia/cu13/lib INC=$WORK/cublas/nvidia/cu13/include
ln -sf libcublas.so.13 "$LIB/libcublas.so" && ln -sf libcublasLt.so.13 "$LIB/libcublasLt.so"
echo 'void cuGetErrorString(void) {}' > "$WORK/stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 "$WORK/stub.c" -o "$WORK/libcuda.so"
# the CPU backends as loadable variants: the GPU machine's CPU picks its own (AVX-512 where it has it)
cmake -S "$SRC" -B "$SRC/build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON \
  -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCUDA_cublas_LIBRARY="$LIB/libcublas.so" \
  -DCUDA_cublasLt_LIBRARY="$LIB/libcublasLt.so" -DCUDA_cuda_driver_LIBRARY="$WORK/libcuda.so" \
  -DCMAKE_CUDA_FLAGS="-I$INC" -DCMAKE_CXX_FLAGS="-I$INC" -DCMAKE_C_FLAGS="-I$INC" > "$WORK/cmake.log"
nice -n 19 cmake --build "$SRC/build" --target llama-bench -j "$(nproc)" > "$WORK/build.log"
# the binary, its libraries (links followed) and the CPU variants of current x86 hosts, within the carry limit
PACK=$WORK/pack && rm -rf "$PACK" && mkdir -p "$PACK"
(cd "$SRC/build/bin" && cp -L llama-bench libllama*.so* libggml.so* libggml-base.so* libggml-cuda.so libmtmd.so* \
  libggml-cpu-{x64,haswell,skylakex,icelake,sapphirerapids,zen4}.so "$PACK/")
cp -L /lib/x86_64-linux-gnu/libgomp.so.1 "$PACK/"
mkdir -p .llamacuda && (cd "$PACK" && tar cf - .) | xz -T0 -9 > .llamacuda/llamacuda.tar.xz
ls -la .llamacuda/llamacuda.tar.xz
