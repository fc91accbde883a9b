"""Hugging Face transformers as the oracle of pipemat's llama (ctest Hf.LlamaOracle).

For an untied and a tied random LlamaForCausalLM (2 layers, hidden 64, 4 heads, 2 key/value
heads, ffn 128, vocab 256, float32) saved with save_pretrained into a directory, pipemat reads
that directory (model.from for the shape, training.init_from for the weights) and:
  - its logits on the token windows its training reads equal transformers' within 1e-5, and
    the loss of that micro-batch too (llama_hf_check writes the windows, logits and loss);
  - 3 AdamW steps (2 ranks under mpiexec for the untied model, one process for the tied one,
    whose embedding and head share a stage) give, after `pipemat export`, the weights of 3 steps
    of torch.optim.AdamW on the same micro-batches within 1e-5 relative (the loss of each step,
    output.metrics, within 1e-5 too), and the exported
    directory loads in transformers (its config.json) with those weights;
  - export -> init_from -> export is byte-identical.
Exit 77: transformers or safetensors is not installed (ctest skips the test).

  llama_oracle.py --pipemat BIN --check LLAMA_HF_CHECK [--mpiexec "mpiexec -n 2 ..."]
"""
import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile

try:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:
    print(f"llama_oracle: {e}; scripts/install-deps.sh installs transformers and safetensors")
    sys.exit(77)

SEQ_LEN, BATCH, MICRO_BATCHES, STEPS = 16, 2, 2, 3
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.1
TOL = 1e-5


def fails(cmd, expected):
    print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(done.stdout, end="", flush=True)
    assert done.returncode != 0, f"{cmd[0]} succeeded; expected an error"
    for text in expected:
        assert text in done.stdout, f"the error does not say {text!r}"


def run(cmd):
    print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        sys.exit(f"llama_oracle: {cmd[0]} exited {done.returncode}")
    return done.stdout


def write_text(path):
    # Deterministic bytes 1..255 (no NUL: a text file), enough for both splits.
    g = torch.Generator().manual_seed(11)
    data = torch.randint(1, 256, (3 * 4096,), generator=g, dtype=torch.uint8)
    with open(path, "wb") as f:
        f.write(bytes(data.tolist()))


