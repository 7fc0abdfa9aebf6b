#include "rans.h"

namespace wsync::codec::internal {
namespace {

RansTable Scaled(const sparse::TableChoice& t) {
  RansTable out;
  sparse::ScaleTable(t, out.enc.data(), out.freq.data(), out.start.data());
  return out;
}

}  // namespace

double RansCostBits(const uint32_t* counts) {
  return static_cast<double>(sparse::ChooseTable(counts, RansLog2()).cost) / (1u << sparse::kCostFraction);
}

RansTable ChooseRansTable(const uint32_t* counts, BitWriter* w) {
  const sparse::TableChoice t = sparse::ChooseTable(counts, RansLog2());
  BitWriter::Cursor c = w->Open(4 + kRansSymbols + (kRansSymbols - 1) * 64);
  sparse::PutTable(t, c);
  w->Close(c);
  return Scaled(t);
}

void RansEncoder::Finish(std::string* out) {
  const size_t at = out->size();
  out->resize(at + 10 + 2 * (words_.size() + 4));
  sparse::ByteOut b{reinterpret_cast<uint8_t*>(out->data() + at), out->size() - at};
  sparse::PutRansWords(state_[0], state_[1], words_.data(), words_.size(), b);
  out->resize(at + b.at);
}

}  // namespace wsync::codec::internal
