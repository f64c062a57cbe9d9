// The small per-token pieces of a decoder layer, one call each: RMSNorm, the rotary embedding
// with the KV cache write, row-wise attention over cache slots, and SwiGLU's gate.
//
// Why: in a decoding step of a low-bit target the weights cost ~35 ms (qgemm.cpp) and running
// transformers' modules around them another ~18 ms: about 60 small aten ops per layer, each a
// few to a hundred microseconds of dispatch, allocation and (for one-row bf16 attention matmuls)
// slow generic paths. These functions do the same arithmetic in one call per piece.
//
// Row-invariant by construction, as exact speculation needs (model/attention.py): every row is
// computed alone, by the same operations in the same order whatever the number of rows, so a
// verification row gets the bits a one-token step gets. Sums run in float32 in a fixed order
// (8 lanes, two accumulators, then one fixed horizontal sum); outputs round once to the
// activation dtype (bfloat16 rounds to nearest even).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// float -> bf16 rounded to nearest even, as c10::BFloat16's conversion does (NaN stays a NaN)
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  // pack the low halves of the 32-bit lanes into 8 x 16 bits
  const __m128i lo = _mm256_castsi256_si128(rounded), hi = _mm256_extracti128_si256(rounded, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum a[i] * b[i] over n (a multiple of 8) in float32, in one fixed order
template <typename B>
inline float dot(const float* a, const B* b, int64_t n) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    even = _mm256_fmadd_ps(load8(a + i), load8(b + i), even);
    odd = _mm256_fmadd_ps(load8(a + i + 8), load8(b + i + 8), odd);
  }
  if (i < n) even = _mm256_fmadd_ps(load8(a + i), load8(b + i), even);
  return hsum(_mm256_add_ps(even, odd));
}

template <typename T>
inline float sum_of_squares(const T* x, int64_t n) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = load8(x + i), b = load8(x + i + 8);
    even = _mm256_fmadd_ps(a, a, even);
    odd = _mm256_fmadd_ps(b, b, odd);
  }
  float total = hsum(_mm256_add_ps(even, odd));
  for (; i < n; ++i) total = std::fma(static_cast<float>(x[i]), static_cast<float>(x[i]), total);
  return total;
}

// y = w * x / sqrt(mean(x^2) + eps), in float32, rounded once
template <typename T>
void rms_norm_row(const T* x, const T* w, float eps, int64_t n, float* y) {
  const float r = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(w[i]) * (static_cast<float>(x[i]) * r);
}

template <typename T>
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t M = x.size(0), H = x.size(1);
  at::Tensor y = at::empty_like(x);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t m = begin; m < end; ++m) {
      rms_norm_row(xp + m * H, wp, static_cast<float>(eps), H, row.data());
      for (int64_t i = 0; i < H; ++i) yp[m * H + i] = static_cast<T>(row[i]);
    }
  });
  return y;
}

// One head vector, optionally RMS-normed per head (Qwen3's q_norm / k_norm), then rotated:
// out[i] = x[i] cos[i] - x[i+h] sin[i], out[i+h] = x[i+h] cos[i+h] + x[i] sin[i+h]  (h = d/2),
// the half-split layout of transformers' rotate_half.
template <typename T>
void rotate(const T* x, const T* norm, float eps, const T* cos, const T* sin, int64_t d, T* out) {
  float v[512];
  if (norm != nullptr) {
    rms_norm_row(x, norm, eps, d, v);
  } else {
    for (int64_t i = 0; i < d; ++i) v[i] = static_cast<float>(x[i]);
  }
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = v[i], b = v[i + h];
    out[i] = static_cast<T>(a * static_cast<float>(cos[i]) - b * static_cast<float>(sin[i]));
    out[i + h] = static_cast<T>(b * static_cast<float>(cos[i + h]) + a * static_cast<float>(sin[i + h]));
  }
}

struct CacheRows {
  std::vector<at::Tensor> keys, values;  // per cache: [1, kv_heads, capacity, head_dim]
  const int64_t* cache_of_row;           // [M]
};

