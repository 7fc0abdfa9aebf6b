// The layouts sinks offer: one per node, the distinct ones listed once in
// the order first offered, a deregistered node's gone, bad offers refused.
#include "wsync/control/layout_offers.h"

#include <gtest/gtest.h>

namespace wsync::control {
namespace {

namespace v1 = wsync::v1;

v1::ServedLayout Layout(const std::string& tensor, uint64_t rows) {
  v1::ServedLayout l;
  v1::TensorSpec* t = l.add_tensors();
  t->set_name(tensor);
  t->set_dtype("BF16");
  t->add_shape(rows);
  v1::PieceSpec* p = t->add_pieces();
  p->set_canonical(tensor);
  p->add_start(0);
  p->add_extent(rows);
  p->add_at(0);
  return l;
}

TEST(LayoutOffers, OnePerNodeDistinctOnesOnceInTheOrderFirstOffered) {
  LayoutOffers offers;
  EXPECT_EQ(*offers.Offer("rank-0", Layout("a", 4)), 1u);
  EXPECT_EQ(*offers.Offer("rank-1", Layout("a", 2)), 2u);
  EXPECT_EQ(*offers.Offer("replica-rank-0", Layout("a", 4)), 2u);  // the same layout as rank-0's
  auto listed = offers.List();
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].tensors(0).shape(0), 4u);
  EXPECT_EQ(listed[1].tensors(0).shape(0), 2u);

  // rank-1's engine restarts with another layout: its last offer goes.
  EXPECT_EQ(*offers.Offer("rank-1", Layout("b", 8)), 2u);
  listed = offers.List();
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[1].tensors(0).name(), "b");

  // A layout stays while any node offers it.
  offers.Forget("rank-0");
  EXPECT_EQ(offers.List().size(), 2u);
  offers.Forget("replica-rank-0");
  offers.Forget("nobody");
  listed = offers.List();
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].tensors(0).name(), "b");
}

TEST(LayoutOffers, RefusesEmptyLayoutsNamesAndShapes) {
  LayoutOffers offers;
  EXPECT_EQ(offers.Offer("", Layout("a", 4)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(offers.Offer("n", v1::ServedLayout()).status().code(), StatusCode::kInvalidArgument);
  v1::ServedLayout no_shape = Layout("a", 4);
  no_shape.mutable_tensors(0)->clear_shape();
  auto s = offers.Offer("n", no_shape);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("offered by n"), std::string::npos) << s.status().ToString();
  EXPECT_TRUE(offers.List().empty());
}

}  // namespace
}  // namespace wsync::control
