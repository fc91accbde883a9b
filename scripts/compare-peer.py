#!/usr/bin/env python3
"""The peer benchmark: pipemat's main job against PyTorch's own pipeline runtime.

One command, on this machine and with the torch wheel pipemat builds against:

* pipemat: `pipemat bench pipeline --config configs/default.yaml --json` over MPI, once with
  the config's remat policy (selective) and once with `--set remat.policy=none`. Its JSON gives
  every row: the step time, the bubble, the tracking-allocator peak, each rank's peak resident
  set, the last step's loss, and the single-process references.
* the peer: the same byte-level GPT in plain PyTorch, trained by `torch.distributed.pipelining`
  on 2 ranks over gloo (one process per rank, 1 thread each), and single-process eager runs
  with gradient accumulation, with 1 and with 2 threads.

Both train the model of configs/default.yaml (checked at start; a key that differs is
reported): vocab 256, hidden 128, 4 pre-norm blocks of 4 heads, ffn 512, seq_len 128, dropout
0.05, AdamW lr 0.004 wd 0.01, grad-norm clip 1.0, 20 warm-up steps then cosine to 0.0004, each
step 4 micro-batches of 8 x 128 bytes of Debian's fortunes. The LR schedule spans --steps on
both sides (`pipemat bench` sets training.steps to --steps).

Found while writing it, with torch 2.15 on CPU (see PEER_RECOMPUTE and run_worker):
* The stages get static metadata (example inputs and outputs): without it they infer shapes in
  the first step and exchange them with send/recv_object_list, which needs numpy.
* Selective activation checkpointing (SAC) refuses the zero-bubble schedules' split backward
  (dI, then dW: "Trying to backward an extra time"); those schedules run with a plain per-block
  checkpoint instead, which recomputes a block again for every autograd.grad call the split
  backward makes.

Known differences between the two sides (none changes a shape or a hyper-parameter):
* Dropout: the peer uses nn.Dropout (one generator draw per element); pipemat its counter-based
  dropout (one draw per call, models/src/dropout.cpp), which is several times cheaper on CPU.
* Data: the same text, split and window shape; the offsets come from another generator.
* Selective recompute: pipemat's SAVE regions keep the inputs of attn.qkv and mlp.up as well as
  their outputs; the SAC policy keeps the outputs only (the layer norms before them are rerun).
* The peer's processes are Python: each holds about 0.5 GiB after `import torch` alone.
* bf16 (--precision bf16): pipemat runs `training.precision: bf16` (each stage forward its own
  autocast region; its GPT computes attention in float32 inside it); the peer wraps each stage
  forward in torch.autocast("cpu", bfloat16), so its fused attention runs in bf16. On both
  sides the residual stream, and so what crosses between the stages, stays float32 (the
  float32 embedding plus bf16 branches); the logits are bf16 and the loss is float32.
* pipemat's 2-thread reference runs with OpenMP's default wait policy, the peer's eager-2t with
  OMP_WAIT_POLICY=passive.

The parent process never imports torch; the workers (this script with --worker) do, after
their thread environment is set. Only the standard library and torch are used.
"""

import argparse
import json
import math
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------------------------
# The model and the training hyper-parameters: configs/default.yaml, written out for the peer.
# check_config() compares them with the config pipemat runs and warns about every difference.
# ---------------------------------------------------------------------------------------------
MODEL = {
    "vocab": 256,  # bytes (pipemat: kByteVocab)
    "layers": 4,
    "hidden": 128,
    "heads": 4,
    "ffn": 512,
    "seq_len": 128,
    "batch": 8,  # sequences per micro-batch
    "dropout": 0.05,
}
TRAIN = {
    "micro_batches": 4,
    "lr": 0.004,
    "weight_decay": 0.01,
    "clip_grad_norm": 1.0,
    "warmup": 20,
    "min_lr": 0.0004,
    "seed": 0,
    "data": "/usr/share/games/fortunes",
    "validation": 0.05,
}
TOKENS_PER_STEP = MODEL["batch"] * MODEL["seq_len"] * TRAIN["micro_batches"]  # 4096

# configs/default.yaml keys and the value the peer assumes for each.
CONFIG_EXPECTED = {
    "model.kind": "gpt",
    "model.layers": MODEL["layers"],
    "model.hidden": MODEL["hidden"],
    "model.heads": MODEL["heads"],
    "model.ffn": MODEL["ffn"],
    "model.seq_len": MODEL["seq_len"],
    "model.batch": MODEL["batch"],
    "model.dropout": MODEL["dropout"],
    "data.path": TRAIN["data"],
    "data.validation": TRAIN["validation"],
    "schedule.ranks": 2,
    "schedule.micro_batches": TRAIN["micro_batches"],
    "remat.policy": "selective",
    "training.optimizer": "adamw",
    "training.lr": TRAIN["lr"],
    "training.weight_decay": TRAIN["weight_decay"],
    "training.clip_grad_norm": TRAIN["clip_grad_norm"],
    "training.warmup": TRAIN["warmup"],
    "training.lr_decay": "cosine",
    "training.min_lr": TRAIN["min_lr"],
    "training.seed": TRAIN["seed"],
}

# For `pipemat train --reference` reruns: no checkpoint, sample, validation, metrics or loss curve
# (the main job writes all of them into runs/; `pipemat bench pipeline` leaves them out itself).
PIPEMAT_QUIET_SETS = [
    "checkpoint.dir=",
    "sample.tokens=0",
    "training.eval_every=0",
    "output.metrics=",
    "output.loss_svg=",
    "output.reference_steps=0",
]
PIPEMAT_SCHEDULES = [("1f1b", 2), ("zb-h1", 2), ("zb-v", 4)]  # (kind, stages in all)

