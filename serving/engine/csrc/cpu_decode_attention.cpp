// Decode and verify attention on CPU, read in place from the paged KV cache (built and loaded by
// serving/engine/cpu_attention.py; plain C ABI, called through ctypes, so no torch headers are needed).
//
// A few query tokens per sequence: one in a decode step, k + 1 in a speculative verify step. The gather path
// copies a group's context blocks into one [G, Hkv, K, D] tensor and runs SDPA on the copy, so every key and
// value is read twice and written once. Here each sequence's keys and values are read where they sit in the
// block pool, a cache block at a time: the block's keys for the scores of every query row (query token x head),
// then, after the softmax, its values. GQA: the n_rep query heads of a KV head read the same keys and values.
// Causal: query token j of a sequence sits at position q_start + j and sees keys 0 .. q_start + j.
//
// fp32 only. Two-pass softmax: scores are scaled, the row maximum is subtracted, and the output is divided by
// the row's sum once at the end. Differences from SDPA are summation order and the exponential below (relative
// error under 2e-7).
//
// Everything walks the cache in its own order, row by row inside a block, and requests the sequence's next
// block as it goes: once the KV cache outgrows the CPU's caches (32 sequences of the demo target) memory, not
// arithmetic, decides the time, and a head-by-head walk of each block measured 1.6x slower there. With AVX2 and
// FMA (x86-64-v3 and later) the scores of each key are computed eight query rows at a time with one horizontal
// reduction for all eight, where the head dimension is a multiple of 8 and the query heads a multiple of 8;
// elsewhere (other shapes, other CPUs, or SPECDEPLOY_GENERIC defined, which the tests use to check that path
// too) plain loops that the compiler vectorizes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && !defined(SPECDEPLOY_GENERIC)
#include <immintrin.h>
#define SPECDEPLOY_AVX2 1
#endif

namespace {

// e^x for x <= 0: x = n ln2 + f with |f| <= ln2/2, e^x = 2^n e^f, e^f by its Taylor series to f^7 (the first
// term left out is below 6e-9 relative on that interval). ln2 is split in two so that f keeps its low bits.
// Written without library calls so that the loop over a row's scores vectorizes.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // e^-87 is still a normal float; below it the result would underflow anyway
  const float n = std::floor(x * 1.4426950408889634f + 0.5f);
  const float f = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n as a float's exponent field
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// Cache blocks sit anywhere in the pool, so the hardware prefetcher loses the stream at every block boundary
// (measured: a third of the kernel's time once the cache no longer fits the CPU's caches). Row i of the
// sequence's next block is requested while row i of the current one is read.
inline void prefetch(const float* from, int64_t floats) {
  for (int64_t f = 0; f < floats; f += 16) __builtin_prefetch(from + f);  // one request per 64-byte line
}

struct Shape {
  int64_t n_kv_heads, n_rep, head_dim, block_size;
  int64_t num_rows;  // query rows of a sequence: its query tokens x query heads, row r = token * Hq + head
  const int64_t* kv_offset;  // per row, where its KV head starts in a token's row of keys or values (floats)
};

// scores[r * stride + i] = q_r . key_i for the n keys of one block, every query row r.
// next: the sequence's next block (nullptr if none), whose rows are requested as this block's are read.
template <int kDim>
void block_scores(const float* qs, const float* block, int64_t n, float* scores, int64_t stride, const float* next,
                  int64_t next_n, const Shape& s) {
  const int64_t dim = kDim > 0 ? kDim : s.head_dim, token_stride = s.n_kv_heads * dim;
#ifdef SPECDEPLOY_AVX2
  if constexpr (kDim > 0 && kDim % 8 == 0) {
    if (s.n_kv_heads * s.n_rep % 8 == 0) {  // then eight consecutive rows belong to one query token
      constexpr int kChunks = kDim / 8;
      for (int64_t i = 0; i < n; ++i) {  // key by key (cache order), eight query rows at a time
        const float* key_row = block + i * token_stride;
        if (i < next_n) prefetch(next + i * token_stride, token_stride);
        for (int64_t r0 = 0; r0 < s.num_rows; r0 += 8) {
          __m256 part[8];
          for (int u = 0; u < 8; ++u) {
            const float* key = key_row + s.kv_offset[r0 + u];
            const float* qr = qs + (r0 + u) * kDim;
            part[u] = _mm256_mul_ps(_mm256_loadu_ps(qr), _mm256_loadu_ps(key));
            for (int c = 1; c < kChunks; ++c)
              part[u] = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * c), _mm256_loadu_ps(key + 8 * c), part[u]);
          }
          // hadd adds neighbours within each 128-bit half: two rounds leave, per half, the sums of 4 rows
          const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(part[0], part[1]), _mm256_hadd_ps(part[2], part[3]));
          const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(part[4], part[5]), _mm256_hadd_ps(part[6], part[7]));
          alignas(32) float sums[8];
          _mm256_store_ps(sums, _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                              _mm256_permute2f128_ps(s0123, s4567, 0x31)));
          for (int u = 0; u < 8; ++u) scores[(r0 + u) * stride + i] = sums[u];
        }
      }
      return;
    }
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const float* key_row = block + i * token_stride;
    if (i < next_n) prefetch(next + i * token_stride, token_stride);
    for (int64_t r = 0; r < s.num_rows; ++r) {
      const float* key = key_row + s.kv_offset[r];
      const float* qr = qs + r * dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qr[d] * key[d];
      scores[r * stride + i] = dot;
    }
  }
}