def config_yaml(path, hf_dir, text, ck, ranks, transport, optimizer="adamw", lr=LR,
                weight_decay=WEIGHT_DECAY, steps=STEPS, metrics=""):
    with open(path, "w") as f:
        f.write(f"""model:
  kind: llama
  from: {hf_dir}
  seq_len: {SEQ_LEN}
  batch: {BATCH}
data:
  path: {text}
  validation: 0.34
schedule:
  kind: 1f1b
  ranks: {ranks}
  micro_batches: {MICRO_BATCHES}
transport:
  kind: {transport}
training:
  steps: {steps}
  optimizer: {optimizer}
  lr: {lr}
  weight_decay: {weight_decay}
  clip_grad_norm: 0
  warmup: 0
  lr_decay: none
  eval_every: 0
  seed: 5
  precision: fp32
  init_from: {hf_dir}
checkpoint:
  dir: {ck}
sample:
  tokens: 0
output:
  metrics: "{metrics}"
  loss_svg: ""
  progress: false
  reference_steps: 0
""")


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check(tied, args, work, results):
    name = "tied" if tied else "untied"
    d = os.path.join(work, name)
    hf_dir = os.path.join(d, "hf")
    os.makedirs(hf_dir)
    torch.manual_seed(1 if tied else 0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=tied,
                      hidden_act="silu", attention_bias=False, mlp_bias=False)
    model = LlamaForCausalLM(cfg).float()
    # Norm weights away from 1, so that a norm read wrongly shows.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    if tied:
        # As older transformers saved it: the rotary embedding's inv_freq buffer too (ignored).
        f = os.path.join(hf_dir, "model.safetensors")
        tensors = load_file(f)
        tensors["model.rotary_emb.inv_freq"] = 1.0 / (10000.0 ** (torch.arange(0, 16, 2) / 16))
        save_file(tensors, f, metadata={"format": "pt"})
    text = os.path.join(d, "text.bin")
    write_text(text)
    ranks, transport = (1, "local") if tied else (2, "mpi" if args.mpiexec else "local")

    # Logits and loss of one micro-batch, and the windows of every step.
    cfg_path = os.path.join(d, "train.yaml")
    ck = os.path.join(d, "ck")
    metrics = os.path.join(d, "metrics.jsonl")
    config_yaml(cfg_path, hf_dir, text, ck, ranks, transport, metrics=metrics)
    out = os.path.join(d, "pipemat.safetensors")
    run([args.check, cfg_path, out, str(STEPS)])
    got = load_file(out)
    model.eval()
    with torch.no_grad():
        logits = model(got["ids.0.0"]).logits
        loss = F.cross_entropy(logits.reshape(-1, 256), got["next.0.0"].reshape(-1))
    # Logits that vary, so that equal ones say something.
    assert logits.std().item() > 1e-2, f"{name}: logits std {logits.std().item()}"
    dl = (got["logits"] - logits).abs().max().item()
    dloss = abs(got["loss"].item() - loss.item())
    results[name + " logits max abs diff"] = dl
    results[name + " loss abs diff"] = dloss
    print(f"{name}: logits max |diff| {dl:.3g}, loss {got['loss'].item():.7f} vs {loss.item():.7f}")
    assert dl <= TOL, f"{name}: logits differ by {dl}"
    assert dloss <= TOL, f"{name}: loss differs by {dloss}"

    if not tied:
        # A config.json of another shape than the weights: one error listing the mis-shaped.
        bad = os.path.join(d, "bad")
        os.makedirs(bad)
        os.symlink(os.path.join(hf_dir, "model.safetensors"), os.path.join(bad, "model.safetensors"))
        with open(os.path.join(hf_dir, "config.json")) as f:
            j = json.load(f)
        j["intermediate_size"] = 96
        with open(os.path.join(bad, "config.json"), "w") as f:
            json.dump(j, f)
        bad_yaml = os.path.join(d, "bad.yaml")
        config_yaml(bad_yaml, bad, text, ck, 1, "local")
        fails([args.check, bad_yaml, os.path.join(d, "bad.safetensors"), "1"],
              ["training.init_from: " + bad, "6 of another shape",
               "model.layers.0.mlp.gate_proj.weight ([128, 64] in the file, the model's [96, 64])",
               "model.layers.1.mlp.down_proj.weight ([64, 128] in the file, the model's [64, 96])"])

    # 3 AdamW steps in pipemat (2 ranks under mpiexec for the untied model), then export.
    train = [args.pipemat, "train", "--config", cfg_path]
    if ranks == 2 and args.mpiexec:
        train = shlex.split(args.mpiexec) + train
    run(train)
    step_dirs = sorted(glob.glob(os.path.join(ck, "step-*")))
    assert step_dirs, f"{name}: no checkpoint in {ck}"
    out_dir = os.path.join(d, "out")
    os.makedirs(out_dir)
    run([args.pipemat, "export", "--checkpoint", step_dirs[-1], "--out",
         os.path.join(out_dir, "model.safetensors")])

    # The same 3 steps in plain PyTorch: mean loss over the micro-batches of each step.
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(0.0)
        for mb in range(MICRO_BATCHES):
            lg = model(got[f"ids.{step}.{mb}"]).logits
            l = F.cross_entropy(lg.reshape(-1, 256), got[f"next.{step}.{mb}"].reshape(-1))
            (l / MICRO_BATCHES).backward()
            losses[-1] += l.item() / MICRO_BATCHES
        opt.step()
    # The pipeline's loss of each step (output.metrics) against the same micro-batches here.
    with open(metrics) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    assert len(steps) == STEPS, f"{name}: {len(steps)} steps in {metrics}"
    dsteps = max(abs(m["loss"] - l) for m, l in zip(steps, losses))
    results[name + " training loss (3 steps) max abs diff"] = dsteps
    print(f"{name}: training losses {[m['loss'] for m in steps]} vs {losses}")
    assert dsteps <= TOL, f"{name}: the training loss differs by {dsteps}"
    expected = {k: v.detach() for k, v in model.state_dict().items()}
    if tied:
        expected.pop("lm_head.weight", None)
    exported = load_file(os.path.join(out_dir, "model.safetensors"))
    assert set(exported) == set(expected), \
        f"{name}: exported names {sorted(set(exported) ^ set(expected))} differ"
    worst = max(max_rel(exported[k], expected[k]) for k in expected)
    results[name + " weights after 3 steps max rel diff"] = worst
    print(f"{name}: weights after {STEPS} AdamW steps: max relative diff {worst:.3g}")
    assert worst <= TOL, f"{name}: weights differ by {worst} relative"
    moved = min(max_rel(exported[k], initial[k]) for k in expected)
    assert moved > 100 * TOL, f"{name}: training moved a tensor by only {moved} relative"

    # The exported directory loads in transformers.
    loaded = LlamaForCausalLM.from_pretrained(out_dir)
    assert loaded.config.tie_word_embeddings == tied
    for k, v in loaded.state_dict().items():
        ref = exported.get(k, exported.get("model.embed_tokens.weight") if tied else None)
        assert ref is not None and torch.equal(v, ref), f"{name}: transformers loaded {k} otherwise"

    # export -> init_from -> export is byte-identical (one SGD step of a learning rate below
    # float32's smallest changes nothing).
    again_yaml = os.path.join(d, "again.yaml")
    ck2 = os.path.join(d, "ck2")
    config_yaml(again_yaml, out_dir, text, ck2, 1, "local", optimizer="sgd", lr=1e-300,
                weight_decay=0, steps=1)
    run([args.pipemat, "train", "--config", again_yaml])
    again = os.path.join(d, "again")  # export creates it
    said = run([args.pipemat, "export", "--checkpoint", sorted(glob.glob(os.path.join(ck2, "step-*")))[-1],
         "--out", os.path.join(again, "model.safetensors")])
    assert " and " + os.path.join(again, "config.json") in said, "export does not name config.json"
    for f in ("model.safetensors", "config.json"):
        with open(os.path.join(out_dir, f), "rb") as a, open(os.path.join(again, f), "rb") as b:
            assert a.read() == b.read(), f"{name}: {f} differs after export -> init_from -> export"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipemat", required=True)
    ap.add_argument("--check", required=True)
    ap.add_argument("--mpiexec", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipemat_hf_oracle_") as work:
        for tied in (False, True):
            check(tied, args, work, results)
    print("llama_oracle: " + json.dumps(results))


if __name__ == "__main__":
    main()
