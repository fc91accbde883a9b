# pipematConfig.cmake of a pipemat build directory (not installed): find_package(pipemat) with
# CMAKE_PREFIX_PATH or pipemat_DIR naming the build directory ends here. Only an installed
# pipemat is a package (lib/cmake/pipemat of the install prefix).
message(FATAL_ERROR
  "pipemat: ${CMAKE_CURRENT_LIST_DIR} is a pipemat build directory, not an installed pipemat; "
  "find_package(pipemat) needs an install prefix. Install the build and point "
  "CMAKE_PREFIX_PATH at the prefix:\n"
  "  cmake --install ${CMAKE_CURRENT_LIST_DIR} --prefix <dir>\n"
  "  cmake ... -DCMAKE_PREFIX_PATH=<dir>\n"
  "(docs/library.md, \"In your own project\").")
