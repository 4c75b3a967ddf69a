// Unit tests of the torch-free kernel core (csrc/kernels/*.h), built by CMakeLists.txt as
// `kernel_core_tests` and run through ctest (tests/test_cmake_build.py runs it in CI).
#include <cfenv>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "../kernels/common.h"
#include "../kernels/dct.h"
#include "../kernels/segments.h"
#include "../kernels/select.h"
#include "../kernels/size_class.h"

namespace hc = hetero_comm;

static int passed = 0, failed = 0;

#define EXPECT(cond)                                                   \
  do {                                                                 \
    if (cond) {                                                        \
      ++passed;                                                        \
    } else {                                                           \
      ++failed;                                                        \
      std::printf("FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond);    \
    }                                                                  \
  } while (0)

static void test_round_half_even_matches_the_fpu() {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> wide(-2.1e9f, 2.1e9f), narrow(-100.0f, 100.0f);
  std::fesetround(FE_TONEAREST);
  bool all_equal = true;
  for (int i = 0; i < 200000; ++i) {
    const float v = i % 2 ? wide(rng) : narrow(rng);
    all_equal = all_equal && hc::round_half_even_to_int(v) == static_cast<int64_t>(std::nearbyint(v));
  }
  EXPECT(all_equal);
  const float halves[] = {0.5f, 1.5f, 2.5f, -0.5f, -2.5f, 4194304.5f, 8388607.5f, -8388607.5f};
  for (float h : halves) EXPECT(hc::round_half_even_to_int(h) == static_cast<int64_t>(std::nearbyint(h)));
}

static void test_ordered_key_preserves_order_and_ties_signed_zeros() {
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> dist(-1e6f, 1e6f);
  bool ordered = true;
  for (int i = 0; i < 100000; ++i) {
    const float a = dist(rng), b = i % 3 ? dist(rng) : a;
    ordered = ordered && ((a < b) == (hc::ordered_key(a) < hc::ordered_key(b))) &&
              ((a == b) == (hc::ordered_key(a) == hc::ordered_key(b)));
  }
  EXPECT(ordered);
  EXPECT(hc::ordered_key(-0.0f) == hc::ordered_key(0.0f));
  EXPECT(hc::ordered_key(-1e-45f) < hc::ordered_key(0.0f));
  EXPECT(hc::ordered_key(1e-45f) > hc::ordered_key(0.0f));
}

static void test_all_finite() {
  std::vector<float> values(100, 1.0f);
  EXPECT(hc::all_finite(values.data(), 100));
  values[63] = INFINITY;
  EXPECT(!hc::all_finite(values.data(), 100));
  values[63] = NAN;
  EXPECT(!hc::all_finite(values.data(), 100));
}

static void test_quantize_value_clamps_and_bound_fits() {
  EXPECT(hc::levels_bound(2147483647) <= 2147483647.0);
  EXPECT(hc::levels_bound(127) == 127.0f);
  EXPECT(hc::quantize_value(10.0f, 100.0f, 127.0f) == 127);
  EXPECT(hc::quantize_value(-10.0f, 100.0f, 127.0f) == -127);
  EXPECT(hc::quantize_value(1.0f, 2.5f, 127.0f) == 2);  // 2.5 rounds to even
  EXPECT(hc::quantize_value(1e30f, 1.0f, hc::levels_bound(2147483647)) == 2147483520);
  EXPECT(hc::quantize_factor(0.0f, 127) == 0.0f);
  EXPECT(hc::dequantize_step(2.0f, 4) == 0.5f);
}

static void test_size_classes() {
  bool ok = true;
  int64_t previous = 0;
  for (int64_t bytes = 1; bytes < (1 << 22); bytes = bytes * 9 / 8 + 1) {
    const int64_t reserved = hc::size_class_bytes(bytes);
    ok = ok && reserved >= bytes && reserved >= previous &&
         (bytes <= 256 ? reserved == 256 : reserved * 4 <= bytes * 5);
    previous = reserved;
  }
  EXPECT(ok);
  EXPECT(hc::size_class_bytes(4000) == 4096);
  EXPECT(hc::size_class_bytes(4097) == 5120);
}

static void test_dct_matches_the_definition() {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (int64_t n = 1; n <= 1024; n *= 2) {
    std::vector<float> x(n), work(n), scratch(n);
    for (auto& v : x) v = normal(rng);
    const std::vector<float> twiddles = hc::dct_twiddles(n);
    work = x;
    hc::dct2_unnormalized(work.data(), scratch.data(), n, twiddles.data());
    double worst = 0;
    for (int64_t k = 0; k < n; ++k) {
      double exact = 0;
      for (int64_t i = 0; i < n; ++i) exact += x[i] * std::cos(M_PI * (2 * i + 1) * k / (2.0 * n));
      worst = std::fmax(worst, std::fabs(exact - work[k]) / std::sqrt(static_cast<double>(n)));
    }
    EXPECT(worst < 3e-7 * n + 2e-6);
    // The DCT-III is the transpose: applying it to orthonormally scaled coefficients inverts.
    for (int64_t k = 0; k < n; ++k) {
      const float s = hc::dct_ortho_scale(k, n);
      work[k] *= s * s;
    }
    hc::dct3_unnormalized(work.data(), scratch.data(), n, twiddles.data());
    double round_trip = 0;
    for (int64_t i = 0; i < n; ++i) round_trip = std::fmax(round_trip, std::fabs(work[i] - x[i]));
    EXPECT(round_trip < 3e-7 * n + 2e-6);
  }
}

static void test_segment_helpers() {
  std::vector<float> residual = {1, 2, 3, 4, 5}, grad = {1, 1, 1, 1, 1};
  const float norm = hc::accumulate_segment(residual.data(), grad.data(), 5);
  EXPECT(residual[4] == 6.0f);
  EXPECT(std::fabs(norm - std::sqrt(4.0f + 9 + 16 + 25 + 36)) < 1e-5f);
  std::vector<float> packed(8, -1.0f);
  hc::pack_segment(residual.data() + 3, 2, 8, packed.data());
  EXPECT(packed[0] == 5.0f && packed[1] == 6.0f && packed[2] == 0.0f && packed[7] == 0.0f);
  EXPECT(residual[3] == 0.0f && residual[4] == 0.0f && residual[2] == 4.0f);
  // A narrower destination (int truncates): the source keeps what it could not hold.
  std::vector<float> exact = {2.75f, -1.5f};
  std::vector<int> narrow(3, 9);
  hc::pack_segment(exact.data(), 2, 3, narrow.data());
  EXPECT(narrow[0] == 2 && narrow[1] == -1 && narrow[2] == 0);
  EXPECT(exact[0] == 0.75f && exact[1] == -0.5f);
  std::vector<float> out(10, -1.0f), values = {1, 2, 3, 4};
  const int64_t indices[] = {1, 4};
  hc::unpack_segment_range(values.data(), indices, 2, 0, 2, 9, 2.0f, 0, 5, out.data());
  EXPECT(out[0] == 0.0f && out[2] == 2.0f && out[3] == 4.0f && out[8] == 6.0f && out[9] == -1.0f);
  // Quantized: scale 1, 4 levels (step 0.25); 2.0 clips at 4 and keeps 1.0; padded with zeros.
  std::vector<float> source = {0.3f, -0.125f, 2.0f};
  std::vector<int8_t> integers(4, 9);
  hc::pack_quantized_segment(source.data(), 3, 4, hc::quantize_factor(1.0f, 4), hc::levels_bound(4),
                             hc::dequantize_step(1.0f, 4), integers.data());
  EXPECT(integers[0] == 1 && integers[1] == 0 && integers[2] == 4 && integers[3] == 0);
  EXPECT(source[0] == 0.3f - 0.25f && source[1] == -0.125f && source[2] == 1.0f);
}

static void test_select_passes() {
  const float values[] = {1.0f, 5.0f, 3.0f, 5.0f, 3.0f, 3.0f, 0.0f, -0.0f, 7.0f, 2.0f,
                          3.0f, 3.0f, 3.0f, 3.0f, 3.0f, 3.0f, 3.0f, 9.0f, 1.0f, 3.0f};
  std::vector<float> within;
  const hc::RangeScan scan = hc::scan_range(values, 20, 3.0f, 5.0f, within);
  EXPECT(scan.above == 2 && scan.within == 13 && scan.finite && within.size() == 13);
  EXPECT(within[0] == 5.0f && within[1] == 3.0f && within[12] == 3.0f);
  std::vector<float> bad(40, 1.0f), unused;
  bad[37] = NAN;  // in the scalar tail
  EXPECT(!hc::scan_range(bad.data(), 40, 0.0f, 1.0f, unused).finite);
  bad[37] = 1.0f;
  bad[5] = -INFINITY;  // in a masked block
  EXPECT(!hc::scan_range(bad.data(), 40, 0.0f, 1.0f, unused).finite);
  // Threshold 3 with 2 ties wanted (20 values: one masked block, then the scalar tail): everything above 3, then the first two 3s.
  int64_t out[20], tie_rank = 0;
  const int64_t written = hc::write_selected(values, 20, 100, 3.0f, &tie_rank, 2, out);
  const int64_t expected[] = {101, 102, 103, 104, 108, 117};
  EXPECT(written == 6);
  bool same = written == 6;
  for (int64_t i = 0; same && i < 6; ++i) same = out[i] == expected[i];
  EXPECT(same);
  EXPECT(tie_rank == 11);  // every tie (eleven 3s) is counted, taken or not
  // The vector and scalar paths agree on a long random input with ties.
  std::mt19937 rng(4);
  std::uniform_int_distribution<int> pick(0, 40);
  std::vector<float> many(10007);
  for (auto& v : many) v = static_cast<float>(pick(rng)) * 0.25f;
  std::vector<float> fast_within, slow_within;
  const hc::RangeScan fast = hc::scan_range(many.data(), 10007, 2.0f, 5.0f, fast_within);
  hc::RangeScan slow;
  hc::scan_range_scalar(many.data(), 0, 10007, 2.0f, 5.0f, slow, slow_within);
  EXPECT(fast.above == slow.above && fast.within == slow.within && fast_within == slow_within);
}

int main() {
  test_round_half_even_matches_the_fpu();
  test_ordered_key_preserves_order_and_ties_signed_zeros();
  test_quantize_value_clamps_and_bound_fits();
  test_all_finite();
  test_size_classes();
  test_dct_matches_the_definition();
  test_segment_helpers();
  test_select_passes();
  std::printf("kernel core: %d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