// acc_r += sum_i p[r * stride + i] value_i over the n values of one block, every query row r.
template <int kDim>
void block_values(const float* p, int64_t stride, const float* block, int64_t n, float* acc, const float* next,
                  int64_t next_n, const Shape& s) {
  const int64_t dim = kDim > 0 ? kDim : s.head_dim, token_stride = s.n_kv_heads * dim;
  for (int64_t i = 0; i < n; ++i) {
    const float* value_row = block + i * token_stride;
    if (i < next_n) prefetch(next + i * token_stride, token_stride);
    for (int64_t r = 0; r < s.num_rows; ++r) {
      const float weight = p[r * stride + i];
      const float* value = value_row + s.kv_offset[r];
      float* o = acc + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] += weight * value[d];
    }
  }
}

struct Scratch {  // grown to the longest sequence of a call, reused across its sequences
  std::vector<float> scores, scaled_q, inv_sum;
};

// Rows of one query token run over the query heads, n_rep per KV head (computed once per call: an integer
// division per row and key cost more than the arithmetic it indexes).

// One sequence: its query tokens (token j at q + j * q_stride, heads contiguous), first query position q_start,
// block table and length len (keys it holds after this step); out [tokens, Hq, D] contiguous.
// kDim > 0 fixes the head dimension at compile time (the inner loops then unroll and vectorize); 0 = runtime.
template <int kDim>
void attend_one(const float* q, int64_t q_stride, int64_t num_tokens, int64_t q_start, const float* k_pool,
                const float* v_pool, const int64_t* table, int64_t len, float* out, const Shape& s, float scale,
                Scratch& scratch) {
  const int64_t dim = kDim > 0 ? kDim : s.head_dim;
  const int64_t hq = s.n_kv_heads * s.n_rep, rows = s.num_rows, bs = s.block_size;
  const int64_t block_floats = bs * s.n_kv_heads * dim;
  scratch.scores.resize(static_cast<size_t>(rows * len));
  scratch.scaled_q.resize(static_cast<size_t>(rows * dim));
  scratch.inv_sum.resize(static_cast<size_t>(rows));
  float* sc = scratch.scores.data();
  float* qs = scratch.scaled_q.data();
  for (int64_t j = 0; j < num_tokens; ++j)
    for (int64_t i = 0; i < hq * dim; ++i) qs[j * hq * dim + i] = q[j * q_stride + i] * scale;

  // scores[r, t] = q_r . k_t, a block at a time, each key read once for every query row
  for (int64_t start = 0, b = 0; start < len; start += bs, ++b) {
    const int64_t n = std::min(bs, len - start);
    // the last block of keys requests the first block of values
    const bool more = start + bs < len;
    const float* next = more ? k_pool + table[b + 1] * block_floats : v_pool + table[0] * block_floats;
    const int64_t next_n = more ? std::min(bs, len - start - bs) : std::min(bs, len);
    block_scores<kDim>(qs, k_pool + table[b] * block_floats, n, sc + start, len, next, next_n, s);
  }

  // softmax numerators in place over the keys each row sees; the keys after them get weight 0, and the division
  // by each row's sum is left to the output
  for (int64_t r = 0; r < rows; ++r) {
    float* row = sc + r * len;
    const int64_t seen = std::min(q_start + r / hq + 1, len);  // a padding token past len sees every key
    float top = row[0];
    for (int64_t t = 1; t < seen; ++t) top = std::max(top, row[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < seen; ++t) {
      const float e = exp_nonpositive(row[t] - top);
      row[t] = e;
      sum += e;
    }
    for (int64_t t = seen; t < len; ++t) row[t] = 0.0f;
    scratch.inv_sum[r] = 1.0f / sum;
  }

  // out[r] = sum_t p[r, t] v_t, again a block at a time
  std::fill(out, out + rows * dim, 0.0f);
  for (int64_t start = 0, b = 0; start < len; start += bs, ++b) {
    const int64_t n = std::min(bs, len - start);
    const bool more = start + bs < len;
    const float* next = more ? v_pool + table[b + 1] * block_floats : nullptr;
    block_values<kDim>(sc + start, len, v_pool + table[b] * block_floats, n, out, next,
                       more ? std::min(bs, len - start - bs) : 0, s);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * dim;
    const float inv = scratch.inv_sum[r];
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
  }
}

template <int kDim>
void attend_all(const float* q, int64_t q_stride, int64_t num_tokens, const int64_t* q_start, const float* k_pool,
                const float* v_pool, const int64_t* tables, int64_t table_stride, const int64_t* lens, float* out,
                int64_t num_seqs, Shape s, float scale) {
  Scratch scratch;
  const int64_t hq = s.n_kv_heads * s.n_rep;
  s.num_rows = num_tokens * hq;
  std::vector<int64_t> kv_offset(static_cast<size_t>(s.num_rows));
  for (int64_t r = 0; r < s.num_rows; ++r) kv_offset[r] = r % hq / s.n_rep * s.head_dim;
  s.kv_offset = kv_offset.data();
  const int64_t out_stride = s.num_rows * s.head_dim;
  for (int64_t g = 0; g < num_seqs; ++g)
    attend_one<kDim>(q + g * num_tokens * q_stride, q_stride, num_tokens, q_start[g], k_pool, v_pool,
                     tables + g * table_stride, lens[g], out + g * out_stride, s, scale, scratch);
}

}  // namespace