template <typename T>
at::Tensor rope_write_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                           int64_t kv_heads, int64_t d, const at::Tensor& q_norm, const at::Tensor& k_norm,
                           double norm_eps, const CacheRows& caches, const at::Tensor& slot_of_row) {
  const int64_t M = qkv.size(0), width = qkv.size(1);
  at::Tensor q = at::empty({M, heads, d}, qkv.options());
  const T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const T* qn = q_norm.numel() ? q_norm.data_ptr<T>() : nullptr;
  const T* kn = k_norm.numel() ? k_norm.data_ptr<T>() : nullptr;
  const int64_t* slots = slot_of_row.data_ptr<int64_t>();
  T* qp = q.data_ptr<T>();
  const float eps = static_cast<float>(norm_eps);
  for (int64_t m = 0; m < M; ++m) {
    const T* row = xp + m * width;
    const T* c = cp + m * d;
    const T* s = sp + m * d;
    for (int64_t h = 0; h < heads; ++h) rotate(row + h * d, qn, eps, c, s, d, qp + (m * heads + h) * d);
    const int64_t which = caches.cache_of_row[m];
    const int64_t capacity = caches.keys[which].size(2);
    T* kc = caches.keys[which].data_ptr<T>();
    T* vc = caches.values[which].data_ptr<T>();
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t at = (h * capacity + slots[m]) * d;
      rotate(row + (heads + h) * d, kn, eps, c, s, d, kc + at);
      const T* v = row + (heads + kv_heads + h) * d;
      std::copy(v, v + d, vc + at);
    }
  }
  return q;
}

// The query heads that share one key/value head read each key and value row once for up to
// kHeadBlock of them (grouped-query attention: 6 query heads per key head in qwen2.5-1.5b).
// Each head's arithmetic is what it was with one head at a time, in the same order, so the
// bits are unchanged: `dot`'s two accumulators over 16 inputs, then the weighted sum of values
// 8 columns at a time over the slots in order.
constexpr int64_t kHeadBlock = 4;

// scores[g][j] = q_g . k_j * scale for G heads (queries [G][d] float32) and `count` keys
template <int G, typename T>
void head_scores(const float* queries, const T* kc, const int64_t* slots, int64_t count, int64_t d, float scale,
                 float* scores) {
  for (int64_t j = 0; j < count; ++j) {
    const T* k = kc + slots[j] * d;
    __m256 even[G], odd[G];
    for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
      const __m256 k0 = load8(k + i), k1 = load8(k + i + 8);
      for (int g = 0; g < G; ++g) {
        even[g] = _mm256_fmadd_ps(load8(queries + g * d + i), k0, even[g]);
        odd[g] = _mm256_fmadd_ps(load8(queries + g * d + i + 8), k1, odd[g]);
      }
    }
    if (i < d) {
      const __m256 k0 = load8(k + i);
      for (int g = 0; g < G; ++g) even[g] = _mm256_fmadd_ps(load8(queries + g * d + i), k0, even[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * count + j] = hsum(_mm256_add_ps(even[g], odd[g])) * scale;
  }
}

// acc[g][0..d) = sum over j of weights[g][j] * v_j, for G heads, 8 columns at a time
template <int G, typename T>
void weighted_values(const float* weights, const T* vc, const int64_t* slots, int64_t count, int64_t d, float* acc) {
  for (int64_t i = 0; i < d; i += 8) {
    __m256 sum[G];
    for (int g = 0; g < G; ++g) sum[g] = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; ++j) {
      const __m256 v = load8(vc + slots[j] * d + i);
      for (int g = 0; g < G; ++g) sum[g] = _mm256_fmadd_ps(_mm256_set1_ps(weights[g * count + j]), v, sum[g]);
    }
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(acc + g * d + i, sum[g]);
  }
}

template <typename T>
void block_scores(int G, const float* queries, const T* kc, const int64_t* slots, int64_t count, int64_t d, float scale,
                  float* scores) {
  switch (G) {
    case 1: head_scores<1>(queries, kc, slots, count, d, scale, scores); break;
    case 2: head_scores<2>(queries, kc, slots, count, d, scale, scores); break;
    case 3: head_scores<3>(queries, kc, slots, count, d, scale, scores); break;
    default: head_scores<4>(queries, kc, slots, count, d, scale, scores); break;
  }
}

template <typename T>
void block_values(int G, const float* weights, const T* vc, const int64_t* slots, int64_t count, int64_t d, float* acc) {
  switch (G) {
    case 1: weighted_values<1>(weights, vc, slots, count, d, acc); break;
    case 2: weighted_values<2>(weights, vc, slots, count, d, acc); break;
    case 3: weighted_values<3>(weights, vc, slots, count, d, acc); break;
    default: weighted_values<4>(weights, vc, slots, count, d, acc); break;
  }
}