# The peer's pipeline schedules. `stages`: stages in all, `layout`: which ranks hold which
# stages ("loop": stage s on rank s % 2; "v": rank 0 holds the first and the last stage).
PEER_SCHEDULES = {
    "1f1b": {"cls": "Schedule1F1B", "stages": 2, "layout": "loop", "label": "1F1B 2st"},
    # ZB1P with one stage per rank is ZB-H1, the schedule of pipemat's main job.
    "izb-2st": {"cls": "ScheduleInterleavedZeroBubble", "stages": 2, "layout": "loop",
                "label": "InterleavedZB 2st"},
    "izb-4st": {"cls": "ScheduleInterleavedZeroBubble", "stages": 4, "layout": "loop",
                "label": "InterleavedZB 4st"},
    "zbv": {"cls": "ScheduleZBVZeroBubble", "stages": 4, "layout": "v",
            "label": "ZBVZeroBubble 4st"},
}
PEER_RECOMPUTE = {
    # Selective activation checkpoint of every block that keeps the outputs of attn.qkv and
    # mlp.up (their addmm), pipemat's `selective` policy; everything else in the block is
    # recomputed in backward.
    "sac": "sac qkv,up",
    # Plain non-reentrant checkpoint of every block: all of it is recomputed. SAC refuses a
    # second backward through a region, which the zero-bubble schedules' split backward (dI,
    # then dW) makes; this is what they can run.
    "block": "block",
    "none": "none",
}

