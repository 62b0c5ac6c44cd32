// Tests for the safetensors reader/writer: bit-exact round trips of every
// dtype and odd shape, metadata, LoadRows, writer errors and atomic
// replacement, one test per malformed-file case (exact messages), and a check
// that a standard-library-only Python reader agrees with what we wrote.
#include "formats/safetensors/safetensors.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/allocator.h"
#include "core/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace {

using ::testing::HasSubstr;

std::string TempPath(absl::string_view name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteAll(const std::string& path, absl::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string LengthPrefix(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s;
}

// A raw file: length prefix, `header` verbatim, then `data_bytes` zero bytes.
std::string RawFile(absl::string_view header, size_t data_bytes) {
  return absl::StrCat(LengthPrefix(header.size()), header,
                      std::string(data_bytes, '\0'));
}

// A tensor of `shape` filled with random bytes (any bit pattern, NaNs too).
Tensor RandomTensor(Shape shape, DType dtype, std::mt19937_64* rng) {
  Tensor t = *Tensor::Empty(std::move(shape), dtype, Device::Cpu());
  auto* p = static_cast<unsigned char*>(t.raw_data());
  for (size_t i = 0; i < t.nbytes(); ++i)
    p[i] = static_cast<unsigned char>((*rng)());
  return t;
}

std::string TensorBytes(const Tensor& t) {
  return std::string(static_cast<const char*>(t.raw_data()), t.nbytes());
}

constexpr DType kAllDTypes[] = {DType::kF32, DType::kBF16, DType::kF16,
                                DType::kI32, DType::kI64,  DType::kU8};

TEST(SafetensorsTest, RoundTripsEveryDTypeAndShapeBitExactly) {
  std::mt19937_64 rng(7);
  const std::vector<Shape> shapes = {{},     {0},       {3, 0},    {1},
                                     {7},    {3, 5},    {2, 3, 5}, {1, 1, 1, 1},
                                     {0, 4}, {13, 1, 3}};
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (DType dtype : kAllDTypes) {
    for (const Shape& shape : shapes) {
      tensors.emplace_back(absl::StrCat(DTypeName(dtype), ShapeToString(shape)),
                           RandomTensor(shape, dtype, &rng));
    }
  }
  const std::string path = TempPath("roundtrip.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());

  // Layout: the header is padded to a multiple of 8 with spaces.
  const std::string raw = ReadAll(path);
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, raw.data(), 8);
  EXPECT_EQ(header_bytes % 8, 0u);
  EXPECT_EQ(raw[8], '{');

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->size(), tensors.size());
  std::vector<std::string> names = (*file)->names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  for (const auto& [name, tensor] : tensors) {
    SCOPED_TRACE(name);
    auto info = (*file)->Info(name);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->dtype_name, SafetensorsDTypeName(tensor.dtype()));
    EXPECT_EQ(info->dtype, tensor.dtype());
    EXPECT_EQ(info->shape, tensor.shape());
    EXPECT_EQ(info->end - info->begin, tensor.nbytes());
    // Data is laid out by decreasing element size: naturally aligned.
    EXPECT_EQ(info->begin % info->element_size, 0u);

    auto loaded = (*file)->Load(name, Device::Cpu(), MemoryTag::kParams);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->shape(), tensor.shape());
    EXPECT_EQ(loaded->dtype(), tensor.dtype());
    EXPECT_EQ(loaded->tag(), MemoryTag::kParams);
    EXPECT_EQ(TensorBytes(*loaded), TensorBytes(tensor));
    auto bytes = (*file)->Bytes(name);
    ASSERT_TRUE(bytes.ok());
    EXPECT_EQ(std::string(bytes->data(), bytes->size()), TensorBytes(tensor));
  }
}

