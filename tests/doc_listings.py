#!/usr/bin/env python3
"""doc_listings.py SOURCE_DIR: docs/library.md shows the files of examples/pipeline_library
exactly (main.cpp and CMakeLists.txt, each as one fenced listing of the whole file)."""
import pathlib
import sys

root = pathlib.Path(sys.argv[1])
doc = (root / "docs/library.md").read_text()
failed = False
for name, fence in (("main.cpp", "cpp"), ("CMakeLists.txt", "cmake")):
    text = (root / "examples/pipeline_library" / name).read_text()
    if f"```{fence}\n{text}```\n" not in doc:
        print(f"doc_listings: FAIL: docs/library.md does not show examples/pipeline_library/{name}"
              f" as it is (copy the whole file into its ```{fence} listing)")
        failed = True
    else:
        print(f"doc_listings: examples/pipeline_library/{name} is shown as it is")
sys.exit(1 if failed else 0)
