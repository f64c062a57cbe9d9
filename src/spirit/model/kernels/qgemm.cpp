// Weight-only 4-bit and 8-bit matrix products for decoding on CPUs: y = x W^T (+ bias).
//
// Why our own kernel: a decoding step reads every weight once, and torch's int4 CPU op turns
// each 4-bit weight into a float before multiplying, which makes it compute-bound on two cores
// (about half of llama.cpp's speed on the same GGUF file). Here, as in llama.cpp, the
// activations are quantized to int8 per block of 32 and the products are integer dot
// products (AVX-512 VNNI where the CPU has it, AVX2 otherwise), so a step costs about what
// reading the packed bytes costs.
//
// Row-invariant by construction: row m of the output is computed by the same operations in
// the same order whatever the number of rows, so verifying k draft tokens in one pass gives
// bit for bit what k single-token passes give (model/exactness.py still measures it).
//
// Formats, per output row n and block b of 32 inputs:
//   int4: codes uint8 [N, K/2]; w = code * scale[n, b] + offset[n, b]  (float16). The first
//         16 * floor(K/512) blocks come in groups of 16 (256 bytes): byte 64c + 4l + j of a
//         group holds input 4c + j of its block l in the low nibble and input 16 + 4c + j in
//         the high one (c < 4, l < 16, j < 4). So the low nibbles of 64 bytes are 4 inputs of
//         each of 16 blocks, and one VNNI dot product over them leaves block l's partial sum in
//         lane l: 8 of them give the 16 blocks' integer sums, and the float work (scales,
//         offsets) is one vector operation per 16 blocks instead of one per block. The blocks
//         after the groups come in pairs: byte j of a pair holds input j of its first block in
//         the low nibble and input j of its second block in the high one (a lone last block:
//         inputs j and j+16). The activations' int8 codes take the same order (grouped_index).
//         model/quantize.py packs both layouts (SPIRIT_LAYOUT names them in kept packings).
//   int8: codes int8 [N, K] in [-127, 127], w = code * scale[n, b]  (offset: empty). The first
//         16 * floor(K/512) blocks come in groups of 16 (512 bytes) in the same order as int4's
//         activations: byte 64k + 4l + j of a group holds input 4k + j of its block l (k < 8,
//         l < 16, j < 4), so one VNNI dot product over 64 bytes leaves block l's partial sum in
//         lane l, as for int4. The blocks after the groups come in order.
// Activations: q = round(x / d), d = max|x| / 127 per block of 32, so sum(w x) over a block is
// scale * d * sum(code * q) + offset * d * sum(q). Both formats take the activations' codes in
// the grouped order (grouped_index).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <array>
#include <utility>

namespace {

constexpr int64_t kBlock = 32;

// AVX-512 with VNNI (Xeons since Cascade Lake, AMD Zen 4): the 8-block loop runs 512 bits wide
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPIRIT_WIDE 1
#endif
// AMX tile products (Sapphire Rapids and later) for many rows; -DSPIRIT_NO_AMX leaves them out
#if defined(SPIRIT_WIDE) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(SPIRIT_NO_AMX)
#define SPIRIT_AMX 1
#endif
// Products of this many rows or more take the tile path where it runs; below, the VNNI path
// measured as fast or faster (a tile product costs about the same for 1 row as for 16).
// Measured with the weights cycled through 1.2 GB, so read from memory as in a model
// (benchmarks/amx_speed.py), time of the tile path over the VNNI path's, on a Xeon with AMX:
//   int8 17920x1536: 0.98 / 0.78 / 0.62 / 0.53 at 4 / 8 / 16 / 32 rows;
//   int4 17920x1536: 1.07 / 0.98 / 0.74 / 0.69 at 4 / 8 / 12 / 16 rows, 0.72 at 128;
//     2048x1536: 1.22 / 1.07 / 0.81 / 0.76 at 4 / 8 / 12 / 16;
//   1536x8960 (8 blocks after 17 groups, which run one weight row at a time either way):
//     int4 (panels of one byte per code) 1.05 / 1.02 / 1.14 at 8 / 16 / 32 rows, int8 0.96 /
//     1.05 / 1.01 at 4 / 8 / 16: no gain short of a prefill chunk.
#ifndef SPIRIT_PREFILL_RANGE_BYTES
#define SPIRIT_PREFILL_RANGE_BYTES (1 << 20)
#endif
// prefill_panels takes the inputs in ranges of blocks whose input pairs stay under this many bytes
// (int8 1536x8960 at 128 rows, weights from memory: 4.33 ms in one range, 3.56 with 1 MB ranges,
// 3.81 with 512 KB ones)
constexpr int64_t kPrefillRangeBytes = SPIRIT_PREFILL_RANGE_BYTES;
#ifndef SPIRIT_AMX_MIN_ROWS_INT8
#define SPIRIT_AMX_MIN_ROWS_INT8 8
#endif
#ifndef SPIRIT_AMX_MIN_ROWS_INT4
#define SPIRIT_AMX_MIN_ROWS_INT4 12
#endif
#ifndef SPIRIT_AMX_MIN_ROWS_REMAINDER
#define SPIRIT_AMX_MIN_ROWS_REMAINDER 64  // a prefill chunk (128 rows) still takes it
#endif
#ifndef SPIRIT_ROWS_PER_CHUNK
#define SPIRIT_ROWS_PER_CHUNK 4
#endif
constexpr int64_t kRowsPerChunk = SPIRIT_ROWS_PER_CHUNK;  // activation rows that share one read of a weight row
constexpr int64_t kGroup = 16;        // blocks per interleaved group (see the formats)
#ifndef SPIRIT_BLOCKED_MIN_ROWS
#define SPIRIT_BLOCKED_MIN_ROWS 2  // int4 products of this many rows or more take two weight rows at a time
#endif
#ifndef SPIRIT_TILE_BYTES
#define SPIRIT_TILE_BYTES 32768
#endif
constexpr int64_t kTileBytes = SPIRIT_TILE_BYTES;  // packed weight bytes taken against all activation rows at once

// Blocks of a row that are in interleaved groups, and where an activation's input j of block b
// goes in the grouped order (input j of block l of a group at 64 (j / 4) + 4 l + j % 4).
inline int64_t grouped_blocks(int64_t nb) { return nb / kGroup * kGroup; }
inline int64_t grouped_index(int64_t b, int64_t j, int64_t grouped) {
  if (b >= grouped) return b * kBlock + j;
  return (b / kGroup) * kGroup * kBlock + (j / 4) * 64 + (b % kGroup) * 4 + j % 4;
}

struct QuantizedRows {
  at::Tensor codes;     // int8 [M, K], in the grouped order
  at::Tensor scale;     // float [M, K/32]: d
  at::Tensor sum;       // float [M, K/32]: d * sum of the block's codes
  at::Tensor code_sum;  // int32 [M, K/32]: sum of the block's codes
};

// Where a kernel reads activation rows: from row m of QuantizedRows on.
struct Rows {
  const int8_t* codes;
  const float* scale;
  const float* sum;
  const int32_t* code_sum;
  int64_t K, nb;
  Rows from(int64_t m) const { return {codes + m * K, scale + m * nb, sum + m * nb, code_sum + m * nb, K, nb}; }
};
inline Rows rows_of(const QuantizedRows& q) {
  const int64_t K = q.codes.size(1);
  return {q.codes.data_ptr<int8_t>(), q.scale.data_ptr<float>(), q.sum.data_ptr<float>(), q.code_sum.data_ptr<int32_t>(),
          K, K / kBlock};
}
// a packed tensor's bytes as P (codes as bytes, float16 scales and offsets as their bits)
template <typename P>
const P* raw(const at::Tensor& t) {
  return reinterpret_cast<const P*>(t.data_ptr());
}

// 8 floats of a row (float32 or bfloat16) from `p`
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bfloat16 is the high half of a float32
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Reads float32 or bfloat16 rows in place: a decoding step's activations are one row, and a
// separate conversion would cost a tensor and a copy per layer. Vectorized (a prefill chunk of
// 128 rows against the 8960-wide down projection spent a quarter of its time here, scalar);
// the same arithmetic as one value at a time: max |x| exactly, d = max / 127 and 1 / d in
// scalar float, codes rounded to nearest even as nearbyint does, an exact integer sum.
// The codes go in the grouped order (grouped_index) that both weight formats use.
// `grouped_order` false: every block's codes in input order (the AMX path's tiles read a block's
// 32 codes as one row).
template <typename T>
QuantizedRows quantize_rows(const at::Tensor& x, bool grouped_order = true) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  QuantizedRows q{at::empty({M, K}, at::kChar), at::empty({M, nb}, at::kFloat), at::empty({M, nb}, at::kFloat),
                  at::empty({M, nb}, at::kInt)};
  const T* xp = x.data_ptr<T>();
  int8_t* qp = q.codes.data_ptr<int8_t>();
  float* dp = q.scale.data_ptr<float>();
  float* sp = q.sum.data_ptr<float>();
  int32_t* cp = q.code_sum.data_ptr<int32_t>();
  const int64_t in_groups = grouped_order ? grouped_blocks(nb) : 0;
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i % nb;
      const T* source = xp + (i / nb) * K + b * kBlock;
      int8_t* row = qp + (i / nb) * K;
      __m256 v[4];
      for (int k = 0; k < 4; ++k) v[k] = load8(source + 8 * k);
      __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
      __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
      top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
      const float d = amax / 127.0f;
      const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
      const __m256 scale = _mm256_set1_ps(inverse);
      __m256i codes[4];  // int32, rounded to nearest even (the default rounding mode, as nearbyint)
      for (int k = 0; k < 4; ++k) codes[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], scale));
      const __m256i total8 = _mm256_add_epi32(_mm256_add_epi32(codes[0], codes[1]), _mm256_add_epi32(codes[2], codes[3]));
      __m128i total4 = _mm_add_epi32(_mm256_castsi256_si128(total8), _mm256_extracti128_si256(total8, 1));
      total4 = _mm_add_epi32(total4, _mm_shuffle_epi32(total4, _MM_SHUFFLE(1, 0, 3, 2)));
      const int total = _mm_cvtsi128_si32(_mm_add_epi32(total4, _mm_shuffle_epi32(total4, _MM_SHUFFLE(2, 3, 0, 1))));
      // to bytes (|code| <= 127: no saturation); packing leaves inputs 4c..4c+3 in 4-byte
      // group (c % 2) * 4 + c / 2, put back in order by one permute
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]), _mm256_packs_epi32(codes[2], codes[3])),
          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      if (b >= in_groups) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + b * kBlock), bytes);
      } else {  // inputs 4c..4c+3 go together in the grouped order (grouped_index)
        alignas(32) int32_t quads[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(quads), bytes);
        for (int c = 0; c < 8; ++c) std::memcpy(row + grouped_index(b, 4 * c, in_groups), quads + c, 4);
      }
      dp[i] = d;
      sp[i] = d * static_cast<float>(total);
      cp[i] = total;
    }
  });
  return q;
}