// q: query token j of sequence g at q + (g * num_tokens + j) * q_stride, its Hq = n_kv_heads * n_rep heads of
// head_dim floats contiguous. q_start[g]: position of the sequence's first query token (token j sits at
// q_start[g] + j and sees the keys up to it; tokens past lens[g] are padding, their output is not meant to be
// used). k_pool, v_pool: [num_blocks, block_size, n_kv_heads, head_dim] contiguous. tables: row g at
// tables + g * table_stride, the sequence's cache blocks in order. lens[g]: keys the sequence holds after this
// step (>= 1). out: [num_seqs, num_tokens, Hq, head_dim] contiguous.
// Returns 0, or 1 if a length is not positive (nothing is written then).
extern "C" int specdeploy_decode_attention_f32(const float* q, int64_t q_stride, int64_t num_tokens,
                                               const int64_t* q_start, const float* k_pool, const float* v_pool,
                                               const int64_t* tables, int64_t table_stride, const int64_t* lens,
                                               float* out, int64_t num_seqs, int64_t n_kv_heads, int64_t n_rep,
                                               int64_t head_dim, int64_t block_size, float scale) {
  for (int64_t g = 0; g < num_seqs; ++g)
    if (lens[g] <= 0) return 1;
  const Shape s{n_kv_heads, n_rep, head_dim, block_size, 0, nullptr};
  switch (head_dim) {
    case 32:
      attend_all<32>(q, q_stride, num_tokens, q_start, k_pool, v_pool, tables, table_stride, lens, out, num_seqs, s,
                     scale);
      break;
    case 64:
      attend_all<64>(q, q_stride, num_tokens, q_start, k_pool, v_pool, tables, table_stride, lens, out, num_seqs, s,
                     scale);
      break;
    case 128:
      attend_all<128>(q, q_stride, num_tokens, q_start, k_pool, v_pool, tables, table_stride, lens, out, num_seqs, s,
                      scale);
      break;
    default:
      attend_all<0>(q, q_stride, num_tokens, q_start, k_pool, v_pool, tables, table_stride, lens, out, num_seqs, s,
                    scale);
  }
  return 0;
}
