// The signer against AWS's published Signature V4 examples for S3.
#include "sigv4.h"

#include <gtest/gtest.h>

namespace wsync::store::sigv4 {
namespace {

constexpr const char* kKey = "AKIAIOSFODNN7EXAMPLE";
constexpr const char* kSecret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";

TEST(SigV4, AwsGetObjectExample) {
  Request r;
  r.method = "GET";
  r.host = "examplebucket.s3.amazonaws.com";
  r.path = "/test.txt";
  r.headers = {{"range", "bytes=0-9"}};
  r.payload_sha256 = Sha256Hex("");
  r.amz_date = "20130524T000000Z";
  EXPECT_EQ(r.payload_sha256, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Authorization(r, "us-east-1", kKey, kSecret),
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
            "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
}

TEST(SigV4, AwsListObjectsExample) {
  Request r;
  r.method = "GET";
  r.host = "examplebucket.s3.amazonaws.com";
  r.path = "/";
  r.query = {{"max-keys", "2"}, {"prefix", "J"}};
  r.payload_sha256 = Sha256Hex("");
  r.amz_date = "20130524T000000Z";
  EXPECT_EQ(Authorization(r, "us-east-1", kKey, kSecret),
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;x-amz-content-sha256;x-amz-date, "
            "Signature=34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7");
}

TEST(SigV4, UriEncodingKeepsOnlyUnreservedCharacters) {
  EXPECT_EQ(UriEncode("a/b c+d~e_f.g-h", true), "a/b%20c%2Bd~e_f.g-h");
  EXPECT_EQ(UriEncode("a/b", false), "a%2Fb");
  EXPECT_EQ(CanonicalQuery({{"uploads", ""}, {"a b", "c=d"}}), "a%20b=c%3Dd&uploads=");
}

}  // namespace
}  // namespace wsync::store::sigv4
