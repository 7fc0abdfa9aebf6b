// The values S3's XML answers carry (private): flat documents whose
// elements of interest (<Key>, <Code>, <UploadId>, ...) hold text only.
// Bytes from the store: never trusted, fuzzed (tests/fuzz/store_fuzzer.cc).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace wsync::store {

// The text of every <tag>...</tag>, in order, the five XML entities
// decoded (any other '&' kept as is).
std::vector<std::string> XmlValues(std::string_view xml, std::string_view tag);
// The first of them, or empty.
std::string XmlValue(std::string_view xml, std::string_view tag);

}  // namespace wsync::store
