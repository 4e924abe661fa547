# Rules for zig-macos.cmake that CMake's own platform files would otherwise reset: read after them
# (CMAKE_USER_MAKE_RULES_OVERRIDE).
# CMake's Darwin platform turns rpaths on only after asking sw_vers for the running macOS (there is none
# here); without them a shared library's install name is its absolute build path. With them:
# @rpath/libmeshccl.dylib, as a build on a Mac gives.
set(CMAKE_SHARED_LIBRARY_RUNTIME_C_FLAG "-Wl,-rpath,")
set(CMAKE_SHARED_LIBRARY_RUNTIME_CXX_FLAG "-Wl,-rpath,")
