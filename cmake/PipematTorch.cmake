# Finding LibTorch, and the versions pipemat supports.
#
# Note [Finding LibTorch]
# pipemat builds against the LibTorch inside PyPI's `torch` wheel (headers, libraries and CMake
# package live in the wheel: torch/share/cmake). cmake/torch-version.txt pins the one version
# scripts/install-deps.sh installs, into the virtual environment PIPEMAT_VENV (default
# /opt/pipemat-venv for root, ~/.local/share/pipemat/venv otherwise). Search order:
#   1. whatever the user gives: -DTorch_DIR=..., -DCMAKE_PREFIX_PATH=... (another pip version's
#      torch/share/cmake, or an unpacked libtorch archive);
#   2. the virtual environment above;
#   3. a `torch` importable by python3 (the machine's Python);
#   4. CMake's system paths.
# The first TorchConfig.cmake found is used, with the Caffe2 package beside it (never another
# LibTorch's).
# Only versions in PIPEMAT_TORCH_MIN..PIPEMAT_TORCH_MAX are accepted: pipemat reaches five
# LibTorch internals (four in remat, listed in remat/include/pipemat/remat/remat.h, and pp's split
# backward in pp/src/split_backward.cpp), each checked for exactly this range. Anything else stops
# the configure step here, naming what was found; scripts/check-torch.sh VERSION builds and tests
# one version of the range.

set(PIPEMAT_TORCH_MIN 2.11)
set(PIPEMAT_TORCH_MAX 2.15)
file(STRINGS "${CMAKE_CURRENT_LIST_DIR}/torch-version.txt" PIPEMAT_TORCH_PINNED LIMIT_COUNT 1)

