#!/usr/bin/env python3
"""The peer benchmark: pipemat against PyTorch's own pipeline runtime, on one model.

One command, on this machine and with the torch wheel pipemat builds against:

* pipemat: `pipemat bench pipeline --config CONFIG --json` over MPI, once with the config's
  remat policy (selective) and once with `--set remat.policy=none`. Its JSON gives every row:
  the step time, the bubble, the tracking-allocator peak, each rank's peak resident set, the
  last step's loss, and the single-process references.
* the peer: the same model in plain PyTorch, trained by `torch.distributed.pipelining` on 2
  ranks over gloo (one process per rank, 1 thread each), and single-process eager runs with
  gradient accumulation, with 1 and with 2 threads.

The model (--model; checked at start against pipemat's config with the preset's overrides: a key
that differs is reported):
* main (default): configs/default.yaml's GPT, vocab 256, hidden 128, 4 pre-norm blocks of 4
  heads, ffn 512, seq_len 128, dropout 0.05; 0.88 M parameters.
* gpt-48m: the same GPT with 12 blocks, hidden 576, 9 heads of 64, ffn 1536, seq_len 256, vocab
  256: 37.7 M parameters (the name is the preset's; 4 x hidden = 2304 as ffn would make 47.9 M).
  pipemat: configs/default.yaml with --set model.layers=12 model.hidden=576 model.heads=9
  model.ffn=1536 model.seq_len=256.
* smollm-135m: a Llama of SmolLM-135M's shape: 30 blocks, hidden 576, 9 query heads and 3
  key/value heads of 64, SwiGLU ffn 1536, vocab 49152, tied embeddings, RMSNorm eps 1e-5, rope
  theta 10000, no biases, no dropout, seq_len 256: 134.5 M parameters. pipemat:
  configs/llama.yaml with --set of those model keys and data.tokenizer= (bytes). The peer's
  Llama is written here with torch alone (RMSNorm in float32, RoPE, SwiGLU MLP, grouped-query
  attention by repeating the key/value heads into scaled_dot_product_attention, the head
  multiplying by the embedding's weight), as models/src/llama.cpp computes it.
Every preset: AdamW lr 0.004 wd 0.01, grad-norm clip 1.0, 20 warm-up steps then cosine to
0.0004, each step 4 micro-batches of 8 sequences. The LR schedule spans --steps on both sides
(`pipemat bench` sets training.steps to --steps).

Data: both sides train on the bytes of Debian's fortunes (pipemat's byte-level text, the same
split and window shape; the offsets come from another generator). With smollm-135m's vocab of
49152 the ids are still bytes, 0-255: the embedding's other rows are ones no byte uses
(pipemat's model.vocab), on both sides; their compute (the 49152-wide head) is the real one.

Stages: both sides split the blocks as pipemat does with partition.layers_per_stage empty
(pp::balance_by_size: contiguous blocks balanced by parameter count, the embedding counted with
the first block and the head with the last; with tied embeddings over several stages the last
stage holds a copy of the embedding, whose gradient is summed with the first stage's every
step and counted once in the clipping norm). The split is printed under the table.

Schedules (--schedules): pipemat's schedule.kind values, each with the peer's counterpart in
torch.distributed.pipelining, and peer-only entries (HELP_EPILOG has the table): gpipe
(ScheduleGPipe), 1f1b (Schedule1F1B), interleaved (ScheduleInterleaved1F1B; pipemat with 2
stages per rank, in a bench run of its own), zb-h1 (ScheduleInterleavedZeroBubble on one stage
per rank), zb-h2 (no peer counterpart: said under the table), zb-v (ScheduleZBVZeroBubble);
peer only: izb-4st (ScheduleInterleavedZeroBubble on 4 stages), bfs-4st (ScheduleLoopedBFS),
dualpipev (ScheduleDualPipeV). Without --schedules: 1f1b, zb-h1, izb-4st, zb-v, the rows the
script ran before the option (with --variants and no --schedules: every entry).

Pipeline efficiency (column `pipe eff`): (the same side's 1-thread single-process step ms in
the same precision: pipemat's ref-1t, the peer's eager-1t) / (ranks x threads) / (the row's
step ms). For the pipelines (2 ranks x 1 thread) that is ref / 2 / step.

MFU (column `MFU`): model FLOPs per step / step time / (ranks x threads x R), with
  model FLOPs per step = 6 N T + 12 L h S T
N the parameters in GEMMs (all but the embedding tables that are only looked up: the GPT's token
and position tables, an untied Llama's embedding; a tied embedding counts, as the head), T the
tokens per step (4 x 8 x seq_len), L the blocks, h the hidden size, S seq_len. 6 N T: forward
and backward of every GEMM weight; 12 L h S T: attention's q k^T and its product with v,
forward and backward, without the causal mask's savings (as PaLM and Megatron count it).
Recompute is not counted (the model FLOPs, not the hardware FLOPs). R is the GEMM rate of one
core in the row's precision: by default (--gemm-gflops auto) measured after the runs in a
1-thread worker, on the model's forward GEMM shapes of one micro-batch (8 x seq_len rows), each
timed by scripts/bench-gemm.py's median_gflops (float32: F.linear on float32 tensors, MKL;
bf16: on bf16 tensors, oneDNN) and weighted by its calls per micro-batch; or given as
--gemm-gflops FP32[,BF16]; --gemm-gflops off leaves the column empty.

Found while writing it, with torch 2.15 on CPU (see PEER_RECOMPUTE and run_worker):
* The stages get static metadata (example inputs and outputs): without it they infer shapes in
  the first step and exchange them with send/recv_object_list, which needs numpy.
* Selective activation checkpointing (SAC) refuses the zero-bubble schedules' split backward
  (dI, then dW: "Trying to backward an extra time"); those schedules run with a plain per-block
  checkpoint instead, which recomputes a block again for every autograd.grad call the split
  backward makes. The same holds for ScheduleDualPipeV.

Known differences between the two sides (none changes a shape or a hyper-parameter):
* Dropout (GPT): the peer uses nn.Dropout (one generator draw per element); pipemat its
  counter-based dropout (one draw per call, models/src/dropout.cpp), which is several times
  cheaper on CPU. The Llama has none.
* Data: the same text, split and window shape; the offsets come from another generator.
* Selective recompute: pipemat's SAVE regions keep the inputs of the saved GEMMs as well as
  their outputs; the SAC policy keeps the outputs only (the norms before them are rerun). The
  GPT's policy finds attn.qkv and mlp.up by their output width; the Llama's finds q/k/v_proj
  and gate/up_proj by the module running (q_proj and o_proj have the same shape).
* The peer's processes are Python: each holds about 0.5 GiB after `import torch` alone.
* bf16 (--precision bf16): pipemat runs `training.precision: bf16` (each stage forward its own
  autocast region; its GPT and Llama compute attention in float32 inside it); the peer wraps
  each stage forward in torch.autocast("cpu", bfloat16), so its fused attention runs in bf16. On
  both sides the residual stream, and so what crosses between the stages, stays float32 (the
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
# The models (--model) and the training hyper-parameters, written out for the peer.
# check_config() compares them with the config pipemat runs (plus the preset's --set overrides)
# and warns about every difference.
# ---------------------------------------------------------------------------------------------
# Each preset: the config pipemat starts from, the model both sides train, and the model keys
# pipemat gets as `--set model.KEY=VALUE` on top of that config ("main" needs none).
PRESETS = {
    # configs/default.yaml's GPT: 0.88 M parameters.
    "main": {
        "config": "configs/default.yaml",
        "model": {
            "kind": "gpt",
            "vocab": 256,  # bytes (pipemat: kByteVocab)
            "layers": 4,
            "hidden": 128,
            "heads": 4,
            "ffn": 512,
            "seq_len": 128,
            "batch": 8,  # sequences per micro-batch
            "dropout": 0.05,
        },
        "sets": [],
    },
    # The GPT of configs/default.yaml, wider and deeper: 37.7 M parameters (12 blocks of 3.1 M;
    # with ffn 4 x hidden = 2304 it would be 47.9 M).
    "gpt-48m": {
        "config": "configs/default.yaml",
        "model": {
            "kind": "gpt",
            "vocab": 256,
            "layers": 12,
            "hidden": 576,
            "heads": 9,  # head size 64
            "ffn": 1536,
            "seq_len": 256,
            "batch": 8,
            "dropout": 0.05,
        },
        "sets": ["layers", "hidden", "heads", "ffn", "seq_len"],
    },
    # A Llama of SmolLM-135M's shape (HuggingFaceTB/SmolLM-135M's config.json): 134.5 M
    # parameters, 28.3 M of them the tied embedding. Trained on the same bytes: ids 256..49151
    # are rows no byte uses (pipemat's model.vocab).
    "smollm-135m": {
        "config": "configs/llama.yaml",
        "model": {
            "kind": "llama",
            "vocab": 49152,
            "layers": 30,
            "hidden": 576,
            "heads": 9,  # head size 64
            "kv_heads": 3,
            "ffn": 1536,
            "seq_len": 256,
            "batch": 8,
            "rope_theta": 10000.0,
            "norm_eps": 1e-5,
            "tie_embeddings": True,
            "dropout": 0.0,
        },
        "sets": ["layers", "hidden", "heads", "kv_heads", "ffn", "seq_len", "vocab",
                 "tie_embeddings", "norm_eps", "rope_theta"],
        # Bytes, not configs/llama-bpe.yaml's tokenizer: the peer reads the same bytes.
        "extra_sets": ["data.tokenizer="],
    },
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


def yaml_value(value):
    """A value as a `--set KEY=VALUE` and the YAML configs spell it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def preset_sets(preset):
    """The `--set` overrides that give pipemat the preset's model (none for main)."""
    p = PRESETS[preset]
    return [f"model.{key}={yaml_value(p['model'][key])}" for key in p["sets"]] + \
        p.get("extra_sets", [])


