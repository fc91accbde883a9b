#!/usr/bin/env python3
"""A model of real size: a SmolLM-135M-shaped Llama trained by pipemat, checked against
transformers (the helper of scripts/bench-smollm.sh, which finds the binaries and the Python).

1. Builds a random LlamaForCausalLM of SmolLM-135M's shape with transformers (30 layers, hidden
   576, 9 heads, 3 key/value heads, ffn 1536, vocab 49152, tied embeddings, RMSNorm eps 1e-5,
   RoPE theta 10000; torch.manual_seed(--seed), the initializer's weights unchanged) and saves
   it with save_pretrained in float32 into WORKDIR/hf.
2. Trains it with pipemat (model.from and training.init_from = WORKDIR/hf) for --steps steps on
   --ranks ranks (build/launch/pipemat-run, Open MPI): bf16, remat.policy selective,
   schedule.recompute pretrigger, --schedule over --micro-batches micro-batches of --batch
   windows of --seq-len tokens of --data (data.path, Debian's fortunes) encoded by --tokenizer
   (data.tokenizer; the repo's byte-level BPE configs/tokenizers/fortunes-bpe by default, 2,048
   ids, below the vocabulary of 49152; `none`: the text's bytes are the ids); its summary gives
   the tokens/s and each rank's peak memory.
3. The single process: output.reference_steps (--reference-steps) makes the last stage's rank
   run the same model and batch in one process after training (pipemat train --reference, with
   the faster of 1 thread and all cores) and the summary prints its tokens/s and peak beside
   the pipeline's, and the ratio largest-rank peak / one-process peak.
4. The first step's loss against transformers on the same batch (llama_hf_check writes the
   windows the training reads; the step's loss is the mean of its micro-batches' mean losses,
   all of one size, so the mean over the batch):
   - fp32: a separate 1-step run of the same pipeline in float32 against transformers in
     float32: within --fp32-tol relative (1e-5; --no-fp32-check skips that run);
   - bf16: the bf16 run's first loss against transformers under torch.autocast(cpu, bfloat16)
     with float32 weights (what pipemat's bf16 does: Note [Mixed precision]): within
     --bf16-tol relative (1e-3). Not bitwise: the two round to bf16 at different places
     (pipemat runs the attention core in float32 inside the bf16 region, transformers' autocast
     in bf16; kernels sum in other orders), each logit to about 2^-9 of itself, and the loss
     averages those errors over the batch's 4,096 tokens (measured: 2.9e-6 relative on
     the BPE tokens, 4.7e-6 on bytes). 1e-3 leaves over 300 times that and still fails the loss
     of uniform logits (a head that is zero or not applied): the random model's first loss lies
     0.08 above ln 49152 on the BPE tokens (7e-3 relative), 0.17 on bytes;
   - pipemat's float32 logits of the first micro-batch (llama_hf_check, one stage) against
     transformers': within --logits-tol absolute.
   Exit 1 when one differs (77: torch, transformers or safetensors is not installed).
5. Prints a summary block: the machine (lscpu), the load, tokens/s, each rank's peak, the
   single process's peak and tokens/s, the ratio, the losses, the phases' times.
"""
import argparse
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

SMOLLM = dict(layers=30, hidden=576, heads=9, kv_heads=3, ffn=1536, vocab=49152)


