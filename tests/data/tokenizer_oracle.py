#!/usr/bin/env python3
"""The reference side of pipemat's tokenizer tests (tests/data/tokenizer_test.cpp): the Python
tokenizers and sentencepiece packages, run by the test through the project's Python
(/opt/pipemat-venv/bin/python3). Nothing here reaches the network.

  tokenizer_oracle.py fixture KIND DIR       train a small tokenizer on fortunes text into DIR
                                             (tokenizer.json or tokenizer.model); KIND is one of
                                             gpt2 roberta llama3 qwen2 smollm splits sp-bpe
                                             (byte fallback) sp-bpe-plain sp-unigram
  tokenizer_oracle.py encode TOKENIZER OUT INPUT...
                                             the ids of each INPUT file's bytes, read as
                                             bytes.decode("utf-8", "replace"), into OUT (per
                                             input: a little-endian uint32 count, then the ids
                                             as int32); tokenizer.json with
                                             add_special_tokens=False, a .model with encode()
  tokenizer_oracle.py decode TOKENIZER IDS OUT
                                             the text of each id list of IDS ({"ids": [...]})
                                             into OUT ({"texts": [...]}), special tokens kept
  tokenizer_oracle.py utf8 OUT INPUT...       each INPUT's bytes.decode("utf-8", "replace") into
                                             OUT ({"texts": [...]})
  tokenizer_oracle.py classes OUT            the code points each pre-tokenizer class matches in
                                             the tokenizers package (Oniguruma), as ranges
  tokenizer_oracle.py nfc-cases OUT          texts that probe NFC (every code point, its NFD,
                                             pairs of combining marks), one per line of OUT
  tokenizer_oracle.py fuzz-seeds DIR         the seed corpus of tests/fuzz/tokenizer_json_fuzz.cpp:
                                             small tokenizer.json files of each supported layout
                                             (300 tokens) and damaged copies of them
  tokenizer_oracle.py nfc-tables             the C++ tables of data/src/unicode_nfc_tables.h:
                                             Python's Unicode data as the tokenizers package's NFC
                                             has it (its tables are older: marks it does not know
                                             have class 0, decompositions it lacks are dropped)
"""
import array
import glob
import json
import os
import struct
import sys
import time
import unicodedata

FORTUNES = "/usr/share/games/fortunes"

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def fortune_files():
    """The text files of the fortunes directory (not the .dat indexes, not the .u8 links)."""
    return sorted(f for f in glob.glob(os.path.join(FORTUNES, "*"))
                  if not f.endswith(".dat") and not os.path.islink(f) and os.path.isfile(f))


def fortune_slice(limit):
    data = b"".join(open(f, "rb").read() for f in fortune_files())
    return data[:limit].decode("utf-8", "replace")


def load(path):
    if path.endswith(".json"):
        from tokenizers import Tokenizer
        return "hf", Tokenizer.from_file(path)
    import sentencepiece as spm
    return "sp", spm.SentencePieceProcessor(model_file=path)


def train_hf(kind, out_dir):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pt
    from tokenizers import trainers

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=False)
    special = ["<|endoftext|>"]
    model = models.BPE()
    normalizer = None
    if kind == "gpt2":
        pre = pt.ByteLevel(add_prefix_space=False)
    elif kind == "roberta":
        pre = pt.ByteLevel(add_prefix_space=True)
        special = ["<s>", "</s>", "<|endoftext|>"]
    elif kind == "llama3":
        model = models.BPE(ignore_merges=True)
        pre = pt.Sequence([pt.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
                           byte_level])
        special = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"] + [
            f"<|reserved_special_token_{i}|>" for i in range(4)]
    elif kind == "qwen2":
        normalizer = normalizers.NFC()
        pre = pt.Sequence([pt.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
                           byte_level])
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    elif kind == "smollm":
        pre = pt.Sequence([pt.Digits(individual_digits=True),
                           pt.ByteLevel(add_prefix_space=False, use_regex=True)])
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    elif kind == "splits":
        pre = pt.Sequence([
            pt.Split(Regex(r"\s+"), behavior="merged_with_previous"),
            pt.Split("--", behavior="merged_with_next"),
            pt.Split(Regex(r"[.!?]"), behavior="contiguous", invert=True),
            pt.Split(Regex(r"[,;]"), behavior="removed"),
            pt.Digits(individual_digits=False),
            byte_level,
        ])
    else:
        sys.exit(f"tokenizer_oracle: unknown fixture kind {kind}")
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=special,
                                  initial_alphabet=pt.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([fortune_slice(400_000)], trainer)
    if kind == "gpt2":
        # Added tokens of every kind the matcher handles.
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True),
                                AddedToken("[RSTRIP]", rstrip=True, special=True)])
        tok.add_tokens([AddedToken("héllo wörld", normalized=False),
                        AddedToken(" spaced ", normalized=True),
                        AddedToken("the", normalized=True)])
    if kind == "roberta":
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    if kind == "qwen2":
        tok.add_tokens([AddedToken("Ame\u0301lie", normalized=True)])  # matched as NFC "Amélie"
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))