// sum over 32 byte pairs of unsigned(u) * signed(s), as 8 int32 lanes (no saturation for
// |u| <= 127, which both formats guarantee)
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// sum_b offset[b] * xsum[b], 8 blocks at a time then the rest, in one fixed order
__attribute__((noinline)) float offset_dot(const uint16_t* offset, const float* xsum, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const __m256 o = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offset + b)));
    acc = _mm256_fmadd_ps(o, _mm256_loadu_ps(xsum + b), acc);
  }
  float total = horizontal_sum(acc);
  for (; b < nb; ++b) total = std::fma(half_to_float(offset[b]), xsum[b], total);
  return total;
}

// Block b's 32 codes as unsigned bytes (int4) or their magnitudes (int8), and, for int8, the
// raw signed codes. int4 codes come in pairs of blocks: byte j of a pair holds input j of the
// first block (low nibble) and input j of the second (high nibble), so one 32-byte load and
// two masks give both blocks.
struct WeightBlocks {
  __m256i first, second;
};

inline WeightBlocks int4_pair(const uint8_t* w) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i low = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
}

#ifndef SPIRIT_PREFETCH_ROWS
#define SPIRIT_PREFETCH_ROWS 8
#endif
// A weight row's bytes are read once per product, from memory: asking now for the same
// `lines` cache lines SPIRIT_PREFETCH_ROWS weight rows further on overlaps that read with the
// dot products (one-row products of qwen2.5-coder-1.5b's 768-byte rows measured 1.15-1.5x faster on a
// Xeon, rows of 4480 bytes about the same; no bit changed).
// Only the first chunk of activation rows against a tile of weight rows reads it from memory;
// the later chunks find it in cache, and asking for rows past the tile would evict it.
// (GCC 12 drops prefetches under an early return or an `if` block: the count of lines is zeroed
// instead, which it keeps.)
inline void prefetch_ahead(bool streaming, const uint8_t* here, int64_t row_bytes, int lines) {
  if (!streaming) lines = 0;
  const char* ahead = reinterpret_cast<const char*>(here + SPIRIT_PREFETCH_ROWS * row_bytes);
  for (int line = 0; line < lines; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
}

#ifdef SPIRIT_WIDE
// A group's weight bytes as the unsigned operand of the dot products, step k of 8 (64 bytes
// each; see the formats). int4: the low nibbles of bytes 64k.. (k < 4) or the high ones of
// 64(k - 4).. . int8: the codes plus 128 (a flipped sign bit), in 1..255, so that one VNNI dot
// product needs no sign work per activation row; the 128 * sum(q) this adds is taken off the
// exact integer sums (take_off_bias), so the sums are sum(code * q) exactly.
template <bool Int4>
inline __m512i group_step(const uint8_t* group, int k) {
  if constexpr (Int4) {
    const __m512i v = _mm512_loadu_si512(group + 64 * (k & 3));
    return _mm512_and_si512(k < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
  } else {
    return _mm512_xor_si512(_mm512_loadu_si512(group + 64 * k), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
}
template <bool Int4>
inline __m512i take_off_bias(__m512i sums, const int32_t* code_sum) {
  if constexpr (Int4) return sums;
  return _mm512_sub_epi32(sums, _mm512_slli_epi32(_mm512_loadu_si512(code_sum), 7));
}
// A group's float step for one (weight row, row) pair, 16 blocks in 16 lanes: acc +=
// (weight scale * activation scale) * sum, then (int4) + offset * (activation scale * sum of
// codes). Integer sums are exact, so only these roundings per block count.
template <bool Int4>
inline __m512 group_update(__m512 acc, __m512 ws, __m512 os, const float* xd, const float* xs, __m512i sums) {
  const __m512 a = _mm512_fmadd_ps(_mm512_mul_ps(ws, _mm512_loadu_ps(xd)), _mm512_cvtepi32_ps(sums), acc);
  if constexpr (Int4) return _mm512_fmadd_ps(os, _mm512_loadu_ps(xs), a);
  return a;
}
inline __m512 half16_to_float(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// One weight row against R activation rows. Each row keeps two accumulators (even and odd
// blocks) so that consecutive blocks do not wait on one another; the per-block factor
// (weight scale times activation scale) is formed 8 blocks at a time and broadcast by lane.
// `grouped_sums`: R partial sums over the interleaved groups already formed by
// grouped_sums_block (the same operations, see there), or nullptr to form them here.
template <int R, bool Int4>
inline void row_times_rows(const uint8_t* w, const uint16_t* scale, const uint16_t* offset, const Rows& x,
                           float* out, const float* grouped_sums, bool streaming) {
  const int8_t* xq = x.codes;
  const float* xd = x.scale;
  const float* xs = x.sum;
  const int64_t K = x.K, nb = x.nb;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t row_bytes_per_block = Int4 ? 16 : 32;
  const int64_t row_bytes = nb * row_bytes_per_block;
  auto block_product = [&](int r, int64_t b, __m256i wu, __m256i wraw, __m256 factor) {
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * kBlock));
    if constexpr (!Int4) xv = _mm256_sign_epi8(xv, wraw);  // the weight's sign moves to x
    const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(wu, xv));
    acc[r][b & 1] = _mm256_fmadd_ps(factor, p, acc[r][b & 1]);
  };
#ifdef SPIRIT_WIDE
  __m512 wide[R][2];
  for (int r = 0; r < R; ++r) wide[r][0] = wide[r][1] = _mm512_setzero_ps();
#endif
  // the interleaved groups: 8 dot products leave 16 blocks' integer sums in 16 lanes, then
  // one float step per 16 blocks (group_update)
  const int64_t grouped = grouped_blocks(nb);
  __m256 group_acc[R][2];
  for (int r = 0; r < R; ++r) group_acc[r][0] = group_acc[r][1] = _mm256_setzero_ps();
#ifdef SPIRIT_WIDE
  __m512 group_wide[R];
  for (int r = 0; r < R; ++r)
    group_wide[r] = grouped_sums ? _mm512_loadu_ps(grouped_sums + 16 * r) : _mm512_setzero_ps();
  for (int64_t g = 0; grouped_sums == nullptr && g < grouped; g += kGroup) {
    const uint8_t* wg = w + g * row_bytes_per_block;
    prefetch_ahead(streaming, wg, row_bytes, Int4 ? 4 : 8);
    __m512i u[8];
    for (int k = 0; k < 8; ++k) u[k] = group_step<Int4>(wg, k);
    const __m512 ws = half16_to_float(scale + g);
    const __m512 os = Int4 ? half16_to_float(offset + g) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = xq + r * K + g * kBlock;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], _mm512_loadu_si512(xg));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], _mm512_loadu_si512(xg + 64));
      for (int k = 2; k < 8; k += 2) {
        s0 = _mm512_dpbusd_epi32(s0, u[k], _mm512_loadu_si512(xg + 64 * k));
        s1 = _mm512_dpbusd_epi32(s1, u[k + 1], _mm512_loadu_si512(xg + 64 * (k + 1)));
      }
      const __m512i sums = take_off_bias<Int4>(_mm512_add_epi32(s0, s1), x.code_sum + r * nb + g);
      group_wide[r] = group_update<Int4>(group_wide[r], ws, os, xd + r * nb + g, xs + r * nb + g, sums);
    }
  }