def parse_args():
    ap = argparse.ArgumentParser(
        prog="bench-smollm.sh",
        description="Train a SmolLM-135M-shaped Llama (random weights from transformers) with "
                    "pipemat on 4 ranks in bf16 with selective recompute, print tokens/s and "
                    "each rank's peak memory beside one process's, and check the first step's "
                    "loss against transformers on the same batch (exit 1 when it differs).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/pipemat-bench-smollm",
                    help="where the model, configs, logs and metrics go (the model directory "
                         "WORKDIR/hf is rebuilt each run)")
    ap.add_argument("--ranks", type=int, default=4, help="pipeline ranks (schedule.ranks)")
    ap.add_argument("--steps", type=int, default=3, help="bf16 training steps")
    ap.add_argument("--schedule", default="zb-h1", choices=["1f1b", "zb-h1"],
                    help="schedule.kind")
    ap.add_argument("--micro-batches", type=int, default=8, help="schedule.micro_batches")
    ap.add_argument("--batch", type=int, default=2, help="model.batch: windows per micro-batch")
    ap.add_argument("--seq-len", type=int, default=256, help="model.seq_len")
    ap.add_argument("--reference-steps", type=int, default=3,
                    help="output.reference_steps: steps of the single process after training "
                         "(its time is the median of the last two thirds); 0: not measured")
    ap.add_argument("--layers", type=int, default=SMOLLM["layers"],
                    help="num_hidden_layers (30 is SmolLM-135M; fewer for a quick smoke run)")
    ap.add_argument("--rope-theta", type=float, default=10000.0, help="rope_theta")
    ap.add_argument("--seed", type=int, default=0,
                    help="torch.manual_seed of the random weights and training.seed")
    ap.add_argument("--lr", type=float, default=3e-4, help="training.lr (AdamW, no warmup)")
    ap.add_argument("--data", default="/usr/share/games/fortunes",
                    help="data.path: a text file or a directory of them")
    ap.add_argument("--tokenizer", default=os.path.normpath(os.path.join(
                        os.path.dirname(os.path.abspath(__file__)), "..", "configs", "tokenizers",
                        "fortunes-bpe")),
                    help="data.tokenizer (a tokenizer.json, a SentencePiece .model or a "
                         "directory); none: the text's bytes are the ids")
    ap.add_argument("--fp32-tol", type=float, default=1e-5,
                    help="relative tolerance of the fp32 first-step loss")
    ap.add_argument("--bf16-tol", type=float, default=1e-3,
                    help="relative tolerance of the bf16 first-step loss")
    ap.add_argument("--logits-tol", type=float, default=1e-4,
                    help="absolute tolerance of the first micro-batch's float32 logits")
    ap.add_argument("--no-fp32-check", action="store_true",
                    help="skip the 1-step fp32 pipeline run and its check")
    ap.add_argument("--pipemat", required=True, help="build/launch/pipemat (bench-smollm.sh gives it)")
    ap.add_argument("--pipemat-run", required=True, help="build/launch/pipemat-run (bench-smollm.sh gives it)")
    ap.add_argument("--check", required=True, help="build/tests/train/llama_hf_check (bench-smollm.sh gives it)")
    return ap.parse_args()


def load_average():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], stdout=subprocess.PIPE, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (lscpu failed)"
    model = re.search(r"^Model name:\s*(.+)$", out, re.M)
    return model.group(1).strip() if model else "unknown"


def run(cmd, log_path, quiet=False):
    """Runs cmd, its output to the terminal (unless quiet) and to log_path; returns the output.
    Exits with the command's code when it fails."""
    print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    lines = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            lines.append(line)
            log.write(line)
            if not quiet:
                print("  " + line, end="", flush=True)
        code = proc.wait()
    if code != 0:
        if quiet:
            print("".join(lines[-20:]), end="")
        sys.exit(f"bench-smollm: {cmd[0]} exited {code} (log: {log_path})")
    return "".join(lines)


def write_config(path, a, hf_dir, precision, steps, reference_steps, metrics):
    tokenizer = "" if a.tokenizer == "none" else f"  tokenizer: {a.tokenizer}\n"
    with open(path, "w") as f:
        f.write(f"""# Written by scripts/bench_smollm.py: a SmolLM-135M-shaped Llama from {hf_dir}.
model:
  kind: llama
  from: {hf_dir}
  seq_len: {a.seq_len}
  batch: {a.batch}
data:
  path: {a.data}
  validation: 0.05
{tokenizer}schedule:
  kind: {a.schedule}
  ranks: {a.ranks}
  micro_batches: {a.micro_batches}
  recompute: pretrigger
remat:
  policy: selective
  early_stop: true
transport:
  kind: auto
  timeout: 900
training:
  steps: {steps}
  optimizer: adamw
  lr: {a.lr}
  weight_decay: 0.01
  clip_grad_norm: 1.0
  warmup: 0
  lr_decay: none
  eval_every: 0
  seed: {a.seed}
  precision: {precision}
  init_from: {hf_dir}
checkpoint:
  dir: ""
sample:
  tokens: 0
output:
  metrics: {metrics}
  loss_svg: ""
  progress: true
  reference_steps: {reference_steps}
""")