def train_sp(kind, out_dir):
    import sentencepiece as spm
    os.makedirs(out_dir, exist_ok=True)
    text = os.path.join(out_dir, "train.txt")
    with open(text, "w", encoding="utf-8") as f:
        f.write(fortune_slice(300_000))
    model_type = kind.split("-")[1]
    spm.SentencePieceTrainer.train(
        input=text, model_prefix=os.path.join(out_dir, "tokenizer"), vocab_size=800,
        model_type=model_type, num_threads=1, minloglevel=2, character_coverage=0.9995,
        byte_fallback=(kind == "sp-bpe"), user_defined_symbols=["<sep>"])
    os.remove(text)


def cmd_fixture(kind, out_dir):
    if kind.startswith("sp-"):
        train_sp(kind, out_dir)
    else:
        train_hf(kind, out_dir)


def cmd_encode(path, out, inputs):
    kind, tok = load(path)
    texts = [open(p, "rb").read().decode("utf-8", "replace") for p in inputs]
    if kind == "hf":
        ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    else:
        ids = [tok.encode(t) for t in texts]
    with open(out, "wb") as f:
        for one in ids:
            f.write(struct.pack("<I", len(one)))
            f.write(array.array("i", one).tobytes())


def cmd_decode(path, ids_file, out):
    kind, tok = load(path)
    lists = json.load(open(ids_file))["ids"]
    if kind == "hf":
        texts = [tok.decode(ids, skip_special_tokens=False) for ids in lists]
    else:
        texts = [tok.decode(ids) for ids in lists]
    with open(out, "w") as f:
        json.dump({"texts": texts}, f)


def cmd_utf8(out, inputs):
    with open(out, "w") as f:
        json.dump({"texts": [open(p, "rb").read().decode("utf-8", "replace") for p in inputs]}, f)


def ranges(code_points):
    out = []
    for c in sorted(code_points):
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def cmd_classes(out):
    """For each class: the code points it matches alone ("c"), or after an apostrophe ("'c")."""
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pt
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    alone = "".join(chr(c) for c in cps)
    classes = {
        "\\s": r"\s", "\\S": r"\S", "\\p{L}": r"\p{L}", "\\p{N}": r"\p{N}",
        "[^\\s\\p{L}\\p{N}]": r"[^\s\p{L}\p{N}]", "[^\\r\\n\\p{L}\\p{N}]": r"[^\r\n\p{L}\p{N}]",
    }
    result = {}
    for name, pattern in classes.items():
        kept = pt.Split(Regex(pattern), behavior="removed").pre_tokenize_str(alone)
        left = set(ord(ch) for piece, _ in kept for ch in piece)
        result[name] = ranges(c for c in cps if c not in left)
    # The contractions, case-insensitive: which "'c" match (?i:'s|'t|'re|'ve|'m|'ll|'d) whole.
    split = pt.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"), behavior="isolated")
    matched = set()
    for piece, _ in split.pre_tokenize_str("\n".join("'" + chr(c) for c in cps)):
        if len(piece) == 2 and piece[0] == "'":
            matched.add(ord(piece[1]))
    result["(?i:'s|'t|'re|'ve|'m|'ll|'d)"] = ranges(matched)
    with open(out, "w") as f:
        json.dump(result, f)