TEST(SafetensorsTest, RoundTripsManyTensors) {
  std::mt19937_64 rng(11);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (int i = 0; i < 1000; ++i) {
    const DType dtype = kAllDTypes[rng() % 6];
    Shape shape = {static_cast<int64_t>(rng() % 4),
                   static_cast<int64_t>(rng() % 5 + 1)};
    tensors.emplace_back(absl::StrCat("layers.", 999 - i, ".weight"),
                         RandomTensor(shape, dtype, &rng));
  }
  const std::string path = TempPath("many.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ((*file)->size(), 1000u);
  for (const auto& [name, tensor] : tensors) {
    auto loaded = (*file)->Load(name);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ASSERT_EQ(TensorBytes(*loaded), TensorBytes(tensor)) << name;
  }
}

TEST(SafetensorsTest, WritesAndReadsAFileWithoutTensors) {
  const std::string path = TempPath("none.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {}).ok());
  EXPECT_EQ(ReadAll(path), absl::StrCat(LengthPrefix(8), "{}      "));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->size(), 0u);
  EXPECT_TRUE((*file)->metadata().empty());
}

TEST(SafetensorsTest, RoundTripsMetadata) {
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"", ""},
      {"quote\"back\\slash", "line\nbreak\ttab\x01"},
      {"unicode \xc3\xa9\xf0\x9f\x98\x80", "\xe4\xb8\xad\xe6\x96\x87"},
  };
  const std::string path = TempPath("metadata.safetensors");
  Tensor t = *Tensor::FromFloats({2}, {1.0f, 2.0f});
  ASSERT_TRUE(WriteSafetensors(path, {{"t", t}}, metadata).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata(), metadata);

  // Without metadata, no "__metadata__" entry is written.
  ASSERT_TRUE(WriteSafetensors(path, {{"t", t}}).ok());
  EXPECT_EQ(ReadAll(path).find("__metadata__"), std::string::npos);
  file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->metadata().empty());
}

TEST(SafetensorsTest, LoadRowsReadsADim0Slice) {
  std::vector<int64_t> values(15);
  for (int i = 0; i < 15; ++i) values[i] = i;
  const std::string path = TempPath("rows.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(
          path, {{"w", *Tensor::FromInts({5, 3}, values)},
                 {"empty", *Tensor::Zeros({0, 4}, DType::kF32, Device::Cpu())},
                 {"s", *Tensor::FromFloats({}, {3.0f})}})
          .ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const SafetensorsFile& f = **file;

  auto rows = f.LoadRows("w", 1, 4);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->shape(), (Shape{3, 3}));
  for (int i = 0; i < 9; ++i) EXPECT_EQ(rows->data<int32_t>()[i], i + 3);

  auto none = f.LoadRows("w", 2, 2);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->shape(), (Shape{0, 3}));
  auto last = f.LoadRows("w", 4, 5);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->data<int32_t>()[2], 14);
  auto empty = f.LoadRows("empty", 0, 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->shape(), (Shape{0, 4}));
  auto meta = f.LoadRows("w", 0, 2, Device::Meta());
  ASSERT_TRUE(meta.ok());
  EXPECT_TRUE(meta->is_meta());
  EXPECT_EQ(meta->shape(), (Shape{2, 3}));

  auto out_of_range = f.LoadRows("w", 3, 6);
  EXPECT_EQ(out_of_range.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(out_of_range.status().message(),
            absl::StrCat(path,
                         ": LoadRows(\"w\", 3, 6): rows out of range for "
                         "shape [5, 3]"));
  EXPECT_EQ(f.LoadRows("w", -1, 2).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(f.LoadRows("w", 3, 2).status().code(),
            absl::StatusCode::kOutOfRange);
  auto scalar = f.LoadRows("s", 0, 1);
  EXPECT_EQ(scalar.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(scalar.status().message(),
            absl::StrCat(path, ": LoadRows(\"s\", 0, 1): tensor is a scalar"));
  auto missing = f.LoadRows("nope", 0, 1);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(),
            absl::StrCat(path, ": no tensor named \"nope\""));
  EXPECT_EQ(f.Info("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(f.Bytes("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(f.Contains("nope"));
  EXPECT_TRUE(f.Contains("w"));
}

TEST(SafetensorsTest, WritesOnlyTheBytesOfAView) {
  std::vector<int64_t> values(12);
  for (int i = 0; i < 12; ++i) values[i] = 100 + i;
  Tensor full = *Tensor::FromInts({4, 3}, values, DType::kI64);
  Tensor rows = *full.Narrow(1, 2);  // Rows 1-2: values 103..108.
  const std::string path = TempPath("view.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"rows", rows}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  Tensor loaded = *(*file)->Load("rows");
  EXPECT_EQ(loaded.shape(), (Shape{2, 3}));
  EXPECT_EQ(TensorBytes(loaded), TensorBytes(rows));
  EXPECT_EQ(loaded.data<int64_t>()[0], 103);
  EXPECT_EQ(loaded.data<int64_t>()[5], 108);
}

TEST(SafetensorsTest, LoadOnMetaSetsOnlyShapeAndDType) {
  const std::string path = TempPath("meta.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(path, {{"w", *Tensor::FromFloats({2, 2}, {1, 2, 3, 4},
                                                        DType::kBF16)}})
          .ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  auto t = (*file)->Load("w", Device::Meta());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->is_meta());
  EXPECT_EQ(t->dtype(), DType::kBF16);
  EXPECT_EQ(t->shape(), (Shape{2, 2}));
}