function(pipemat_torch_candidates out)
  set(prefixes)
  set(venvs)
  if(DEFINED ENV{PIPEMAT_VENV})
    list(APPEND venvs "$ENV{PIPEMAT_VENV}")
  endif()
  list(APPEND venvs /opt/pipemat-venv)
  if(DEFINED ENV{HOME})
    list(APPEND venvs "$ENV{HOME}/.local/share/pipemat/venv")
  endif()
  foreach(venv IN LISTS venvs)
    file(GLOB found LIST_DIRECTORIES true "${venv}/lib/python3*/site-packages/torch/share/cmake")
    list(APPEND prefixes ${found})
  endforeach()
  find_program(PIPEMAT_PYTHON3 python3)
  if(PIPEMAT_PYTHON3)
    # find_spec locates the package without importing it (importing loads the CUDA libraries).
    execute_process(
      COMMAND "${PIPEMAT_PYTHON3}" -c
              "import importlib.util as u; s = u.find_spec('torch'); print(s.submodule_search_locations[0] if s else '')"
      OUTPUT_VARIABLE site OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(site AND EXISTS "${site}/share/cmake")
      list(APPEND prefixes "${site}/share/cmake")
    endif()
  endif()
  set(${out} ${prefixes} PARENT_SCOPE)
endfunction()

# An installed pipemat (pipematConfig.cmake) sets PIPEMAT_TORCH_BUILT_VERSION and _DIR: a project
# that links it must link the same LibTorch, so that one is searched first and any other refused.
macro(pipemat_find_torch)
  if(PIPEMAT_TORCH_BUILT_DIR AND NOT DEFINED Torch_DIR)
    set(Torch_DIR "${PIPEMAT_TORCH_BUILT_DIR}" CACHE PATH "LibTorch's CMake package")
  endif()
  # Torch_DIR is settled here, before LibTorch's package loads: that package finds its Caffe2 part
  # with find_dependency, which searches CMAKE_PREFIX_PATH before its own directory, so another
  # LibTorch on the search path could supply the libraries under this one's headers. The first
  # TorchConfig.cmake of the user's CMAKE_PREFIX_PATH, then of the candidates, is the one;
  # its sibling Caffe2 directory is the only Caffe2 loaded.
  if(NOT DEFINED Torch_DIR)
    pipemat_torch_candidates(_pipemat_torch_prefixes)
    set(_pipemat_torch_search)
    foreach(_prefix IN LISTS CMAKE_PREFIX_PATH _pipemat_torch_prefixes)
      list(APPEND _pipemat_torch_search "${_prefix}/Torch" "${_prefix}/share/cmake/Torch"
                  "${_prefix}/lib/cmake/Torch")
    endforeach()
    foreach(_dir IN LISTS _pipemat_torch_search)
      if(EXISTS "${_dir}/TorchConfig.cmake")
        set(Torch_DIR "${_dir}" CACHE PATH "LibTorch's CMake package")
        break()
      endif()
    endforeach()
  endif()
  if(DEFINED Torch_DIR AND EXISTS "${Torch_DIR}/../Caffe2/Caffe2Config.cmake")
    get_filename_component(_pipemat_caffe2 "${Torch_DIR}/../Caffe2" ABSOLUTE)
    set(Caffe2_DIR "${_pipemat_caffe2}" CACHE PATH "LibTorch's Caffe2 part" FORCE)
  endif()
  # The wheel's TorchConfig is a CUDA build: it runs CUDA detection at configure time and wants an
  # architecture list when no GPU is visible. pipemat compiles no CUDA code of its own; the list only
  # fills LibTorch's nvcc flags (H100/H200, A100).
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT DEFINED TORCH_CUDA_ARCH_LIST)
    set(ENV{TORCH_CUDA_ARCH_LIST} "8.0;9.0")
  endif()
  # LibTorch's CMake package enables CUDA and chooses nvcc's architectures from the list above; it
  # warns about CMake's own CMAKE_CUDA_ARCHITECTURES, which CMP0104 NEW would define.
  cmake_policy(SET CMP0104 OLD)
  # The first LibTorch in the search order is the one used (no version in the request: CMake
  # would skip an unsuitable one silently and take the next, even against an explicit Torch_DIR).
  find_package(Torch CONFIG QUIET)
  if(NOT Torch_FOUND OR Torch_VERSION VERSION_LESS "${PIPEMAT_TORCH_MIN}"
     OR Torch_VERSION VERSION_GREATER_EQUAL "${PIPEMAT_TORCH_MAX}.9999")
    if(Torch_FOUND)
      set(_seen "\n  LibTorch ${Torch_VERSION} at ${Torch_DIR}")
    else()
      string(CONCAT _seen "\n  none (searched Torch_DIR, CMAKE_PREFIX_PATH, the pipemat "
                    "virtual environment, python3's torch and the system)")
    endif()
    message(FATAL_ERROR
      "pipemat supports LibTorch ${PIPEMAT_TORCH_MIN} to ${PIPEMAT_TORCH_MAX}; found:${_seen}\n"
      "scripts/install-deps.sh installs torch==${PIPEMAT_TORCH_PINNED} from PyPI into "
      "PIPEMAT_VENV (default /opt/pipemat-venv). Another one: -DTorch_DIR=<torch>/share/cmake/Torch "
      "or -DCMAKE_PREFIX_PATH=<libtorch>. A build directory configured before keeps its Torch_DIR: "
      "remove its CMakeCache.txt.")
  endif()
  if(PIPEMAT_TORCH_BUILT_VERSION AND NOT Torch_VERSION VERSION_EQUAL PIPEMAT_TORCH_BUILT_VERSION)
    message(FATAL_ERROR
      "this pipemat was built against LibTorch ${PIPEMAT_TORCH_BUILT_VERSION} "
      "(${PIPEMAT_TORCH_BUILT_DIR}); this project found LibTorch ${Torch_VERSION} at ${Torch_DIR}. "
      "Link the same one: -DTorch_DIR=${PIPEMAT_TORCH_BUILT_DIR}")
  endif()
  message(STATUS "pipemat: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX}")
  # PyPI's LibTorch libraries export copies of parts of the C++ standard library they were built
  # with (std::filesystem among them: 64 symbols in 2.11's libtorch.so, 142 in libtorch_cpu.so).
  # The dynamic linker binds a program's calls to the first library in its needed list that
  # defines a symbol, and g++ names libstdc++ last, so pipemat's std::filesystem::remove_all ran
  # 2.11's copy, which jumps to a null address. Naming libstdc++ first binds the program to the
  # standard library it was compiled against.
  add_link_options("LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
  # The wheel's libtorch_cuda needs the wheel's NCCL and CUDA runtime (nvidia-* wheels beside
  # torch), found at run time through its own RUNPATH; the linker needs to be told where they are,
  # or it picks up an older NCCL from a CUDA toolkit on the machine.
  file(GLOB _pipemat_nvidia_libs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
  foreach(_dir IN LISTS _pipemat_nvidia_libs)
    add_link_options("LINKER:-rpath-link,${_dir}")
  endforeach()
endmacro()

# PIPEMAT_CUDA: ON compiles pipemat's CUDA paths (devices per rank, the CUDA allocator's
# statistics), OFF leaves them out, AUTO (the default) is ON when the LibTorch found is a CUDA
# build and CMake found the CUDA compiler that build needs. Compiling them needs no GPU; running
# them does (scripts/gpu-check.sh). Sets PIPEMAT_CUDA_ENABLED.
macro(pipemat_cuda_option)
  set(PIPEMAT_CUDA AUTO CACHE STRING "Compile pipemat's CUDA paths: ON, OFF or AUTO")
  set_property(CACHE PIPEMAT_CUDA PROPERTY STRINGS AUTO ON OFF)
  if(TORCH_CUDA_LIBRARIES AND CMAKE_CUDA_COMPILER)
    set(_pipemat_cuda_possible TRUE)
  else()
    set(_pipemat_cuda_possible FALSE)
  endif()
  if(PIPEMAT_CUDA STREQUAL "AUTO")
    set(PIPEMAT_CUDA_ENABLED ${_pipemat_cuda_possible})
  elseif(PIPEMAT_CUDA)
    if(NOT _pipemat_cuda_possible)
      message(FATAL_ERROR "PIPEMAT_CUDA=ON needs a CUDA build of LibTorch and the CUDA toolkit; "
              "LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX} has CUDA libraries: "
              "'${TORCH_CUDA_LIBRARIES}', CUDA compiler: '${CMAKE_CUDA_COMPILER}'")
    endif()
    set(PIPEMAT_CUDA_ENABLED TRUE)
  else()
    set(PIPEMAT_CUDA_ENABLED FALSE)
  endif()
  message(STATUS "pipemat: CUDA paths ${PIPEMAT_CUDA_ENABLED} (PIPEMAT_CUDA=${PIPEMAT_CUDA})")
endmacro()

# PIPEMAT_NCCL_ENABLED: the NCCL link of device lanes (comm; Note [Device lanes]) is built. It
# needs the CUDA paths and NCCL's header and library: those of the torch wheel (its nvidia/nccl,
# which LibTorch itself links) before any other. Defines the imported target pipemat::nccl.
# REQUIRED (an installed pipemat built with it): a missing NCCL is an error.
macro(pipemat_find_nccl)
  cmake_parse_arguments(_pipemat_nccl "REQUIRED" "" "" ${ARGN})
  set(PIPEMAT_NCCL_ENABLED FALSE)
  if(PIPEMAT_CUDA_ENABLED OR _pipemat_nccl_REQUIRED)
    # The wheel's first (NO_DEFAULT_PATH: CMAKE_PREFIX_PATH would come before HINTS), then the
    # system's.
    find_path(PIPEMAT_NCCL_INCLUDE_DIR nccl.h
              PATHS "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include" NO_DEFAULT_PATH)
    find_path(PIPEMAT_NCCL_INCLUDE_DIR nccl.h)
    find_library(PIPEMAT_NCCL_LIBRARY NAMES nccl libnccl.so.2
                 PATHS "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/lib" NO_DEFAULT_PATH)
    find_library(PIPEMAT_NCCL_LIBRARY NAMES nccl libnccl.so.2)
    if(PIPEMAT_NCCL_INCLUDE_DIR AND PIPEMAT_NCCL_LIBRARY)
      set(PIPEMAT_NCCL_ENABLED TRUE)
      if(NOT TARGET pipemat::nccl)
        add_library(pipemat::nccl UNKNOWN IMPORTED)
        set_target_properties(pipemat::nccl PROPERTIES
          IMPORTED_LOCATION "${PIPEMAT_NCCL_LIBRARY}"
          INTERFACE_INCLUDE_DIRECTORIES "${PIPEMAT_NCCL_INCLUDE_DIR}")
      endif()
    elseif(_pipemat_nccl_REQUIRED)
      message(FATAL_ERROR "this pipemat was built with NCCL; nccl.h or libnccl was not found "
              "(searched ${TORCH_INSTALL_PREFIX}/../nvidia/nccl and the system)")
    endif()
  endif()
  if(NOT _pipemat_nccl_REQUIRED)
    message(STATUS "pipemat: NCCL link ${PIPEMAT_NCCL_ENABLED} ${PIPEMAT_NCCL_LIBRARY}")
  endif()
endmacro()
