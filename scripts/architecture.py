#!/usr/bin/env python3
"""The drawings and the Note index of docs/architecture.md, made from the tree.

  python3 scripts/architecture.py --write   regenerates docs/img/architecture-libraries.svg,
                                            docs/img/architecture-step.svg and the Note index
                                            between the markers in docs/architecture.md
  python3 scripts/architecture.py --check   exits 1 naming what differs (ctest
                                            Docs.ArchitectureMatchesTheTree runs it)

The libraries and their edges come from the pipemat_check_dependencies() lines of the top
CMakeLists.txt (the configure step enforces them); each library needs a role below. The step's
flow is the table FLOW: every box names a file and a text in it, and the check fails when the
file is gone or no longer holds the text. The Note index lists every Note of the tree: a comment
line "// Note [Name]" (or "# Note [Name]") opens one; the check also fails when a "Note [Name]"
anywhere in the tree names no Note, or one Note is opened twice.
"""

import argparse
import html
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
LIB_SVG = ROOT / "docs" / "img" / "architecture-libraries.svg"
STEP_SVG = ROOT / "docs" / "img" / "architecture-step.svg"
BEGIN = "<!-- notes:begin (scripts/architecture.py --write) -->"
END = "<!-- notes:end -->"

# What each library is for, in a few words (the drawing's second line).
ROLES = {
    "core": "errors, formats, digests, SVG",
    "schedule": "action IR, generators, simulator",
    "plan": "remat choice under budgets",
    "comm": "transports: mpi, tcp, local",
    "comm_tensor": "tensors over a transport",
    "remat": "saved-tensor hooks, replay",
    "pp": "the pipeline API, executor",
    "weights": "safetensors read / write",
    "data": "tokenizers, indexed datasets",
    "models": "the zoo: GPT, MLP, MoE, ...",
    "train": "config, drivers, planner glue",
    "bench": "benchmarks, the demo",
    "launch": "the pipemat binary",
}
TORCH_FREE_NOTE = "white: no torch; grey: uses LibTorch"

# One training step, from the YAML file to the optimizer: (label, file, text the file holds).
FLOW = [
    ("YAML -> TrainConfig", "train/src/config_read.cpp", "TrainConfig parse_config("),
    ("model, loss, data", "train/src/model_run.cpp", "ModelRun make_model_run("),
    ("schedule of actions", "schedule/src/schedule.cpp", "Schedule build_schedule("),
    ("stages + remat policy", "pp/src/pipeline.cpp", "remat::apply_policy("),
    ("step: run the actions", "pp/src/executor.cpp", "StepMetrics Pipeline::Impl::train_step("),
    ("F / B: stage I/O", "pp/src/stage_io.cpp", "Note [Stage boundary signature]"),
    ("SEND / RECV", "comm/src/tensor_list.cpp", "TensorListWork::TensorListWork("),
    ("I / W: split backward", "pp/src/split_backward.cpp", "SplitBackward::run_weight("),
    ("R: replay", "remat/src/replay.cpp", "void Invocation::replay("),
    ("gradient all-reduce", "pp/src/data_parallel.cpp", "Note [Data x pipeline]"),
    ("clip, optimizer step", "pp/src/executor.cpp", "optimizer->step()"),
    ("metrics, checkpoint", "train/src/train.cpp", "TrainResult train_on("),
]


def libraries():
    """{library: set of pipemat libraries it may use} from the top CMakeLists.txt, plus launch."""
    text = (ROOT / "CMakeLists.txt").read_text()
    graph = {}
    for m in re.finditer(r"pipemat_check_dependencies\((\w+)\s+ALLOWED([^)]*)\)", text):
        name = m.group(1).removeprefix("pipemat_")
        graph[name] = {d.removeprefix("pipemat_") for d in m.group(2).split()
                       if d.startswith("pipemat_")}
        graph[name + "#torch"] = "torch" in m.group(2).split()
    core = ROOT / "core" / "CMakeLists.txt"
    if "pipemat_core" in core.read_text():
        graph.setdefault("core", set())
        graph.setdefault("core#torch", False)
    launch = (ROOT / "launch" / "CMakeLists.txt").read_text()
    m = re.search(r"target_link_libraries\(pipemat PRIVATE([^)]*)\)", launch)
    graph["launch"] = {d.removeprefix("pipemat_") for d in m.group(1).split()
                       if d.startswith("pipemat_")}
    graph["launch#torch"] = True
    return graph