TEST(SafetensorsTest, WriterRejectsBadInputsAndLeavesThePathAlone) {
  const std::string path = TempPath("bad_write.safetensors");
  ::unlink(path.c_str());
  Tensor t = *Tensor::FromFloats({1}, {1.0f});
  struct Case {
    std::vector<std::pair<std::string, Tensor>> tensors;
    std::map<std::string, std::string> metadata;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{{"a", t}, {"a", t}}, {}, "duplicate tensor name \"a\""},
      {{{"a", t}, {"", t}}, {}, "tensor #1 has an empty name"},
      {{{"__metadata__", t}},
       {},
       "the tensor name \"__metadata__\" is reserved"},
      {{{"bad\xff", t}}, {}, "tensor name \"bad\xff\" is not valid UTF-8"},
      {{{"u", Tensor()}}, {}, "tensor \"u\" is undefined"},
      {{{"m", *Tensor::Empty({2}, DType::kF32, Device::Meta())}},
       {},
       "tensor \"m\" is a meta tensor (no bytes)"},
      {{{"a", t}},
       {{"k", "\xc0\x80"}},
       "metadata entry \"k\" is not valid UTF-8"},
  };
  for (const Case& c : cases) {
    absl::Status s = WriteSafetensors(path, c.tensors, c.metadata);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message(),
              absl::StrCat("WriteSafetensors ", path, ": ", c.message));
    EXPECT_NE(::access(path.c_str(), F_OK), 0) << "file created on error";
  }
  absl::Status no_dir =
      WriteSafetensors(TempPath("no/such/dir/x.safetensors"), {{"a", t}});
  EXPECT_EQ(no_dir.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(no_dir.message()),
              HasSubstr("cannot create a temporary file"));
}

TEST(SafetensorsTest, ReplacesAtomicallyAndKeepsOpenMappingsIntact) {
  const std::string dir = TempPath("atomic");
  ASSERT_EQ(::mkdir(dir.c_str(), 0777), 0);
  const std::string path = dir + "/model.safetensors";
  ASSERT_TRUE(
      WriteSafetensors(path, {{"w", *Tensor::FromFloats({2}, {1, 2})}}).ok());
  auto old_file = SafetensorsFile::Open(path);
  ASSERT_TRUE(old_file.ok());
  ASSERT_TRUE(
      WriteSafetensors(path, {{"v", *Tensor::FromFloats({3}, {4, 5, 6})}})
          .ok());
  // The old mapping still sees the old file; a new Open sees the new one.
  EXPECT_EQ(*(*old_file)->Load("w")->ToFloats(), (std::vector<float>{1, 2}));
  auto new_file = SafetensorsFile::Open(path);
  ASSERT_TRUE(new_file.ok());
  EXPECT_EQ((*new_file)->names(), (std::vector<std::string>{"v"}));
  // No temporary file is left behind.
  std::vector<std::string> entries;
  DIR* d = ::opendir(dir.c_str());
  ASSERT_NE(d, nullptr);
  while (dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
      entries.push_back(e->d_name);
    }
  }
  ::closedir(d);
  EXPECT_EQ(entries, (std::vector<std::string>{"model.safetensors"}));
}

TEST(SafetensorsTest, OpensForeignDTypesAsBytesOnly) {
  const std::string path = TempPath("f64.safetensors");
  WriteAll(
      path,
      RawFile(R"({"d":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
              R"("b":{"dtype":"BOOL","shape":[3],"data_offsets":[16,19]}})",
              19));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto info = (*file)->Info("d");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->dtype_name, "F64");
  EXPECT_FALSE(info->dtype.has_value());
  EXPECT_EQ(info->element_size, 8u);
  EXPECT_EQ((*file)->Bytes("b")->size(), 3u);
  auto loaded = (*file)->Load("d");
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(loaded.status().message(),
            absl::StrCat(path,
                         ": tensor \"d\" has dtype F64, which fsdpp has no "
                         "DType for; read it with Bytes()"));
}

