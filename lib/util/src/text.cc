#include "wsync/util/text.h"

namespace wsync {

std::string Quoted(std::string_view s, size_t max_bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  const size_t n = s.size() < max_bytes ? s.size() : max_bytes;
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (n < s.size()) out += "...";
  out += "'";
  return out;
}

}  // namespace wsync
