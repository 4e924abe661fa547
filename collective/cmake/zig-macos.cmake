# CMake toolchain: meshccl cross-compiled for macOS on Linux with zig (PyPI's `ziglang`), against the
# macOS SDK headers and libSystem stubs zig bundles. Used by scripts/meshccl-macos:
#   cmake -DCMAKE_TOOLCHAIN_FILE=collective/cmake/zig-macos.cmake -DMESHCCL_ZIG=/path/to/zig \
#         -DMESHCCL_ZIG_TARGET=aarch64-macos.11.0|x86_64-macos.10.15 ...
# (zig's target: the architecture, macos, and the minimum macOS version the binaries declare and are
# checked against: -Wunguarded-availability-new makes an API newer than that an error under -Werror).
# It proves the code compiles and links for macOS; it runs nothing (behaviour needs a Mac).
set(MESHCCL_ZIG "" CACHE FILEPATH "the zig executable (python -m ziglang's)")
set(MESHCCL_ZIG_TARGET "" CACHE STRING "zig's target: aarch64-macos.MIN or x86_64-macos.MIN (MIN: minimum macOS)")
# try_compile projects read this file again: hand them the two settings.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES MESHCCL_ZIG MESHCCL_ZIG_TARGET)
if(NOT MESHCCL_ZIG OR NOT EXISTS "${MESHCCL_ZIG}")
  message(FATAL_ERROR "zig-macos.cmake: set MESHCCL_ZIG to the zig executable (scripts/meshccl-macos does)")
endif()
if(NOT MESHCCL_ZIG_TARGET MATCHES "^(aarch64|x86_64)-macos\\.([0-9]+)\\.([0-9]+)$")
  message(FATAL_ERROR "zig-macos.cmake: MESHCCL_ZIG_TARGET must be aarch64-macos.MAJOR.MINOR or "
                      "x86_64-macos.MAJOR.MINOR (e.g. aarch64-macos.11.0), not '${MESHCCL_ZIG_TARGET}'")
endif()
set(_meshccl_arch "${CMAKE_MATCH_1}")
# CMAKE_SYSTEM_VERSION is Darwin's (kernel) version: macOS 10.N is Darwin N+4, macOS N>=11 is N+9.
if(CMAKE_MATCH_2 EQUAL 10)
  math(EXPR _meshccl_darwin "${CMAKE_MATCH_3} + 4")
else()
  math(EXPR _meshccl_darwin "${CMAKE_MATCH_2} + 9")
endif()

set(CMAKE_SYSTEM_NAME Darwin)
set(CMAKE_SYSTEM_VERSION "${_meshccl_darwin}.0")
if(_meshccl_arch STREQUAL "aarch64")
  set(CMAKE_SYSTEM_PROCESSOR arm64)
else()
  set(CMAKE_SYSTEM_PROCESSOR x86_64)
endif()
# No Xcode SDK: zig brings the headers and the libSystem stubs. No -arch/-isysroot flags from CMake.
set(CMAKE_OSX_SYSROOT "" CACHE PATH "" FORCE)
set(CMAKE_OSX_ARCHITECTURES "" CACHE STRING "" FORCE)
# What CMake's platform files would reset (rpaths) is set again after them:
set(CMAKE_USER_MAKE_RULES_OVERRIDE "${CMAKE_CURRENT_LIST_DIR}/zig-macos-rules.cmake")

# The compiler is a list: the wrapper, then its fixed arguments (CMake passes them as ARG1 on every
# compile and link line).
set(_meshccl_cc "${CMAKE_CURRENT_LIST_DIR}/zig-macos-cc")
set(CMAKE_C_COMPILER "${_meshccl_cc}" "${MESHCCL_ZIG}" cc "${MESHCCL_ZIG_TARGET}")
set(CMAKE_CXX_COMPILER "${_meshccl_cc}" "${MESHCCL_ZIG}" c++ "${MESHCCL_ZIG_TARGET}")
# CMake's compiler checks compile static libraries instead of linking executables: every link needs zig's
# libc++ built for the target and optimization level (a minute or more each), and only the real links
# should pay for it.
set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)
# Archives in the BSD (Darwin) format, made and indexed by zig's own ar and ranlib (zig is multi-call:
# the rules name zig and the tool). CMake's install step runs CMAKE_RANLIB FILE on a static library for
# Apple targets, so CMAKE_RANLIB is a one-line script calling zig ranlib, written into the build tree.
set(_meshccl_ranlib "${CMAKE_BINARY_DIR}/zig-ranlib")
set(_meshccl_ranlib_text "#!/bin/sh\nexec \"${MESHCCL_ZIG}\" ranlib \"$@\"\n")
set(_meshccl_ranlib_old "")
if(EXISTS "${_meshccl_ranlib}")
  file(READ "${_meshccl_ranlib}" _meshccl_ranlib_old)
endif()
if(NOT _meshccl_ranlib_old STREQUAL _meshccl_ranlib_text)
  file(WRITE "${CMAKE_BINARY_DIR}/zig-ranlib.tmp/zig-ranlib" "${_meshccl_ranlib_text}")
  file(COPY "${CMAKE_BINARY_DIR}/zig-ranlib.tmp/zig-ranlib" DESTINATION "${CMAKE_BINARY_DIR}"
       FILE_PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
  file(REMOVE_RECURSE "${CMAKE_BINARY_DIR}/zig-ranlib.tmp")
endif()
set(CMAKE_AR "${MESHCCL_ZIG}" CACHE FILEPATH "" FORCE)
set(CMAKE_RANLIB "${_meshccl_ranlib}" CACHE FILEPATH "" FORCE)
foreach(lang C CXX)
  set(CMAKE_${lang}_ARCHIVE_CREATE "<CMAKE_AR> ar --format=darwin qc <TARGET> <LINK_FLAGS> <OBJECTS>")
  set(CMAKE_${lang}_ARCHIVE_APPEND "<CMAKE_AR> ar --format=darwin q <TARGET> <LINK_FLAGS> <OBJECTS>")
  set(CMAKE_${lang}_ARCHIVE_FINISH "<CMAKE_RANLIB> <TARGET>")
endforeach()
# Nothing of the build machine (Linux libraries, headers, packages) is found for the target unless a
# path is given explicitly (GTest_DIR, nanobind_ROOT, Python_INCLUDE_DIR...): libraries and headers
# are searched only under a root that does not exist.
set(CMAKE_FIND_ROOT_PATH "${CMAKE_CURRENT_LIST_DIR}/zig-macos-no-sysroot")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