#else
  for (int64_t g = 0; g < grouped; g += kGroup) {
    prefetch_ahead(streaming, w + g * row_bytes_per_block, row_bytes, Int4 ? 4 : 8);
    for (int h = 0; h < 2; ++h) {  // blocks 8h..8h+7 of the group: bytes 32h..32h+31 of each 64
      const uint8_t* wg = w + g * row_bytes_per_block + 32 * h;
      __m256i u[8];
      for (int k = 0; k < 8; ++k) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 64 * (Int4 ? k & 3 : k)));
        if constexpr (Int4) u[k] = _mm256_and_si256(k < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
        else u[k] = v;  // int8: signed codes, made unsigned per dot product below
      }
      const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + g + 8 * h)));
      const __m256 os = Int4 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offset + g + 8 * h)))
                             : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const int8_t* xg = xq + r * K + g * kBlock + 32 * h;
        auto x_at = [&](int k) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 64 * k)); };
        __m256i sums;
        if constexpr (Int4) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
          __m256i s0 = dot_u8s8(u[0], x_at(0));
          __m256i s1 = dot_u8s8(u[1], x_at(1));
          for (int k = 2; k < 8; k += 2) {
            s0 = _mm256_add_epi32(s0, dot_u8s8(u[k], x_at(k)));
            s1 = _mm256_add_epi32(s1, dot_u8s8(u[k + 1], x_at(k + 1)));
          }
          sums = _mm256_add_epi32(s0, s1);
#else
          // Without VNNI a dot product is maddubs (byte pairs to int16) then madd (int16 pairs to
          // int32). The 8 products of a half group add up in int16 first, exactly: a code is at
          // most 15 and |q| at most 127, so a byte pair gives at most 3810 and 8 of them 30480,
          // under 32767. One madd instead of 8, and the same integer sums, so the same bits.
          __m256i p0 = _mm256_maddubs_epi16(u[0], x_at(0));
          __m256i p1 = _mm256_maddubs_epi16(u[1], x_at(1));
          for (int k = 2; k < 8; k += 2) {
            p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(u[k], x_at(k)));
            p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(u[k + 1], x_at(k + 1)));
          }
          sums = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1));
#endif
        } else {
          // int8: the weight's sign moves to x (|code| <= 127: no saturation in maddubs)
          sums = dot_u8s8(_mm256_abs_epi8(u[0]), _mm256_sign_epi8(x_at(0), u[0]));
          for (int k = 1; k < 8; ++k)
            sums = _mm256_add_epi32(sums, dot_u8s8(_mm256_abs_epi8(u[k]), _mm256_sign_epi8(x_at(k), u[k])));
        }
        const __m256 fsums = _mm256_cvtepi32_ps(sums);
        group_acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(ws, _mm256_loadu_ps(xd + r * nb + g + 8 * h)), fsums, group_acc[r][h]);
        if constexpr (Int4)
          group_acc[r][h] = _mm256_fmadd_ps(os, _mm256_loadu_ps(xs + r * nb + g + 8 * h), group_acc[r][h]);
      }
    }
  }
#endif
  int64_t b = grouped;
  for (; b + 8 <= nb; b += 8) {
    prefetch_ahead(streaming, w + b * row_bytes_per_block, row_bytes, Int4 ? 2 : 4);
    const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + b)));
    __m256 factors[R];
    for (int r = 0; r < R; ++r) factors[r] = _mm256_mul_ps(ws, _mm256_loadu_ps(xd + r * nb + b));
#ifdef SPIRIT_WIDE
    // two blocks per 512-bit operation: half the instructions for the same products
    for (int i = 0; i < 8; i += 2) {
      __m512i u, raw;
      if constexpr (Int4) {
        const WeightBlocks pair = int4_pair(w + (b + i) * 16);
        u = raw = _mm512_inserti64x4(_mm512_castsi256_si512(pair.first), pair.second, 1);
      } else {
        raw = _mm512_loadu_si512(w + (b + i) * 32);
        u = _mm512_abs_epi8(raw);
      }
      const __m512i lanes = _mm512_set_epi32(i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1,
                                             i, i, i, i, i, i, i, i);
      for (int r = 0; r < R; ++r) {
        __m512i xv = _mm512_loadu_si512(xq + r * K + (b + i) * kBlock);
        if constexpr (!Int4) xv = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(raw), _mm512_setzero_si512(), xv);
        const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xv));
        const __m512 factor = _mm512_permutexvar_ps(lanes, _mm512_castps256_ps512(factors[r]));
        wide[r][(i >> 1) & 1] = _mm512_fmadd_ps(factor, p, wide[r][(i >> 1) & 1]);
      }
    }
#else
    for (int i = 0; i < 8; i += 2) {
      __m256i u0, u1, raw0, raw1;
      if constexpr (Int4) {
        const WeightBlocks pair = int4_pair(w + (b + i) * 16);
        u0 = raw0 = pair.first;
        u1 = raw1 = pair.second;
      } else {
        raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b + i) * 32));
        raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b + i + 1) * 32));
        u0 = _mm256_abs_epi8(raw0);
        u1 = _mm256_abs_epi8(raw1);
      }
      const __m256i lane0 = _mm256_set1_epi32(i), lane1 = _mm256_set1_epi32(i + 1);
      for (int r = 0; r < R; ++r) {
        block_product(r, b + i, u0, raw0, _mm256_permutevar8x32_ps(factors[r], lane0));
        block_product(r, b + i + 1, u1, raw1, _mm256_permutevar8x32_ps(factors[r], lane1));
      }
    }
#endif
  }
  for (; b < nb; ++b) {  // the last blocks (fewer than 8), one factor at a time
    __m256i u, raw;
    if constexpr (Int4) {
      // pairs continue while two blocks remain; a lone last block holds 16 bytes, low
      // nibbles inputs 0..15 and high nibbles inputs 16..31
      if (b + 1 < nb && ((b & 1) == 0)) {
        const WeightBlocks pair = int4_pair(w + b * 16);
        const float ws0 = half_to_float(scale[b]), ws1 = half_to_float(scale[b + 1]);
        for (int r = 0; r < R; ++r) {
          block_product(r, b, pair.first, pair.first, _mm256_set1_ps(ws0 * xd[r * nb + b]));
          block_product(r, b + 1, pair.second, pair.second, _mm256_set1_ps(ws1 * xd[r * nb + b + 1]));
        }
        ++b;
        continue;
      }
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * row_bytes_per_block));
      u = raw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
    } else {
      raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * row_bytes_per_block));
      u = _mm256_abs_epi8(raw);
    }
    const float ws = half_to_float(scale[b]);
    for (int r = 0; r < R; ++r) block_product(r, b, u, raw, _mm256_set1_ps(ws * xd[r * nb + b]));
  }
  for (int r = 0; r < R; ++r) {
    __m256 sum = _mm256_add_ps(acc[r][0], acc[r][1]);
#ifdef SPIRIT_WIDE
    const __m512 w2 = _mm512_add_ps(wide[r][0], wide[r][1]);
    sum = _mm256_add_ps(sum, _mm256_add_ps(_mm512_castps512_ps256(w2),
                                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w2), 1))));
#endif
    sum = _mm256_add_ps(sum, _mm256_add_ps(group_acc[r][0], group_acc[r][1]));
#ifdef SPIRIT_WIDE
    sum = _mm256_add_ps(sum, _mm256_add_ps(_mm512_castps512_ps256(group_wide[r]),
                                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(group_wide[r]), 1))));
#endif
    float total = horizontal_sum(sum);
    if constexpr (Int4) total += offset_dot(offset + grouped, xs + r * nb + grouped, nb - grouped);
    out[r] = total;
  }
}

#ifdef SPIRIT_WIDE
#ifndef SPIRIT_COLS_PER_BLOCK
#define SPIRIT_COLS_PER_BLOCK 2
#endif
constexpr int kColsPerBlock = SPIRIT_COLS_PER_BLOCK;  // weight rows that share one read of the activation rows (3 and 4 measured slower: registers)
#ifndef SPIRIT_BLOCKED_ROWS
#define SPIRIT_BLOCKED_ROWS 8
#endif
// Activation rows per chunk in the column-blocked path where every block is in a group: one
// chunk of a batch's 8-row pass reads each weight byte once, as it arrives from memory (two
// chunks of 4 left the memory idle during the second).
constexpr int64_t kBlockedRows = SPIRIT_BLOCKED_ROWS;
static_assert(kBlockedRows <= 16 && kRowsPerChunk * kColsPerBlock <= 16, "reduce_lanes takes at most 16 (weight row, row) pairs");
// Weight rows per grouped_sums_block for `rows` activation rows: R x C integer and R x C float
// accumulators must fit the 32 vector registers with the operands, so R x C <= 8.
constexpr int64_t cols_per_block(int64_t rows) { return std::max<int64_t>(1, std::min<int64_t>(kColsPerBlock, 8 / rows)); }