def nfc_probe_texts():
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000 and c not in (0x0A, 0x0D)]
    texts = [chr(c) for c in cps]
    texts += [unicodedata.normalize("NFD", chr(c)) for c in cps
              if unicodedata.normalize("NFD", chr(c)) != chr(c)]
    marks = [c for c in cps if unicodedata.combining(chr(c))]
    texts += ["a" + chr(m1) + chr(m2) + "\u0301" for m1 in marks[::5] for m2 in marks[::13]]
    return texts


def cmd_nfc_cases(out):
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        # Texts joined by line: each probe is a word of its own in the pre-tokenizer too.
        f.write("\n".join(nfc_probe_texts()))


def cmd_fuzz_seeds(out_dir):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pt
    from tokenizers import trainers

    os.makedirs(out_dir, exist_ok=True)
    text = fortune_slice(20_000)
    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=False)
    layouts = {
        "gpt2": (models.BPE(), None, pt.ByteLevel(add_prefix_space=False)),
        "roberta": (models.BPE(), None, pt.ByteLevel(add_prefix_space=True)),
        "llama3": (models.BPE(ignore_merges=True), None,
                   pt.Sequence([pt.Split(Regex(LLAMA3_PATTERN), behavior="isolated"), byte_level])),
        "qwen2": (models.BPE(), normalizers.NFC(),
                  pt.Sequence([pt.Split(Regex(QWEN2_PATTERN), behavior="isolated"), byte_level])),
        "smollm": (models.BPE(), None,
                   pt.Sequence([pt.Digits(individual_digits=True),
                                pt.ByteLevel(add_prefix_space=False)])),
        "splits": (models.BPE(), None,
                   pt.Sequence([pt.Split(Regex(r"\s+"), behavior="merged_with_previous"),
                                pt.Split("--", behavior="merged_with_next"),
                                pt.Split(Regex(r"[.!?]"), behavior="contiguous", invert=True),
                                pt.Split(Regex(r"[,;]"), behavior="removed"),
                                pt.Digits(individual_digits=False), byte_level])),
    }
    seeds = {}
    for name, (model, normalizer, pre) in layouts.items():
        tok = Tokenizer(model)
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.pre_tokenizer = pre
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pt.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator([text], trainer)
        if name == "gpt2":
            tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True),
                                    AddedToken("[RSTRIP]", rstrip=True, special=True)])
            tok.add_tokens([AddedToken(" spaced ", normalized=True)])
        seeds[name] = tok.to_str()
    for name, content in seeds.items():
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            f.write(content)
    base = json.loads(seeds["gpt2"])

    def damaged(name, edit):
        j = json.loads(json.dumps(base))
        edit(j)
        with open(os.path.join(out_dir, f"damaged-{name}.json"), "w") as f:
            f.write(json.dumps(j, ensure_ascii=False))

    damaged("merge-not-in-vocab", lambda j: j["model"]["merges"].__setitem__(0, ["x", "NOPE"]))
    damaged("added-id", lambda j: j["added_tokens"][1].__setitem__("id", 999))
    damaged("wordpiece", lambda j: j["model"].__setitem__("type", "WordPiece"))
    damaged("metaspace", lambda j: j.__setitem__("pre_tokenizer", {"type": "Metaspace"}))
    damaged("bad-regex", lambda j: j.__setitem__("pre_tokenizer", {
        "type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(a|"}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]}))
    with open(os.path.join(out_dir, "damaged-truncated.json"), "w") as f:
        f.write(seeds["gpt2"][: len(seeds["gpt2"]) // 2])


def cmd_nfc_tables():
    from tokenizers import normalizers
    nfc = normalizers.NFC()
    nfd = normalizers.NFD()
    sep = "\u0001"
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000 and c != 1]
    # Combining classes: Python's, except the marks the tokenizers package does not reorder.
    marks = [c for c in cps if unicodedata.combining(chr(c))]
    probe = [0x0334, 0x0316, 0x0301, 0x0345]  # classes 1, 220, 230, 240: old marks
    cases = []
    for m in marks:
        for p in probe:
            cases += [chr(m) + chr(p), chr(p) + chr(m)]
    out = nfd.normalize_str(sep.join(cases)).split(sep)
    ccc = {}
    k = 0
    for m in marks:
        moved = False
        for p in probe:
            nd = unicodedata.normalize("NFD", chr(m))
            if out[k] != nd + chr(p) or out[k + 1] != chr(p) + nd:
                moved = True
            k += 2
        ccc[m] = unicodedata.combining(chr(m)) if moved else 0
    # Canonical decompositions (one level), as far as the tokenizers package has them.
    decomp = {}
    for c in cps:
        d = unicodedata.decomposition(chr(c))
        if not d or d.startswith("<") or 0xAC00 <= c <= 0xD7A3:
            continue
        decomp[c] = [int(x, 16) for x in d.split()]
    singles = nfd.normalize_str(sep.join(chr(c) for c in decomp)).split(sep)
    for c, got in zip(list(decomp), singles):
        if got != unicodedata.normalize("NFD", chr(c)):
            del decomp[c]
    # Primary composites: two-part decompositions NFC recomposes.
    pairs = {c: d for c, d in decomp.items() if len(d) == 2 and
             unicodedata.normalize("NFC", chr(d[0]) + chr(d[1])) == chr(c)}
    got = nfc.normalize_str(sep.join(chr(d[0]) + chr(d[1]) for d in pairs.values())).split(sep)
    compositions = sorted((d[0], d[1], c) for (c, d), g in zip(pairs.items(), got) if g == chr(c))
    classes = []
    for c in sorted(ccc):
        if ccc[c] == 0:
            continue
        if classes and classes[-1][1] == c - 1 and classes[-1][2] == ccc[c]:
            classes[-1][1] = c
        else:
            classes.append([c, c, ccc[c]])

    def rows(items, per_line):
        lines = []
        for i in range(0, len(items), per_line):
            lines.append("    " + " ".join(items[i:i + per_line]))
        return "\n".join(lines)

    print("#pragma once")
    print("// Generated by tests/data/tokenizer_oracle.py nfc-tables (Python "
          f"{sys.version.split()[0]}, Unicode {unicodedata.unidata_version},")
    print(f"// tokenizers {__import__('tokenizers').__version__}): Note [NFC as the tokenizers "
          "package writes it] in unicode_nfc.cpp.")
    print("// Do not edit.")
    print()
    print("#include <array>")
    print("#include <cstdint>")
    print()
    print("namespace pipemat::data::unicode {")
    print()
    print("// clang-format off")
    print("struct ClassRange {\n  char32_t first;\n  char32_t last;\n  uint8_t ccc;\n};")
    print("struct Decomposition {\n  char32_t code_point;\n  char32_t first;\n  char32_t second;  "
          "// 0: a singleton\n};")
    print("struct Composition {\n  char32_t first;\n  char32_t second;\n  char32_t composite;\n};")
    print()
    print(f"inline constexpr std::array<ClassRange, {len(classes)}> kCombiningClasses = {{{{")
    print(rows([f"{{0x{a:X}, 0x{b:X}, {v}}}," for a, b, v in classes], 4))
    print("}};")
    dl = sorted(decomp.items())
    print(f"inline constexpr std::array<Decomposition, {len(dl)}> kDecompositions = {{{{")
    print(rows([f"{{0x{c:X}, 0x{d[0]:X}, 0x{d[1] if len(d) > 1 else 0:X}}}," for c, d in dl],
               3))
    print("}};")
    print(f"inline constexpr std::array<Composition, {len(compositions)}> kCompositions = {{{{")
    print(rows([f"{{0x{a:X}, 0x{b:X}, 0x{c:X}}}," for a, b, c in compositions], 3))
    print("}};")
    print("// clang-format on")
    print()
    print("}  // namespace pipemat::data::unicode")


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, args = argv[1], argv[2:]
    if cmd == "fixture" and len(args) == 2:
        cmd_fixture(*args)
    elif cmd == "encode" and len(args) >= 2:
        cmd_encode(args[0], args[1], args[2:])
    elif cmd == "decode" and len(args) == 3:
        cmd_decode(*args)
    elif cmd == "utf8" and len(args) >= 1:
        cmd_utf8(args[0], args[1:])
    elif cmd == "classes" and len(args) == 1:
        cmd_classes(args[0])
    elif cmd == "nfc-cases" and len(args) == 1:
        cmd_nfc_cases(args[0])
    elif cmd == "fuzz-seeds" and len(args) == 1:
        cmd_fuzz_seeds(args[0])
    elif cmd == "nfc-tables" and not args:
        cmd_nfc_tables()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
