#!/usr/bin/env python3
"""Where a training step's time goes, per rank: samples the CPU of every pipemat process with
`perf` while `pipemat-run` (or `pipemat train --reference`) trains, keeps the samples of the
steps after the warm-up, sorts each sample's function into a category (GEMM, attention,
element-wise, optimizer, memory, comm, runtime, ...) and prints milliseconds per step per
category and rank; what no category holds (off CPU) is the rank's idle time: waiting on a peer,
the bubble.

    python3 scripts/step-breakdown.py                                  # the main job, 2 ranks
    python3 scripts/step-breakdown.py --reference                      # one process, 1 thread
    python3 scripts/step-breakdown.py --set remat.policy=selective     # any config override

Needs Linux `perf` (Debian: linux-perf) and a built pipemat (build/launch). Sampling costs the
run a few percent. Ranks are numbered by process start order (mpirun starts rank 0 first).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (category, pattern over "dso symbol"); the first match wins, so the narrow ones come first.
CATEGORIES = [
    ("gemm", r"sgemm|dgemm|gemm_kernel|mkl_blas|cblas|at::native::cpublas|brgemm"),
    ("attention", r"flash_attention|scaled_dot_product|softmax"),
    ("optimizer", r"adam|Adam|_foreach|optim::"),
    ("memory", r"malloc|_int_free|free$|cfree|unlink_chunk|malloc_consolidate|memset|"
               r"page_fault|clear_page|do_anonymous_page|handle_mm_fault|alloc_pages|"
               r"memcg|folio|zap_|tracking_allocator|CPUAllocator|alloc_cpu|free_cpu"),
    ("comm", r"libmpi|libopen-pal|libopen-rte|mca_|btl_|vader|pipemat::comm|boost::asio|tcp_|"
             r"sock_|process_vm"),
    ("element-wise", r"TensorIterator|VectorizedLoop|vectorized_|Vectorized<|cpu_kernel|"
                     r"_kernel_impl|Kernel|Sleef|layer_norm|LayerNorm|RowwiseMoments|gelu|"
                     r"GeluKernel|copy_|fill_|add_kernel|mul_kernel|div_|masked|reduce|sum_|"
                     r"embedding|index_|scatter|gather|cross_entropy|nll_loss|log_softmax|"
                     r"counter_dropout|fill_noise|direct_copy|unary|binary|where"),
    ("runtime", r"libtorch|libc10|pipemat|c10::|at::|torch::|libstdc\+\+|libgomp|"
                r"std::|ld-linux|libc\.so"),
    ("kernel", r"kernel\.kallsyms|\[k\]"),
    # Code generated at run time (perf-PID.map): MKL's and oneDNN's just-in-time kernels.
    ("jit", r"perf-\d+\.map"),
]
ORDER = [c for c, _ in CATEGORIES] + ["other"]


def category(dso, sym):
    text = dso + " " + sym
    for name, pattern in CATEGORIES:
        if re.search(pattern, text):
            return name
    return "other"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--config", default=os.path.join(ROOT, "configs/default.yaml"))
    p.add_argument("--build", default=os.path.join(ROOT, "build"),
                   help="build directory with launch/pipemat and launch/pipemat-run")
    p.add_argument("--ranks", type=int, default=2, help="processes for pipemat-run (default 2)")
    p.add_argument("--reference", action="store_true",
                   help="one process: pipemat train --reference (training.threads applies)")
    p.add_argument("--steps", type=int, default=30, help="steps trained (default 30)")
    p.add_argument("--warmup", type=int, default=10,
                   help="steps left out of the samples (default 10)")
    p.add_argument("--frequency", type=int, default=999, help="samples per second per CPU")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override passed to pipemat (repeatable)")
    p.add_argument("--top", type=int, default=0,
                   help="also print the N hottest functions per rank")
    return p.parse_args()


def main():
    a = parse_args()
    if a.warmup >= a.steps:
        sys.exit(f"step-breakdown: --warmup {a.warmup} must be below --steps {a.steps}")
    if not shutil.which("perf"):
        sys.exit("step-breakdown: `perf` is not installed (Debian: apt-get install linux-perf)")
    binary = os.path.join(a.build, "launch", "pipemat")
    if not os.access(binary, os.X_OK):
        sys.exit(f"step-breakdown: no pipemat at {binary}; build first (bash scripts/build.sh) "
                 "or give --build")
    work = tempfile.mkdtemp(prefix="pipemat-breakdown-")
    sets = [f"training.steps={a.steps}", "training.eval_every=0", "sample.tokens=0",
            f"checkpoint.dir={work}/checkpoints", f"output.metrics={work}/metrics.jsonl",
            "output.loss_svg=", "output.progress=true"] + a.set
    set_args = [x for s in sets for x in ("--set", s)]
    if a.reference:
        cmd = [binary, "train", "--config", a.config, "--reference"] + set_args
    else:
        cmd = [os.path.join(a.build, "launch", "pipemat-run"), "-n", str(a.ranks), a.config,
               "--"] + set_args
    data = os.path.join(work, "perf.data")
    perf = ["perf", "record", "-a", "-k", "CLOCK_MONOTONIC", "-F", str(a.frequency), "-o", data,
            "-q", "--"] + cmd
    print("step-breakdown: " + " ".join(cmd), file=sys.stderr)
    # The window: from the line of step `warmup` to the line of the last step (both printed when
    # the step ends), so the samples are those of steps warmup+1 .. steps.
    start = stop = None
    step_re = re.compile(r"^step (\d+)/(\d+)")
    proc = subprocess.Popen(perf, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        sys.stderr.write("  " + line)
        m = step_re.match(line)
        if m:
            n = int(m.group(1))
            if n == a.warmup:
                start = time.monotonic()
            if n == a.steps:
                stop = time.monotonic()
    if proc.wait() != 0 or start is None or stop is None:
        sys.exit(f"step-breakdown: the run failed or printed no step lines (exit "
                 f"{proc.returncode}); its output is above, its files in {work}")
    steps = a.steps - a.warmup
    # One line per sample: "pid/tid time: ip symbol (dso)"; threads count to their process.
    script = subprocess.run(
        ["perf", "script", "-i", data, "--comm", "pipemat", "--time", f"{start:.6f},{stop:.6f}",
         "-F", "pid,tid,time,ip,sym,dso"], capture_output=True, text=True)
    if script.returncode != 0:
        sys.exit("step-breakdown: perf script failed: " + script.stderr.strip())
    per_pid = defaultdict(lambda: defaultdict(int))
    functions = defaultdict(lambda: defaultdict(int))
    row = re.compile(r"^\s*(\d+)/\d+\s+[\d.]+:\s+[0-9a-f]+\s+(.*)\s+\(([^()]*)\)\s*$")
    for line in script.stdout.splitlines():
        m = row.match(line)
        if not m:
            continue
        pid, sym, dso = int(m.group(1)), m.group(2), os.path.basename(m.group(3))
        per_pid[pid][category(dso, sym)] += 1
        functions[pid][f"{dso} {sym}"] += 1
    if not per_pid:
        sys.exit("step-breakdown: no samples of a pipemat process in the window")
    window_ms = (stop - start) * 1000.0
    step_ms = window_ms / steps
    ms = 1000.0 / a.frequency / steps  # one sample, in ms per step
    pids = sorted(per_pid)
    name = "rank" if not a.reference else "process"
    print(f"\nsteps {a.warmup + 1}-{a.steps} ({steps} steps, {step_ms:.1f} ms per step); "
          f"ms per step on CPU, by category; idle = step - on CPU")
    header = f"{'category':<14}" + "".join(f"{name + ' ' + str(i):>12}" for i in range(len(pids)))
    print(header)
    for c in ORDER:
        if any(per_pid[p][c] for p in pids):
            print(f"{c:<14}" + "".join(f"{per_pid[p][c] * ms:>12.1f}" for p in pids))
    busy = [sum(per_pid[p].values()) * ms for p in pids]
    print(f"{'on CPU':<14}" + "".join(f"{b:>12.1f}" for b in busy))
    print(f"{'idle':<14}" + "".join(f"{max(0.0, step_ms - b):>12.1f}" for b in busy))
    for i, p in enumerate(pids[: len(pids)] if a.top else []):
        print(f"\n{name} {i}: hottest functions (ms per step)")
        for f, s in sorted(functions[p].items(), key=lambda kv: -kv[1])[: a.top]:
            print(f"  {s * ms:8.2f}  {category(*f.split(' ', 1)):<13} {f[:110]}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