// The interleaved groups for R activation rows against C weight rows at once, into `sums`
// (float [C][R][16]: one lane per block of a group, as row_times_rows keeps them).
// Why: row_times_rows takes one weight row at a time, so with many activation rows (prefill,
// a batch's packed pass) every activation byte is loaded once per weight row, and the
// loads, the weight unpacking and the short dot-product chains leave the VNNI units idle
// most of the time (about a fifth of their rate measured at 128 rows). Here each 64-byte
// activation load feeds C dot products and each unpacked weight vector R of them, in R x C
// independent chains. Per (row, weight row) pair the float operations are row_times_rows'
// own, in the same order (the integer sums are exact in any order), so the bits are the same.
template <bool Int4, int R, int C>
inline void grouped_sums_block(const uint8_t* w, int64_t row_bytes, const uint16_t* scale, const uint16_t* offset,
                               const Rows& x, float* sums, bool streaming) {
  const int64_t nb = x.nb, grouped = grouped_blocks(nb), block_bytes = Int4 ? 16 : 32;
  __m512 acc[C][R];  // in registers across the groups (through memory it measured a third slower)
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < grouped; g += kGroup) {
    for (int c = 0; c < C; ++c) prefetch_ahead(streaming, w + c * row_bytes + g * block_bytes, row_bytes, Int4 ? 4 : 8);
    __m512i s[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) s[c][r] = _mm512_setzero_si512();
    for (int k = 0; k < 8; ++k) {
      __m512i u[C];
      for (int c = 0; c < C; ++c) u[c] = group_step<Int4>(w + c * row_bytes + g * block_bytes, k);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(x.codes + r * x.K + g * kBlock + 64 * k);
        for (int c = 0; c < C; ++c) s[c][r] = _mm512_dpbusd_epi32(s[c][r], u[c], xv);
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m512 ws = half16_to_float(scale + c * nb + g);
      const __m512 os = Int4 ? half16_to_float(offset + c * nb + g) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r)
        acc[c][r] = group_update<Int4>(acc[c][r], ws, os, x.scale + r * nb + g, x.sum + r * nb + g,
                                       take_off_bias<Int4>(s[c][r], x.code_sum + r * nb + g));
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums + 16 * (c * R + r), acc[c][r]);
}

// Each of up to 16 (weight row, row) pairs' 16 lanes (`sums`, float [count][16]) summed to
// one float, into `totals` [count]: the tree row_times_rows takes when every block is in a
// group (lane i + lane i+8, then i + i+4, i + i+2, i + i+1, then + 0 for its empty remainder:
// the same bits), for 16 pairs at once: 30 shuffles and 15 additions instead of 16 reductions.
inline void reduce_lanes(const float* sums, int count, float* totals) {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = i < count ? _mm512_loadu_ps(sums + 16 * i) : _mm512_setzero_ps();
  __m512 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i)  // lanes i and i + 8 of two pairs: each now holds 8 values
    l1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // i and i + 4: four pairs of 4 values
    l2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // i and i + 2 in each 128-bit lane
    l3[i] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 last = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_add_ps(last, _mm512_setzero_ps()));  // + 0: row_times_rows' empty remainder (-0 becomes +0)
  for (int i = 0; i < count; ++i) totals[i] = lanes[(i & 3) * 4 + (i >> 2)];  // pair i ends in lane 4 (i % 4) + i / 4
}

using BlockKernel = void (*)(const uint8_t*, int64_t, const uint16_t*, const uint16_t*, const Rows&, float*, bool);

template <bool Int4, int R, int... C>
constexpr std::array<BlockKernel, sizeof...(C)> block_row_of(std::integer_sequence<int, C...>) {
  return {&grouped_sums_block<Int4, R, C + 1>...};
}
template <bool Int4, int... R>
constexpr std::array<std::array<BlockKernel, kColsPerBlock>, sizeof...(R)> block_table_of(std::integer_sequence<int, R...>) {
  return {block_row_of<Int4, R + 1>(std::make_integer_sequence<int, kColsPerBlock>{})...};
}
// grouped_sums_block for 1..kBlockedRows rows and 1..kColsPerBlock weight rows
template <bool Int4>
BlockKernel block_kernel(int64_t rows, int64_t cols) {
  static constexpr auto table = block_table_of<Int4>(std::make_integer_sequence<int, kBlockedRows>{});
  return table[rows - 1][cols - 1];
}
#endif

using RowsKernel = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, const Rows&, float*, const float*, bool);

// row_times_rows for 1..kRowsPerChunk activation rows, picked at run time
template <bool Int4, int... R>
RowsKernel rows_kernel_of(int64_t rows, std::integer_sequence<int, R...>) {
  static constexpr RowsKernel table[] = {&row_times_rows<R + 1, Int4>...};
  return table[rows - 1];
}
template <bool Int4>
RowsKernel rows_kernel(int64_t rows) {
  return rows_kernel_of<Int4>(rows, std::make_integer_sequence<int, kRowsPerChunk>{});
}

#ifdef SPIRIT_WIDE
// `rows` (<= kBlockedRows) activation rows `x` against weight rows [n0, n1), cols_per_block(rows)
// weight rows at a time (grouped_sums_block); the blocks after the groups, if any, and the
// reductions as row_times_rows does them. Outputs go to y [rows, N] (columns n0..n1).
template <bool Int4, typename T>
void chunk_blocked(const uint8_t* wp, const uint16_t* sp, const uint16_t* op, const Rows& x, int64_t rows,
                   int64_t n0, int64_t n1, bool streaming, const float* bias, T* y, int64_t N) {
  const int64_t nb = x.nb, row_bytes = Int4 ? x.K / 2 : x.K, block_cols = cols_per_block(rows);
  auto offset_of = [&](int64_t n) { return Int4 ? op + n * nb : nullptr; };
  alignas(64) float grouped_sums[16 * 16];  // up to 16 (weight row, row) pairs' lanes
  auto put = [&](int64_t r, int64_t n, float total) { y[r * N + n] = static_cast<T>(bias ? total + bias[n] : total); };
  if (grouped_blocks(nb) == nb) {  // nothing after the groups: up to 16 pairs reduced at once
    const int64_t step = 16 / rows / block_cols * block_cols;  // weight rows per reduction
    for (int64_t n = n0; n < n1; n += step) {
      const int64_t cols = std::min<int64_t>(step, n1 - n);
      for (int64_t c = 0; c < cols; c += block_cols)
        block_kernel<Int4>(rows, std::min<int64_t>(block_cols, cols - c))(
            wp + (n + c) * row_bytes, row_bytes, sp + (n + c) * nb, offset_of(n + c), x, grouped_sums + 16 * rows * c,
            streaming);
      float totals[16];
      reduce_lanes(grouped_sums, static_cast<int>(rows * cols), totals);
      for (int64_t c = 0; c < cols; ++c)
        for (int64_t r = 0; r < rows; ++r) put(r, n + c, totals[c * rows + r]);
    }
    return;
  }
  float out[kRowsPerChunk];
  for (int64_t n = n0; n < n1; n += block_cols) {
    const int64_t cols = std::min<int64_t>(block_cols, n1 - n);
    block_kernel<Int4>(rows, cols)(wp + n * row_bytes, row_bytes, sp + n * nb, offset_of(n), x, grouped_sums, streaming);
    for (int64_t c = 0; c < cols; ++c) {
      // the rest of each row, kRowsPerChunk rows at a time (row_times_rows' registers)
      for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerChunk) {
        const int64_t part = std::min(kRowsPerChunk, rows - r0);
        rows_kernel<Int4>(part)(wp + (n + c) * row_bytes, sp + (n + c) * nb, offset_of(n + c), x.from(r0), out,
                                grouped_sums + 16 * (rows * c + r0), streaming);
        for (int64_t r = 0; r < part; ++r) put(r0 + r, n + c, out[r]);
      }
    }
  }
}
#endif

#ifdef SPIRIT_AMX
// Many rows on CPUs with AMX (Xeons since Sapphire Rapids): the interleaved groups' integer sums
// come from tile dot products, one block of 32 inputs at a time for 16 weight rows (a "panel")
// against up to 16 activation rows. Why: with VNNI every extra activation row is another full
// set of dot products (8 rows measured 2.8x one row's time, 128 rows 211 GMAC/s on two cores);
// a tile product does a block for 16 x 16 (weight row, row) pairs in one instruction, and what
// is left per pair is the float step row_times_rows takes anyway.
//
// Same bits as row_times_rows: integer sums are exact in any order, and each float operation
// is the one row_times_rows does on that block's lane (acc = (ws * xd) * sum + acc, then for
// int4 acc = os * xs + acc), only vectorized across the panel's 16 weight rows instead of
// across a group's 16 blocks; the 16 lanes are then reduced in row_times_rows' tree (lane
// i + i+8, i + i+4, i + i+2, i + i+1, + 0), or handed to it where blocks follow the groups.
//
// The panels (model/qgemm.py tile_panels) hold the grouped blocks in tile order, made once
// when a model loads: per panel of 16 weight rows and block, int8 a tile of 512 bytes (byte
// 64k + 4n + j: input 4k + j of weight row n) and int4 256 bytes of nibble pairs (byte
// 64c + 4n + j: inputs 4c + j low and 16 + 4c + j high), unpacked into tiles one lane ahead
// (unpacked once at load, a byte per code, the panels cost twice the reads: 8 rows of
// 17920x1536 took 1.27x the VNNI time, against 0.98x now); then the block's 16 float16 scales
// (and offsets) by weight row. Rows past N are zero.
constexpr int64_t kPanel = 16;  // weight rows per tile product (a tile's 16 int32 columns)