def tokens_per_step(model):
    return model["batch"] * model["seq_len"] * TRAIN["micro_batches"]  # main: 4096


def config_expected(model):
    """The config keys that must hold what the peer assumes, and those values."""
    keys = ["kind", "layers", "hidden", "heads", "ffn", "seq_len", "batch", "vocab", "dropout"]
    if model["kind"] == "llama":
        keys += ["kv_heads", "rope_theta", "norm_eps", "tie_embeddings"]
    expected = {f"model.{k}": model[k] for k in keys}
    if model["kind"] == "llama":
        expected["data.tokenizer"] = ""  # bytes
    expected.update({
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
    })
    return expected


# ---------------------------------------------------------------------------------------------
# Parameter counts, the stage split and the model FLOPs, from the shape alone (the parent never
# imports torch; the workers check these counts against their modules).
# ---------------------------------------------------------------------------------------------
def layer_parameters(model):
    """(embedding, one block, head) parameter counts. The head: the final norm and the output
    GEMM's weight (with tied embeddings none of its own)."""
    h, v, f = model["hidden"], model["vocab"], model["ffn"]
    if model["kind"] == "gpt":
        embed = v * h + model["seq_len"] * h  # tok, pos
        block = (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        head = 2 * h + h * v + v  # norm, out (with bias)
        return embed, block, head
    d = h // model["heads"]
    q, kv = model["heads"] * d, model["kv_heads"] * d
    block = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h  # q, k, v, o, gate, up, down, norms
    head = h + (0 if model["tie_embeddings"] else h * v)
    return v * h, block, head


def parameter_counts(model):
    """(all parameters, those in GEMMs): the embedding tables that are only looked up (the GPT's
    tok and pos, an untied Llama's embed_tokens) are not GEMM weights; a tied embedding is, as
    the head."""
    embed, block, head = layer_parameters(model)
    total = embed + model["layers"] * block + head
    lookup_only = embed if model["kind"] == "gpt" or not model["tie_embeddings"] else 0
    return total, total - lookup_only


def model_flops_per_step(model):
    """6 N T + 12 L h S T: N the GEMM parameters (parameter_counts), T the tokens of a step, L
    the blocks, h the hidden size, S the sequence length. 6 N per token is the forward and
    backward of the GEMMs (2 + 4 FLOPs per weight); 12 L h S per token is attention's q k^T and
    its product with v, forward and backward, counted without the causal mask (as PaLM's
    appendix B and Megatron count it)."""
    t = tokens_per_step(model)
    _, gemm = parameter_counts(model)
    return 6 * gemm * t + 12 * model["layers"] * model["hidden"] * model["seq_len"] * t


def stage_layer_sizes(model, stages):
    """The size of each block for the split, as pipemat's partition_gpt / partition_llama count
    them: the embedding counted with the first block, the head with the last (a tied head over
    several stages: the last stage's copy of the embedding)."""
    embed, block, head = layer_parameters(model)
    sizes = [float(block)] * model["layers"]
    sizes[0] += embed
    if model["kind"] == "llama" and model["tie_embeddings"] and stages > 1:
        head += embed
    sizes[-1] += head
    return sizes


def balance_by_size(sizes, stages):
    """pipemat's pp::balance_by_size (pp/src/stages.cpp): contiguous stages of about equal total
    size; returns the stage bounds [0, ..., len(sizes)]. Same double arithmetic, same order."""
    n = len(sizes)
    if n < stages:
        raise ValueError(f"the model has {n} layers but the schedule has {stages} stages")
    total = 0.0
    for s in sizes:
        total += s
    bounds, running, i = [0], 0.0, 0
    for s in range(stages - 1):
        target = total * (s + 1) / stages
        while True:
            running += sizes[i]
            i += 1
            if not (i < n - (stages - 1 - s) and running + 0.5 * sizes[i] <= target):
                break
        bounds.append(i)
    bounds.append(n)
    return bounds


def stage_bounds(model, stages):
    return balance_by_size(stage_layer_sizes(model, stages), stages)


def gemm_shapes(model):
    """The forward GEMMs of one micro-batch, (rows, in, out, name, calls per step and
    micro-batch): the shapes scripts/bench-gemm.py times, for this model."""
    rows, h, f, v, L = model["batch"] * model["seq_len"], model["hidden"], model["ffn"], \
        model["vocab"], model["layers"]
    if model["kind"] == "gpt":
        return [(rows, h, 3 * h, "attn.qkv", L), (rows, h, h, "attn.proj", L),
                (rows, h, f, "mlp.up", L), (rows, f, h, "mlp.down", L), (rows, h, v, "head", 1)]
    d = h // model["heads"]
    q, kv = model["heads"] * d, model["kv_heads"] * d
    return [(rows, h, q, "q_proj", L), (rows, h, kv, "k_proj, v_proj", 2 * L),
            (rows, q, h, "o_proj", L), (rows, h, f, "gate_proj, up_proj", 2 * L),
            (rows, f, h, "down_proj", L), (rows, h, v, "head", 1)]


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
# pipemat's interleaved schedule runs with this many stages per rank: 4 stages on 2 ranks, as
# zb-v and the peer's 4-stage schedules. `pipemat bench pipeline` gives one config to all its
# schedules and the others refuse virtual_stages above 1, so interleaved is a bench run of its
# own (which runs the single-process references again).
INTERLEAVED_VIRTUAL_STAGES = 2

# The peer's pipeline schedules. `stages`: stages in all, `layout`: which ranks hold which
# stages ("loop": stage s on rank s % 2; "v": rank 0 holds the first and the last stage).
PEER_SCHEDULES = {
    "gpipe": {"cls": "ScheduleGPipe", "stages": 2, "layout": "loop", "label": "GPipe 2st"},
    "1f1b": {"cls": "Schedule1F1B", "stages": 2, "layout": "loop", "label": "1F1B 2st"},
    "i1f1b-4st": {"cls": "ScheduleInterleaved1F1B", "stages": 4, "layout": "loop",
                  "label": "Interleaved1F1B 4st"},
    "bfs-4st": {"cls": "ScheduleLoopedBFS", "stages": 4, "layout": "loop",
                "label": "LoopedBFS 4st"},
    # ZB1P with one stage per rank is ZB-H1, the schedule of pipemat's main job.
    "izb-2st": {"cls": "ScheduleInterleavedZeroBubble", "stages": 2, "layout": "loop",
                "label": "InterleavedZB 2st"},
    "izb-4st": {"cls": "ScheduleInterleavedZeroBubble", "stages": 4, "layout": "loop",
                "label": "InterleavedZB 4st"},
    "zbv": {"cls": "ScheduleZBVZeroBubble", "stages": 4, "layout": "v",
            "label": "ZBVZeroBubble 4st"},
    "dualpipev": {"cls": "ScheduleDualPipeV", "stages": 4, "layout": "v",
                  "label": "DualPipeV 4st"},
}

# What --schedules takes: pipemat's schedule.kind values, each with the stages pipemat runs it
# on and the peer schedules that are its counterpart, and the peer's schedules that have no
# pipemat counterpart (pipemat None). `note`: printed under the table when selected.
SCHEDULE_KINDS = {
    "gpipe": {"pipemat": 2, "peer": ["gpipe"]},
    "1f1b": {"pipemat": 2, "peer": ["1f1b"]},
    "interleaved": {"pipemat": 4, "peer": ["i1f1b-4st"]},
    "zb-h1": {"pipemat": 2, "peer": ["izb-2st"]},
    "zb-h2": {"pipemat": 2, "peer": [],
              "note": "zb-h2: torch.distributed.pipelining has no ZB-H2 schedule (pipemat rows "
                      "only)"},
    "zb-v": {"pipemat": 4, "peer": ["zbv"]},
    "izb-4st": {"pipemat": None, "peer": ["izb-4st"],
                "note": "izb-4st: peer only (an interleaved zero-bubble schedule; pipemat's "
                        "interleaved does not split the backward)"},
    "bfs-4st": {"pipemat": None, "peer": ["bfs-4st"],
                "note": "bfs-4st: peer only (ScheduleLoopedBFS, breadth-first over the looped "
                        "stages; pipemat's gpipe is its one-stage-per-rank form)"},
    "dualpipev": {"pipemat": None, "peer": ["dualpipev"],
                  "note": "dualpipev: peer only (ScheduleDualPipeV; pipemat's V schedule is "
                          "zb-v)"},
}
# Without --schedules: today's rows (pipemat 1f1b, zb-h1, zb-v; the peer's 1f1b, izb-2st,
# izb-4st, zbv).
DEFAULT_SCHEDULES = ["1f1b", "zb-h1", "izb-4st", "zb-v"]
PIPEMAT_KINDS = [k for k, v in SCHEDULE_KINDS.items() if v["pipemat"]]

PEER_RECOMPUTE = {
    # Selective activation checkpoint of every block that keeps the outputs of the GEMMs that
    # pipemat's `selective` policy saves (gpt: attn.qkv and mlp.up, their addmm; llama:
    # q/k/v_proj and gate/up_proj, their mm); everything else in the block is recomputed in
    # backward.
    "sac": {"gpt": "sac qkv,up", "llama": "sac qkv,gate,up"},
    # Plain non-reentrant checkpoint of every block: all of it is recomputed. SAC refuses a
    # second backward through a region, which the zero-bubble schedules' split backward (dI,
    # then dW) makes; this is what they can run.
    "block": "block",
    "none": "none",
}


def recompute_label(recompute, kind):
    label = PEER_RECOMPUTE[recompute]
    return label[kind] if isinstance(label, dict) else label

# The thread environment of the peer's processes, by compute threads; set before torch is
# imported. With 2 threads, passive waiting keeps OpenMP's idle thread off the other core.
CHILD_ENV = {
    1: {"OMP_NUM_THREADS": "1"},
    2: {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"},
}

HELP_EPILOG = """\
Models (--model; every row of a run trains the same one):
  main         configs/default.yaml's byte-level GPT: 4 blocks, hidden 128, 4 heads, ffn 512,
               seq_len 128; 0.88 M parameters (the default)
  gpt-48m      the same GPT with 12 blocks, hidden 576, 9 heads of 64, ffn 1536, seq_len 256,
               vocab 256: 37.7 M parameters; pipemat: configs/default.yaml with
               --set model.layers=12 model.hidden=576 model.heads=9 model.ffn=1536
               model.seq_len=256
  smollm-135m  a Llama of SmolLM-135M's shape: 30 blocks, hidden 576, 9 heads, 3 key/value
               heads, ffn 1536 (SwiGLU), vocab 49152, tied embeddings, RMSNorm eps 1e-5, rope
               theta 10000, seq_len 256: 134.5 M parameters; pipemat: configs/llama.yaml with
               --set model.layers=30 ... model.tie_embeddings=true data.tokenizer=
  Every model: micro-batches of 8 sequences, 4 per step, trained on the bytes of Debian's
  fortunes (byte ids 0-255; smollm-135m's ids 256-49151 are embedding rows no byte uses).

What runs, in this order (one row each; a variant that fails is a row with the first line of
its error, and the command goes on; with --rounds N all of it N times, the even rounds with the
peer's variants first, and each row the median over the rounds):
  pipemat  ref-1t, ref-2t      the single-process references of `pipemat bench pipeline` (no
                               pipeline, no remat; LibTorch with 1 and with 2 threads)
  pipemat  KIND/selective      the bench's KIND (each pipemat kind of --schedules) over MPI,
                               2 ranks x 1 thread, with the config's remat (selective,
                               pre-triggered recompute); interleaved with 2 stages per rank
  pipemat  KIND/none           the same with --set remat.policy=none
  peer     eager-1t, eager-2t  plain PyTorch in one process: 4 micro-batches with gradient
                               accumulation per step (as pipemat's --reference); eager-2t runs
                               with OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive
  peer     SCHED/RECOMPUTE     torch.distributed.pipelining, gloo, 2 processes x 1 thread, for
                               the SCHED of each --schedules entry, and RECOMPUTE: sac, block,
                               none (the recompute column)

--schedules (comma list; default 1f1b,zb-h1,izb-4st,zb-v; `all`: every entry below):
  entry        pipemat (schedule.kind)        peer SCHED (torch.distributed.pipelining)
  gpipe        gpipe, 2 stages                gpipe      ScheduleGPipe, 2 stages
  1f1b         1f1b, 2 stages                 1f1b       Schedule1F1B, 2 stages
  interleaved  interleaved, 4 stages           i1f1b-4st  ScheduleInterleaved1F1B, 4 stages,
               (virtual_stages 2)                         stage s on rank s % 2
  zb-h1        zb-h1, 2 stages                izb-2st    ScheduleInterleavedZeroBubble on 2
                                                         stages (ZB1P with one stage per rank
                                                         is ZB-H1)
  zb-h2        zb-h2, 2 stages                (none: torch has no ZB-H2)
  zb-v         zb-v, 4 stages in a V          zbv        ScheduleZBVZeroBubble on 4 stages in
                                                         a V (rank 0: stages 0 and 3; rank 1:
                                                         stages 1 and 2)
  izb-4st      (none)                         izb-4st    ScheduleInterleavedZeroBubble, 4
                                                         stages, stage s on rank s % 2
  bfs-4st      (none)                         bfs-4st    ScheduleLoopedBFS, 4 stages, stage s
                                                         on rank s % 2
  dualpipev    (none)                         dualpipev  ScheduleDualPipeV, 4 stages in a V
  Both sides split the blocks into stages as pipemat does (partition.layers_per_stage empty:
  contiguous blocks balanced by parameter count, the embedding counted with the first block
  and the head with the last); the split is printed under the table.

Columns:
  side       pipemat, or peer (torch.distributed.pipelining and plain PyTorch)
  variant    the name --variants takes after "SIDE/"
  precision  fp32, or bf16 (--precision): pipemat's training.precision; the peer's stage
             forwards inside torch.autocast("cpu", bfloat16)
  schedule   the schedule and its stages in all ("2st": 2 stages, one per rank)
  recompute  none: nothing recomputed.
             selective (pipemat): every block a checkpoint unit with SAVE regions (gpt:
               attn.qkv and mlp.up; llama: q/k/v_proj and gate/up_proj; their outputs and
               inputs kept), the rest recomputed before backward.
             sac qkv,up / sac qkv,gate,up (peer): torch.utils.checkpoint per block with a
               selective-checkpoint policy (create_selective_checkpoint_contexts) that saves
               the outputs of those GEMMs and recomputes the rest.
             block (peer): plain non-reentrant torch.utils.checkpoint per block, all of it
               recomputed: what the zero-bubble schedules can run, since SAC refuses their
               split backward (dI, then dW: a second backward through the region).
  ranks      processes
  threads    compute threads per process
  step ms    median step time over the steps after --warmup; a pipeline step is the max over
             ranks (pipemat: its own metric; peer: the ranks start each step together after an
             untimed barrier). A step includes grad clipping and the optimizer.
  tokens/s   tokens per step (4 x 8 x seq_len: 4096 for main) / step ms
  x-eager1   speed relative to the 1-thread eager row: the peer's eager-1t, or pipemat's ref-1t
             when the peer does not run (the line under the table names it)
  pipe eff   pipeline efficiency: (the 1-thread single-process step ms of the same side and
             precision: pipemat's ref-1t, the peer's eager-1t) / (ranks x threads) / step ms;
             1.00: the cores do the single process's work in 1/cores of its time
  MFU        model FLOPs per step (6 N T + 12 L h S T, the line under the table) / step time /
             (ranks x threads x the GEMM rate of one core in the row's precision: --gemm-gflops,
             measured by default on the model's GEMM shapes as scripts/bench-gemm.py measures)
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


def check_config(path, expected, sets):
    """Warns on stderr about every key of `expected` (config_expected) that the config, with the
    `--set KEY=VALUE` overrides `sets` applied, sets differently."""
    try:
        values = read_flat_yaml(path)
    except OSError as e:
        log(f"warning: cannot read {path} ({e}); the peer's model is not checked against it")
        return
    for s in sets:
        key, _, value = s.partition("=")
        values[key] = value
    for key, want in expected.items():
        if key not in values:
            continue
        got = values[key]
        if isinstance(want, bool):
            same = got.lower() == yaml_value(want)
        else:
            try:
                same = math.isclose(float(got), float(want), rel_tol=1e-12)
            except ValueError:
                same = got == str(want)
        if not same:
            where = "with the preset's --set" if any(s.startswith(key + "=") for s in sets) \
                else "sets"
            log(f"warning: {shown_path(path)} {where} {key}: {got!r}, the peer trains with "
                f"{want!r}: the two sides no longer train the same model")


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
def pipemat_bench_command(binary, config, steps, warmup, schedules, policy_none, precision,
                          sets=()):
    """`sets`: the preset's and the bench run's own --set overrides (none for main's usual run)."""
    cmd = [binary, "bench", "pipeline", "--config", config, "--json", "--steps", str(steps),
           "--warmup", str(warmup), "--schedules", ",".join(schedules), "--transports", "mpi"]
    for s in list(sets) + [f"training.precision={precision}"]:
        cmd += ["--set", s]
    if policy_none:
        cmd += ["--set", "remat.policy=none"]
    return cmd


def pipemat_reference_command(binary, config, steps, threads, precision, sets=()):
    cmd = [binary, "train", "--config", config, "--reference"]
    for s in list(sets) + PIPEMAT_QUIET_SETS + [f"training.steps={steps}",
                                                f"training.threads={threads}",
                                                f"training.precision={precision}"]:
        cmd += ["--set", s]
    return cmd


def pipemat_bench_runs(kinds):
    """The `pipemat bench pipeline` runs that give the rows of the pipemat `kinds`: (kinds, their
    own --set overrides) each. interleaved runs alone, with its virtual stages: the bench gives
    every schedule of a run one config, and the others refuse virtual_stages above 1."""
    plain = [k for k in kinds if k != "interleaved"]
    runs = [(plain, [])] if plain else []
    if "interleaved" in kinds:
        runs.append((["interleaved"], ["schedule.kind=interleaved",
                                       f"schedule.virtual_stages={INTERLEAVED_VIRTUAL_STAGES}"]))
    return runs


def run_pipemat(args, binary, selected, precision):
    """pipemat's rows in `precision`: per remat policy (selective, none), one bench run for the
    selected kinds (and one more for interleaved); the references come from the first one."""
    rows, references_done = [], False
    config = shown_path(args.config)  # the bench runs in the repository root
    base_sets = preset_sets(args.model)
    kinds = [k for k in args.schedule_list if SCHEDULE_KINDS[k]["pipemat"]]
    policy_runs = [(policy, pipemat_bench_runs([k for k in kinds
                                                if selected(f"pipemat/{k}/{policy}")]))
                   for policy in ("selective", "none")]
    # Every bench run measures the references too: a run of their own only when no schedule
    # of either policy runs.
    if not any(runs for _, runs in policy_runs) and (
            selected("pipemat/ref-1t") or selected("pipemat/ref-2t")):
        policy_runs = [("none", [([], [])])]
    for policy, runs in policy_runs:
        for run_kinds, run_sets in runs:
            want_refs = not references_done and (
                selected("pipemat/ref-1t") or selected("pipemat/ref-2t"))
            # The bench needs a schedule; with none selected its row is dropped below.
            schedules = run_kinds or ["1f1b"]
            keep_schedules = set(run_kinds)
            sets = base_sets + run_sets
            rows += run_pipemat_bench(args, binary, selected, precision, policy, config,
                                      schedules, keep_schedules, sets, base_sets, want_refs,
                                      references_done)
            references_done = True
    return rows


def run_pipemat_bench(args, binary, selected, precision, policy, config, schedules,
                      keep_schedules, sets, base_sets, want_refs, references_done):
    """One `pipemat bench pipeline` run: its rows (the references' when `want_refs` and not
    `references_done`)."""
    rows = []
    cmd = pipemat_bench_command(binary, config, args.steps, args.warmup, schedules,
                                policy == "none", precision, sets)

    def rerun_bench(kind):
        return pipemat_bench_command(shown_path(binary), config, args.steps, args.warmup, [kind],
                                     policy == "none", precision, sets)

    def rerun_reference(threads):
        return pipemat_reference_command(shown_path(binary), config, args.steps, threads,
                                         precision, base_sets)

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
                                        error=message, rerun=rerun_reference(threads)))
        for kind in schedules:
            if kind in keep_schedules:
                rows.append(pipemat_row(kind, SCHEDULE_KINDS[kind]["pipemat"], policy,
                                        precision, error=message, rerun=rerun_bench(kind)))
        return rows
    os.unlink(logfile.name)
    log(f"pipemat: remat {policy} ({', '.join(schedules)}) done in {seconds:.0f} s")
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
                rerun=rerun_reference(threads)))
            continue
        kind = r["schedule"]
        if kind not in keep_schedules:
            continue
        rows.append(pipemat_row(
            kind, SCHEDULE_KINDS[kind]["pipemat"], policy, precision, threads=int(r["threads"]),
            step_ms=r["step_ms"], bubble=r["bubble"], alloc_peak=r["peak_bytes"],
            rss=r["resident_peak_bytes"], loss=r["loss"], rerun=rerun_bench(kind)))
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


