// Seeds of store_fuzzer: a signed and an unsigned manifest, S3's answers
// to a listing, an error and a multipart start.
#include <cstdio>
#include <fstream>
#include <string>

#include "wsync/store/versions.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: store_fuzz_seeds DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  wsync::store::Manifest m;
  m.version = 12;
  m.set_checksum = 0x1234567890abcdefull;
  m.objects.push_back({wsync::store::StoredObject::Kind::kPatch, 11, "runs/r/versions/00000000000000000012/patch-11",
                       38160, std::string(64, 'a')});
  m.objects.push_back({wsync::store::StoredObject::Kind::kKeyframe, 0, "runs/r/versions/00000000000000000012/keyframe",
                       9026829, std::string(64, 'b')});
  const std::string unsigned_json = m.ToJson();
  m.signature = std::string(128, 'c');
  const std::pair<const char*, std::string> seeds[] = {
      {"manifest", std::string(1, '\0') + unsigned_json},
      {"signed", std::string(1, '\x02') + m.ToJson()},
      {"list", "\x01<ListBucketResult><IsTruncated>true</IsTruncated><Contents><Key>a&amp;b</Key></Contents>"
               "<Contents><Key>c&lt;d</Key></Contents><NextContinuationToken>t</NextContinuationToken>"
               "</ListBucketResult>"},
      {"error", "\x03<Error><Code>NoSuchKey</Code><Message>The key &quot;x&quot; does not exist</Message></Error>"},
      {"upload", "\x05<InitiateMultipartUploadResult><UploadId>abc</UploadId></InitiateMultipartUploadResult>"},
  };
  for (const auto& [name, bytes] : seeds) {
    std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
  }
  return 0;
}
