#!/usr/bin/env python3
"""Trains the byte-level BPE of configs/llama-bpe.yaml on the fortunes text.

A GPT-2-style byte-level BPE (the ByteLevel pre-tokenizer with GPT-2's pattern, the ByteLevel
decoder, one special token <|endoftext|>) of --vocab tokens, trained with Hugging Face's
tokenizers package on every text file under --input (in path order, a file reached through a
symlink read once, binary files skipped), and saved as --output/tokenizer.json. The same input
gives the same bytes: run it twice and compare. Needs the project's Python (scripts/install-deps.sh
installs tokenizers with transformers):

    /opt/pipemat-venv/bin/python3 scripts/train-tokenizer.py
"""

import argparse
import os
import sys


def text_files(root):
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
    if os.path.isfile(root):
        paths = [root]
    seen = set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(path):
            continue
        seen.add(real)
        with open(path, "rb") as f:
            data = f.read()
        if data and b"\0" not in data:
            yield data.decode("utf-8", "replace")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default="/usr/share/games/fortunes",
                        help="a text file or a directory of them (default: the fortunes)")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "..",
                                                         "configs", "tokenizers", "fortunes-bpe"),
                        help="the directory of tokenizer.json (default: configs/tokenizers/fortunes-bpe)")
    parser.add_argument("--vocab", type=int, default=2048, help="tokens, special ones included")
    args = parser.parse_args()
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        sys.exit("train-tokenizer: the tokenizers package is missing; run scripts/install-deps.sh "
                 "and use its Python (/opt/pipemat-venv/bin/python3)")
    texts = list(text_files(args.input))
    if not texts:
        sys.exit(f"train-tokenizer: {args.input} holds no text files")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    os.makedirs(args.output, exist_ok=True)
    out = os.path.join(args.output, "tokenizer.json")
    tokenizer.save(out)
    print(f"train-tokenizer: {len(texts)} files, {tokenizer.get_vocab_size()} tokens -> {out}")


if __name__ == "__main__":
    main()