// Linux hands a process the tile registers only when asked (arch_prctl ARCH_REQ_XCOMP_PERM
// for XTILEDATA); where that fails (older kernels, a VM that hides them) the VNNI path runs.
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0, 1: int32 sums [rows][16]; 2, 3: activation codes [rows][32]; 4, 5: a block of the
// panel's weights [8][64] (input 4k + j of weight row n at 64k + 4n + j). Two of each, so one
// block's products run while the other's sums are read.
inline void configure_tiles(int rows) {
  TileConfig config;
  for (int t : {0, 1}) config.rows[t] = rows, config.colsb[t] = 64;
  for (int t : {2, 3}) config.rows[t] = rows, config.colsb[t] = 32;
  for (int t : {4, 5}) config.rows[t] = 8, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// The float step of one block for R rows: sums [R][16] int32 by weight row.
template <bool Int4, int R>
inline void panel_block_update(__m512 (&acc)[R], const int32_t* sums, const uint16_t* scale, const uint16_t* offset,
                               const Rows& x, int64_t b) {
  const __m512 ws = half16_to_float(scale);
  const __m512 os = Int4 ? half16_to_float(offset) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512 factor = _mm512_mul_ps(ws, _mm512_set1_ps(x.scale[r * x.nb + b]));
    acc[r] = _mm512_fmadd_ps(factor, _mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * r)), acc[r]);
    if constexpr (Int4) acc[r] = _mm512_fmadd_ps(os, _mm512_set1_ps(x.sum[r * x.nb + b]), acc[r]);
  }
}

// Block b's products for the panel's 16 weight rows against R rows into tile T (0 or 1),
// from activation codes in tile 2 + T and the block's weight tile `weights` (512 bytes) in 4 + T.
// (GCC's tile intrinsics are macros that paste the tile number: it must be a literal.)
template <bool Int4, int T>
inline void issue_block(const uint8_t* weights, const Rows& x, int64_t b) {
  const int8_t* codes = x.codes + b * kBlock;
  if constexpr (T == 0) {
    _tile_zero(0);
    _tile_loadd(2, codes, x.K);
    _tile_loadd(4, weights, 64);
    if constexpr (Int4) _tile_dpbsud(0, 2, 4); else _tile_dpbssd(0, 2, 4);
  } else {
    _tile_zero(1);
    _tile_loadd(3, codes, x.K);
    _tile_loadd(5, weights, 64);
    if constexpr (Int4) _tile_dpbsud(1, 3, 5); else _tile_dpbssd(1, 3, 5);
  }
}

// int4: lane l's blocks (l, 16 + l, ...) from the panel's nibble pairs (256 bytes a block:
// byte 64c + 4n + j holds input 4c + j in the low nibble and 16 + 4c + j in the high one) into
// tiles of one code per byte (512 bytes a block: tile row c the low nibbles, 4 + c the high).
inline void unpack_lane(const uint8_t* panel, int l, int64_t groups, uint8_t* tiles) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* packed = panel + 256 * (g * kGroup + l);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(packed + 64 * c);
      _mm512_store_si512(tiles + 512 * g + 64 * c, _mm512_and_si512(v, low));
      _mm512_store_si512(tiles + 512 * g + 64 * (4 + c), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
  }
}

// One panel's grouped blocks against R activation rows (plain-order codes `x`), into
// lanes [R][16 blocks of a group][16 weight rows]: row_times_rows' group_wide, transposed.
// `panel`: the panel's weights (int8: block b's tile at 512 b; int4: its nibble pairs at
// 256 b); `scale`, `offset`: 16 per block; `unpacked` (int4): room for 2 x groups tiles.
// Lane by lane: lane l's blocks l, 16 + l, 32 + l, ... in order (its sum runs over the groups
// in order), two blocks' tile products in flight at once. int4 lanes are unpacked one lane
// ahead (a tile load waits for stores to the bytes it reads to land). `next`, `next_bytes`:
// the next panel, asked for a sixteenth per lane, so it streams in while this one is computed
// (without it, 8 rows of int8 read the panels at 32 GB/s where one VNNI row reads 46; the
// prefetch's own gain was not measured apart).
template <bool Int4, int R>
void panel_lanes(const uint8_t* panel, const uint16_t* scale, const uint16_t* offset, const Rows& x, float* lanes,
                 uint8_t* unpacked, const uint8_t* next, int64_t next_bytes) {
  const int64_t groups = grouped_blocks(x.nb) / kGroup;
  const int64_t lines_per_lane = (next_bytes / 64 + kGroup - 1) / kGroup;
  alignas(64) int32_t sums[2][16 * 16];
  if constexpr (Int4) unpack_lane(panel, 0, groups, unpacked);
  for (int l = 0; l < kGroup; ++l) {
    const char* ahead = reinterpret_cast<const char*>(next) + 64 * lines_per_lane * l;
    for (int64_t line = 0; line < lines_per_lane && 64 * (lines_per_lane * l + line) < next_bytes; ++line)
      _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
    const uint8_t* lane_tiles = Int4 ? unpacked + (l & 1) * groups * 512 : nullptr;
    if constexpr (Int4)
      if (l + 1 < kGroup) unpack_lane(panel, l + 1, groups, unpacked + ((l + 1) & 1) * groups * 512);
    auto tile_of = [&](int64_t g) { return Int4 ? lane_tiles + 512 * g : panel + 512 * (g * kGroup + l); };
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 2) {
      const int64_t b0 = g * kGroup + l, b1 = b0 + kGroup;
      const bool pair = g + 1 < groups;
      issue_block<Int4, 0>(tile_of(g), x, b0);
      if (pair) issue_block<Int4, 1>(tile_of(g + 1), x, b1);
      _tile_stored(0, sums[0], 64);
      panel_block_update<Int4, R>(acc, sums[0], scale + 16 * b0, offset + 16 * b0, x, b0);
      if (pair) {
        _tile_stored(1, sums[1], 64);
        panel_block_update<Int4, R>(acc, sums[1], scale + 16 * b1, offset + 16 * b1, x, b1);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_store_ps(lanes + 256 * r + 16 * l, acc[r]);
  }
}

using PanelKernel = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, const Rows&, float*, uint8_t*,
                             const uint8_t*, int64_t);
template <bool Int4, int... R>
PanelKernel panel_kernel_of(int64_t rows, std::integer_sequence<int, R...>) {
  static constexpr PanelKernel table[] = {&panel_lanes<Int4, R + 1>...};
  return table[rows - 1];
}

// The tree of row_times_rows' reduction over a group's 16 lanes, for 16 weight rows at once
inline __m512 reduce_lanes_by_row(const float* lanes) {
  __m512 v[8];
  for (int i = 0; i < 8; ++i) v[i] = _mm512_add_ps(_mm512_load_ps(lanes + 16 * i), _mm512_load_ps(lanes + 16 * (i + 8)));
  for (int i = 0; i < 4; ++i) v[i] = _mm512_add_ps(v[i], v[i + 4]);
  for (int i = 0; i < 2; ++i) v[i] = _mm512_add_ps(v[i], v[i + 2]);
  return _mm512_add_ps(_mm512_add_ps(v[0], v[1]), _mm512_setzero_ps());
}

template <bool Int4, typename T>
void gemm_amx(const QuantizedRows& xq, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
              const at::Tensor& panels, const float* bias, at::Tensor& y) {
  const int64_t M = xq.codes.size(0), K = xq.codes.size(1), N = codes.size(0), nb = K / kBlock;
  const int64_t grouped = grouped_blocks(nb), row_bytes = Int4 ? K / 2 : K;
  const int64_t code_bytes = (Int4 ? 256 : 512) * grouped, half_bytes = 2 * 16 * grouped;
  const int64_t panel_bytes = code_bytes + (Int4 ? 2 : 1) * half_bytes;
  const uint8_t* pp = panels.data_ptr<uint8_t>();
  const uint8_t* wp = raw<uint8_t>(codes);
  const uint16_t* sp = raw<uint16_t>(scale);
  const uint16_t* op = Int4 ? raw<uint16_t>(offset) : nullptr;
  const Rows all = rows_of(xq);
  T* yp = y.data_ptr<T>();
  const int64_t panel_count = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panel_count, 1, [&](int64_t begin, int64_t end) {
    float* lanes = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * 16 * 256));
    uint8_t* unpacked = Int4 ? static_cast<uint8_t*>(std::aligned_alloc(64, 2 * 512 * (grouped / kGroup))) : nullptr;
    int configured = 0;
    alignas(64) float grouped_sums[kRowsPerChunk * 16];
    float out[kRowsPerChunk];
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = pp + p * panel_bytes;
      const uint16_t* pscale = reinterpret_cast<const uint16_t*>(panel + code_bytes);
      const uint16_t* poffset = Int4 ? pscale + 16 * grouped : nullptr;
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, M - m0));
        if (rows != configured) configure_tiles(rows), configured = rows;
        const Rows x = all.from(m0);
        panel_kernel_of<Int4>(rows, std::make_integer_sequence<int, 16>{})(
            panel, pscale, poffset, x, lanes, unpacked, panel + panel_bytes, m0 == 0 && p + 1 < end ? panel_bytes : 0);
        if (grouped == nb) {
          for (int r = 0; r < rows; ++r) {
            alignas(64) float totals[16];
            _mm512_store_ps(totals, reduce_lanes_by_row(lanes + 256 * r));
            for (int64_t c = 0; c < cols; ++c)
              yp[(m0 + r) * N + n0 + c] = static_cast<T>(bias ? totals[c] + bias[n0 + c] : totals[c]);
          }
          continue;
        }
        // blocks after the groups: row_times_rows finishes each (weight row, row) pair from its lanes
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t n = n0 + c;
          for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerChunk) {
            const int64_t part = std::min<int64_t>(kRowsPerChunk, rows - r0);
            for (int64_t r = 0; r < part; ++r)
              for (int l = 0; l < 16; ++l) grouped_sums[16 * r + l] = lanes[256 * (r0 + r) + 16 * l + c];
            rows_kernel<Int4>(part)(wp + n * row_bytes, sp + n * nb, Int4 ? op + n * nb : nullptr, x.from(r0), out,
                                    grouped_sums, false);
            for (int64_t r = 0; r < part; ++r)
              yp[(m0 + r0 + r) * N + n] = static_cast<T>(bias ? out[r] + bias[n] : out[r]);
          }
        }
      }
    }
    if (configured) _tile_release();
    std::free(lanes);
    std::free(unpacked);
  });
}
#endif

