// Text from outside (tensor names, node names, file names) made safe to put
// into an error message or a log line.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace wsync {

// `s` in single quotes, with bytes outside printable ASCII, quotes and
// backslashes written as \xNN, and cut after `max_bytes` of input ("...").
std::string Quoted(std::string_view s, size_t max_bytes = 200);

// The items of a comma-separated list ("a:1, b:2"), spaces around each
// trimmed, empty ones dropped.
std::vector<std::string> SplitList(std::string_view list);

// Lowercase hex of bytes, two digits each.
std::string Hex(std::string_view bytes);
// The bytes lowercase hex stands for; nothing when `hex` is not that (an odd
// length, another character).
std::optional<std::string> FromHex(std::string_view hex);

}  // namespace wsync