def peer_schedules(schedule_list):
    """The peer's schedules of the --schedules entries, in their order, each once."""
    out = []
    for kind in schedule_list:
        out += [p for p in SCHEDULE_KINDS[kind]["peer"] if p not in out]
    return out


def peer_variants(schedule_list):
    """(variant name, worker spec without the run's fields), in the order they run."""
    out = [("eager-1t", {"mode": "eager", "threads": 1}),
           ("eager-2t", {"mode": "eager", "threads": 2})]
    for schedule in peer_schedules(schedule_list):
        for recompute in PEER_RECOMPUTE:
            out.append((f"{schedule}/{recompute}",
                        {"mode": "pipeline", "threads": 1, "schedule": schedule,
                         "recompute": recompute}))
    return out


def run_peer_variant(args, name, spec, workdir, precision):
    """Starts the ranks of one peer variant in `precision`, waits for them and returns its
    row."""
    ranks = 2 if spec["mode"] == "pipeline" else 1
    model = PRESETS[args.model]["model"]
    spec = dict(spec, steps=args.steps, warmup=args.warmup, timeout_s=args.peer_timeout,
                attention=args.attention, precision=precision, model=model)
    rerun = [sys.executable, shown_path(__file__)]
    if args.model != "main":
        rerun += ["--model", args.model]
    rerun += ["--steps", str(args.steps), "--warmup", str(args.warmup),
              "--attention", args.attention, "--precision", precision, "--only", "peer",
              "--variants", f"peer/{name}"]
    row = {
        "side": "peer", "variant": name, "precision": precision,
        "schedule": PEER_SCHEDULES[spec["schedule"]]["label"] if ranks > 1 else "-",
        "recompute": recompute_label(spec.get("recompute", "none"), model["kind"]),
        "ranks": ranks, "threads": spec["threads"], "step_ms": None, "bubble": None, "rss": [],
        "alloc_peak": None, "loss": None, "error": None,
        "rerun": shlex.join(rerun),
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


def torch_model(model):
    """The model in PyTorch: the GPT of models/src/gpt.cpp or the Llama of models/src/llama.cpp,
    of the shape `model` (a PRESETS entry's model). Returns a namespace of its classes and
    helpers. Defined here, not at module level, because only the workers import torch."""
    import functools
    import types

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    kind = model["kind"]
    hidden, heads, ffn, vocab = model["hidden"], model["heads"], model["ffn"], model["vocab"]
    aten = torch.ops.aten

    def keep_qkv_and_up(ctx, op, *args, **kwargs):
        """SAC policy (gpt): save the GEMM outputs of attn.qkv and mlp.up, recompute everything
        else. A Linear on [batch, seq, in] reaches the dispatcher as addmm(bias, x2d, w.t());
        those two are the only GEMMs in a block that are 3 x hidden (qkv) or ffn (up) wide."""
        if op in (aten.addmm.default, aten.mm.default):
            weight_t = args[2] if op is aten.addmm.default else args[1]
            if weight_t.shape[-1] in (3 * hidden, ffn):
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    # SAC policy (llama): save the GEMM outputs of the projections pipemat's selective policy
    # saves (q/k/v_proj, gate/up_proj: SavedLinear, which counts itself in `saving` while it
    # runs, in the forward and in the recompute alike), recompute everything else. Shapes cannot
    # tell them apart: q_proj and o_proj are both hidden x hidden.
    saving = [0]

    def keep_saved_linears(ctx, op, *args, **kwargs):
        if saving[0] and op in (aten.mm.default, aten.addmm.default):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    sac_context = functools.partial(create_selective_checkpoint_contexts,
                                    keep_qkv_and_up if kind == "gpt" else keep_saved_linears)

    class Checkpointed(nn.Module):
        """A block: its body() with the peer's recompute ("none", "sac", "block")."""

        def __init__(self):
            super().__init__()
            self.recompute = "none"  # or "sac", "block" (PEER_RECOMPUTE)

        def forward(self, x):
            if self.recompute == "none" or not torch.is_grad_enabled():
                return self.body(x)
            if self.recompute == "sac":
                return checkpoint(self.body, x, use_reentrant=False, context_fn=sac_context)
            return checkpoint(self.body, x, use_reentrant=False)  # "block": recompute it all

    # --- the GPT (models/src/gpt.cpp) ---------------------------------------------------------
    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, hidden)
            self.pos = nn.Embedding(model["seq_len"], hidden)
            self.drop = nn.Dropout(model["dropout"])

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
            return self.proj(attend(q, k, v, self.kernel).transpose(1, 2).reshape(b, t, h))

    def attend(q, k, v, kernel):
        """Causal attention of q, k, v [B, heads, T, d] (as many heads each)."""
        if kernel == "sdpa":  # one fused kernel, no [T, T] tensors
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # softmax(q k^T / sqrt(d) + causal mask) v, op by op
        t, d = q.size(-2), q.size(-1)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        return torch.matmul(torch.softmax(scores, -1), v)  # [B, heads, T, d]

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(hidden, ffn)
            self.down = nn.Linear(ffn, hidden)

        def forward(self, x):
            return self.down(F.gelu(self.up(x)))  # exact (erf) GELU, as at::gelu

    class Block(Checkpointed):
        def __init__(self, attention):
            super().__init__()
            self.ln1 = nn.LayerNorm(hidden)
            self.attn = Attention(attention)
            self.ln2 = nn.LayerNorm(hidden)
            self.mlp = Mlp()
            self.drop = nn.Dropout(model["dropout"])

        def body(self, x):
            h = x + self.drop(self.attn(self.ln1(x)))
            return h + self.drop(self.mlp(self.ln2(h)))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.out = nn.Linear(hidden, vocab)

        def forward(self, x):
            return self.out(self.norm(x))

    class GptStage(nn.Module):
        """Blocks [first, end) of the model, with the embedding first when first == 0 and the
        head last when end == layers (pipemat's GptStage). With bf16 its forward is one
        torch.autocast region to bfloat16 (pipemat: training.precision bf16)."""

        def __init__(self, parts, first, end, bf16=False):
            super().__init__()
            self.embed = parts["embed"] if first == 0 else None
            self.blocks = nn.ModuleList(parts["blocks"][first:end])
            self.head = parts["head"] if end == len(parts["blocks"]) else None
            self.bf16 = bf16
            self.head_copy = None  # no tied weights

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
            residual_std = 0.02 / math.sqrt(2.0 * model["layers"])
            blocks = []
            for _ in range(model["layers"]):
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

    # --- the Llama (models/src/llama.cpp) -----------------------------------------------------
    head_dim = hidden // heads
    kv_heads = model.get("kv_heads") or heads

    def rope_tables():
        """cos, sin [seq_len, head_dim] in float32, as pipemat's rope_tables."""
        exponent = torch.arange(0, head_dim, 2, dtype=torch.long).float() / head_dim
        inv_freq = 1.0 / torch.pow(float(model.get("rope_theta", 10000.0)), exponent)
        positions = torch.arange(model["seq_len"], dtype=torch.long).float()
        freqs = torch.outer(positions, inv_freq)  # [T, d / 2]
        emb = torch.cat([freqs, freqs], -1)  # [T, d]
        return emb.cos(), emb.sin()

    rope_cos, rope_sin = rope_tables() if kind == "llama" else (None, None)

    def apply_rope(x, cos, sin):
        half = x.size(-1) // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def repeat_kv(x):
        """[B, kv_heads, T, d] -> [B, heads, T, d] (Hugging Face's repeat_kv)."""
        b, kv, t, d = x.shape
        if kv == heads:
            return x
        return x.unsqueeze(2).expand(b, kv, heads // kv, t, d).reshape(b, heads, t, d)

    class RMSNorm(nn.Module):
        """Computed in float32, as Hugging Face's LlamaRMSNorm and pipemat's."""

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden))
            self.eps = model.get("norm_eps", 1e-5)

        def forward(self, x):
            dtype = x.dtype
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * h.to(dtype)

    class SavedLinear(nn.Linear):
        """A Linear whose GEMM output the llama SAC policy saves (keep_saved_linears)."""

        def forward(self, x):
            saving[0] += 1
            try:
                return super().forward(x)
            finally:
                saving[0] -= 1

    class LlamaAttention(nn.Module):
        def __init__(self, kernel):
            super().__init__()
            self.q_proj = SavedLinear(hidden, heads * head_dim, bias=False)
            self.k_proj = SavedLinear(hidden, kv_heads * head_dim, bias=False)
            self.v_proj = SavedLinear(hidden, kv_heads * head_dim, bias=False)
            self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
            self.kernel = kernel

        def forward(self, x):
            b, t, _ = x.shape
            d = head_dim
            rows = x.reshape(-1, hidden)  # [B * T, hidden], as pipemat's flat_rows
            q = self.q_proj(rows).view(b, t, heads, d).transpose(1, 2)  # [B, nh, T, d]
            k = self.k_proj(rows).view(b, t, kv_heads, d).transpose(1, 2)
            v = self.v_proj(rows).view(b, t, kv_heads, d).transpose(1, 2)
            c, s = rope_cos[:t].to(q.dtype), rope_sin[:t].to(q.dtype)
            q = apply_rope(q, c, s)
            k = repeat_kv(apply_rope(k, c, s))
            v = repeat_kv(v)
            context = attend(q, k, v, self.kernel)
            return self.o_proj(context.transpose(1, 2).reshape(b, t, heads * d))

    class LlamaMlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = SavedLinear(hidden, ffn, bias=False)
            self.up_proj = SavedLinear(hidden, ffn, bias=False)
            self.down_proj = nn.Linear(ffn, hidden, bias=False)

        def forward(self, x):
            rows = x.reshape(-1, hidden)
            return self.down_proj(F.silu(self.gate_proj(rows)) * self.up_proj(rows)).view(x.shape)

    class LlamaBlock(Checkpointed):
        def __init__(self, attention):
            super().__init__()
            self.input_layernorm = RMSNorm()
            self.self_attn = LlamaAttention(attention)
            self.post_attention_layernorm = RMSNorm()
            self.mlp = LlamaMlp()

        def body(self, x):
            h = x + self.self_attn(self.input_layernorm(x))
            return h + self.mlp(self.post_attention_layernorm(h))

    class LlamaStage(nn.Module):
        """Blocks [first, end), with the embedding first when first == 0 and the final norm
        and head last when end == layers (pipemat's LlamaStage). With tied embeddings the head
        multiplies by the embedding's weight; a last stage without the embedding holds a copy of
        it (head_copy), whose gradient the ranks add to the embedding's every step."""

        def __init__(self, parts, first, end, bf16=False):
            super().__init__()
            last = end == len(parts["blocks"])
            self.embed = parts["embed"] if first == 0 else None
            self.blocks = nn.ModuleList(parts["blocks"][first:end])
            self.norm = parts["norm"] if last else None
            self.lm_head = parts["lm_head"] if last else None
            self.head_copy = None
            if last and parts["lm_head"] is None and first != 0:
                self.head_copy = nn.Parameter(parts["embed"].weight.detach().clone())
            self.bf16 = bf16

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                return self.body(x)

        def body(self, x):
            if self.embed is not None:
                x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            if self.norm is None:
                return x
            x = self.norm(x)
            if self.lm_head is not None:
                return self.lm_head(x)
            return F.linear(x, self.embed.weight if self.embed is not None else self.head_copy)

    def build_llama(seed, recompute, attention):
        """Every part, built and initialized as pipemat's build_llama does (normal 0.02 for the
        embedding and every projection, norms at 1; same order of random draws)."""
        torch.manual_seed(seed)
        with torch.no_grad():
            embed = nn.Embedding(vocab, hidden)
            nn.init.normal_(embed.weight, 0.0, 0.02)
            blocks = []
            for _ in range(model["layers"]):
                block = LlamaBlock(attention)
                a, mlp = block.self_attn, block.mlp
                for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
                          mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight):
                    nn.init.normal_(w, 0.0, 0.02)
                block.recompute = recompute
                blocks.append(block)
            norm = RMSNorm()
            lm_head = None
            if not model.get("tie_embeddings"):
                lm_head = nn.Linear(hidden, vocab, bias=False)
                nn.init.normal_(lm_head.weight, 0.0, 0.02)
        return {"embed": embed, "blocks": blocks, "norm": norm, "lm_head": lm_head}

    def check_counts(parts):
        """The modules' parameter counts against layer_parameters(), which the split and the
        MFU use."""
        def count(m):
            return sum(p.numel() for p in m.parameters()) if m is not None else 0
        if kind == "gpt":
            got = (count(parts["embed"]), count(parts["blocks"][0]), count(parts["head"]))
        else:
            got = (count(parts["embed"]), count(parts["blocks"][0]),
                   count(parts["norm"]) + count(parts["lm_head"]))
        want = layer_parameters(model)
        if got != want:
            raise RuntimeError(f"parameter counts (embedding, block, head) {got}, expected "
                               f"{want} (layer_parameters)")

    def loss_fn(logits, targets):  # in float32 under either precision
        return F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))

    return types.SimpleNamespace(
        torch=torch, Stage=GptStage if kind == "gpt" else LlamaStage,
        build=build_gpt if kind == "gpt" else build_llama, check_counts=check_counts,
        loss_fn=loss_fn)


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

    if spec["mode"] == "gemm":
        return run_gemm_probe(spec)
    shape = spec["model"]
    m = torch_model(shape)
    torch = m.torch
    torch.set_num_threads(spec["threads"])
    import_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    train, _val, _files, _binary = load_text(TRAIN["data"], TRAIN["validation"])
    span = shape["seq_len"] + 1
    M = TRAIN["micro_batches"]
    bf16 = spec["precision"] == "bf16"

    def micro_batch(step, i):
        """(ids, targets) [batch, seq_len] int64: windows of span bytes, targets shifted by 1."""
        offsets = window_offsets(len(train), TRAIN["seed"], step, i, shape["batch"], span)
        data = bytearray(b"".join(train[o:o + span] for o in offsets))
        windows = torch.frombuffer(data, dtype=torch.uint8).long().view(shape["batch"], span)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    parts = m.build(TRAIN["seed"], spec.get("recompute", "none"), spec["attention"])
    m.check_counts(parts)
    steps = spec["steps"]
    out = {"rank": rank, "torch": torch.__version__, "import_rss_mib": import_rss,
           "step_ms": [], "busy_ms": [], "losses": []}
    if spec["mode"] == "eager":
        net = m.Stage(parts, 0, shape["layers"], bf16=bf16)
        del parts
        params = list(net.parameters())
        optimizer = torch.optim.AdamW(params, lr=TRAIN["lr"], weight_decay=TRAIN["weight_decay"])
        for step in range(steps):
            batches = [micro_batch(step, i) for i in range(M)]
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for ids, targets in batches:  # gradient accumulation over the micro-batches
                loss = m.loss_fn(net(ids), targets) / M
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

        def ranks_of(stages):
            if sched_info["layout"] == "v":  # rank r: stages r and n - 1 - r
                return [min(s, n_stages - 1 - s) for s in stages]
            return [s % world for s in stages]  # loop: stage s on rank s % world

        mine = [s for s in range(n_stages) if ranks_of([s])[0] == rank]
        # The blocks of each stage as pipemat splits them (partition_gpt / partition_llama).
        bounds = stage_bounds(shape, n_stages)
        modules = [m.Stage(parts, bounds[s], bounds[s + 1], bf16=bf16) for s in mine]
        del parts  # the other ranks' blocks

        # Static stage metadata: the shapes of every stage's input and output. Without them
        # the stages infer the shapes in the first step and exchange them with
        # send/recv_object_list, which needs numpy (not installed here).
        # With bf16 the logits are bf16 (the head's GEMM under autocast); the residual stream
        # between the stages stays float32 (the float32 embedding plus the blocks' branches).
        b, t, h = shape["batch"], shape["seq_len"], shape["hidden"]
        logits_dtype = torch.bfloat16 if bf16 else torch.float32

        def example_input(s):
            return torch.zeros(b, t, dtype=torch.long) if s == 0 else \
                torch.zeros(b, t, h, requires_grad=True)

        def example_output(s):
            if s == n_stages - 1:
                return torch.zeros(b, t, shape["vocab"], dtype=logits_dtype, requires_grad=True)
            return torch.zeros(b, t, h, requires_grad=True)

        stages = [pipelining.PipelineStage(mod, s, n_stages, torch.device("cpu"),
                                           input_args=example_input(s),
                                           output_args=example_output(s))
                  for mod, s in zip(modules, mine)]
        cls = getattr(pipelining, sched_info["cls"])
        if issubclass(cls, pipelining.schedules.PipelineScheduleSingle):
            schedule = cls(stages[0], n_microbatches=M, loss_fn=m.loss_fn)
        else:
            schedule = cls(stages, n_microbatches=M, loss_fn=m.loss_fn)
        params = [p for mod in modules for p in mod.parameters()]
        optimizer = torch.optim.AdamW(params, lr=TRAIN["lr"], weight_decay=TRAIN["weight_decay"])

        # Tied embeddings (llama): the first stage's embedding and the last stage's copy of it
        # get the sum of their gradients every step, so both stay equal (pipemat's TiedCopies);
        # the clipping norm counts the weight once.
        tied_model = n_stages > 1 and shape["kind"] == "llama" and shape.get("tie_embeddings")
        tied = [mod.embed.weight for mod, s in zip(modules, mine) if s == 0 and tied_model] + \
            [mod.head_copy for mod in modules if mod.head_copy is not None]
        has_copy = any(mod.head_copy is not None for mod in modules)
        tied_across_ranks = ranks_of([0])[0] != ranks_of([n_stages - 1])[0]
        copies = {id(mod.head_copy) for mod in modules if mod.head_copy is not None}
        normed = [p for p in params if id(p) not in copies]

        def sum_tied_gradients():
            if not tied_model or (not tied and not tied_across_ranks):
                return
            total = None
            for p in tied:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                total = g.clone() if total is None else total + g
            if tied_across_ranks:  # one copy on each rank (2 ranks)
                dist.all_reduce(total)
            for p in tied:
                p.grad = total.clone()

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
        if rank == 0:
            print(f"stages of {n_stages}: blocks {bounds}; this rank: stages {mine}"
                  + (f", tied embedding (copy here: {has_copy})" if tied_model else ""),
                  flush=True)
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
            sum_tied_gradients()
            clip_global_grad_norm(torch, dist, params, TRAIN["clip_grad_norm"], normed)
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