template <bool Int4, typename T>
void gemm(const QuantizedRows& xq, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
          const float* bias, at::Tensor& y) {
  const int64_t M = xq.codes.size(0), K = xq.codes.size(1), N = codes.size(0), nb = K / kBlock;
  const int64_t row_bytes = Int4 ? K / 2 : K;
  const uint8_t* wp = raw<uint8_t>(codes);
  const uint16_t* sp = raw<uint16_t>(scale);
  const uint16_t* op = Int4 ? raw<uint16_t>(offset) : nullptr;
  const Rows all = rows_of(xq);
  T* yp = y.data_ptr<T>();
  // Many rows (prefill, wide verification): a tile of weight rows is taken against every chunk
  // of activation rows before the next tile, so the tile is read from memory once and then
  // from cache, and each chunk's activations stay in L1 across the tile. Each output is still
  // computed by the same operations (row_times_rows', or for chunks of several rows
  // chunk_blocked's, which are the same per output), so the loop order changes no bit.
  const int64_t tile = std::max<int64_t>(1, kTileBytes / row_bytes);
#ifdef SPIRIT_WIDE
  // Column blocks pay once a chunk has more than one activation row (one row is bound by
  // reading the weights); SPIRIT_BLOCKED_MIN_ROWS moves that point for A/B runs.
  const bool blocked = M >= SPIRIT_BLOCKED_MIN_ROWS && grouped_blocks(nb) > 0;
#endif
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float out[kRowsPerChunk];
    for (int64_t n0 = begin; n0 < end; n0 += tile) {
      const int64_t n1 = std::min(end, n0 + tile);
#ifdef SPIRIT_WIDE
      // Rows with blocks after the groups keep chunks of kRowsPerChunk: their remainder runs
      // one weight row at a time (row_times_rows), which 8-row chunks measured slower
      // (1536x8960 0.86-0.94x) where all-grouped rows gained (17920x1536 1.08-1.15x).
      const int64_t chunk = blocked && grouped_blocks(nb) == nb ? kBlockedRows : kRowsPerChunk;
#else
      const int64_t chunk = kRowsPerChunk;
#endif
      for (int64_t m = 0; m < M; m += chunk) {
        const int64_t rows = std::min(chunk, M - m);
        const Rows x = all.from(m);
#ifdef SPIRIT_WIDE
        if (blocked) {
          chunk_blocked<Int4>(wp, sp, op, x, rows, n0, n1, m == 0, bias, yp + m * N, N);
          continue;
        }
#endif
        for (int64_t n = n0; n < n1; ++n) {
          const uint16_t* o = Int4 ? op + n * nb : nullptr;
          rows_kernel<Int4>(rows)(wp + n * row_bytes, sp + n * nb, o, x, out, nullptr, m == 0);
          for (int64_t r = 0; r < rows; ++r) yp[(m + r) * N + n] = static_cast<T>(bias ? out[r] + bias[n] : out[r]);
        }
      }
    }
  });
}

inline int32_t load_u32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 16 codes (bytes; signed for int8) to bfloat16 at `out`: code * scale + offset in float32 by one
// fma (std::fma's rounding), then rounded to nearest even as c10's float -> bfloat16 conversion
// does (the values are finite), 8 at a time.
template <bool Signed>
inline void bf16_codes(__m128i codes, float scale, float offset, uint16_t* out) {
  const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
  __m256i rounded[2];
  for (int h = 0; h < 2; ++h) {
    const __m128i eight = h ? _mm_srli_si128(codes, 8) : codes;
    const __m256i wide = Signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
    const __m256i bits = _mm256_castps_si256(_mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), s, o));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    rounded[h] = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  }
  // packus interleaves 128-bit halves: lanes 0-3 of each, then 4-7; one permute puts them in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded[0], rounded[1]), _MM_SHUFFLE(3, 1, 2, 0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
}

// Block b's 32 codes of one packed weight row (see the formats) as two 16-byte halves: inputs
// 0..15 and 16..31 (bytes; int8 signed).
struct BlockCodes {
  __m128i first, second;
};
inline __m128i four_pieces(const uint8_t* p, int64_t stride) {  // 4-byte pieces `stride` bytes apart, in order
  return _mm_setr_epi32(load_u32(p), load_u32(p + stride), load_u32(p + 2 * stride), load_u32(p + 3 * stride));
}
template <bool Int4>
inline BlockCodes block_codes(const uint8_t* row, int64_t b, int64_t nb) {
  const int64_t grouped = grouped_blocks(nb);
  if constexpr (Int4) {
    const __m128i low = _mm_set1_epi8(0x0F);
    auto nibbles = [&](__m128i packed) {  // low nibbles inputs 0..15, high ones 16..31
      return BlockCodes{_mm_and_si128(packed, low), _mm_and_si128(_mm_srli_epi16(packed, 4), low)};
    };
    if (b < grouped)  // byte 64c + 4l + j of a group: inputs 4c + j and 16 + 4c + j of block l
      return nibbles(four_pieces(row + (b / kGroup) * kGroup * 16 + (b % kGroup) * 4, 64));
    if (b + 1 == nb && (b - grouped) % 2 == 0)  // a lone last block: byte j holds inputs j and j + 16
      return nibbles(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16)));
    // a pair: byte j of the pair holds input j of its even block (low nibble) and of its odd one
    const uint8_t* pair = row + (b - (b - grouped) % 2) * 16;
    const bool odd = (b - grouped) % 2 == 1;
    auto half = [&](int h) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 16 * h));
      return _mm_and_si128(odd ? _mm_srli_epi16(v, 4) : v, low);
    };
    return {half(0), half(1)};
  } else {
    if (b < grouped) {  // byte 64k + 4l + j of a group: input 4k + j of block l
      const uint8_t* at_block = row + (b / kGroup) * kGroup * kBlock + (b % kGroup) * 4;
      return {four_pieces(at_block, 64), four_pieces(at_block + 256, 64)};
    }
    return {_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kBlock)),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kBlock + 16))};
  }
}

// One packed weight row (nb blocks; scale and offset per block, offset null for int8) as K
// bfloat16 values at `out`.
template <bool Int4>
inline void bf16_row(const uint8_t* row, const uint16_t* scale, const uint16_t* offset, int64_t nb, uint16_t* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const BlockCodes codes = block_codes<Int4>(row, b, nb);
    const float s = half_to_float(scale[b]), o = Int4 ? half_to_float(offset[b]) : 0.0f;
    bf16_codes<!Int4>(codes.first, s, o, out + b * kBlock);
    bf16_codes<!Int4>(codes.second, s, o, out + b * kBlock + 16);
  }
}

