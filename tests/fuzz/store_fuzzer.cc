// What a puller parses of an object store's bytes, which it does not trust:
// manifests (store::Manifest::Parse) and S3's XML answers (xml.h). The
// first byte picks the parser. A manifest that parses writes itself back as
// JSON that parses to the same manifest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "wsync/store/versions.h"
#include "xml.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    auto m = wsync::store::Manifest::Parse(bytes, "fuzz");
    if (m.ok()) {
      auto again = wsync::store::Manifest::Parse(m->ToJson(), "fuzz");
      if (!again.ok() || again->ToJson() != m->ToJson() || again->SignedBytes() != m->SignedBytes()) std::abort();
    }
  } else {
    for (const char* tag : {"Key", "Code", "Message", "UploadId", "IsTruncated", "NextContinuationToken"}) {
      for (const auto& v : wsync::store::XmlValues(bytes, tag)) {
        if (v.size() > bytes.size()) std::abort();  // decoding only shrinks
      }
    }
  }
  return 0;
}
