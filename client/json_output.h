// Protobuf messages as JSON on stdout, for the CLI's --json output.
#pragma once

#include <google/protobuf/message.h>

namespace wsync::cli {

// Prints `m` as indented JSON (every field, defaults included) and a newline.
void PrintJson(const google::protobuf::Message& m);

}  // namespace wsync::cli