#ifdef SPIRIT_AMX
// Prefill on CPUs with AMX: bfloat16 tile products (TDPBF16PS) of the weights, turned to
// bfloat16 a panel of 16 weight rows at a time, against the bfloat16 activations as they are.
// Why: a prefill chunk is bound by arithmetic, and the integer path spends most of it on the
// float step per block of 32 inputs for every (weight row, row) pair (128 rows of 17920x1536 int4
// ran at about 170 GMAC/s on two cores). Here the scale and offset go into the weights once per
// panel, and the tiles add up the whole row in float32 themselves. Not row-invariant, so
// exact passes (verification, batched decoding) never take it; prefill need not be, since a
// request's prefill runs the same way alone or in a batch.
//
// Tiles 0-3: sums [16 weight rows][16 rows] float32 for up to 4 tiles of 16 rows; 4: one block
// of the panel's weights [16 weight rows][32 inputs]; 5, 6: one block of 16 rows' inputs in
// pairs [16 pairs][16 rows x 2] (TDPBF16PS's layout for its second operand).
inline void configure_bf16_tiles() {
  TileConfig config;
  for (int t = 0; t < 7; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// T tiles of 16 rows (1..4) against one panel over blocks [b0, b1): `weights` [16][K] bfloat16,
// `pairs` the first tile's blocks (each block 512 values, tiles nb * 512 apart); sums [T][16][16]
// float32, which the products add to where `accumulate` (the earlier blocks' sums: float32
// in and out exactly, so a product split over block ranges has the bits of one over all).
template <int T>
inline void bf16_panel_products(const uint16_t* weights, int64_t K, const uint16_t* pairs, int64_t nb, int64_t b0,
                                int64_t b1, bool accumulate, float* sums) {
  static_assert(T >= 1 && T <= 4, "four sum tiles");
  const int64_t tile = nb * 512;
  if (accumulate) {
    _tile_loadd(0, sums, 64);
    if constexpr (T > 1) _tile_loadd(1, sums + 256, 64);
    if constexpr (T > 2) _tile_loadd(2, sums + 512, 64);
    if constexpr (T > 3) _tile_loadd(3, sums + 768, 64);
  } else {
    _tile_zero(0);
    if constexpr (T > 1) _tile_zero(1);
    if constexpr (T > 2) _tile_zero(2);
    if constexpr (T > 3) _tile_zero(3);
  }
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* block = pairs + b * 512;
    _tile_loadd(4, weights + b * kBlock, K * 2);
    _tile_loadd(5, block, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (T > 1) {
      _tile_loadd(6, block + tile, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (T > 2) {
      _tile_loadd(5, block + 2 * tile, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (T > 3) {
      _tile_loadd(6, block + 3 * tile, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, sums, 64);
  if constexpr (T > 1) _tile_stored(1, sums + 256, 64);
  if constexpr (T > 2) _tile_stored(2, sums + 512, 64);
  if constexpr (T > 3) _tile_stored(3, sums + 768, 64);
}

// x [M, K] bfloat16 in TDPBF16PS's pair layout: per tile of 16 rows and block of 32 inputs, 512
// values, input 2p + h of row r at 32 p + 2 r + h; rows past M are zero.
at::Tensor input_pairs(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock, tiles = (M + 15) / 16;
  at::Tensor pairs = at::empty({tiles * nb * 512}, at::kShort);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());  // a pair of inputs as one 32-bit word
  uint32_t* pp = reinterpret_cast<uint32_t*>(pairs.data_ptr());
  at::parallel_for(0, tiles * nb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / nb, b = i % nb;
      uint32_t* out = pp + i * 256;
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t m = t * 16 + r;
        for (int64_t p = 0; p < 16; ++p) out[16 * p + r] = m < M ? xp[m * (K / 2) + b * 16 + p] : 0;
      }
    }
  });
  return pairs;
}

// bf16_row for the tile products: the same values by AVX-512 BF16's conversion (rounded to
// nearest even as well; it would flush denormals, which code * scale + offset from float16
// scales and offsets does not reach in practice), 32 at a time: the weights are turned to bf16
// once per product, which at a prefill chunk's rows is a third of its time.
template <bool Int4>
inline void panel_row(const uint8_t* row, const uint16_t* scale, const uint16_t* offset, int64_t nb, int64_t b0,
                      int64_t b1, uint16_t* out) {
#ifdef __AVX512BF16__
  int64_t b = b0;
  if constexpr (Int4) {
    // Whole groups at once: the group's four 64-byte runs (byte 64c + 4l + j: inputs 4c + j
    // and 16 + 4c + j of block l) transposed so that each block's 16 bytes are together, as
    // block_codes gathers them one block at a time, and its 16 scales and offsets converted
    // in one step each. The same values as the loop below, about 1.5x as fast.
    alignas(64) uint8_t blocks[4][64];  // blocks[i][16k .. 16k + 16): block 4k + i of the group
    alignas(64) float scales[kGroup], offsets[kGroup];
    const __m128i low = _mm_set1_epi8(0x0F);
    for (; b < std::min(b1, grouped_blocks(nb)); b += kGroup) {
      const uint8_t* group = row + b * 16;
      const __m512i r0 = _mm512_loadu_si512(group), r1 = _mm512_loadu_si512(group + 64);
      const __m512i r2 = _mm512_loadu_si512(group + 128), r3 = _mm512_loadu_si512(group + 192);
      const __m512i t0 = _mm512_unpacklo_epi32(r0, r1), t1 = _mm512_unpackhi_epi32(r0, r1);
      const __m512i t2 = _mm512_unpacklo_epi32(r2, r3), t3 = _mm512_unpackhi_epi32(r2, r3);
      _mm512_store_si512(blocks[0], _mm512_unpacklo_epi64(t0, t2));
      _mm512_store_si512(blocks[1], _mm512_unpackhi_epi64(t0, t2));
      _mm512_store_si512(blocks[2], _mm512_unpacklo_epi64(t1, t3));
      _mm512_store_si512(blocks[3], _mm512_unpackhi_epi64(t1, t3));
      _mm512_store_ps(scales, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + b))));
      _mm512_store_ps(offsets, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + b))));
      for (int64_t l = 0; l < kGroup; ++l) {
        const __m128i codes = _mm_load_si128(reinterpret_cast<const __m128i*>(blocks[l % 4] + 16 * (l / 4)));
        const __m512 s = _mm512_set1_ps(scales[l]), o = _mm512_set1_ps(offsets[l]);
        auto values = [&](__m128i c) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c)), s, o); };
        const __m128i first = _mm_and_si128(codes, low), second = _mm_and_si128(_mm_srli_epi16(codes, 4), low);
        const __m512bh pair = _mm512_cvtne2ps_pbh(values(second), values(first));
        _mm512_storeu_si512(out + (b + l) * kBlock, reinterpret_cast<const __m512i&>(pair));
      }
    }
  }
  for (; b < b1; ++b) {
    const BlockCodes codes = block_codes<Int4>(row, b, nb);
    const __m512 s = _mm512_set1_ps(half_to_float(scale[b]));
    const __m512 o = _mm512_set1_ps(Int4 ? half_to_float(offset[b]) : 0.0f);
    auto values = [&](__m128i c) {
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(Int4 ? _mm512_cvtepu8_epi32(c) : _mm512_cvtepi8_epi32(c)), s, o);
    };
    const __m512bh pair = _mm512_cvtne2ps_pbh(values(codes.second), values(codes.first));
    _mm512_storeu_si512(out + b * kBlock, reinterpret_cast<const __m512i&>(pair));
  }
#else
  bf16_row<Int4>(row, scale, offset, nb, out);  // the whole row, whatever the range: the buffer holds other panels' between ranges
  (void)b0, (void)b1;
#endif
}

// 16 rows of 16 floats transposed in registers: r[i][j] becomes r[j][i]. (A gather per output
// row measured slower than the scalar loop it replaced: gathers are slow on these Xeons.)
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane k: r[2i][4k], r[2i+1][4k], r[2i][4k+1], r[2i+1][4k+1] / ...+2, +3
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], lane k: rows 4i..4i+3 at column 4k + j
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {  // column 4k + j: lane k of u[j], u[4 + j], u[8 + j], u[12 + j]
    const __m512 ab_low = _mm512_shuffle_f32x4(u[j], u[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 ab_high = _mm512_shuffle_f32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 cd_low = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 cd_high = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
    r[j] = _mm512_shuffle_f32x4(ab_low, cd_low, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + j] = _mm512_shuffle_f32x4(ab_low, cd_low, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + j] = _mm512_shuffle_f32x4(ab_high, cd_high, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + j] = _mm512_shuffle_f32x4(ab_high, cd_high, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// A sums tile ([16 weight rows][16 rows] float32) out as bfloat16 rows: + bias, then rounded to
// nearest even exactly as c10's float -> BFloat16 (NaN to 0x7FC0); `rows` rows, `mask`'s
// columns, row r at out + r * N. (One value at a time this took about a quarter of a 128-row
// chunk's product time.)
inline void store_bf16_tile(const float* sums, __m512 bias, __mmask16 mask, int64_t rows, at::BFloat16* out, int64_t N) {
  __m512 v[16];
  for (int c = 0; c < 16; ++c) v[c] = _mm512_load_ps(sums + 16 * c);
  transpose16(v);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 value = _mm512_add_ps(v[r], bias);
    const __m512i bits = _mm512_castps_si512(value);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(out + r * N, mask, _mm512_cvtepi32_epi16(rounded));
  }
}

template <bool Int4>
void prefill_panels(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                    const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = K / kBlock, row_bytes = Int4 ? K / 2 : K;
  const int64_t tiles = (M + 15) / 16, panel_count = (N + 15) / 16;
  const at::Tensor pairs = input_pairs(x);
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(pairs.data_ptr());
  const uint8_t* wp = raw<uint8_t>(codes);
  const uint16_t* sp = raw<uint16_t>(scale);
  const uint16_t* op = Int4 ? raw<uint16_t>(offset) : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // Inputs in ranges of blocks whose pairs fit a core's L2 (2 MB on these Xeons) with room to
  // spare: every panel reads the whole range's pairs, which for the 8960-wide down projection
  // at 128 rows (2.3 MB in all) came from L3 for every panel. Sums carry over between ranges.
  const int64_t range = std::max<int64_t>(kGroup, (kPrefillRangeBytes / (tiles * 16 * 64)) / kGroup * kGroup);
  at::parallel_for(0, panel_count, 1, [&](int64_t begin, int64_t end) {
    uint16_t* weights = static_cast<uint16_t*>(std::aligned_alloc(64, sizeof(uint16_t) * 16 * K));
    const bool ranged = range < nb;
    float* partial = ranged ? static_cast<float*>(std::aligned_alloc(64, sizeof(float) * (end - begin) * tiles * 256)) : nullptr;
    alignas(64) float sums[4 * 256];
    configure_bf16_tiles();
    for (int64_t b0 = 0; b0 < nb; b0 += range) {
      const int64_t b1 = std::min(nb, b0 + range);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * 16, cols = std::min<int64_t>(16, N - n0);
        const __mmask16 column_mask = static_cast<__mmask16>((1u << cols) - 1);
        const __m512 panel_bias = bias ? _mm512_maskz_loadu_ps(column_mask, bias + n0) : _mm512_setzero_ps();
        for (int64_t c = 0; c < 16; ++c) {
          if (c < cols) panel_row<Int4>(wp + (n0 + c) * row_bytes, sp + (n0 + c) * nb, Int4 ? op + (n0 + c) * nb : nullptr, nb, b0, b1, weights + c * K);
          else std::memset(weights + c * K + b0 * kBlock, 0, sizeof(uint16_t) * (b1 - b0) * kBlock);
        }
        for (int64_t t0 = 0; t0 < tiles; t0 += 4) {
          const int64_t count = std::min<int64_t>(4, tiles - t0);
          const uint16_t* first = pp + t0 * nb * 512;
          float* carried = ranged ? partial + ((p - begin) * tiles + t0) * 256 : sums;  // this range's sums
          switch (count) {
            case 1: bf16_panel_products<1>(weights, K, first, nb, b0, b1, b0 > 0, carried); break;
            case 2: bf16_panel_products<2>(weights, K, first, nb, b0, b1, b0 > 0, carried); break;
            case 3: bf16_panel_products<3>(weights, K, first, nb, b0, b1, b0 > 0, carried); break;
            default: bf16_panel_products<4>(weights, K, first, nb, b0, b1, b0 > 0, carried); break;
          }
          if (b1 < nb) continue;
          for (int64_t t = 0; t < count; ++t)
            store_bf16_tile(carried + 256 * t, panel_bias, column_mask, std::min<int64_t>(16, M - (t0 + t) * 16),
                            yp + (t0 + t) * 16 * N + n0, N);
        }
      }
    }
    _tile_release();
    std::free(weights);
    std::free(partial);
  });
}
#endif

// The checks every entry point makes of a packed weight for K inputs (and of its bias, if any):
// `name` starts each message.
void check_packed(const char* name, int64_t K, const at::Tensor& codes, const at::Tensor& scale,
                  const at::Tensor& offset, const at::Tensor& bias, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, name, ": bits must be 4 or 8");
  TORCH_CHECK(K % kBlock == 0 && codes.is_contiguous() && codes.dim() == 2 && codes.size(1) == (bits == 4 ? K / 2 : K),
              name, ": codes shape");
  const int64_t N = codes.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.numel() == N * (K / kBlock),
              name, ": scale must be float16 [N, K/32]");
  TORCH_CHECK(bits == 8 || (offset.scalar_type() == at::kHalf && offset.is_contiguous() && offset.numel() == N * (K / kBlock)),
              name, ": offset must be float16 [N, K/32]");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == N), name, ": bias must be float32 [N]");
}

}  // namespace