def clip_global_grad_norm(torch, dist, params, max_norm, normed=None):
    """Clips the gradients of every rank's parameters by their global L2 norm over `normed`
    (default: all of them; one all-reduce), as pipemat's clip_grad_norm does over its ranks and
    torch.nn.utils.clip_grad_norm_ in one process."""
    grads = [p.grad for p in params if p.grad is not None]
    square = torch.zeros((), dtype=torch.float32)
    for p in (params if normed is None else normed):
        if p.grad is not None:
            square += p.grad.detach().pow(2).sum()
    dist.all_reduce(square)
    coef = torch.clamp(max_norm / (square.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef)


def run_gemm_probe(spec):
    """The GEMM rate of one core on the model's forward GEMM shapes, per precision: each shape
    timed by scripts/bench-gemm.py's median_gflops (F.linear on float32 tensors, MKL; on bf16
    tensors, oneDNN), rounds of about 50 ms, 3 rounds; the rate is the shapes' FLOPs over their
    time, each shape weighted by its calls per micro-batch (gemm_shapes)."""
    import importlib.util
    import warnings
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch.nn.functional as F
    loader = importlib.util.spec_from_file_location(
        "bench_gemm", os.path.join(REPO, "scripts", "bench-gemm.py"))
    bench_gemm = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(bench_gemm)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = {"torch": torch.__version__, "rates": {}, "shapes": []}
    for precision in spec["precisions"]:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        flops_sum = seconds_sum = 0.0
        for rows, k, n, name, calls in spec["shapes"]:
            x, w = torch.randn(rows, k).to(dtype), (torch.randn(n, k) * 0.1).to(dtype)

            def fn():
                return F.linear(x, w)

            flops = 2.0 * rows * k * n
            t0 = time.perf_counter()
            fn()
            once = time.perf_counter() - t0
            iters = max(1, int(0.05 / max(once, 1e-7)))
            gflops = bench_gemm.median_gflops(fn, flops, iters, 3)
            flops_sum += calls * flops
            seconds_sum += calls * flops / (gflops * 1e9)
            out["shapes"].append([precision, f"{name} {rows}x{k}x{n}", gflops])
        out["rates"][precision] = flops_sum / seconds_sum / 1e9
    return out


# ---------------------------------------------------------------------------------------------
# The table.
# ---------------------------------------------------------------------------------------------
COLUMNS = ["side", "variant", "precision", "schedule", "recompute", "ranks", "threads",
           "step ms", "tokens/s", "x-eager1", "pipe eff", "MFU", "bubble", "peak RSS/rank MiB",
           "alloc peak MiB", "loss"]


def format_rows(rows, baseline_ms, tokens):
    table = []
    for r in rows:
        cells = [r["side"], r["variant"], r["precision"], r["schedule"], r["recompute"],
                 str(r["ranks"]), str(r["threads"])]
        if r["error"]:
            table.append(cells + ["FAILED: " + r["error"][:160]])
            continue
        cells += [
            f"{r['step_ms']:.1f}",
            f"{tokens / r['step_ms'] * 1e3:,.0f}",
            f"{baseline_ms[r['precision']] / r['step_ms']:.2f}x"
            if baseline_ms.get(r["precision"]) else "-",
            f"{r['efficiency']:.2f}" if r.get("efficiency") is not None else "-",
            f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-",
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


def one_thread_references(rows, precisions):
    """Per (side, precision): the 1-thread single-process row the pipeline efficiency counts
    from (pipemat's ref-1t, the peer's eager-1t), or the other side's when its own did not run.
    Values: (row, borrowed)."""
    own = {"pipemat": "ref-1t", "peer": "eager-1t"}
    found = {(r["side"], r["precision"]): r for r in rows
             if not r["error"] and own.get(r["side"]) == r["variant"]}
    refs = {}
    for side, other in (("pipemat", "peer"), ("peer", "pipemat")):
        for precision in precisions:
            if (side, precision) in found:
                refs[(side, precision)] = (found[(side, precision)], False)
            elif (other, precision) in found:
                refs[(side, precision)] = (found[(other, precision)], True)
    return refs


def add_efficiency_and_mfu(rows, refs, flops, rates):
    """Each row's pipeline efficiency (refs: one_thread_references) and MFU (rates: GFLOP/s of
    one core by precision)."""
    for r in rows:
        if r["error"]:
            continue
        cores = r["ranks"] * r["threads"]
        ref = refs.get((r["side"], r["precision"]))
        r["efficiency"] = ref[0]["step_ms"] / cores / r["step_ms"] if ref else None
        rate = rates.get(r["precision"])
        r["mfu"] = flops / (r["step_ms"] / 1e3) / (cores * rate * 1e9) if rate else None


def measure_gemm_rates(args, model, precisions):
    """run_gemm_probe in a worker of 1 thread: ({precision: GFLOP/s}, [(precision, shape,
    GFLOP/s)]), or ({}, []) with a warning when it fails."""
    spec = {"mode": "gemm", "precisions": precisions, "shapes": gemm_shapes(model)}
    with tempfile.TemporaryDirectory(prefix="compare-peer-gemm-") as workdir:
        spec_path = os.path.join(workdir, "spec.json")
        result = os.path.join(workdir, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
        env.update(CHILD_ENV[1])
        log(f"GEMM rate of one core on the model's shapes in {', '.join(precisions)} "
            "(--gemm-gflops auto)")
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                                   spec_path, result], env=env, cwd=REPO, capture_output=True,
                                  text=True, timeout=args.peer_timeout)
        except subprocess.TimeoutExpired:
            log(f"warning: the GEMM probe took more than {args.peer_timeout} s; no MFU")
            return {}, []
        data = None
        if os.path.exists(result):
            with open(result) as f:
                data = json.load(f)
        if proc.returncode != 0 or not data or data.get("error"):
            why = (data or {}).get("error") or first_line(proc.stderr or proc.stdout)
            log(f"warning: the GEMM probe failed ({why}); no MFU")
            return {}, []
    return data["rates"], data["shapes"]


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="compare-peer.py",
        description="The peer benchmark: pipemat (a byte-level GPT or Llama on 2 pipeline\n"
                    "ranks; --model) against torch.distributed.pipelining training the same\n"
                    "model in PyTorch, and both against one process. One table on stdout,\n"
                    "progress on stderr; then one command per variant to rerun it.",
        epilog=HELP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(PRESETS), default="main",
                   help="the model both sides train: main (configs/default.yaml's GPT; "
                        "default), gpt-48m, smollm-135m (below)")
    p.add_argument("--schedules", metavar="LIST",
                   help="comma-separated schedules: pipemat's schedule.kind values (gpipe, "
                        "1f1b, interleaved, zb-h1, zb-h2, zb-v), each with its peer "
                        "counterpart, and the peer-only izb-4st, bfs-4st, dualpipev; `all` for "
                        "every one (default: 1f1b,zb-h1,izb-4st,zb-v; with --variants: all)")
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
                   help="pipemat's config (default: the --model preset's, configs/default.yaml "
                        "or configs/llama.yaml); the preset's model keys are --set on top of it, "
                        "and the result is checked against the peer's model")
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
    p.add_argument("--gemm-gflops", default="auto", metavar="auto|off|FP32[,BF16]",
                   help="the GEMM rate of one core (GFLOP/s) the MFU column counts against: "
                        "auto (default) measures it after the runs, in a 1-thread worker, on the "
                        "model's forward GEMM shapes with scripts/bench-gemm.py's timing; "
                        "FP32[,BF16] takes numbers (e.g. from scripts/bench-gemm.py); off: no "
                        "MFU")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="run every selected variant N times, the sides alternating which goes "
                        "first (round 2 starts with the peer), so that a machine slowing down "
                        "during the run slows both; the table gives each variant's median step "
                        "over the rounds and a line under it every round's (default 1)")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds} must be at least 1")
    if args.warmup < 0 or args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must be more than --warmup {args.warmup} (>= 0)")
    args.precisions = [v.strip() for v in args.precision.split(",") if v.strip()]
    bad = [v for v in args.precisions if v not in ("fp32", "bf16")]
    if bad or not args.precisions:
        p.error(f"--precision {args.precision}: each entry must be fp32 or bf16")
    if args.schedules:
        entries = [v.strip() for v in args.schedules.split(",") if v.strip()]
        if "all" in entries:
            entries = list(SCHEDULE_KINDS)
        bad = [v for v in entries if v not in SCHEDULE_KINDS]
        if bad or not entries:
            p.error(f"--schedules {args.schedules}: unknown {', '.join(bad) or '(empty)'}; "
                    f"known: {', '.join(SCHEDULE_KINDS)}, all")
        args.schedule_list = list(dict.fromkeys(entries))
    else:
        args.schedule_list = list(SCHEDULE_KINDS) if args.variants else DEFAULT_SCHEDULES
    args.gemm_rates = {}
    if args.gemm_gflops not in ("auto", "off"):
        try:
            numbers = [float(v) for v in args.gemm_gflops.split(",")]
        except ValueError:
            numbers = []
        if not 1 <= len(numbers) <= 2 or min(numbers) <= 0:
            p.error(f"--gemm-gflops {args.gemm_gflops}: auto, off, or FP32[,BF16] (GFLOP/s of "
                    "one core, > 0)")
        args.gemm_rates = dict(zip(("fp32", "bf16"), numbers))
    if args.config is None:
        args.config = os.path.join(REPO, PRESETS[args.model]["config"])
    args.config = os.path.abspath(args.config)
    return args