TEST(SafetensorsTest, AcceptsUnpaddedAndWhitespaceHeaders) {
  const std::string path = TempPath("unpadded.safetensors");
  WriteAll(path, RawFile(" {\"a\" : {\"dtype\":\"U8\",\"shape\":[3],"
                         "\"data_offsets\":[0,3]}}\n\t",
                         3));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->Load("a")->shape(), (Shape{3}));
}

// One malformed file per case: the error code and exact message.
struct BadFile {
  const char* test_name;
  std::string contents;
  absl::StatusCode code;
  std::string message;  // After "<path>: ".
};

class SafetensorsBadFileTest : public testing::TestWithParam<BadFile> {};

TEST_P(SafetensorsBadFileTest, IsRejectedWithAnExactMessage) {
  const BadFile& bad = GetParam();
  const std::string path =
      TempPath(absl::StrCat(bad.test_name, ".safetensors"));
  WriteAll(path, bad.contents);
  auto file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), bad.code) << file.status();
  EXPECT_EQ(file.status().message(), absl::StrCat(path, ": ", bad.message));
  // The in-memory path validates identically.
  auto buffer = SafetensorsFile::FromBuffer(bad.contents, path);
  EXPECT_EQ(buffer.status(), file.status());
}

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
constexpr absl::StatusCode kDataLoss = absl::StatusCode::kDataLoss;

// `{"a": <a>}` with an F32 [2] tensor at [0, 8) unless overridden.
std::string Entry(absl::string_view name, absl::string_view dtype,
                  absl::string_view shape, absl::string_view offsets) {
  return absl::StrCat("\"", name, "\":{\"dtype\":\"", dtype,
                      "\",\"shape\":", shape, ",\"data_offsets\":", offsets,
                      "}");
}

