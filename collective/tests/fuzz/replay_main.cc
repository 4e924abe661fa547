// Reruns fuzz inputs without libFuzzer (any compiler): meshccl_fuzz_replay acceptor|connector
// FILE|DIR...  A crash file from make meshccl-fuzz reproduces here under gdb or the sanitizers.

#include <dirent.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "targets.h"

namespace {

int runFile(const std::string& path, int (*entry)(const uint8_t*, size_t)) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    return 1;
  }
  const std::vector<uint8_t> data{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  entry(data.data(), data.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || (std::strcmp(argv[1], "acceptor") != 0 && std::strcmp(argv[1], "connector") != 0)) {
    std::fprintf(stderr, "usage: %s acceptor|connector FILE|DIR...\n", argv[0]);
    return 2;
  }
  const auto entry = std::strcmp(argv[1], "acceptor") == 0 ? meshccl::fuzz::acceptorTarget : meshccl::fuzz::connectorTarget;
  int failed = 0;
  int ran = 0;
  for (int i = 2; i < argc; ++i) {
    struct stat st {};
    if (::stat(argv[i], &st) == 0 && S_ISDIR(st.st_mode)) {
      if (DIR* d = ::opendir(argv[i])) {
        while (const dirent* e = ::readdir(d)) {
          if (e->d_name[0] == '.') continue;
          failed += runFile(std::string(argv[i]) + "/" + e->d_name, entry);
          ++ran;
        }
        ::closedir(d);
      }
    } else {
      failed += runFile(argv[i], entry);
      ++ran;
    }
  }
  std::printf("%s: %d input(s) replayed, %d unreadable\n", argv[1], ran, failed);
  return failed == 0 ? 0 : 1;
}