# The thread environment of the peer's processes, by compute threads; set before torch is
# imported. With 2 threads, passive waiting keeps OpenMP's idle thread off the other core.
CHILD_ENV = {
    1: {"OMP_NUM_THREADS": "1"},
    2: {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"},
}

HELP_EPILOG = """\
What runs, in this order (one row each; a variant that fails is a row with the first line of
its error, and the command goes on):
  pipemat  ref-1t, ref-2t      the single-process references of `pipemat bench pipeline` (no
                               pipeline, no remat; LibTorch with 1 and with 2 threads)
  pipemat  KIND/selective      the bench's 1f1b, zb-h1 and zb-v over MPI, 2 ranks x 1 thread,
                               with the config's remat (selective, pre-triggered recompute)
  pipemat  KIND/none           the same with --set remat.policy=none
  peer     eager-1t, eager-2t  plain PyTorch in one process: 4 micro-batches with gradient
                               accumulation per step (as pipemat's --reference); eager-2t runs
                               with OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive
  peer     SCHED/RECOMPUTE     torch.distributed.pipelining, gloo, 2 processes x 1 thread, for
                               SCHED:
                                 1f1b     Schedule1F1B, 2 stages (rank 0: embed + blocks 0-1,
                                          rank 1: blocks 2-3 + head + loss)
                                 izb-2st  ScheduleInterleavedZeroBubble on the same 2 stages
                                          (ZB1P with one stage per rank: ZB-H1, the schedule
                                          of pipemat's main job)
                                 izb-4st  ScheduleInterleavedZeroBubble, 4 stages of one block
                                          (embed on stage 0, head on stage 3), stage s on rank
                                          s % 2
                                 zbv      ScheduleZBVZeroBubble on those 4 stages in a V
                                          (rank 0: stages 0 and 3; rank 1: stages 1 and 2)
                               and RECOMPUTE: sac, block, none (the recompute column)

Columns:
  side       pipemat, or peer (torch.distributed.pipelining and plain PyTorch)
  variant    the name --variants takes after "SIDE/"
  precision  fp32, or bf16 (--precision): pipemat's training.precision; the peer's stage
             forwards inside torch.autocast("cpu", bfloat16)
  schedule   the schedule and its stages in all ("2st": 2 stages, one per rank)
  recompute  none: nothing recomputed.
             selective (pipemat): every block a checkpoint unit, its attn.qkv and mlp.up SAVE
               regions (their outputs and inputs kept), the rest recomputed before backward.
             sac qkv,up (peer): torch.utils.checkpoint per block with a selective-checkpoint
               policy (create_selective_checkpoint_contexts) that saves the addmm outputs of
               attn.qkv and mlp.up and recomputes the rest.
             block (peer): plain non-reentrant torch.utils.checkpoint per block, all of it
               recomputed: what the zero-bubble schedules can run, since SAC refuses their
               split backward (dI, then dW: a second backward through the region).
  ranks      processes
  threads    compute threads per process
  step ms    median step time over the steps after --warmup; a pipeline step is the max over
             ranks (pipemat: its own metric; peer: the ranks start each step together after an
             untimed barrier). A step includes grad clipping and the optimizer.
  tokens/s   4096 tokens per step / step ms
  x-eager1   speed relative to the 1-thread eager row: the peer's eager-1t, or pipemat's ref-1t
             when the peer does not run (the line under the table names it)
  bubble     1 - (time inside compute, summed over ranks) / (ranks x step), median over the
             steps after warm-up. pipemat: its F/B/I/W/R actions (the bench's `bubble`); peer:
             inside the stages' forward_one_chunk, backward_one_chunk and
             backward_weight_one_chunk and the loss. Waits, sends, clipping and the optimizer
             count as bubble on both sides. '-': a single process
  peak RSS/rank MiB  peak resident set per process, rank 0 first, LibTorch's libraries
             included (ru_maxrss on both sides); pipemat's ref-1t/ref-2t: the bench process,
             which ran the earlier reference too
  alloc peak MiB  pipemat only: its tracking allocator's peak within a step, max over ranks
  loss       training loss of the last step (mean over its micro-batches)
"""


def shown_path(path):
    """A path as the rerun commands show it: relative to the repository root when inside it."""
    path = os.path.abspath(path)
    return os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else path


def log(message):
    """A progress line on stderr."""
    print(f"[compare-peer] {message}", file=sys.stderr, flush=True)


def first_line(text):
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return str(text).strip() or "(no message)"


# ---------------------------------------------------------------------------------------------
# Data: pipemat's load_text() and text_windows() (train/src/text_data.cpp), in Python.
# ---------------------------------------------------------------------------------------------
SPLIT_BLOCK = 4096  # pipemat's kSplitBlock


def load_text(path, validation_fraction):
    """The train and validation bytes of a file or of every text file under a directory.

    As pipemat reads it: regular files (symlinks followed) in path order, compared component by
    component like std::filesystem::path; a file whose canonical path was read before is
    skipped, so are empty files and binary ones (a NUL byte). The concatenation is cut into
    4096-byte blocks; block i goes to validation when floor((i + 1) f) > floor(i f).
    Returns (train, validation, files read, binary files skipped).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"data: '{path}' does not exist (Debian's fortunes package: "
                                "apt-get install fortunes; or run scripts/install-deps.sh)")
    if os.path.isdir(path):
        files = []
        for root, _dirs, names in os.walk(path):
            for name in names:
                full = os.path.join(root, name)
                if os.path.isfile(full):
                    files.append(full)
        files.sort(key=lambda p: p.split(os.sep))
    else:
        files = [path]
    seen, texts, read, binary = set(), [], 0, 0
    for file in files:
        real = os.path.realpath(file)
        if real in seen:
            continue
        seen.add(real)
        with open(file, "rb") as f:
            data = f.read()
        if not data:
            continue
        if b"\0" in data:
            binary += 1
            continue
        texts.append(data)
        read += 1
    text = b"".join(texts)
    if not text:
        raise ValueError(f"data: '{path}' holds no text files ({binary} binary files skipped)")
    train, validation = [], []
    for i in range((len(text) + SPLIT_BLOCK - 1) // SPLIT_BLOCK):
        is_val = math.floor((i + 1) * validation_fraction) > math.floor(i * validation_fraction)
        (validation if is_val else train).append(text[i * SPLIT_BLOCK:(i + 1) * SPLIT_BLOCK])
    return b"".join(train), b"".join(validation), read, binary


def window_offsets(text_len, seed, step, micro_batch, batch, span):
    """`batch` window offsets, uniform in [0, len - span], from a generator keyed by (seed, step,
    micro-batch): the same on every rank. (pipemat draws them with std::mt19937_64 from a
    seed_seq; the windows differ, their distribution and shape do not.)"""
    rng = random.Random(f"{seed}/{step}/{micro_batch}")
    return [rng.randint(0, text_len - span) for _ in range(batch)]


# ---------------------------------------------------------------------------------------------
# The config check and the pipemat binary.
# ---------------------------------------------------------------------------------------------
def read_flat_yaml(path):
    """`section.key -> value` of a YAML file of `section:` lines and indented `key: value` lines
    (the form of configs/*.yaml); anything else is ignored."""
    values, section = {}, None
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
            if not line.strip():
                continue
            key, _, value = line.strip().partition(":")
            if line[0] not in " \t":
                section = key
                continue
            if section and value.strip():
                values[f"{section}.{key}"] = value.strip().strip('"').strip("'")
    return values


def check_config(path):
    """Warns on stderr about every key of CONFIG_EXPECTED the config sets differently."""
    try:
        values = read_flat_yaml(path)
    except OSError as e:
        log(f"warning: cannot read {path} ({e}); the peer's model is not checked against it")
        return
    for key, expected in CONFIG_EXPECTED.items():
        if key not in values:
            continue
        got = values[key]
        try:
            same = math.isclose(float(got), float(expected), rel_tol=1e-12)
        except ValueError:
            same = got == str(expected)
        if not same:
            log(f"warning: {shown_path(path)} sets {key}: {got}, the peer trains with "
                f"{expected}: the two sides no longer train the same model")


def pipemat_binary(args):
    binary = args.pipemat or os.path.join(args.build, "launch", "pipemat")
    binary = os.path.abspath(binary)
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        sys.exit(f"compare-peer: error: no pipemat binary at {binary}; build it "
                 "(bash scripts/build.sh --target pipemat) or pass "
                 "--pipemat PATH / --build DIR (or --only peer)")
    launcher = os.path.join(os.path.dirname(binary), "pipemat-run")
    if not os.path.isfile(launcher):
        sys.exit(f"compare-peer: error: no pipemat-run next to {binary}; the MPI runs of "
                 "`pipemat bench pipeline` need it")
    return binary


# ---------------------------------------------------------------------------------------------
# pipemat's side.
# ---------------------------------------------------------------------------------------------
def pipemat_bench_command(binary, config, steps, warmup, schedules, policy_none, precision):
    cmd = [binary, "bench", "pipeline", "--config", config, "--json", "--steps", str(steps),
           "--warmup", str(warmup), "--schedules", ",".join(schedules), "--transports", "mpi",
           "--set", f"training.precision={precision}"]
    if policy_none:
        cmd += ["--set", "remat.policy=none"]
    return cmd


def pipemat_reference_command(binary, config, steps, threads, precision):
    cmd = [binary, "train", "--config", config, "--reference"]
    for s in PIPEMAT_QUIET_SETS + [f"training.steps={steps}", f"training.threads={threads}",
                                   f"training.precision={precision}"]:
        cmd += ["--set", s]
    return cmd


def run_pipemat(args, binary, selected, precision):
    """pipemat's rows in `precision`: one bench run per remat policy (selective, none) that has
    a selected schedule; the references come from the first one."""
    rows, references_done = [], False
    config = shown_path(args.config)  # the bench runs in the repository root
    for policy in ("selective", "none"):
        schedules = [k for k, _ in PIPEMAT_SCHEDULES if selected(f"pipemat/{k}/{policy}")]
        want_refs = not references_done and (
            selected("pipemat/ref-1t") or selected("pipemat/ref-2t"))
        if not schedules and not want_refs:
            continue
        if not schedules:
            schedules = ["1f1b"]  # the bench needs one; its row is dropped below
            keep_schedules = set()
        else:
            keep_schedules = set(schedules)
        cmd = pipemat_bench_command(binary, config, args.steps, args.warmup, schedules,
                                    policy == "none", precision)
        logfile = tempfile.NamedTemporaryFile(prefix="compare-peer-pipemat-", suffix=".log",
                                              delete=False)
        cmd_logged = cmd + ["--log", logfile.name]
        log(f"pipemat: {precision}, remat {policy}: references, then "
            f"{', '.join(schedules)} over mpi ({args.steps} steps each)")
        t0 = time.monotonic()
        proc = subprocess.run(cmd_logged, cwd=REPO, capture_output=True, text=True)
        out, err = proc.stdout, proc.stderr
        seconds = time.monotonic() - t0
        if proc.returncode != 0:
            # The bench prints nothing when a variant fails: every row of this run gets its error.
            message = first_line(err.replace("pipemat: error: ", "")) if err.strip() \
                else f"exit {proc.returncode}"
            kept = os.path.getsize(logfile.name) > 0
            log(f"pipemat: remat {policy} failed after {seconds:.0f} s: {message}" +
                (f" (the ranks' output: {logfile.name})" if kept else ""))
            if not kept:
                os.unlink(logfile.name)
            for threads in (1, 2):
                if want_refs and selected(f"pipemat/ref-{threads}t"):
                    rows.append(pipemat_row(None, 1, "none", precision, threads=threads,
                                            error=message,
                                            rerun=pipemat_reference_command(
                                                shown_path(binary), config, args.steps, threads,
                                                precision)))
            for kind, stages in PIPEMAT_SCHEDULES:
                if kind in keep_schedules:
                    rows.append(pipemat_row(kind, stages, policy, precision, error=message,
                                            rerun=pipemat_bench_command(
                                                shown_path(binary), config, args.steps,
                                                args.warmup, [kind], policy == "none",
                                                precision)))
            references_done = True
            continue
        os.unlink(logfile.name)
        log(f"pipemat: remat {policy} done in {seconds:.0f} s")
        results = json.loads(out)
        for r in results:
            if r["transport"] == "reference":
                threads = int(r["threads"])
                if references_done or not selected(f"pipemat/ref-{threads}t"):
                    if references_done:
                        log(f"pipemat:   (this run's reference with {threads} thread(s): "
                            f"{r['step_ms']:.1f} ms/step; not in the table)")
                    continue
                rows.append(pipemat_row(
                    None, 1, "none", precision, threads=threads, step_ms=r["step_ms"],
                    alloc_peak=r["peak_bytes"], rss=r["resident_peak_bytes"], loss=r["loss"],
                    rerun=pipemat_reference_command(shown_path(binary), config, args.steps,
                                                    threads, precision)))
                continue
            kind = r["schedule"]
            if kind not in keep_schedules:
                continue
            stages = dict(PIPEMAT_SCHEDULES)[kind]
            rows.append(pipemat_row(
                kind, stages, policy, precision, threads=int(r["threads"]),
                step_ms=r["step_ms"], bubble=r["bubble"], alloc_peak=r["peak_bytes"],
                rss=r["resident_peak_bytes"], loss=r["loss"],
                rerun=pipemat_bench_command(shown_path(binary), config, args.steps, args.warmup,
                                            [kind], policy == "none", precision)))
        references_done = True
    return rows


def pipemat_row(kind, stages, policy, precision, threads=1, step_ms=None, bubble=None,
                alloc_peak=None, rss=None, loss=None, error=None, rerun=None):
    reference = kind is None
    return {
        "side": "pipemat",
        "variant": f"ref-{threads}t" if reference else f"{kind}/{policy}",
        "precision": precision,
        "schedule": "-" if reference else f"{kind} {stages}st",
        "recompute": policy,
        "ranks": 1 if reference else 2,
        "threads": threads,
        "step_ms": step_ms,
        "bubble": bubble,
        "rss": [b / 2**20 for b in rss or [] if b],
        "alloc_peak": alloc_peak / 2**20 if alloc_peak else None,
        "loss": loss,
        "error": error,
        "rerun": shlex.join(rerun) if rerun else "",
    }


# ---------------------------------------------------------------------------------------------
# The peer's side: the parent starts the worker processes and reads their results.
# ---------------------------------------------------------------------------------------------
def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_variants():
    """(variant name, worker spec without the run's fields), in the order they run."""
    out = [("eager-1t", {"mode": "eager", "threads": 1}),
           ("eager-2t", {"mode": "eager", "threads": 2})]
    for schedule in PEER_SCHEDULES:
        for recompute in PEER_RECOMPUTE:
            out.append((f"{schedule}/{recompute}",
                        {"mode": "pipeline", "threads": 1, "schedule": schedule,
                         "recompute": recompute}))
    return out


def run_peer_variant(args, name, spec, workdir, precision):
    """Starts the ranks of one peer variant in `precision`, waits for them and returns its
    row."""
    ranks = 2 if spec["mode"] == "pipeline" else 1
    spec = dict(spec, steps=args.steps, warmup=args.warmup, timeout_s=args.peer_timeout,
                attention=args.attention, precision=precision)
    row = {
        "side": "peer", "variant": name, "precision": precision,
        "schedule": PEER_SCHEDULES[spec["schedule"]]["label"] if ranks > 1 else "-",
        "recompute": PEER_RECOMPUTE[spec.get("recompute", "none")],
        "ranks": ranks, "threads": spec["threads"], "step_ms": None, "bubble": None, "rss": [],
        "alloc_peak": None, "loss": None, "error": None,
        "rerun": shlex.join([sys.executable, shown_path(__file__),
                             "--steps", str(args.steps), "--warmup", str(args.warmup),
                             "--attention", args.attention, "--precision", precision,
                             "--only", "peer",
                             "--variants", f"peer/{name}"]),
    }
    port = free_port()
    procs, results, logs = [], [], []
    for rank in range(ranks):
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
        env.update(CHILD_ENV[spec["threads"]])  # read by torch when the worker imports it
        env.update({"RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)})
        base = f"{name.replace('/', '_')}.{precision}"
        result = os.path.join(workdir, f"{base}.rank{rank}.json")
        logpath = os.path.join(workdir, f"{base}.rank{rank}.log")
        spec_path = os.path.join(workdir, f"{base}.spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        results.append(result)
        logs.append(logpath)
        with open(logpath, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", spec_path, result],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO))
    # When a rank fails, its peer may wait for it in gloo for good: end it after a grace time.
    deadline = time.monotonic() + args.peer_timeout
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > 10):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            if now > deadline:
                row["error"] = f"timed out after {args.peer_timeout} s (--peer-timeout)"
        time.sleep(0.2)
    per_rank, failures = [], []
    for rank, (p, result) in enumerate(zip(procs, results)):
        data = None
        if os.path.exists(result):
            with open(result) as f:
                data = json.load(f)
        if data is None:
            # Killed inside LibTorch (gloo's checks end the process): its log's last line says
            # why.
            with open(logs[rank], errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
            failures.append((False, math.inf, rank,
                             f"rank {rank} exited with status {p.returncode}: "
                             f"{lines[-1] if lines else 'no output'}"))
        elif data.get("error"):
            # A peer that saw the other side's socket close only reports the consequence.
            consequence = "Connection reset by peer" in data["error"] or \
                "Connection closed by peer" in data["error"]
            failures.append((consequence, os.path.getmtime(result), rank, data["error"]))
        else:
            per_rank.append(data)
    if failures and not row["error"]:
        # The rank that failed first has the cause; its peer then fails on the closed socket.
        _, _, rank, row["error"] = min(failures)
        row["log"] = logs[rank]
    if row["error"]:
        row.setdefault("log", logs[0])
        return row
    summarize_peer(row, per_rank, args.warmup)
    return row


def summarize_peer(row, per_rank, warmup):
    """Medians over the steps after warm-up: a step takes the max over ranks; its bubble is
    1 - (compute time summed over ranks) / (ranks x step)."""
    steps = len(per_rank[0]["step_ms"])
    step_ms, bubbles = [], []
    for i in range(warmup, steps):
        step = max(r["step_ms"][i] for r in per_rank)
        step_ms.append(step)
        if per_rank[0].get("busy_ms"):
            busy = sum(r["busy_ms"][i] for r in per_rank)
            bubbles.append(1.0 - busy / (len(per_rank) * step))
    row["step_ms"] = statistics.median(step_ms)
    row["step_range"] = (min(step_ms), max(step_ms))
    row["bubble"] = statistics.median(bubbles) if bubbles and len(per_rank) > 1 else None
    row["rss"] = [r["maxrss_mib"] for r in sorted(per_rank, key=lambda r: r["rank"])]
    losses = [r["losses"][-1] for r in per_rank if r.get("losses")]
    row["loss"] = losses[0] if losses else None
    row["torch"] = per_rank[0].get("torch", "")
    row["import_rss"] = [r["import_rss_mib"] for r in per_rank]


# ---------------------------------------------------------------------------------------------
# The peer's worker process: everything that needs torch.
# ---------------------------------------------------------------------------------------------
def lr_at(step, steps):
    """pipemat's lr_at (train/src/model_run.cpp): linear warm-up, then cosine to min_lr over
    the rest of the run."""
    lr, warmup, min_lr = TRAIN["lr"], TRAIN["warmup"], TRAIN["min_lr"]
    if step < warmup:
        return lr * (step + 1) / warmup
    span = steps - 1 - warmup
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def torch_model():
    """The GPT in PyTorch (models/src/gpt.cpp): returns a namespace of its classes and helpers.
    Defined here, not at module level, because only the workers import torch."""
    import functools
    import types

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    hidden, heads, ffn = MODEL["hidden"], MODEL["heads"], MODEL["ffn"]
    aten = torch.ops.aten

    def keep_qkv_and_up(ctx, op, *args, **kwargs):
        """SAC policy: save the GEMM outputs of attn.qkv and mlp.up, recompute everything else.
        A Linear on [batch, seq, in] reaches the dispatcher as addmm(bias, x2d, w.t()); those two
        are the only GEMMs in a block that are 3 x hidden (qkv) or ffn (up) wide."""
        if op in (aten.addmm.default, aten.mm.default):
            weight_t = args[2] if op is aten.addmm.default else args[1]
            if weight_t.shape[-1] in (3 * hidden, ffn):
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    sac_context = functools.partial(create_selective_checkpoint_contexts, keep_qkv_and_up)

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(MODEL["vocab"], hidden)
            self.pos = nn.Embedding(MODEL["seq_len"], hidden)
            self.drop = nn.Dropout(MODEL["dropout"])

        def forward(self, ids):
            return self.drop(self.tok(ids) + self.pos(torch.arange(ids.size(1))).unsqueeze(0))

    class Attention(nn.Module):
        def __init__(self, kernel):
            super().__init__()
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
            self.kernel = kernel  # "sdpa" or "explicit" (--attention)

        def forward(self, x):
            b, t, h = x.shape
            d = h // heads
            q, k, v = self.qkv(x).view(b, t, 3, heads, d).permute(2, 0, 3, 1, 4)
            if self.kernel == "sdpa":  # one fused kernel, no [T, T] tensors
                context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # softmax(q k^T / sqrt(d) + causal mask) v, op by op
                scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)
                future = torch.ones(t, t, dtype=torch.bool).triu(1)
                scores = scores.masked_fill(future, float("-inf"))
                context = torch.matmul(torch.softmax(scores, -1), v)  # [B, heads, T, d]
            return self.proj(context.transpose(1, 2).reshape(b, t, h))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(hidden, ffn)
            self.down = nn.Linear(ffn, hidden)

        def forward(self, x):
            return self.down(F.gelu(self.up(x)))  # exact (erf) GELU, as at::gelu

    class Block(nn.Module):
        def __init__(self, attention):
            super().__init__()
            self.ln1 = nn.LayerNorm(hidden)
            self.attn = Attention(attention)
            self.ln2 = nn.LayerNorm(hidden)
            self.mlp = Mlp()
            self.drop = nn.Dropout(MODEL["dropout"])
            self.recompute = "none"  # or "sac", "block" (PEER_RECOMPUTE)

        def body(self, x):
            h = x + self.drop(self.attn(self.ln1(x)))
            return h + self.drop(self.mlp(self.ln2(h)))

        def forward(self, x):
            if self.recompute == "none" or not torch.is_grad_enabled():
                return self.body(x)
            if self.recompute == "sac":
                return checkpoint(self.body, x, use_reentrant=False, context_fn=sac_context)
            return checkpoint(self.body, x, use_reentrant=False)  # "block": recompute it all

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.out = nn.Linear(hidden, MODEL["vocab"])

        def forward(self, x):
            return self.out(self.norm(x))

    class Stage(nn.Module):
        """Blocks [first, end) of the model, with the embedding first when first == 0 and the
        head last when end == layers (pipemat's GptStage). With bf16 its forward is one
        torch.autocast region to bfloat16 (pipemat: training.precision bf16)."""

        def __init__(self, parts, first, end, bf16=False):
            super().__init__()
            self.embed = parts["embed"] if first == 0 else None
            self.blocks = nn.ModuleList(parts["blocks"][first:end])
            self.head = parts["head"] if end == len(parts["blocks"]) else None
            self.bf16 = bf16

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                return self.body(x)

        def body(self, x):
            if self.embed is not None:
                x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x) if self.head is not None else x

    def init_linear(linear, std):
        nn.init.normal_(linear.weight, 0.0, std)
        nn.init.zeros_(linear.bias)

    def build_gpt(seed, recompute, attention):
        """Every part of the model, built and initialized as pipemat's build_gpt does (same
        order of random draws), on every rank: each rank then keeps its stages."""
        torch.manual_seed(seed)
        with torch.no_grad():
            embed = Embed()
            nn.init.normal_(embed.tok.weight, 0.0, 0.02)
            nn.init.normal_(embed.pos.weight, 0.0, 0.02)
            residual_std = 0.02 / math.sqrt(2.0 * MODEL["layers"])
            blocks = []
            for _ in range(MODEL["layers"]):
                block = Block(attention)
                init_linear(block.attn.qkv, 0.02)
                init_linear(block.attn.proj, residual_std)
                init_linear(block.mlp.up, 0.02)
                init_linear(block.mlp.down, residual_std)
                block.recompute = recompute
                blocks.append(block)
            head = Head()
            init_linear(head.out, 0.02)
        return {"embed": embed, "blocks": blocks, "head": head}

    def loss_fn(logits, targets):  # in float32 under either precision
        return F.cross_entropy(logits.float().reshape(-1, MODEL["vocab"]), targets.reshape(-1))

    return types.SimpleNamespace(torch=torch, Stage=Stage, build_gpt=build_gpt, loss_fn=loss_fn)


def worker_main(spec_path, result_path):
    """One rank of a peer variant (or the single process of an eager one). The parent set the
    environment (threads, OMP_WAIT_POLICY, RANK/WORLD_SIZE/MASTER_*) before this process
    started, so torch reads it at import. Writes {"error": ...} when anything fails."""
    import warnings
    # torch warns at import that it cannot initialize numpy, which is not installed.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    with open(spec_path) as f:
        spec = json.load(f)
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run_worker(spec, rank)
    except BaseException as e:  # noqa: BLE001: the row shows the innermost error's first line
        import traceback
        traceback.print_exc()
        root = e
        while root.__cause__ is not None:
            root = root.__cause__
        result = {"rank": rank, "error": f"{type(root).__name__}: {first_line(root)}"}
        with open(result_path, "w") as f:
            json.dump(result, f)
        sys.exit(1)
    with open(result_path, "w") as f:
        json.dump(result, f)


def run_worker(spec, rank):
    import resource
    from datetime import timedelta

    m = torch_model()
    torch = m.torch
    torch.set_num_threads(spec["threads"])
    import_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    train, _val, _files, _binary = load_text(TRAIN["data"], TRAIN["validation"])
    span = MODEL["seq_len"] + 1
    M = TRAIN["micro_batches"]

    def micro_batch(step, i):
        """(ids, targets) [batch, seq_len] int64: windows of span bytes, targets shifted by 1."""
        offsets = window_offsets(len(train), TRAIN["seed"], step, i, MODEL["batch"], span)
        data = bytearray(b"".join(train[o:o + span] for o in offsets))
        windows = torch.frombuffer(data, dtype=torch.uint8).long().view(MODEL["batch"], span)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    parts = m.build_gpt(TRAIN["seed"], spec.get("recompute", "none"), spec["attention"])
    steps = spec["steps"]
    out = {"rank": rank, "torch": torch.__version__, "import_rss_mib": import_rss,
           "step_ms": [], "busy_ms": [], "losses": []}
    if spec["mode"] == "eager":
        model = m.Stage(parts, 0, MODEL["layers"], bf16=spec["precision"] == "bf16")
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=TRAIN["lr"], weight_decay=TRAIN["weight_decay"])
        for step in range(steps):
            batches = [micro_batch(step, i) for i in range(M)]
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for ids, targets in batches:  # gradient accumulation over the micro-batches
                loss = m.loss_fn(model(ids), targets) / M
                loss_sum += loss.item()
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, TRAIN["clip_grad_norm"])
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, steps)
            optimizer.step()
            out["step_ms"].append((time.perf_counter() - t0) * 1e3)
            out["losses"].append(loss_sum)
        out["busy_ms"] = []
        out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return out

    import torch.distributed as dist
    from torch.distributed import pipelining

    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec["timeout_s"]))
    try:
        sched_info = PEER_SCHEDULES[spec["schedule"]]
        n_stages = sched_info["stages"]
        if sched_info["layout"] == "v":  # rank r: stages r and n - 1 - r
            mine = sorted({rank, n_stages - 1 - rank})
        else:  # loop: stage s on rank s % world
            mine = [s for s in range(n_stages) if s % world == rank]
        per_stage = MODEL["layers"] // n_stages
        modules = [m.Stage(parts, s * per_stage, (s + 1) * per_stage,
                           bf16=spec["precision"] == "bf16") for s in mine]

        # Static stage metadata: the shapes of every stage's input and output. Without them
        # the stages infer the shapes in the first step and exchange them with
        # send/recv_object_list, which needs numpy (not installed here).
        # With bf16 the logits are bf16 (the head's GEMM under autocast); the residual stream
        # between the stages stays float32 (the float32 embedding plus the blocks' branches).
        b, t, h = MODEL["batch"], MODEL["seq_len"], MODEL["hidden"]
        logits_dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32

        def example_input(s):
            return torch.zeros(b, t, dtype=torch.long) if s == 0 else \
                torch.zeros(b, t, h, requires_grad=True)

        def example_output(s):
            if s == n_stages - 1:
                return torch.zeros(b, t, MODEL["vocab"], dtype=logits_dtype, requires_grad=True)
            return torch.zeros(b, t, h, requires_grad=True)

        stages = [pipelining.PipelineStage(mod, s, n_stages, torch.device("cpu"),
                                           input_args=example_input(s),
                                           output_args=example_output(s))
                  for mod, s in zip(modules, mine)]
        cls = getattr(pipelining, sched_info["cls"])
        if cls is pipelining.Schedule1F1B:
            schedule = cls(stages[0], n_microbatches=M, loss_fn=m.loss_fn)
        else:
            schedule = cls(stages, n_microbatches=M, loss_fn=m.loss_fn)
        params = [p for mod in modules for p in mod.parameters()]
        optimizer = torch.optim.AdamW(params, lr=TRAIN["lr"], weight_decay=TRAIN["weight_decay"])

        # The bubble's "busy": wall time inside each stage's compute calls and the loss.
        busy = [0.0]

        def timed(fn):
            def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    busy[0] += time.perf_counter() - t
            return wrapper

        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, timed(getattr(stage, name)))
        schedule._compute_loss = timed(schedule._compute_loss)

        first, last = 0 in mine, n_stages - 1 in mine
        for step in range(steps):
            batches = [micro_batch(step, i) for i in range(M)]
            kwargs = {"return_outputs": False}
            if first:
                kwargs["arg_mbs"] = [(ids,) for ids, _ in batches]
            losses = []
            if last:
                kwargs["target_mbs"] = [targets for _, targets in batches]
                kwargs["losses"] = losses
            dist.barrier()  # every rank starts the step together; not timed
            busy[0] = 0.0
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            schedule.step(**kwargs)
            clip_global_grad_norm(torch, dist, params, TRAIN["clip_grad_norm"])
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, steps)
            optimizer.step()
            out["step_ms"].append((time.perf_counter() - t0) * 1e3)
            out["busy_ms"].append(busy[0] * 1e3)
            if last:
                out["losses"].append(sum(loss.item() for loss in losses) / len(losses))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def clip_global_grad_norm(torch, dist, params, max_norm):
    """Clips the gradients of every rank's parameters by their global L2 norm (one all-reduce),
    as pipemat's clip_grad_norm does over its ranks and torch.nn.utils.clip_grad_norm_ in one
    process."""
    grads = [p.grad for p in params if p.grad is not None]
    square = torch.zeros((), dtype=torch.float32)
    for g in grads:
        square += g.detach().pow(2).sum()
    dist.all_reduce(square)
    coef = torch.clamp(max_norm / (square.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef)


# ---------------------------------------------------------------------------------------------
# The table.
# ---------------------------------------------------------------------------------------------
COLUMNS = ["side", "variant", "precision", "schedule", "recompute", "ranks", "threads",
           "step ms",
           "tokens/s", "x-eager1", "bubble", "peak RSS/rank MiB", "alloc peak MiB", "loss"]


def format_rows(rows, baseline_ms):
    table = []
    for r in rows:
        cells = [r["side"], r["variant"], r["precision"], r["schedule"], r["recompute"],
                 str(r["ranks"]), str(r["threads"])]
        if r["error"]:
            table.append(cells + ["FAILED: " + r["error"][:160]])
            continue
        cells += [
            f"{r['step_ms']:.1f}",
            f"{TOKENS_PER_STEP / r['step_ms'] * 1e3:,.0f}",
            f"{baseline_ms[r['precision']] / r['step_ms']:.2f}x"
            if baseline_ms.get(r["precision"]) else "-",
            f"{r['bubble']:.3f}" if r["bubble"] is not None else "-",
            " / ".join(f"{v:.0f}" for v in r["rss"]) if r["rss"] else "-",
            f"{r['alloc_peak']:.2f}" if r["alloc_peak"] is not None else "-",
            f"{r['loss']:.4f}" if r["loss"] is not None else "-",
        ]
        table.append(cells)
    # Widths from every cell but an error message, which runs to the end of its line.
    widths = [max([len(c)] + [len(row[i]) for row in table
                              if i < len(row) - (len(row) < len(COLUMNS))])
              for i, c in enumerate(COLUMNS)]
    numeric = set(range(5, len(COLUMNS)))

    def line(cells):
        parts = []
        for i, cell in enumerate(cells):
            if len(cells) < len(COLUMNS) and i == len(cells) - 1:
                parts.append(cell)  # an error runs to the end of the line
            elif i in numeric:
                parts.append(cell.rjust(widths[i]))
            else:
                parts.append(cell.ljust(widths[i]))
        return "  ".join(parts).rstrip()

    return "\n".join([line(COLUMNS)] + [line(row) for row in table])


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="compare-peer.py",
        description="The peer benchmark: pipemat's main job (configs/default.yaml, a byte-level\n"
                    "GPT on 2 pipeline ranks) against torch.distributed.pipelining training the\n"
                    "same model in PyTorch, and both against one process. One table on stdout,\n"
                    "progress on stderr; then one command per variant to rerun it.",
        epilog=HELP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, metavar="N",
                   help="steps per variant, warm-up included (default 20)")
    p.add_argument("--warmup", type=int, default=5, metavar="W",
                   help="first steps left out of the medians (default 5)")
    p.add_argument("--build", default=os.path.join(REPO, "build"), metavar="DIR",
                   help="pipemat's build directory (default: build in the repository)")
    p.add_argument("--pipemat", metavar="PATH",
                   help="the pipemat binary (default: BUILD/launch/pipemat); pipemat-run must be "
                        "next to it")
    p.add_argument("--config", metavar="YAML",
                   default=os.path.join(REPO, "configs", "default.yaml"),
                   help="pipemat's config (default configs/default.yaml); the peer's model is "
                        "written into this script and checked against it")
    p.add_argument("--only", choices=["pipemat", "peer"], help="run one side only")
    p.add_argument("--variants", metavar="LIST",
                   help="comma-separated SIDE/VARIANT names to run (e.g. peer/eager-1t,"
                        "peer/zbv/block,pipemat/zb-h1/selective); default: all")
    p.add_argument("--peer-timeout", type=int, default=600, metavar="S",
                   help="seconds a peer variant may take before its ranks are killed "
                        "(default 600)")
    p.add_argument("--attention", choices=["sdpa", "explicit"], default="sdpa",
                   help="the peer's attention kernel: sdpa (F.scaled_dot_product_attention, "
                        "is_causal: the fused kernel pipemat's GPT calls; default) or explicit "
                        "(matmul, causal mask, softmax, matmul)")
    p.add_argument("--precision", default="fp32", metavar="LIST",
                   help="comma-separated precisions to run every selected variant in: fp32, "
                        "bf16 (default fp32; e.g. fp32,bf16 for both, side by side)")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.warmup < 0 or args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must be more than --warmup {args.warmup} (>= 0)")
    args.precisions = [v.strip() for v in args.precision.split(",") if v.strip()]
    bad = [v for v in args.precisions if v not in ("fp32", "bf16")]
    if bad or not args.precisions:
        p.error(f"--precision {args.precision}: each entry must be fp32 or bf16")
    args.config = os.path.abspath(args.config)
    return args


def main(argv):
    args = parse_args(argv)
    if args.worker:
        worker_main(*args.worker)
        return 0
    t_start, load_start = time.monotonic(), os.getloadavg()[0]
    wanted = set(v.strip() for v in args.variants.split(",")) if args.variants else None
    known = {f"peer/{name}" for name, _ in peer_variants()} | {"pipemat/ref-1t", "pipemat/ref-2t"}
    known |= {f"pipemat/{k}/{p}" for k, _ in PIPEMAT_SCHEDULES for p in ("selective", "none")}
    if wanted and wanted - known:
        sys.exit(f"compare-peer: error: unknown --variants {', '.join(sorted(wanted - known))}; "
                 f"known: {', '.join(sorted(known))}")

    def selected(name):
        side = name.split("/")[0]
        return (args.only in (None, side)) and (wanted is None or name in wanted)

    run_pipemat_side = any(selected(n) for n in known if n.startswith("pipemat/"))
    run_peer_side = any(selected(n) for n in known if n.startswith("peer/"))
    binary = pipemat_binary(args) if run_pipemat_side else None
    if run_pipemat_side and not os.path.isfile(args.config):
        sys.exit(f"compare-peer: error: no config at {args.config}")
    try:
        train, val, files, binaries = load_text(TRAIN["data"], TRAIN["validation"])
    except (OSError, ValueError) as e:
        sys.exit(f"compare-peer: error: {e}")
    log(f"text: {len(train) / 2**20:.2f} MiB train / {len(val) / 2**10:.2f} KiB validation from "
        f"{files} files of {TRAIN['data']} ({binaries} binary files skipped)")
    check_config(args.config)

    rows = []
    if run_pipemat_side:
        for precision in args.precisions:
            rows += run_pipemat(args, binary, selected, precision)
    torch_versions, import_rss = set(), []
    if run_peer_side:
        with tempfile.TemporaryDirectory(prefix="compare-peer-") as workdir:
            for precision, (name, spec) in ((p, v) for p in args.precisions
                                            for v in peer_variants()):
                if not selected(f"peer/{name}"):
                    continue
                log(f"peer: {name} in {precision}: starting ({args.steps} steps)")
                t0 = time.monotonic()
                row = run_peer_variant(args, name, spec, workdir, precision)
                seconds = time.monotonic() - t0
                if row["error"]:
                    log(f"peer: {name}: FAILED after {seconds:.0f} s: {row['error']}")
                    with open(row.pop("log"), errors="replace") as f:  # its traceback
                        for line in f.read().strip().splitlines()[-8:]:
                            log(f"peer:   | {line}")
                else:
                    torch_versions.add(row.pop("torch", ""))
                    import_rss += row.pop("import_rss", [])
                    low, high = row.pop("step_range")
                    log(f"peer: {name}: {row['step_ms']:.1f} ms/step (after warm-up: "
                        f"{low:.0f}-{high:.0f}), loss {row['loss']:.4f} ({seconds:.0f} s)")
                rows.append(row)

    # x-eager1: against the peer's 1-thread eager run of the same precision, or pipemat's
    # 1-thread reference.
    baselines = {}
    for precision in args.precisions:
        baseline = next((r for r in rows if r["side"] == "peer" and r["variant"] == "eager-1t"
                         and r["precision"] == precision and not r["error"]), None) or \
            next((r for r in rows if r["side"] == "pipemat" and r["variant"] == "ref-1t"
                  and r["precision"] == precision and not r["error"]), None)
        if baseline:
            baselines[precision] = baseline
    print(format_rows(rows, {p: b["step_ms"] for p, b in baselines.items()}))
    print()
    print(f"{TOKENS_PER_STEP} tokens per step (4 micro-batches x 8 x 128); medians over steps "
          f"{args.warmup + 1}-{args.steps} of {args.steps}.")
    for precision, baseline in baselines.items():
        print(f"x-eager1 ({precision}): relative to {baseline['side']} {baseline['variant']} "
              f"in {precision} ({baseline['step_ms']:.1f} ms/step).")
    if any(r["side"] == "peer" for r in rows):
        print(f"peer: torch {', '.join(sorted(v for v in torch_versions if v)) or '?'}, CPU, gloo; "
              "every rank/process starts with OMP_NUM_THREADS=1 (eager-2t: OMP_NUM_THREADS=2 "
              "OMP_WAIT_POLICY=passive) and torch.set_num_threads(threads).")
        print(f"peer: attention kernel {args.attention} (--attention; pipemat's GPT: sdpa).")
        if import_rss:
            print(f"peer: a worker holds {min(import_rss):.0f}-{max(import_rss):.0f} MiB RSS "
                  "after `import torch` alone (before its model and data).")
    if any(r["side"] == "pipemat" for r in rows):
        print("pipemat: `bench pipeline` (it leaves out the config's checkpoints, sample, "
              "validation and output files); ref-1t/ref-2t peak RSS: the bench process.")
    minutes, seconds = divmod(time.monotonic() - t_start, 60)
    print(f"wall time: {int(minutes)} min {seconds:.0f} s; load average (1 min) {load_start:.2f} "
          f"at the start, {os.getloadavg()[0]:.2f} at the end, on {os.cpu_count()} CPUs: "
          "anything else running shows in the step times")
    print()
    print("Rerun one variant (from the repository root):")
    for r in rows:
        print(f"  {r['side']}/{r['variant']} ({r['precision']}): {r['rerun']}")
    return 0  # a variant that failed is a row of the table, not a failed command


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