def reduce(graph, libs):
    """Edges of the transitive reduction: a -> b unless a reaches b another way."""
    def reach(a, seen):
        for b in graph[a]:
            if b not in seen:
                seen.add(b)
                reach(b, seen)
        return seen
    edges = []
    for a in libs:
        for b in sorted(graph[a]):
            others = set()
            for c in graph[a] - {b}:
                others |= reach(c, {c})
            if b not in others:
                edges.append((a, b))
    return edges


def layers_of(graph, libs):
    depth = {}
    def d(a):
        if a not in depth:
            depth[a] = 1 + max((d(b) for b in graph[a]), default=-1)
        return depth[a]
    for a in libs:
        d(a)
    return depth


def svg_text(x, y, text, size=12, weight="normal", anchor="middle"):
    return (f'<text x="{x:.0f}" y="{y:.0f}" font-size="{size}" font-weight="{weight}" '
            f'text-anchor="{anchor}">{html.escape(text)}</text>')


def render_libraries(graph):
    libs = sorted(k for k in graph if "#" not in k)
    depth = layers_of(graph, libs)
    rows = {}
    for a in libs:
        rows.setdefault(depth[a], []).append(a)
    order = ["core", "schedule", "comm", "remat", "plan", "comm_tensor", "pp", "models", "train",
             "bench", "launch"]
    for r in rows.values():
        r.sort(key=lambda a: (order.index(a) if a in order else len(order), a))
    box_w, box_h, gap_x, gap_y = 200, 44, 30, 36
    width = max(len(r) for r in rows.values()) * (box_w + gap_x) + gap_x
    top = max(rows)
    height = (top + 1) * (box_h + gap_y) + 40
    pos = {}
    for level, names in rows.items():
        row_w = len(names) * box_w + (len(names) - 1) * gap_x
        x0 = (width - row_w) / 2
        y = 20 + (top - level) * (box_h + gap_y)
        for i, a in enumerate(names):
            pos[a] = (x0 + i * (box_w + gap_x), y)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker>'
           '</defs>',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    for a, b in reduce(graph, libs):
        (xa, ya), (xb, yb) = pos[a], pos[b]
        out.append(f'<line x1="{xa + box_w / 2:.0f}" y1="{ya + box_h:.0f}" '
                   f'x2="{xb + box_w / 2:.0f}" y2="{yb:.0f}" stroke="#555" '
                   f'marker-end="url(#arrow)"/>')
    for a in libs:
        x, y = pos[a]
        fill = "#e0e0e0" if graph[a + "#torch"] else "white"
        out.append(f'<rect x="{x:.0f}" y="{y:.0f}" width="{box_w}" height="{box_h}" rx="6" '
                   f'fill="{fill}" stroke="#333"/>')
        out.append(svg_text(x + box_w / 2, y + 18, a + "/" if a != "comm_tensor" else
                            "comm/ (tensor layer)", 13, "bold"))
        out.append(svg_text(x + box_w / 2, y + 35, ROLES.get(a, "?"), 11))
    out.append(svg_text(10, height - 12, "an arrow: uses (the configure step checks it); "
                        + TORCH_FREE_NOTE, 11, anchor="start"))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render_step():
    box_w, box_h, gap = 190, 46, 14
    per_row = 4
    rows = (len(FLOW) + per_row - 1) // per_row
    width = per_row * box_w + (per_row + 1) * gap + 20
    height = rows * (box_h + 34) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker>'
           '</defs>',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    centers = []
    for i, (label, path, _) in enumerate(FLOW):
        r, c = divmod(i, per_row)
        x = gap + 10 + c * (box_w + gap)
        y = 15 + r * (box_h + 34)
        centers.append((x, y))
        out.append(f'<rect x="{x}" y="{y}" width="{box_w}" height="{box_h}" rx="6" '
                   f'fill="white" stroke="#333"/>')
        out.append(svg_text(x + box_w / 2, y + 19, f"{i + 1}. {label}", 12, "bold"))
        out.append(svg_text(x + box_w / 2, y + 36, path, 10))
    for i in range(len(centers) - 1):
        (xa, ya), (xb, yb) = centers[i], centers[i + 1]
        if yb == ya:
            out.append(f'<line x1="{xa + box_w}" y1="{ya + box_h / 2:.0f}" x2="{xb}" '
                       f'y2="{yb + box_h / 2:.0f}" stroke="#555" marker-end="url(#arrow)"/>')
        else:
            out.append(f'<polyline points="{xa + box_w / 2:.0f},{ya + box_h} '
                       f'{xa + box_w / 2:.0f},{ya + box_h + 17} {xb + box_w / 2:.0f},'
                       f'{ya + box_h + 17} {xb + box_w / 2:.0f},{yb}" fill="none" '
                       f'stroke="#555" marker-end="url(#arrow)"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def tracked_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [f for f in out if (ROOT / f).is_file()
            and re.search(r"(\.(cpp|h|cmake|txt|sh|py|in|md)$)", f)]


