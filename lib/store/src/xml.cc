#include "xml.h"

namespace wsync::store {
namespace {

std::string DecodeEntities(std::string_view v) {
  std::string d;
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] != '&') {
      d += v[i];
      continue;
    }
    const size_t semi = v.find(';', i);
    const std::string_view e = semi == std::string_view::npos ? "" : v.substr(i + 1, semi - i - 1);
    char c = 0;
    if (e == "amp") {
      c = '&';
    } else if (e == "lt") {
      c = '<';
    } else if (e == "gt") {
      c = '>';
    } else if (e == "quot") {
      c = '"';
    } else if (e == "apos") {
      c = '\'';
    }
    if (c == 0) {
      d += '&';
      continue;
    }
    d += c;
    i = semi;
  }
  return d;
}

}  // namespace

std::vector<std::string> XmlValues(std::string_view xml, std::string_view tag) {
  std::vector<std::string> out;
  const std::string open = "<" + std::string(tag) + ">", close = "</" + std::string(tag) + ">";
  for (size_t at = xml.find(open); at != std::string_view::npos; at = xml.find(open, at)) {
    at += open.size();
    const size_t end = xml.find(close, at);
    if (end == std::string_view::npos) break;
    out.push_back(DecodeEntities(xml.substr(at, end - at)));
    at = end + close.size();
  }
  return out;
}

std::string XmlValue(std::string_view xml, std::string_view tag) {
  auto v = XmlValues(xml, tag);
  return v.empty() ? "" : v[0];
}

}  // namespace wsync::store
