"""bf16 matmul ceiling of this GPU at the drafter step's GEMM shapes (issue 3: is the step GEMM-bound at the
hardware's limit, or is there kernel headroom left?).

Times ``torch.mm`` (cuBLAS, then cuBLASLt via ``torch.backends.cuda.preferred_blas_library``) on the 8B-shaped
drafter's largest GEMMs at batch 4 (32,768 block rows; LM-head chunks of 10,240 rows x 151,936 vocab) and a square
8192 GEMM; ``--triton`` adds inductor's max-autotune Triton templates for two of them. Prints ms and TFLOP/s per
shape (2*M*K*N / time). GPU only.

    python benchmarks/gemm_ceiling.py [--triton]
"""

from __future__ import annotations

import argparse
import time

import torch

#: name -> (M, K, N, B stored as [N, K] (a Linear weight) rather than [K, N])
SHAPES = {
    "mlp_up_fwd 32768x4096x12288": (32768, 4096, 12288, True),
    "down_fwd 32768x12288x4096": (32768, 12288, 4096, True),
    "q_fwd 32768x4096x4096": (32768, 4096, 4096, True),
    "lm_fwd 10240x4096x151936": (10240, 4096, 151936, True),
    "lm_dgrad 10240x151936x4096": (10240, 151936, 4096, False),
    "sq 8192": (8192, 8192, 8192, False),
}


def seconds_per_call(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / iters


def operands(m: int, k: int, n: int, weight_layout: bool):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if weight_layout:
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        return a, b, (lambda: a @ b.t())
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return a, b, (lambda: a @ b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton", action="store_true", help="also inductor max-autotune Triton GEMMs (2 shapes)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_ceiling: needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        for name, (m, k, n, weight_layout) in SHAPES.items():
            a, b, fn = operands(m, k, n, weight_layout)
            s = seconds_per_call(fn)
            print(f"{library:9s} {name:30s} {s * 1e3:8.3f} ms {2 * m * k * n / s / 1e12:7.1f} TFLOP/s", flush=True)
            del a, b, fn
    torch.backends.cuda.preferred_blas_library("cublas")
    if args.triton:
        import torch._inductor.config as inductor_config

        inductor_config.max_autotune_gemm_backends = "TRITON"
        for name in ("mlp_up_fwd 32768x4096x12288", "lm_fwd 10240x4096x151936"):
            m, k, n, _ = SHAPES[name]
            a, b, _ = operands(m, k, n, True)
            compiled = torch.compile(lambda x, y: x @ y.t(), mode="max-autotune-no-cudagraphs", dynamic=False)
            started = time.perf_counter()
            compiled(a, b)
            torch.cuda.synchronize()
            tuning = time.perf_counter() - started
            s = seconds_per_call(lambda compiled=compiled, a=a, b=b: compiled(a, b))
            print(f"triton    {name:30s} {s * 1e3:8.3f} ms {2 * m * k * n / s / 1e12:7.1f} TFLOP/s "
                  f"(autotune {tuning:.0f} s)", flush=True)
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