def notes():
    """({name: [file, ...]} of the Notes opened, {name: [file, ...]} of every mention)."""
    opened, named = {}, {}
    heading = re.compile(r"^\s*(//|#) Note \[([^\]]+)\]\s*$")
    mention = re.compile(r"Note \[([^\]]+)\]")
    for f in tracked_files():
        if f in ("docs/architecture.md", "scripts/architecture.py"):
            continue
        for line in (ROOT / f).read_text(errors="replace").splitlines():
            m = heading.match(line)
            if m:
                opened.setdefault(m.group(2), []).append(f)
            for n in mention.findall(line):
                named.setdefault(n, []).append(f)
    return opened, named


def note_index(opened):
    by_folder = {}
    for name, files in opened.items():
        by_folder.setdefault(files[0].split("/")[0], []).append((name, files[0]))
    lines = [BEGIN, "", "| Note | where |", "|---|---|"]
    for folder in sorted(by_folder):
        for name, f in sorted(by_folder[folder], key=lambda x: (x[1], x[0].lower())):
            lines.append(f"| {name} | `{f}` |")
    lines += ["", END]
    return "\n".join(lines)


def problems_of_notes(opened, named):
    found = []
    for name, files in sorted(opened.items()):
        if len(files) > 1:
            found.append(f"Note [{name}] is opened {len(files)} times: {', '.join(files)}")
    for name, files in sorted(named.items()):
        if name not in opened:
            found.append(f"Note [{name}] (in {', '.join(sorted(set(files)))}) names no Note: "
                         "open it with a comment line '// Note [" + name + "]'")
    return found


def problems_of_flow():
    found = []
    for label, path, text in FLOW:
        p = ROOT / path
        if not p.is_file():
            found.append(f"step drawing: '{label}' names {path}, which is gone")
        elif text not in p.read_text():
            found.append(f"step drawing: '{label}': {path} no longer holds '{text}'")
    return found


def problems_of_roles(graph):
    libs = {k for k in graph if "#" not in k}
    found = [f"library {a} has no role in scripts/architecture.py ROLES" for a in
             sorted(libs - set(ROLES))]
    found += [f"ROLES names {a}, which is no library" for a in sorted(set(ROLES) - libs)]
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the drawings and index")
    mode.add_argument("--check", action="store_true", help="exit 1 when they differ from the tree")
    args = ap.parse_args()

    graph = libraries()
    opened, named = notes()
    problems = problems_of_roles(graph) + problems_of_flow() + problems_of_notes(opened, named)
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        problems.append(f"{DOC.relative_to(ROOT)} lacks the Note index markers")
        index_doc = doc
    else:
        index_doc = doc[:doc.index(BEGIN)] + note_index(opened) + doc[doc.index(END) + len(END):]
    wanted = {LIB_SVG: render_libraries(graph), STEP_SVG: render_step(), DOC: index_doc}
    if args.write:
        for path, text in wanted.items():
            path.write_text(text)
        for p in problems:
            print("architecture:", p, file=sys.stderr)
        return 1 if problems else 0
    for path, text in wanted.items():
        if not path.is_file() or path.read_text() != text:
            problems.append(f"{path.relative_to(ROOT)} is out of date: run "
                            "python3 scripts/architecture.py --write")
    for p in problems:
        print("architecture:", p, file=sys.stderr)
    if not problems:
        print(f"architecture: {len([k for k in graph if '#' not in k])} libraries, "
              f"{len(FLOW)} step boxes, {len(opened)} Notes: docs match the tree")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