INSTANTIATE_TEST_SUITE_P(
    Cases, SafetensorsBadFileTest,
    testing::Values(
        BadFile{"empty_file", "", kDataLoss,
                "file is 0 bytes, shorter than the 8-byte header length"},
        BadFile{"short_file", std::string("\x05\0\0\0\0", 5), kDataLoss,
                "file is 5 bytes, shorter than the 8-byte header length"},
        BadFile{"header_past_eof", LengthPrefix(100) + "{}", kDataLoss,
                "header length 100 exceeds the 2 bytes after it (truncated "
                "file?)"},
        BadFile{"oversized_header", LengthPrefix((100 << 20) + 1) + "{}",
                kInvalid,
                "oversized header: 104857601 bytes, the limit is 104857600"},
        BadFile{"huge_header_length", LengthPrefix(~uint64_t{0}) + "{}",
                kInvalid,
                "oversized header: 18446744073709551615 bytes, the limit is "
                "104857600"},
        BadFile{"malformed_json", RawFile(R"({"a":{"dtype":"F32",}})", 0),
                kInvalid,
                "malformed JSON header: at byte 20: unexpected '}', expected "
                "a string key"},
        BadFile{"truncated_json", RawFile(R"({"a":)", 0), kInvalid,
                "malformed JSON header: at byte 5: unexpected end of input"},
        BadFile{"header_not_object", RawFile("[]", 0), kInvalid,
                "header is a JSON array, not an object"},
        BadFile{"entry_not_object", RawFile(R"({"a":[1,2]})", 0), kInvalid,
                "entry \"a\" is a JSON array, not an object"},
        BadFile{
            "unknown_dtype",
            RawFile(absl::StrCat("{", Entry("w", "F33", "[2]", "[0,8]"), "}"),
                    8),
            kInvalid, "tensor \"w\": unknown dtype \"F33\""},
        BadFile{
            "dtype_not_string",
            RawFile(R"({"w":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", 4),
            kInvalid, "tensor \"w\": \"dtype\" is a JSON number, not a string"},
        BadFile{"negative_dim",
                RawFile(absl::StrCat("{", Entry("w", "F32", "[2,-1]", "[0,8]"),
                                     "}"),
                        8),
                kInvalid, "tensor \"w\": negative dim -1 in shape"},
        BadFile{
            "fractional_dim",
            RawFile(absl::StrCat("{", Entry("w", "F32", "[2.0]", "[0,8]"), "}"),
                    8),
            kInvalid,
            "tensor \"w\": shape dims must be integers in [0, "
            "9223372036854775807]"},
        BadFile{
            "shape_not_array",
            RawFile(absl::StrCat("{", Entry("w", "F32", "\"2\"", "[0,8]"), "}"),
                    8),
            kInvalid, "tensor \"w\": \"shape\" is a JSON string, not an array"},
        BadFile{
            "too_many_elements",
            RawFile(absl::StrCat("{",
                                 Entry("w", "F32", "[4294967296,4294967296,0]",
                                       "[0,0]"),
                                 "}"),
                    0),
            kInvalid,
            "tensor \"w\": shape [4294967296, 4294967296, 0] has too many "
            "elements"},
        BadFile{"size_mismatch",
                RawFile(absl::StrCat("{", Entry("w", "F32", "[2,3]", "[0,20]"),
                                     "}"),
                        20),
                kInvalid,
                "tensor \"w\": shape [2, 3] of F32 needs 24 bytes, but "
                "data_offsets [0, 20] hold 20"},
        BadFile{"bytes_overflow",
                RawFile(absl::StrCat("{",
                                     Entry("w", "I64", "[4611686018427387904]",
                                           "[0,8]"),
                                     "}"),
                        8),
                kInvalid,
                "tensor \"w\": shape [4611686018427387904] of I64 needs more "
                "than 2^64 bytes, but data_offsets [0, 8] hold 8"},
        BadFile{
            "offsets_out_of_range",
            RawFile(absl::StrCat("{", Entry("w", "F32", "[6]", "[0,24]"), "}"),
                    16),
            kDataLoss,
            "tensor \"w\": data_offsets [0, 24] are out of range: the data "
            "buffer is 16 bytes (truncated file?)"},
        BadFile{
            "offsets_reversed",
            RawFile(absl::StrCat("{", Entry("w", "F32", "[1]", "[8,4]"), "}"),
                    8),
            kInvalid, "tensor \"w\": data_offsets [8, 4] have begin > end"},
        BadFile{
            "offsets_malformed",
            RawFile(absl::StrCat("{", Entry("w", "F32", "[1]", "[0,4,8]"), "}"),
                    8),
            kInvalid,
            "tensor \"w\": \"data_offsets\" must be [begin, end] with "
            "non-negative integers"},
        BadFile{
            "overlap",
            RawFile(absl::StrCat("{", Entry("b", "F32", "[2]", "[4,12]"), ",",
                                 Entry("a", "F32", "[2]", "[0,8]"), "}"),
                    12),
            kInvalid, "tensors \"a\" [0, 8) and \"b\" [4, 12) overlap"},
        BadFile{
            "gap",
            RawFile(absl::StrCat("{", Entry("a", "F32", "[1]", "[0,4]"), ",",
                                 Entry("b", "F32", "[1]", "[8,12]"), "}"),
                    12),
            kInvalid,
            "bytes [4, 8) of the data buffer belong to no tensor (gap "
            "before \"b\")"},
        BadFile{
            "gap_at_start",
            RawFile(absl::StrCat("{", Entry("a", "F32", "[1]", "[4,8]"), "}"),
                    8),
            kInvalid,
            "bytes [0, 4) of the data buffer belong to no tensor (gap "
            "before \"a\")"},
        BadFile{
            "duplicate_name",
            RawFile(absl::StrCat("{", Entry("a", "F32", "[1]", "[0,4]"), ",",
                                 Entry("a", "F32", "[1]", "[4,8]"), "}"),
                    8),
            kInvalid, "duplicate tensor name \"a\""},
        BadFile{
            "trailing_bytes",
            RawFile(absl::StrCat("{", Entry("a", "F32", "[1]", "[0,4]"), "}"),
                    11),
            kInvalid,
            "7 trailing bytes after the last tensor (the data buffer is 11 "
            "bytes, tensors end at 4)"},
        BadFile{"trailing_bytes_no_tensors", RawFile("{}", 3), kInvalid,
                "3 trailing bytes after the last tensor (the data buffer is 3 "
                "bytes, tensors end at 0)"},
        BadFile{
            "empty_name",
            RawFile(absl::StrCat("{", Entry("", "F32", "[1]", "[0,4]"), "}"),
                    4),
            kInvalid, "empty tensor name"},
        BadFile{
            "unexpected_key",
            RawFile(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],)"
                    R"("extra":1}})",
                    1),
            kInvalid, "tensor \"a\": unexpected key \"extra\""},
        BadFile{"duplicate_key",
                RawFile(R"({"a":{"dtype":"U8","dtype":"U8","shape":[1],)"
                        R"("data_offsets":[0,1]}})",
                        1),
                kInvalid, "tensor \"a\": duplicate key \"dtype\""},
        BadFile{"missing_key",
                RawFile(R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", 1),
                kInvalid, "tensor \"a\": missing \"shape\""},
        BadFile{"metadata_not_object", RawFile(R"({"__metadata__":[]})", 0),
                kInvalid, "\"__metadata__\" is a JSON array, not an object"},
        BadFile{"metadata_value_not_string",
                RawFile(R"({"__metadata__":{"k":1}})", 0), kInvalid,
                "\"__metadata__\" value of \"k\" is a JSON number, not a "
                "string"},
        BadFile{"metadata_duplicate_key",
                RawFile(R"({"__metadata__":{"k":"1","k":"2"}})", 0), kInvalid,
                "duplicate \"__metadata__\" key \"k\""},
        BadFile{"metadata_twice",
                RawFile(R"({"__metadata__":{},"__metadata__":{}})", 0),
                kInvalid, "duplicate \"__metadata__\""},
        BadFile{"invalid_utf8_name", RawFile("{\"\xff\":{}}", 0), kInvalid,
                "malformed JSON header: at byte 2: invalid UTF-8 in a string"},
        BadFile{"deep_nesting",
                RawFile(absl::StrCat("{\"a\":", std::string(100, '['),
                                     std::string(100, ']'), "}"),
                        0),
                kInvalid,
                "malformed JSON header: at byte 68: nesting deeper than 64 "
                "levels"}),
    [](const testing::TestParamInfo<BadFile>& info) {
      return std::string(info.param.test_name);
    });

