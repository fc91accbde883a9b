#!/usr/bin/env python3
"""Which GEMM kernels pipemat's compute gets on this machine, side by side in one run.

pipemat computes with LibTorch from the pinned torch wheel; this script calls the same
libraries (libtorch_cpu) from Python, one thread, on the main job's GEMM shapes
(configs/default.yaml: 1024 rows = 8 sequences x 128 bytes, hidden 128, ffn 512, qkv 384,
vocab 256), and prints for each shape:

* fp32 (MKL): `linear` on float32 tensors, the kernel a float32 run uses (BLAS_INFO=mkl);
* fp32 (oneDNN): oneDNN's float32 inner product (`mkldnn_linear` on oneDNN-layout tensors),
  the float32 alternative the wheel carries;
* fp32 (fp32_precision=bf16): float32 tensors with torch.backends.mkldnn.matmul.fp32_precision
  set to "bf16", which lets oneDNN compute them in bf16;
* bf16: `linear` on bf16 tensors (oneDNN), what a GEMM under `training.precision: bf16` runs;

with GFLOP/s (median of --repeat timings of --iters calls) and the largest absolute error
against the float64 product of the same (float32, or bf16-rounded) inputs. A float32 kernel
is exact float32 when its error is of MKL's order (about 1e-5 here), not bf16's (about 1e-1).
The oneDNN kernel each bf16 GEMM ran (ONEDNN_VERBOSE) is printed at the end, and after the
GEMMs the main job's fused causal attention (scaled_dot_product_attention on q, k, v of
[8 sequences, 4 heads, 128 tokens, 32]) forward, and forward and backward, in both dtypes: why
the GPT keeps its attention in float32 under bf16.

Usage: /opt/pipemat-venv/bin/python scripts/bench-gemm.py [--iters N] [--repeat R]
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

# (rows, in, out): the main job's Linear layers on one micro-batch of 8 x 128 tokens.
SHAPES = [
    (1024, 128, 384, "attn.qkv"),
    (1024, 128, 128, "attn.proj"),
    (1024, 128, 512, "mlp.up"),
    (1024, 512, 128, "mlp.down"),
    (1024, 128, 256, "head"),
]


def median_ms(fn, iters, repeat):
    """The median over `repeat` rounds of one call's time in ms (each round `iters` calls)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times) * 1e3


def median_gflops(fn, flops, iters, repeat):
    return flops / (median_ms(fn, iters, repeat) / 1e3) / 1e9


def measure(args):
    import warnings
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, 1 thread, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    header = f"{'shape':<28}{'kernel':<28}{'GFLOP/s':>9}{'max |err|':>12}"
    print(header)
    print("-" * len(header))
    for rows, k, n, name in SHAPES:
        x, w = torch.randn(rows, k), torch.randn(n, k) * 0.1
        flops = 2.0 * rows * k * n
        exact = (x.double() @ w.double().t())
        xb, wb = x.bfloat16(), w.bfloat16()
        exact_b = (xb.double() @ wb.double().t())
        xm, wm = x.to_mkldnn(), w.to_mkldnn()
        label = f"{name} {rows}x{k}x{n}"
        # (kernel, call, exact result, oneDNN's fp32_precision while it runs)
        results = [
            ("fp32 (MKL)", lambda: F.linear(x, w), exact, "ieee"),
            ("fp32 (oneDNN)", lambda: torch._C._nn.mkldnn_linear(xm, wm, None), exact, "ieee"),
            ("fp32 (fp32_precision=bf16)", lambda: F.linear(x, w), exact, "bf16"),
            ("bf16 (oneDNN)", lambda: F.linear(xb, wb), exact_b, "ieee"),
        ]
        for kernel, fn, ref, precision in results:
            torch.backends.mkldnn.matmul.fp32_precision = precision
            out = fn()
            out = out.to_dense() if out.is_mkldnn else out
            err = (out.double() - ref).abs().max().item()
            gflops = median_gflops(fn, flops, args.iters, args.repeat)
            print(f"{label:<28}{kernel:<28}{gflops:>9.0f}{err:>12.2e}")
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"



def attention(args):
    import torch
    import torch.nn.functional as F
    print(f"\n{'attention [8, 4, 128, 32], causal':<36}{'forward ms':>12}{'fwd+bwd ms':>12}")
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(8, 4, 128, 32, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(8, 4, 128, 32, dtype=dtype)

        def forward():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def forward_backward():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        print(f"{str(dtype).replace('torch.', ''):<36}"
              f"{median_ms(forward, args.iters, args.repeat):>12.2f}"
              f"{median_ms(forward_backward, args.iters, args.repeat):>12.2f}")


def bf16_kernels():
    """The oneDNN implementation of one bf16 GEMM, from a child run with ONEDNN_VERBOSE=1."""
    code = ("import warnings; warnings.filterwarnings('ignore');"
            "import torch; torch.set_num_threads(1);"
            "torch.nn.functional.linear(torch.randn(1024, 128).bfloat16(),"
            " torch.randn(512, 128).bfloat16())")
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        parts = line.split(",")
        if len(parts) > 6 and parts[2] == "primitive" and parts[3] == "exec":
            return f"{parts[5]} {parts[6]}"
    return "unknown (ONEDNN_VERBOSE printed no matmul)"


def main(argv):
    p = argparse.ArgumentParser(prog="bench-gemm.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20, help="calls per timing (default 20)")
    p.add_argument("--repeat", type=int, default=5, help="timings per kernel (default 5)")
    args = p.parse_args(argv)
    if args.iters < 1 or args.repeat < 1:
        p.error("--iters and --repeat must be >= 1")
    measure(args)
    attention(args)
    print(f"\nbf16 GEMMs ran oneDNN's {bf16_kernels()}; load average (1 min) "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