// Each query row attends alone to its own slots (CSR: slots[offsets[m] .. offsets[m+1])) of its
// own cache: scores = q.k * scaling (optionally soft-capped), softmax and the weighted sum of
// values in float32, divided by the softmax's sum at the end, rounded once. A row with no slot
// is padding: zeros.
template <typename T>
at::Tensor attention_impl(const at::Tensor& q, const CacheRows& caches, const at::Tensor& offsets,
                          const at::Tensor& slots, double scaling, double softcap) {
  const int64_t M = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = caches.keys[0].size(1), groups = heads / kv_heads;
  at::Tensor out = at::zeros({M, heads * d}, q.options());
  const T* qp = q.data_ptr<T>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float scale = static_cast<float>(scaling), cap = static_cast<float>(softcap);
  at::parallel_for(0, M * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, queries(kHeadBlock * d), acc(kHeadBlock * d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / kv_heads, kvh = task % kv_heads;
      const int64_t first = off[m], count = off[m + 1] - off[m];
      if (count == 0) continue;
      const int64_t which = caches.cache_of_row[m];
      const int64_t capacity = caches.keys[which].size(2);
      const T* kc = caches.keys[which].data_ptr<T>() + kvh * capacity * d;
      const T* vc = caches.values[which].data_ptr<T>() + kvh * capacity * d;
      scores.resize(kHeadBlock * count);
      for (int64_t g0 = 0; g0 < groups; g0 += kHeadBlock) {
        const int G = static_cast<int>(std::min<int64_t>(kHeadBlock, groups - g0));
        const int64_t h0 = kvh * groups + g0;
        for (int64_t i = 0; i < G * d; ++i) queries[i] = static_cast<float>(qp[(m * heads + h0) * d + i]);
        block_scores<T>(G, queries.data(), kc, sl + first, count, d, scale, scores.data());
        float totals[kHeadBlock];
        for (int g = 0; g < G; ++g) {
          float* row = scores.data() + g * count;
          float top = -INFINITY;
          for (int64_t j = 0; j < count; ++j) {
            if (cap > 0.0f) row[j] = std::tanh(row[j] / cap) * cap;
            top = std::fmax(top, row[j]);
          }
          float total = 0.0f;
          for (int64_t j = 0; j < count; ++j) {
            row[j] = std::exp(row[j] - top);
            total += row[j];
          }
          totals[g] = total;
        }
        block_values<T>(G, scores.data(), vc, sl + first, count, d, acc.data());
        for (int g = 0; g < G; ++g) {
          const float inverse = 1.0f / totals[g];
          T* out_row = op + m * heads * d + (h0 + g) * d;
          for (int64_t i = 0; i < d; ++i) out_row[i] = static_cast<T>(acc[g * d + i] * inverse);
        }
      }
    }
  });
  return out;
}

// e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' expf polynomial (about 1
// ulp), 2^n from the exponent bits; x is clamped to [-87.3, 88.3], where e^x stays a normal float
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: r exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// SwiGLU's gate: [M, 2I] (gate, then up) -> silu(gate) * up, [M, I]; 8 at a time, the last
// fewer than 8 through the same vector code (a row's values do not depend on M)
template <typename T>
at::Tensor silu_mul_impl(const at::Tensor& gate_up) {
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({M, I}, gate_up.options());
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const __m256 one = _mm256_set1_ps(1.0f);
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* gate = gp + m * 2 * I;
      const T* up = gate + I;
      T* row = op + m * I;
      const auto silu_mul8 = [&](__m256 g, __m256 u) {
        return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))), u);
      };
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) store8(row + i, silu_mul8(load8(gate + i), load8(up + i)));
      if (i < I) {  // the last fewer than 8 through buffers
        const int64_t n = I - i;
        T g[8] = {}, u[8] = {}, y[8];
        for (int64_t j = 0; j < n; ++j) g[j] = gate[i + j], u[j] = up[i + j];
        store8(y, silu_mul8(load8(g), load8(u)));
        for (int64_t j = 0; j < n; ++j) row[i + j] = y[j];
      }
    }
  });
  return out;
}