TEST(SafetensorsTest, OpenReportsMissingFilesAndDirectories) {
  auto missing = SafetensorsFile::Open(TempPath("does_not_exist"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("does_not_exist: cannot open"));
  const std::string dir = TempPath("a_directory");
  ASSERT_EQ(::mkdir(dir.c_str(), 0777), 0);
  auto directory = SafetensorsFile::Open(dir);
  EXPECT_EQ(directory.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(directory.status().message(),
            absl::StrCat(dir, ": not a regular file"));
}

// A file we write, read back by a Python reader that uses only the standard
// library (struct + json): names, dtypes, shapes and every value must agree.
TEST(SafetensorsTest, IsReadableByAStandardLibraryPythonReader) {
  if (::access("/usr/bin/python3", X_OK) != 0) {
    GTEST_SKIP() << "/usr/bin/python3 not found: cross-language check skipped";
  }
  Tensor u8 = *Tensor::Empty({4}, DType::kU8, Device::Cpu());
  const uint8_t u8_values[] = {0, 1, 128, 255};
  std::memcpy(u8.raw_data(), u8_values, 4);
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"f.u8", u8},
      {"a.f32", *Tensor::FromFloats({2, 2}, {0.5f, -1.0f, 3.25f, 100.0f})},
      {"b.bf16", *Tensor::FromFloats({3}, {1.0f, -2.5f, 0.125f}, DType::kBF16)},
      {"c.f16", *Tensor::FromFloats({1, 2}, {65504.0f, -0.0f}, DType::kF16)},
      {"d.i32", *Tensor::FromInts({3}, {-7, 0, 2147483647}, DType::kI32)},
      {"e.i64",
       *Tensor::FromInts(
           {2}, {std::numeric_limits<int64_t>::min(), int64_t{1234567890123}},
           DType::kI64)},
      {"g.scalar", *Tensor::FromFloats({}, {2.0f})},
      {"h.empty", *Tensor::Zeros({3, 0}, DType::kI32, Device::Cpu())},
  };
  const std::string path = TempPath("python.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors,
                               {{"format", "pt"}, {"note", "say \"hi\""}})
                  .ok());
  const std::string command = absl::StrCat(
      "/usr/bin/python3 formats/safetensors/testdata/read_safetensors.py '",
      path, "' 2>&1");
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) output.append(buf, n);
  const int rc = ::pclose(pipe);
  ASSERT_EQ(rc, 0) << output;
  EXPECT_EQ(output,
            "a.f32 F32 [2, 2] 0.5 -1.0 3.25 100.0\n"
            "b.bf16 BF16 [3] 1.0 -2.5 0.125\n"
            "c.f16 F16 [1, 2] 65504.0 -0.0\n"
            "d.i32 I32 [3] -7 0 2147483647\n"
            "e.i64 I64 [2] -9223372036854775808 1234567890123\n"
            "f.u8 U8 [4] 0 1 128 255\n"
            "g.scalar F32 [] 2.0\n"
            "h.empty I32 [3, 0]\n"
            "metadata format=pt\n"
            "metadata note=say \"hi\"\n");
}

}  // namespace
}  // namespace fsdpp
