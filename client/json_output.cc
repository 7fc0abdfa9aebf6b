#include "json_output.h"

#include <google/protobuf/util/json_util.h>

#include <cstdio>
#include <string>

namespace wsync::cli {

void PrintJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  opts.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, opts);
  std::printf("%s", out.c_str());
  if (out.empty() || out.back() != '\n') std::printf("\n");
}

}  // namespace wsync::cli