CacheRows cache_rows(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                     const at::Tensor& cache_of_row, const at::Tensor& like, int64_t d) {
  TORCH_CHECK(!keys.empty() && keys.size() == values.size(), "layer_ops: one key and one value buffer per cache");
  for (size_t i = 0; i < keys.size(); ++i) {
    TORCH_CHECK(keys[i].is_contiguous() && values[i].is_contiguous() && keys[i].dim() == 4 &&
                    keys[i].sizes() == values[i].sizes() && keys[i].size(3) == d &&
                    keys[i].scalar_type() == like.scalar_type(),
                "layer_ops: caches must be contiguous [1, kv_heads, capacity, head_dim] in the activation dtype");
  }
  TORCH_CHECK(cache_of_row.scalar_type() == at::kLong && cache_of_row.is_contiguous(), "layer_ops: cache_of_row must be int64");
  const int64_t* which = cache_of_row.data_ptr<int64_t>();
  for (int64_t m = 0; m < cache_of_row.numel(); ++m)
    TORCH_CHECK(which[m] >= 0 && which[m] < static_cast<int64_t>(keys.size()), "layer_ops: cache index out of range");
  return {keys, values, which};
}

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "layer_ops: rows must be a contiguous [rows, features] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "layer_ops: float32 or bfloat16 only");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [features] in x's dtype");
  return x.scalar_type() == at::kFloat ? rms_norm_impl<float>(x, weight, eps) : rms_norm_impl<at::BFloat16>(x, weight, eps);
}

at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, const at::Tensor& q_norm, const at::Tensor& k_norm, double norm_eps,
                      const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                      const at::Tensor& cache_of_row, const at::Tensor& slot_of_row) {
  check_rows(qkv);
  const int64_t M = qkv.size(0);
  TORCH_CHECK(head_dim % 8 == 0 && head_dim <= 512 && heads % kv_heads == 0, "rope_write: unsupported head layout");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * head_dim, "rope_write: qkv must be [rows, (heads + 2 kv_heads) head_dim]");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->is_contiguous() && t->numel() == M * head_dim && t->scalar_type() == qkv.scalar_type(),
                "rope_write: cos and sin must be [rows, head_dim] in the activation dtype");
  for (const at::Tensor* t : {&q_norm, &k_norm})
    TORCH_CHECK(t->numel() == 0 || (t->numel() == head_dim && t->is_contiguous() && t->scalar_type() == qkv.scalar_type()),
                "rope_write: per-head norm weights must be [head_dim]");
  TORCH_CHECK(slot_of_row.scalar_type() == at::kLong && slot_of_row.numel() == M && cache_of_row.numel() == M,
              "rope_write: one cache and one slot per row");
  const CacheRows caches = cache_rows(keys, values, cache_of_row, qkv, head_dim);
  const int64_t* slots = slot_of_row.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(slots[m] >= 0 && slots[m] < caches.keys[caches.cache_of_row[m]].size(2), "rope_write: slot out of range");
  return qkv.scalar_type() == at::kFloat
             ? rope_write_impl<float>(qkv, cos, sin, heads, kv_heads, head_dim, q_norm, k_norm, norm_eps, caches, slot_of_row)
             : rope_write_impl<at::BFloat16>(qkv, cos, sin, heads, kv_heads, head_dim, q_norm, k_norm, norm_eps, caches,
                                             slot_of_row);
}

at::Tensor rowwise_attention(const at::Tensor& q, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                             const at::Tensor& cache_of_row, const at::Tensor& offsets, const at::Tensor& slots,
                             double scaling, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(2) % 8 == 0, "rowwise_attention: q must be [rows, heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "rowwise_attention: float32 or bfloat16 only");
  const int64_t M = q.size(0);
  const CacheRows caches = cache_rows(keys, values, cache_of_row, q, q.size(2));
  TORCH_CHECK(q.size(1) % caches.keys[0].size(1) == 0, "rowwise_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.numel() == M + 1 && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous() && offsets.is_contiguous(), "rowwise_attention: offsets [rows + 1] and slots int64");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[M] == slots.numel(), "rowwise_attention: offsets must span slots");
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(off[m + 1] >= off[m], "rowwise_attention: offsets must not decrease");
    const int64_t capacity = caches.keys[caches.cache_of_row[m]].size(2);
    for (int64_t j = off[m]; j < off[m + 1]; ++j)
      TORCH_CHECK(sl[j] >= 0 && sl[j] < capacity, "rowwise_attention: slot out of range");
  }
  return q.scalar_type() == at::kFloat ? attention_impl<float>(q, caches, offsets, slots, scaling, softcap)
                                       : attention_impl<at::BFloat16>(q, caches, offsets, slots, scaling, softcap);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must hold gate then up, [rows, 2 intermediate]");
  return gate_up.scalar_type() == at::kFloat ? silu_mul_impl<float>(gate_up) : silu_mul_impl<at::BFloat16>(gate_up);
}