def all_variants():
    """Every SIDE/VARIANT name --variants knows, whatever --schedules."""
    names = {f"peer/{name}" for name, _ in peer_variants(list(SCHEDULE_KINDS))}
    names |= {"pipemat/ref-1t", "pipemat/ref-2t"}
    names |= {f"pipemat/{k}/{p}" for k in PIPEMAT_KINDS for p in ("selective", "none")}
    return names


def merge_rounds(rounds):
    """One row per variant from the rows of every round (--rounds): the median step over the
    rounds that ran it, the other columns from the round nearest that median; with more than one
    round, `round_steps` lists each round's step (None where it failed). A variant that failed
    in every round keeps its first error."""
    if len(rounds) == 1:
        return rounds[0]
    merged = []
    for first in rounds[0]:
        key = (first["side"], first["variant"], first["precision"])
        runs = [next(r for r in rows if (r["side"], r["variant"], r["precision"]) == key)
                for rows in rounds]
        good = [r for r in runs if not r["error"]]
        if not good:
            merged.append(first)
            continue
        median = statistics.median(r["step_ms"] for r in good)
        row = dict(min(good, key=lambda r: abs(r["step_ms"] - median)))
        row["step_ms"] = median
        row["round_steps"] = [None if r["error"] else r["step_ms"] for r in runs]
        merged.append(row)
    return merged