def metrics_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def format_bytes(b):
    """As pipemat's summary writes them: 2 decimals in KiB, MiB or GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b} B"


def plural(n, word):
    return f"{n} {word}" + ("" if n == 1 else "s")


def main():
    a = parse_args()
    t_start = time.time()
    phases = []

    def phase(name, since):
        phases.append((name, time.time() - since))

    machine = cpu_model()
    cores = os.cpu_count()
    load_start = load_average()
    print(f"bench-smollm: {machine}, {cores} CPUs, load average {load_start} at the start",
          flush=True)

    try:
        import torch
        import torch.nn.functional as F
        from safetensors.torch import load_file
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        print(f"bench-smollm: {e}; scripts/install-deps.sh installs torch, transformers and "
              "safetensors")
        return 77
    hf_logging.disable_progress_bar()

    work = os.path.abspath(a.workdir)
    os.makedirs(work, exist_ok=True)
    hf_dir = os.path.join(work, "hf")
    shutil.rmtree(hf_dir, ignore_errors=True)

    # 1. The model: transformers' own random initialization, float32.
    t = time.time()
    torch.manual_seed(a.seed)
    cfg = LlamaConfig(vocab_size=SMOLLM["vocab"], hidden_size=SMOLLM["hidden"],
                      intermediate_size=SMOLLM["ffn"], num_hidden_layers=a.layers,
                      num_attention_heads=SMOLLM["heads"], num_key_value_heads=SMOLLM["kv_heads"],
                      max_position_embeddings=max(2048, a.seq_len), rms_norm_eps=1e-5,
                      rope_theta=a.rope_theta, tie_word_embeddings=True, hidden_act="silu",
                      attention_bias=False, mlp_bias=False)
    model = LlamaForCausalLM(cfg).float()
    assert model.lm_head.weight is model.model.embed_tokens.weight, "transformers did not tie"
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(hf_dir)
    del model
    phase("model (transformers, save_pretrained)", t)
    print(f"bench-smollm: a random LlamaForCausalLM of {params:,} parameters "
          f"(seed {a.seed}) -> {hf_dir}", flush=True)

    bf16_yaml = os.path.join(work, "bf16.yaml")
    bf16_metrics = os.path.join(work, "bf16-metrics.jsonl")
    write_config(bf16_yaml, a, hf_dir, "bf16", a.steps, a.reference_steps, bf16_metrics)
    fp32_yaml = os.path.join(work, "fp32.yaml")
    fp32_metrics = os.path.join(work, "fp32-metrics.jsonl")
    write_config(fp32_yaml, a, hf_dir, "fp32", 1, 0, fp32_metrics)

    # The windows of step 1 as the training reads them, and pipemat's float32 logits of the
    # first micro-batch (one stage, the weights of init_from).
    t = time.time()
    windows_file = os.path.join(work, "windows.safetensors")
    run([a.check, bf16_yaml, windows_file, "1"], os.path.join(work, "llama_hf_check.log"))
    got = load_file(windows_file)
    ids = [got[f"ids.0.{mb}"] for mb in range(a.micro_batches)]
    nxt = [got[f"next.0.{mb}"] for mb in range(a.micro_batches)]
    for i, n in zip(ids, nxt):
        assert i.shape == (a.batch, a.seq_len) and torch.equal(i[:, 1:], n[:, :-1])
    max_id = max(int(x.max()) for x in ids + nxt)
    assert max_id < SMOLLM["vocab"], f"id {max_id} is outside the vocabulary"
    phase("llama_hf_check (windows, fp32 logits of micro-batch 1)", t)

    # 2 + 3. The bf16 run and the single process.
    t = time.time()
    load_before = load_average()
    print(f"bench-smollm: load average {load_before} before the bf16 run", flush=True)
    out = run([a.pipemat_run, "-n", str(a.ranks), bf16_yaml],
              os.path.join(work, "bf16.log"))
    load_after = load_average()
    phase(f"pipemat bf16: {plural(a.steps, 'step')} on {a.ranks} ranks"
          + (f", then {a.reference_steps} of the single process" if a.reference_steps else ""), t)
    summary = [l for l in out.splitlines() if l.startswith("summary: ")]
    single = [l for l in out.splitlines() if l.startswith("single process (")]
    assert summary, "the bf16 run printed no summary line"
    m = re.search(r"([0-9.]+[kM]?) tokens/s \(median step ([0-9.]+) ms\)", summary[0])
    pipe_tps, pipe_median = m.group(1), m.group(2)
    bf16_steps = metrics_lines(bf16_metrics)
    assert len(bf16_steps) == a.steps, f"{len(bf16_steps)} steps in {bf16_metrics}"
    ranks_peak = [0] * a.ranks
    for s in bf16_steps:
        for r in range(a.ranks):
            ranks_peak[r] = max(ranks_peak[r], s["rank_start_bytes"][r] + s["rank_peak_bytes"][r])
    step_ms = [s["step_ms"] for s in bf16_steps]
    ref = None
    if single:
        r = re.search(r"\): ([0-9.]+[kM]?) tokens/s \(([0-9.]+) ms per step\), peak memory "
                      r"([0-9.]+ [KMG]?i?B); the pipeline: ([0-9.]+)x the tokens/s, ([0-9.]+)x "
                      r"the peak memory", single[0])
        threads = re.search(r"in one process, (\d+) threads?", single[0])
        ref = dict(tps=r.group(1), ms=r.group(2), peak=r.group(3), speed=r.group(4),
                   ratio=r.group(5), threads=threads.group(1))

    # 4. The fp32 first step on the same pipeline.
    fp32_loss = None
    if not a.no_fp32_check:
        t = time.time()
        run([a.pipemat_run, "-n", str(a.ranks), fp32_yaml], os.path.join(work, "fp32.log"))
        fp32_loss = metrics_lines(fp32_metrics)[0]["loss"]
        phase(f"pipemat fp32: 1 step on {a.ranks} ranks", t)

    # transformers on the same batch: float32, and bf16 autocast over float32 weights.
    t = time.time()
    torch.set_num_threads(cores)
    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf.eval()
    hf_fp32, hf_bf16 = [], []
    with torch.no_grad():
        for mb in range(a.micro_batches):
            logits = hf(ids[mb]).logits
            if mb == 0:
                logits_diff = (got["logits"] - logits).abs().max().item()
                logits_std = logits.std().item()
            hf_fp32.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           nxt[mb].reshape(-1)).item())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                lb = hf(ids[mb]).logits
            hf_bf16.append(F.cross_entropy(lb.float().reshape(-1, lb.shape[-1]),
                                           nxt[mb].reshape(-1)).item())
            del logits, lb
    hf_fp32_loss = sum(hf_fp32) / len(hf_fp32)
    hf_bf16_loss = sum(hf_bf16) / len(hf_bf16)
    phase(f"transformers: {a.micro_batches} micro-batches in fp32 and in bf16 autocast", t)

    bf16_loss = bf16_steps[0]["loss"]
    rel_bf16 = abs(bf16_loss - hf_bf16_loss) / hf_bf16_loss
    failures = []
    if rel_bf16 > a.bf16_tol:
        failures.append(f"bf16 first loss {bf16_loss:.7f} vs transformers {hf_bf16_loss:.7f}: "
                        f"{rel_bf16:.3g} relative > {a.bf16_tol:g}")
    if logits_diff > a.logits_tol:
        failures.append(f"float32 logits of micro-batch 1 differ by {logits_diff:.3g} > "
                        f"{a.logits_tol:g}")
    if fp32_loss is not None:
        rel_fp32 = abs(fp32_loss - hf_fp32_loss) / hf_fp32_loss
        if rel_fp32 > a.fp32_tol:
            failures.append(f"fp32 first loss {fp32_loss:.7f} vs transformers "
                            f"{hf_fp32_loss:.7f}: {rel_fp32:.3g} relative > {a.fp32_tol:g}")

    # 5. The summary block.
    total = time.time() - t_start
    tokens_per_step = a.micro_batches * a.batch * a.seq_len
    id_words = ("the text's bytes" if a.tokenizer == "none" else
           f"ids of {os.path.basename(os.path.normpath(a.tokenizer))}, at most {max_id}")
    ln_vocab = math.log(SMOLLM["vocab"])
    lines = [
        "",
        "=== bench-smollm: a model of real size ===",
        f"machine:        {machine}, {cores} CPUs (lscpu); load average {load_start} at the "
        f"start, {load_before} before the bf16 run, {load_after} after it, {load_average()} at "
        f"the end",
        f"model:          LlamaForCausalLM, SmolLM-135M's shape: {a.layers} layers, hidden "
        f"{SMOLLM['hidden']}, {SMOLLM['heads']} heads ({SMOLLM['kv_heads']} key/value), ffn "
        f"{SMOLLM['ffn']}, vocab {SMOLLM['vocab']}, tied; {params:,} parameters, random "
        f"(torch seed {a.seed}), float32 weights",
        f"run:            {a.ranks} ranks under mpirun, {a.schedule}, {a.micro_batches} "
        f"micro-batches x {a.batch} x {a.seq_len} = {tokens_per_step} tokens a step ({id_words}), "
        f"bf16, selective recompute pretriggered, AdamW lr {a.lr:g}",
        f"pipeline:       {pipe_tps} tokens/s over {plural(a.steps, 'step')} (median step "
        f"{pipe_median} ms; steps {', '.join(f'{ms / 1000:.1f}' for ms in step_ms)} s)",
        "peak per rank:  " + ", ".join(format_bytes(b) for b in ranks_peak) + "  (bytes: " +
        ", ".join(str(b) for b in ranks_peak) + "; tensors: weights, gradients, AdamW state, "
        "activations, received messages)",
    ]
    if ref:
        lines += [
            f"one process:    {ref['tps']} tokens/s ({ref['ms']} ms a step, "
            f"{plural(int(ref['threads']), 'thread')}, median of the last {a.reference_steps - a.reference_steps // 3} of "
            f"{a.reference_steps} steps), peak {ref['peak']} (output.reference_steps)",
            f"ratio:          largest rank / one process = {ref['ratio']}x the peak memory; "
            f"the pipeline {ref['speed']}x the tokens/s",
        ]
    else:
        lines.append("one process:    not measured (--reference-steps 0)")
    lines += [
        f"losses (bf16):  " + ", ".join(f"{s['loss']:.6f}" for s in bf16_steps) +
        f" (ln {SMOLLM['vocab']} = {ln_vocab:.6f})",
        f"first step:     bf16 pipemat {bf16_loss:.7f}, transformers bf16 autocast "
        f"{hf_bf16_loss:.7f}: {rel_bf16:.2e} relative (tolerance {a.bf16_tol:g})",
    ]
    if fp32_loss is not None:
        lines.append(f"first step:     fp32 pipemat {fp32_loss:.7f} ({a.ranks} ranks, 1 step), "
                     f"transformers fp32 {hf_fp32_loss:.7f}: {rel_fp32:.2e} relative "
                     f"(tolerance {a.fp32_tol:g})")
    else:
        lines.append(f"first step:     fp32 not run (--no-fp32-check); transformers fp32 "
                     f"{hf_fp32_loss:.7f}")
    lines += [
        f"logits:         micro-batch 1, float32, pipemat (one stage) vs transformers: max "
        f"|diff| {logits_diff:.2e} (tolerance {a.logits_tol:g}; logits std {logits_std:.3f})",
        "times:          " + "; ".join(f"{n} {s:.0f} s" for n, s in phases),
        f"total:          {total:.0f} s ({total / 60:.1f} min); logs and metrics in {work}",
    ]
    lines.append("result:         " + ("FAILED: " + "; ".join(failures) if failures else
                                       "the first step's loss agrees with transformers"))
    print("\n".join(lines), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
