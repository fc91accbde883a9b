# Helpers shared by every pipemat target. Target-only: nothing here touches global state.

# PIPEMAT_SANITIZE (e.g. "address,undefined"): every pipemat target is built and linked with
# -fsanitize=<value> (tests/sanitize.sh builds the unit suites this way in a separate dir).
function(pipemat_sanitize name)
  if(PIPEMAT_SANITIZE)
    target_compile_options(${name} PRIVATE -fsanitize=${PIPEMAT_SANITIZE} -fno-omit-frame-pointer
                                           -fno-sanitize-recover=all)
    target_link_options(${name} PRIVATE -fsanitize=${PIPEMAT_SANITIZE})
    if(PIPEMAT_SANITIZE MATCHES "thread")
      # GCC warns that ThreadSanitizer does not model atomic_thread_fence, which Boost.Asio's
      # std_fenced_block uses in every handler; the warning is about the tool, not the code.
      target_compile_options(${name} PRIVATE -Wno-tsan)
    endif()
  endif()
endfunction()

# The warnings every pipemat target compiles with (libraries, commands and tests alike):
# -Wall -Wextra -Wshadow, except unused parameters (interfaces and test fixtures name the ones
# they ignore). PIPEMAT_WERROR=ON (the README test command) makes them errors. Headers of
# imported targets (LibTorch, GoogleTest, Boost) are system headers and do not warn.
function(pipemat_warnings name)
  target_compile_options(${name} PRIVATE -Wall -Wextra -Wshadow -Wno-unused-parameter)
  if(PIPEMAT_WERROR)
    target_compile_options(${name} PRIVATE -Werror)
  endif()
endfunction()

# Note [Shared precompiled header]
# A file that includes LibTorch's headers spends about half of its compile time parsing them. Every
# pipemat target that uses LibTorch (libraries with torch in DEPS, tests and commands given
# TORCH_PCH or passed to pipemat_use_torch_pch) force-includes one precompiled header,
# cmake/torch_pch.h, compiled once by the object library pipemat_torch_pch. GCC accepts a
# precompiled header only when code-generation flags match, so every such target compiles with
# -fPIC (as the libraries do) and -Winvalid-pch (an error under PIPEMAT_WERROR: a mismatch would
# silently cost the time again).
function(pipemat_add_torch_pch)
  add_library(pipemat_torch_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/torch_pch.cpp)
  target_link_libraries(pipemat_torch_pch PRIVATE torch)
  target_precompile_headers(pipemat_torch_pch PRIVATE ${PROJECT_SOURCE_DIR}/cmake/torch_pch.h)
  set_target_properties(pipemat_torch_pch PROPERTIES POSITION_INDEPENDENT_CODE ON)
  pipemat_warnings(pipemat_torch_pch)
  pipemat_sanitize(pipemat_torch_pch)
endfunction()

function(pipemat_use_torch_pch name)
  target_precompile_headers(${name} REUSE_FROM pipemat_torch_pch)
  target_compile_options(${name} PRIVATE -fPIC -Winvalid-pch)
endfunction()

# pipemat_add_library(NAME SOURCES ... [DEPS ...])
# A module library with its public headers in <dir>/include and private sources in <dir>/src.
# pipemat_<m> is also pipemat::<m> (an ALIAS here, the exported name when installed: see
# cmake/pipematConfig.cmake.in); its headers install under include/pipemat/<m>.
function(pipemat_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  string(REPLACE "pipemat_" "" short ${name})
  add_library(pipemat::${short} ALIAS ${name})
  target_include_directories(${name} PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
                                            $<INSTALL_INTERFACE:include>
                                     PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  pipemat_warnings(${name})
  set_target_properties(${name} PROPERTIES POSITION_INDEPENDENT_CODE ON EXPORT_NAME ${short})
  pipemat_sanitize(${name})
  if("torch" IN_LIST ARG_DEPS)
    pipemat_use_torch_pch(${name})
  endif()
  install(TARGETS ${name} EXPORT pipematTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endfunction()

# pipemat_add_test(NAME SOURCES ... LIBS ... [TORCH_PCH] [LABELS label] [TIMEOUT s])
# One gtest binary; every TEST is registered with ctest on its own (discovered before the test
# runs, so the build never executes test binaries).
function(pipemat_add_test name)
  cmake_parse_arguments(ARG "TORCH_PCH" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  pipemat_warnings(${name})
  if(ARG_TORCH_PCH)
    pipemat_use_torch_pch(${name})
  endif()
  pipemat_sanitize(${name})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  # One label per discovered test: gtest_discover_tests flattens a list-valued property, so
  # LABELS replaces the default `unit` (e.g. LABELS perf for wall-clock checks).
  set(label unit)
  if(ARG_LABELS)
    list(LENGTH ARG_LABELS count)
    if(NOT count EQUAL 1)
      message(FATAL_ERROR "pipemat_add_test(${name}): give one label, got '${ARG_LABELS}'")
    endif()
    set(label ${ARG_LABELS})
  endif()
  gtest_discover_tests(${name}
    DISCOVERY_MODE PRE_TEST
    # Listing a binary's tests loads LibTorch's libraries (over 3 GB with the CUDA ones): from a
    # cold page cache the first load took 70 s here.
    DISCOVERY_TIMEOUT 300
    PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS ${label} ENVIRONMENT "OMP_NUM_THREADS=1")
endfunction()

# pipemat_add_mpi_test(NAME COMMAND exe args... NP n [TIMEOUT s] [LABELS ...])
# A real multi-process test: `mpiexec -n NP exe args...`, labelled `mpi`; none without MPI.
function(pipemat_add_mpi_test name)
  if(NOT PIPEMAT_MPI)
    return()  # a build without MPI (PIPEMAT_MPI=OFF) has no mpiexec tests
  endif()
  cmake_parse_arguments(ARG "" "NP;TIMEOUT" "COMMAND;LABELS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  list(GET ARG_COMMAND 0 exe)
  list(REMOVE_AT ARG_COMMAND 0)
  if(TARGET ${exe})
    set(exe $<TARGET_FILE:${exe}>)
  endif()
  add_test(NAME ${name}
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ARG_NP} ${PIPEMAT_MPIEXEC_FLAGS}
                   -x OMP_NUM_THREADS=1 ${exe} ${ARG_COMMAND})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "mpi;${ARG_LABELS}"
                       PROCESSORS ${ARG_NP} ENVIRONMENT "OMP_NUM_THREADS=1")
endfunction()

# pipemat_check_dependencies(TARGET ALLOWED dep ...)
# Fails the configure step when a module links something outside its allowed set.
function(pipemat_check_dependencies target)
  cmake_parse_arguments(ARG "" "" "ALLOWED" ${ARGN})
  if(NOT TARGET ${target})
    return()
  endif()
  get_target_property(deps ${target} LINK_LIBRARIES)
  if(NOT deps)
    return()
  endif()
  foreach(dep IN LISTS deps)
    if(dep MATCHES "^\\$<")
      continue()
    endif()
    list(FIND ARG_ALLOWED "${dep}" found)
    if(found EQUAL -1)
      message(FATAL_ERROR "pipemat: ${target} links ${dep}, which breaks the module dependency "
                          "direction (allowed: ${ARG_ALLOWED}). See the top CMakeLists.txt.")
    endif()
  endforeach()
endfunction()
