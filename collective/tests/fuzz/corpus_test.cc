// The fuzz targets' regression corpus, replayed in the gtest suite (gcc, and under ASan + UBSan
// in make meshccl-sanitize): every file with its own flags byte and with every other one (so
// each input is also tried with and without the honest peer, taken slots, other chunkings).
// A violated invariant aborts the suite, as it would crash the fuzzer.

#include <dirent.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "targets.h"

namespace meshccl {
namespace {

std::vector<std::string> corpusFiles(const std::string& target) {
  const std::string dir = std::string(MESHCCL_FUZZ_CORPUS_DIR) + "/" + target;
  std::vector<std::string> files;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      if (e->d_name[0] != '.') files.push_back(dir + "/" + e->d_name);
    }
    ::closedir(d);
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<uint8_t> readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void replay(const std::string& target, int (*entry)(const uint8_t*, size_t)) {
  const auto files = corpusFiles(target);
  ASSERT_GE(files.size(), 5u) << "the " << target << " corpus is missing (" << MESHCCL_FUZZ_CORPUS_DIR << ")";
  for (const auto& f : files) {
    std::vector<uint8_t> data = readFile(f);
    SCOPED_TRACE(f);
    EXPECT_EQ(entry(data.data(), data.size()), 0);
    if (data.empty()) continue;
    for (int flags = 0; flags < 256; ++flags) {
      data[0] = static_cast<uint8_t>(flags);
      entry(data.data(), data.size());
    }
  }
}

TEST(FuzzCorpus, AcceptorReplaysEveryRegressionInput) { replay("acceptor", fuzz::acceptorTarget); }

TEST(FuzzCorpus, ConnectorReplaysEveryRegressionInput) { replay("connector", fuzz::connectorTarget); }

}  // namespace
}  // namespace meshccl