def main(argv):
    args = parse_args(argv)
    if args.worker:
        worker_main(*args.worker)
        return 0
    t_start, load_start = time.monotonic(), os.getloadavg()[0]
    model = PRESETS[args.model]["model"]
    tokens = tokens_per_step(model)
    wanted = set(v.strip() for v in args.variants.split(",")) if args.variants else None
    known = all_variants()
    offered = {f"peer/{name}" for name, _ in peer_variants(args.schedule_list)}
    offered |= {"pipemat/ref-1t", "pipemat/ref-2t"}
    offered |= {f"pipemat/{k}/{p}" for k in args.schedule_list if k in PIPEMAT_KINDS
                for p in ("selective", "none")}
    if wanted and wanted - known:
        sys.exit(f"compare-peer: error: unknown --variants {', '.join(sorted(wanted - known))}; "
                 f"known: {', '.join(sorted(known))}")
    if wanted and wanted - offered:
        sys.exit(f"compare-peer: error: --variants {', '.join(sorted(wanted - offered))}: not "
                 f"a variant of --schedules {','.join(args.schedule_list)}")

    def selected(name):
        side = name.split("/")[0]
        return (args.only in (None, side)) and name in offered and \
            (wanted is None or name in wanted)

    run_pipemat_side = any(selected(n) for n in offered if n.startswith("pipemat/"))
    run_peer_side = any(selected(n) for n in offered if n.startswith("peer/"))
    binary = pipemat_binary(args) if run_pipemat_side else None
    if run_pipemat_side and not os.path.isfile(args.config):
        sys.exit(f"compare-peer: error: no config at {args.config}")
    try:
        train, val, files, binaries = load_text(TRAIN["data"], TRAIN["validation"])
    except (OSError, ValueError) as e:
        sys.exit(f"compare-peer: error: {e}")
    log(f"text: {len(train) / 2**20:.2f} MiB train / {len(val) / 2**10:.2f} KiB validation from "
        f"{files} files of {TRAIN['data']} ({binaries} binary files skipped)")
    total, gemm = parameter_counts(model)
    log(f"model {args.model}: {model['kind']}, {total / 1e6:.2f} M parameters; pipemat: "
        f"{shown_path(args.config)}" +
        (f" with --set {' '.join(preset_sets(args.model))}" if preset_sets(args.model) else ""))

    def kind_selected(kind):
        """Whether a selected variant runs the --schedules entry `kind`."""
        names = [f"pipemat/{kind}/{p}" for p in ("selective", "none")]
        names += [f"peer/{s}/{r}" for s in SCHEDULE_KINDS[kind]["peer"] for r in PEER_RECOMPUTE]
        return any(selected(n) for n in names)

    notes = [SCHEDULE_KINDS[k]["note"] for k in args.schedule_list
             if SCHEDULE_KINDS[k].get("note") and kind_selected(k)]
    for note in notes:
        log(note)
    check_config(args.config, config_expected(model), preset_sets(args.model))

    torch_versions, import_rss = set(), []

    def pipemat_rows():
        rows = []
        for precision in args.precisions:
            rows += run_pipemat(args, binary, selected, precision)
        return rows

    def peer_rows():
        rows = []
        with tempfile.TemporaryDirectory(prefix="compare-peer-") as workdir:
            for precision, (name, spec) in ((p, v) for p in args.precisions
                                            for v in peer_variants(args.schedule_list)):
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
                    import_rss.extend(row.pop("import_rss", []))
                    low, high = row.pop("step_range")
                    log(f"peer: {name}: {row['step_ms']:.1f} ms/step (after warm-up: "
                        f"{low:.0f}-{high:.0f}), loss {row['loss']:.4f} ({seconds:.0f} s)")
                rows.append(row)
        return rows

    # --rounds: every round runs both sides, the second and every even round the peer first, so
    # a machine that slows down during the run slows both sides alike.
    sides = [f for f, on in ((pipemat_rows, run_pipemat_side), (peer_rows, run_peer_side)) if on]
    rounds = []
    for k in range(args.rounds):
        if args.rounds > 1:
            log(f"round {k + 1} of {args.rounds}: "
                f"{' then '.join('pipemat' if f is pipemat_rows else 'peer' for f in sides)}")
        rounds.append([row for f in sides for row in f()])
        sides.reverse()
    rows = merge_rounds(rounds)

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
    # Pipeline efficiency and MFU.
    refs = one_thread_references(rows, args.precisions)
    flops = model_flops_per_step(model)
    rates, gemm_detail = dict(args.gemm_rates), []
    if args.gemm_gflops == "auto" and any(not r["error"] for r in rows):
        rates, gemm_detail = measure_gemm_rates(args, model, args.precisions)
    add_efficiency_and_mfu(rows, refs, flops, rates)

    print(format_rows(rows, {p: b["step_ms"] for p, b in baselines.items()}, tokens))
    print()
    print(f"{tokens} tokens per step ({TRAIN['micro_batches']} micro-batches x {model['batch']} "
          f"x {model['seq_len']}); medians over steps {args.warmup + 1}-{args.steps} of "
          f"{args.steps}.")
    print(f"model: {args.model} ({model['kind']}), {total / 1e6:.2f} M parameters, "
          f"{gemm / 1e6:.2f} M of them in GEMMs (N); stages (blocks each, both sides): " +
          "; ".join(f"{n}: {','.join(str(b - a) for a, b in zip(bounds, bounds[1:]))}"
                    for n, bounds in ((n, stage_bounds(model, n)) for n in (2, 4))) + ".")
    for precision, baseline in baselines.items():
        print(f"x-eager1 ({precision}): relative to {baseline['side']} {baseline['variant']} "
              f"in {precision} ({baseline['step_ms']:.1f} ms/step).")
    for (side, precision), (ref, borrowed) in sorted(refs.items()):
        if borrowed and any(r["side"] == side and r["precision"] == precision for r in rows):
            print(f"pipe eff ({side}, {precision}): from {ref['side']} {ref['variant']} "
                  f"({ref['step_ms']:.1f} ms/step; {side}'s own 1-thread reference did not run).")
    print(f"pipe eff: 1-thread single-process step / (ranks x threads) / step, each side "
          "against its own (pipemat ref-1t, peer eager-1t).")
    print(f"MFU: {flops / 1e9:.2f} GFLOP per step = 6 N T + 12 L h S T = 6 x {gemm:,} x {tokens} "
          f"+ 12 x {model['layers']} x {model['hidden']} x {model['seq_len']} x {tokens}, per "
          "second, over ranks x threads x the GEMM rate of one core: " +
          (", ".join(f"{p} {rates[p]:.0f} GFLOP/s" for p in args.precisions if p in rates)
           or "none") +
          (" (measured after the runs: the model's forward GEMM shapes, 1 thread, "
           "scripts/bench-gemm.py's timing)" if gemm_detail else
           " (--gemm-gflops)" if rates else " (--gemm-gflops off, or the probe failed)") + ".")
    if gemm_detail:
        print("  GEMMs: " + "; ".join(f"{p} {shape} {g:.0f}" for p, shape, g in gemm_detail))
    for note in notes:
        print(f"schedule {note}.")
    if args.rounds > 1:
        print(f"rounds: {args.rounds}, the sides alternating which ran first (round 1: "
              f"{'pipemat' if run_pipemat_side else 'peer'}); step ms is the median over them, "
              "the other columns the round nearest it. Each round's step:")
        for r in rows:
            if "round_steps" in r:
                print(f"  {r['side']}/{r['variant']} ({r['precision']}): " + " / ".join(
                    "failed" if v is None else f"{v:.1f}" for v in r["round_steps"]))
    if any(r["side"] == "peer" for r in rows):
        print(f"peer: torch {', '.join(sorted(v for v in torch_versions if v)) or '?'}, CPU, gloo; "
              "every rank/process starts with OMP_NUM_THREADS=1 (eager-2t: OMP_NUM_THREADS=2 "
              "OMP_WAIT_POLICY=passive) and torch.set_num_threads(threads).")
        print(f"peer: attention kernel {args.attention} (--attention; pipemat's "
              f"{model['kind'].upper() if model['kind'] == 'gpt' else 'Llama'}: sdpa).")
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