// Prefill products (x: bfloat16 [M, K]; the rest as qgemm's) by bfloat16 tile products where
// AMX runs (prefill_panels): about what a dense bf16 product costs, without a dense copy of
// the weights. Not row-invariant: only for passes that need not be exact.
at::Tensor prefill_qgemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                         const at::Tensor& bias, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0 && x.scalar_type() == at::kBFloat16,
              "prefill_qgemm: x must be bfloat16 [rows, K] with K a multiple of 32");
  check_packed("prefill_qgemm", x.size(1), codes, scale, offset, bias, bits);
#ifdef SPIRIT_AMX
  TORCH_CHECK(amx_granted(), "prefill_qgemm: the OS did not grant the AMX tile registers");
  const int64_t N = codes.size(0);
  const at::Tensor rows = x.contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  const float* bias_ptr = bias.numel() ? bias.data_ptr<float>() : nullptr;
  if (bits == 4) prefill_panels<true>(rows, codes, scale, offset, bias_ptr, y);
  else prefill_panels<false>(rows, codes, scale, offset, bias_ptr, y);
  return y;
#else
  TORCH_CHECK(false, "prefill_qgemm: this build has no AMX tile products");
#endif
}

// x: float32 or bfloat16 [M, K]; codes/scale/offset as above; bias: float32 [N] or empty;
// panels: the same weight in tile order (tile_panels in model/qgemm.py) or empty. Returns
// [M, N] in x's dtype (bfloat16 rounded to nearest even from the float32 sums). With panels,
// on a CPU with AMX, products of many rows take the tile path: the same bits, faster.
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                 const at::Tensor& bias, int64_t bits, const at::Tensor& panels) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "qgemm: x must be [rows, K] with K a multiple of 32");
  const int64_t K = x.size(1), N = codes.size(0);
  check_packed("qgemm", K, codes, scale, offset, bias, bits);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qgemm: x must be float32 or bfloat16");
  const int64_t grouped = grouped_blocks(K / kBlock);
  const int64_t panel_bytes = grouped * (bits == 4 ? 256 + 64 : 512 + 32);
  TORCH_CHECK(panels.numel() == 0 || (panels.scalar_type() == at::kByte && panels.is_contiguous() &&
                                      panels.numel() == (N + 15) / 16 * panel_bytes),
              "qgemm: panels must be uint8 [ceil(N/16), grouped blocks x ", bits == 4 ? 320 : 544, "] (tile_panels)");
  const at::Tensor rows = x.contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  const float* bias_ptr = bias.numel() ? bias.data_ptr<float>() : nullptr;
#ifdef SPIRIT_AMX
  const int64_t amx_min_rows = grouped < K / kBlock ? SPIRIT_AMX_MIN_ROWS_REMAINDER
                               : bits == 4 ? SPIRIT_AMX_MIN_ROWS_INT4 : SPIRIT_AMX_MIN_ROWS_INT8;
  if (panels.numel() > 0 && grouped > 0 && x.size(0) >= amx_min_rows && amx_granted()) {
    if (x.scalar_type() == at::kFloat) {
      const QuantizedRows xq = quantize_rows<float>(rows, false);
      if (bits == 4) gemm_amx<true, float>(xq, codes, scale, offset, panels, bias_ptr, y);
      else gemm_amx<false, float>(xq, codes, scale, offset, panels, bias_ptr, y);
    } else {
      const QuantizedRows xq = quantize_rows<at::BFloat16>(rows, false);
      if (bits == 4) gemm_amx<true, at::BFloat16>(xq, codes, scale, offset, panels, bias_ptr, y);
      else gemm_amx<false, at::BFloat16>(xq, codes, scale, offset, panels, bias_ptr, y);
    }
    return y;
  }
#endif
  if (x.scalar_type() == at::kFloat) {
    const QuantizedRows xq = quantize_rows<float>(rows);
    if (bits == 4) gemm<true, float>(xq, codes, scale, offset, bias_ptr, y);
    else gemm<false, float>(xq, codes, scale, offset, bias_ptr, y);
  } else {
    const QuantizedRows xq = quantize_rows<at::BFloat16>(rows);
    if (bits == 4) gemm<true, at::BFloat16>(xq, codes, scale, offset, bias_ptr, y);
    else gemm<false, at::BFloat16>(xq, codes, scale, offset, bias_ptr, y);
  }
  return y;
}

// Whether products of many rows take AMX tile products here (built for a CPU with AMX, and
// granted the tile registers by the OS).
bool amx() {
#ifdef SPIRIT_AMX
  return amx_granted();
#else
  return false;
#endif
}

// The instruction set this build uses for the integer dot products (reported to users).
std::string isa() {
#if defined(SPIRIT_WIDE)
  return "avx512-vnni";
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni-256";
#elif defined(__AVXVNNI__)
  return "avx-vnni";
#else
  return "avx2";
#endif
}

// The packed weight as a dense [N, K] bfloat16 matrix (prefill: a many-row product runs faster
// as a bf16 matrix product on CPUs with AVX-512 BF16 than as integer dot products; model/fused.py
// measures which). w = code * scale + offset (int4) or code * scale (int8), in float32, rounded once.
// `out`: bfloat16 [N, K], written in place (a buffer kept by the caller: a fresh 50 MB tensor
// per call costs more in page faults than the conversion itself).
void dequantize(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset, at::Tensor& out, int64_t bits) {
  const int64_t in_features = out.size(1);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(0) == codes.size(0),
              "dequantize: out must be contiguous bfloat16 [N, K]");
  check_packed("dequantize", in_features, codes, scale, offset, at::Tensor(), bits);
  const int64_t N = codes.size(0), K = in_features, nb = K / kBlock;
  const uint8_t* cp = raw<uint8_t>(codes);
  const uint16_t* sp = raw<uint16_t>(scale);
  const uint16_t* op = bits == 4 ? raw<uint16_t>(offset) : nullptr;
  uint16_t* wp = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t row_bytes = bits == 4 ? K / 2 : K;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (bits == 4) bf16_row<true>(cp + n * row_bytes, sp + n * nb, op + n * nb, nb, wp + n * K);
      else bf16_row<false>(cp + n * row_bytes, sp + n * nb, nullptr, nb, wp + n * K);
    }
  });
}
