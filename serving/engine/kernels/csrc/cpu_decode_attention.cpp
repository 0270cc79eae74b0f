// Decode and verify attention on CPU, read in place from the paged KV cache (built and loaded by
// serving/engine/kernels/cpu_attention.py; plain C ABI, called through ctypes, so no torch headers are needed).
//
// A few query tokens per sequence: one in a decode step, k + 1 in a speculative verify step. The gather path
// copies a group's context blocks into one [G, Hkv, K, D] tensor and runs SDPA on the copy, so every key and
// value is read twice and written once. Here each sequence's keys and values are read where they sit in the
// block pool. GQA: the n_rep query heads of a KV head read the same keys and values. Causal: query token j of a
// sequence sits at position q_start + j and sees keys 0 .. q_start + j.
//
// fp32 only. Decoding sequences (and verifying ones of up to 3 query tokens) make one pass over the context, a
// cache block at a time, with the softmax kept online: the block's keys give the scores of every query row (query
// token x head), each row's running maximum and sum are updated (its output so far rescaled when the maximum
// grows), and the block's values are added at once. The output is divided by the row's sum at the end. The tiled
// walk below keeps two passes (scores, then values). Differences from SDPA are summation order and the
// exponential below (relative error under 2e-7).
//
// A group pads every sequence to its longest query; each sequence is walked over its own query tokens only, so a
// decoding sequence grouped with verifying ones costs what it would alone (its padding rows are written as zeros).
//
// The decode walk reads each block in cache order, row by row, and requests the block's values while it reads the
// keys and the next block's keys while it reads the values: once the KV cache outgrows the CPU's caches (32
// sequences of the demo target) memory, not arithmetic, decides the time, and a head-by-head walk of each block
// measured 1.6x slower there. With AVX2 and FMA (x86-64-v3 and later) the scores of each key are computed eight
// query rows at a time with one horizontal reduction for all eight, where the head dimension is a multiple of 8
// and the query heads a multiple of 8; elsewhere (other shapes, other CPUs, or SPECDEPLOY_GENERIC defined, which
// the tests use to check that path too) plain loops that the compiler vectorizes.
//
// Sequences of SPECDEPLOY_TILED_MIN_TOKENS (4) query tokens and more, with AVX2 and a head dimension that is a
// multiple of 32, take a tiled walk instead (attend_tiled): there a sequence's rows are many, and arithmetic, not
// memory, decides. It measured 0.67-0.85 of the decode walk's time at 4-13 tokens of one sequence and about the
// same at 16 sequences; at 3 tokens and 16-64 sequences the decode walk was faster.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && !defined(SPECDEPLOY_GENERIC)
#include <immintrin.h>
#define SPECDEPLOY_AVX2 1
#endif
#ifndef SPECDEPLOY_TILED_MIN_TOKENS
#define SPECDEPLOY_TILED_MIN_TOKENS 4
#endif

namespace {

// e^x for x <= 0: x = n ln2 + f with |f| <= ln2/2, e^x = 2^n e^f, e^f by its Taylor series to f^7 (the first
// term left out is below 6e-9 relative on that interval). ln2 is split in two so that f keeps its low bits.
// Written without library calls; exp_nonpositive8 below is the same on eight lanes.
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

#ifdef SPECDEPLOY_AVX2
// exp_nonpositive on eight lanes, the same steps. GCC 12 leaves the scalar one unvectorized in a loop (the float to
// int conversion and the bit copy), whatever the pragmas say; the softmax loops call this one with AVX2.
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.4426950408889634f), _mm256_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x));
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

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

struct Scratch {  // grown to the largest sequence of a call, reused across its sequences
  std::vector<float> scores, scaled_q, row_max, row_sum, inv_sum;
};

// e^(x[i] - top) in place for i < seen, 0 for seen <= i < n; returns their sum.
inline float exp_shifted(float* x, int64_t seen, int64_t n, float top) {
  float sum = 0.0f;
  int64_t t = 0;
#ifdef SPECDEPLOY_AVX2
  const __m256 m = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (; t + 8 <= seen; t += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + t), m));
    _mm256_storeu_ps(x + t, e);
    total = _mm256_add_ps(total, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  for (const float lane : lanes) sum += lane;
#endif
  for (; t < seen; ++t) {
    x[t] = exp_nonpositive(x[t] - top);
    sum += x[t];
  }
  for (; t < n; ++t) x[t] = 0.0f;
  return sum;
}

// Rows of one query token run over the query heads, n_rep per KV head (computed once per call: an integer
// division per row and key cost more than the arithmetic it indexes).

// One sequence: its query tokens (token j at q + j * q_stride, heads contiguous), first query position q_start,
// block table and length len (keys it holds after this step); out [tokens, Hq, D] contiguous.
// kDim > 0 fixes the head dimension at compile time (the inner loops then unroll and vectorize); 0 = runtime.
//
// One pass over the context, a cache block at a time, with the softmax kept online (as flash-decoding does): the
// block's keys give every row's scores, each row's running maximum and sum are updated (its output so far is
// rescaled when the maximum grows), and the block's values are added with the weights at once. Each block's keys
// and values are thus read back to back, and the scores never leave a block-sized buffer (a separate softmax
// pass over every row's whole score row took 0.47 of 3.1 ms at 32 decoding sequences of the demo target).
template <int kDim>
void attend_one(const float* q, int64_t q_stride, int64_t num_tokens, int64_t q_start, const float* k_pool,
                const float* v_pool, const int64_t* table, int64_t len, float* out, const Shape& s, float scale,
                Scratch& scratch) {
  const int64_t dim = kDim > 0 ? kDim : s.head_dim;
  const int64_t hq = s.n_kv_heads * s.n_rep, rows = s.num_rows, bs = s.block_size;
  const int64_t block_floats = bs * s.n_kv_heads * dim;
  scratch.scores.resize(static_cast<size_t>(rows * bs));
  scratch.scaled_q.resize(static_cast<size_t>(rows * dim));
  scratch.row_max.assign(static_cast<size_t>(rows), 0.0f);
  scratch.row_sum.assign(static_cast<size_t>(rows), 0.0f);
  float* sc = scratch.scores.data();
  float* qs = scratch.scaled_q.data();
  float* row_max = scratch.row_max.data();
  float* row_sum = scratch.row_sum.data();
  for (int64_t j = 0; j < num_tokens; ++j)
    for (int64_t i = 0; i < hq * dim; ++i) qs[j * hq * dim + i] = q[j * q_stride + i] * scale;
  std::fill(out, out + rows * dim, 0.0f);

  for (int64_t start = 0, b = 0; start < len; start += bs, ++b) {
    const int64_t n = std::min(bs, len - start);
    const float* keys = k_pool + table[b] * block_floats;
    const float* values = v_pool + table[b] * block_floats;
    // the keys request the block's values; the values request the next block's keys
    block_scores<kDim>(qs, keys, n, sc, bs, values, n, s);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = sc + r * bs;
      // keys this row sees in the block: query token r / hq sits at q_start + r / hq (a padding token past len
      // sees every key)
      const int64_t seen = std::clamp<int64_t>(std::min(q_start + r / hq + 1, len) - start, 0, n);
      if (seen == 0) {
        std::fill(row, row + n, 0.0f);
        continue;
      }
      float top = row[0];
      for (int64_t t = 1; t < seen; ++t) top = std::max(top, row[t]);
      if (start == 0) {
        row_max[r] = top;
      } else if (top > row_max[r]) {  // what was added so far was weighed against a smaller maximum
        const float shrink = exp_nonpositive(row_max[r] - top);
        row_sum[r] *= shrink;
        float* o = out + r * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] *= shrink;
        row_max[r] = top;
      }
      row_sum[r] += exp_shifted(row, seen, n, row_max[r]);
    }
    const bool more = start + bs < len;
    block_values<kDim>(sc, bs, values, n, out, more ? k_pool + table[b + 1] * block_floats : nullptr,
                       more ? std::min(bs, len - start - bs) : 0, s);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * dim;
    const float inv = 1.0f / row_sum[r];
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
  }
}

#ifdef SPECDEPLOY_AVX2
// The eight sums of a[0..7]'s lanes, in order, as one vector. hadd adds neighbours within each 128-bit half: two
// rounds leave, per half, the sums of 4 vectors; the halves are then added across.
inline __m256 lane_sums8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Several query tokens per sequence (a verify step). The decode walk above computes each score with its own
// loads of the query row and a horizontal reduction, and adds each value into the output in memory: bound by
// loads, stores and shuffles rather than arithmetic once a sequence has more than a few query rows (at 9 query
// tokens, kernel / gather + SDPA: 0.87 for one sequence and 0.99 for 16 with the decode walk, 0.73 and 0.76 with
// this one). Here one KV head at a time, with that head's rows (query token x its n_rep heads) transposed into
// vectors of 8:
//   scores, kept key-major (scores[t][r]): a tile of 4 keys x up to 24 rows is 12 accumulators, each step over
//           the head dim one broadcast per key and one load per row vector, no reductions;
//   softmax: maxima, exponentials and sums run across the rows' vector, key by key;
//   values: tiles of 3 rows x 32 dims held in twelve registers across the sequence's whole context, each value
//           chunk loaded once per tile and the output written once.
// The head's slice of the next block is requested while the current one is read.
constexpr int64_t kTileKeys = 4, kValueRows = 3, kValueDims = 32;


// scores[t][r] for the 4 keys at key[0..3] (n_keys of them real) and the row vectors v0 .. v0 + kVecs - 1
template <int kDim, int kVecs>
inline void score_tile(const float* qt, int64_t vrows, int64_t v0, const float* const* key, int64_t n_keys,
                       float* scores) {
  __m256 acc[kTileKeys][kVecs];
  for (auto& per_key : acc)
    for (auto& a : per_key) a = _mm256_setzero_ps();
  for (int d = 0; d < kDim; ++d) {
    __m256 qv[kVecs];
    for (int c = 0; c < kVecs; ++c) qv[c] = _mm256_loadu_ps(qt + d * vrows + (v0 + c) * 8);
    for (int u = 0; u < kTileKeys; ++u) {
      const __m256 k = _mm256_broadcast_ss(key[u] + d);
      for (int c = 0; c < kVecs; ++c) acc[u][c] = _mm256_fmadd_ps(k, qv[c], acc[u][c]);
    }
  }
  for (int64_t u = 0; u < n_keys; ++u)
    for (int c = 0; c < kVecs; ++c) _mm256_storeu_ps(scores + u * vrows + (v0 + c) * 8, acc[u][c]);
}

template <int kDim>
void attend_tiled(const float* q, int64_t q_stride, int64_t num_tokens, int64_t q_start, const float* k_pool,
                  const float* v_pool, const int64_t* table, int64_t len, float* out, const Shape& s, float scale,
                  Scratch& scratch) {
  static_assert(kDim > 0 && kDim % kValueDims == 0, "the tiled walk needs a head dim that is a multiple of 32");
  const int64_t hq = s.n_kv_heads * s.n_rep, bs = s.block_size, token_stride = s.n_kv_heads * kDim;
  const int64_t block_floats = bs * token_stride, num_blocks = (len + bs - 1) / bs;
  const int64_t rows = num_tokens * s.n_rep;  // of one KV head: row r = token r / n_rep, head h * n_rep + r % n_rep
  const int64_t vecs = (rows + 7) / 8, vrows = vecs * 8;
  const int64_t value_rows = (rows + kValueRows - 1) / kValueRows * kValueRows;  // whole value tiles
  scratch.scores.resize(static_cast<size_t>(len * vrows + kValueRows));  // the last tile may read past vrows
  scratch.scaled_q.resize(static_cast<size_t>(kDim * vrows));
  scratch.inv_sum.resize(static_cast<size_t>(2 * vrows));
  float* sc = scratch.scores.data();
  float* qt = scratch.scaled_q.data();
  float* sum = scratch.inv_sum.data();
  float* inv = sum + vrows;
  std::fill(sc + len * vrows, sc + len * vrows + kValueRows, 0.0f);

  for (int64_t h = 0; h < s.n_kv_heads; ++h) {
    const int64_t head_floats = h * kDim;
    std::fill(qt, qt + kDim * vrows, 0.0f);  // padding rows score 0 and are never written out
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = q + (r / s.n_rep) * q_stride + (h * s.n_rep + r % s.n_rep) * kDim;
      for (int64_t d = 0; d < kDim; ++d) qt[d * vrows + r] = src[d] * scale;
    }

    // scores[t][r] = q_r . k_t
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t start = b * bs, n = std::min(bs, len - start);
      const float* keys = k_pool + table[b] * block_floats + head_floats;
      if (b + 1 < num_blocks)
        for (int64_t i = 0; i < std::min(bs, len - start - bs); ++i)
          prefetch(k_pool + table[b + 1] * block_floats + head_floats + i * token_stride, kDim);
      for (int64_t i0 = 0; i0 < n; i0 += kTileKeys) {
        const float* key[kTileKeys];
        for (int u = 0; u < kTileKeys; ++u) key[u] = keys + std::min(i0 + u, n - 1) * token_stride;
        const int64_t n_keys = std::min(kTileKeys, n - i0);
        float* tile = sc + (start + i0) * vrows;
        int64_t v0 = 0;
        for (; v0 + 3 <= vecs; v0 += 3) score_tile<kDim, 3>(qt, vrows, v0, key, n_keys, tile);
        if (vecs - v0 == 2) score_tile<kDim, 2>(qt, vrows, v0, key, n_keys, tile);
        if (vecs - v0 == 1) score_tile<kDim, 1>(qt, vrows, v0, key, n_keys, tile);
      }
    }

    // causal: key t is hidden from the rows of tokens before position t (only the last num_tokens keys)
    for (int64_t t = std::max<int64_t>(q_start + 1, 0); t < len; ++t)
      for (int64_t r = 0; r < rows; ++r)
        if (q_start + r / s.n_rep < t) sc[t * vrows + r] = -INFINITY;
    for (int64_t v = 0; v < vecs; ++v) {  // eight rows at a time: their maxima, exponentials and sums
      float* col = sc + v * 8;
      __m256 m = _mm256_set1_ps(-INFINITY);
      for (int64_t t = 0; t < len; ++t) m = _mm256_max_ps(m, _mm256_loadu_ps(col + t * vrows));
      __m256 total = _mm256_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {
        const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(col + t * vrows), m));
        _mm256_storeu_ps(col + t * vrows, e);
        total = _mm256_add_ps(total, e);
      }
      _mm256_storeu_ps(sum + v * 8, total);
    }
    for (int64_t t = std::max<int64_t>(q_start + 1, 0); t < len; ++t)  // hidden keys: weight 0, not e^-87
      for (int64_t r = 0; r < rows; ++r)
        if (q_start + r / s.n_rep < t) sc[t * vrows + r] = 0.0f;
    for (int64_t r = 0; r < vrows; ++r) inv[r] = 1.0f / sum[r];

    // out[r] = sum_t p[t][r] v_t, three rows and 32 dims held in registers across the whole context
    for (int64_t d0 = 0; d0 < kDim; d0 += kValueDims) {
      for (int64_t r0 = 0; r0 < value_rows; r0 += kValueRows) {
        __m256 acc[kValueRows][4];
        for (auto& row : acc)
          for (auto& a : row) a = _mm256_setzero_ps();
        for (int64_t b = 0; b < num_blocks; ++b) {
          const int64_t start = b * bs, n = std::min(bs, len - start);
          const float* values = v_pool + table[b] * block_floats + head_floats + d0;
          if (r0 == 0 && b + 1 < num_blocks)
            for (int64_t i = 0; i < std::min(bs, len - start - bs); ++i)
              prefetch(v_pool + table[b + 1] * block_floats + head_floats + d0 + i * token_stride, kValueDims);
          const float* p = sc + start * vrows + r0;
          for (int64_t i = 0; i < n; ++i, p += vrows) {
            const float* v = values + i * token_stride;
            const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                         v3 = _mm256_loadu_ps(v + 24);
            for (int t = 0; t < kValueRows; ++t) {
              const __m256 w = _mm256_broadcast_ss(p + t);
              acc[t][0] = _mm256_fmadd_ps(w, v0, acc[t][0]);
              acc[t][1] = _mm256_fmadd_ps(w, v1, acc[t][1]);
              acc[t][2] = _mm256_fmadd_ps(w, v2, acc[t][2]);
              acc[t][3] = _mm256_fmadd_ps(w, v3, acc[t][3]);
            }
          }
        }
        for (int64_t t = 0; t < kValueRows && r0 + t < rows; ++t) {
          const int64_t r = r0 + t;
          float* o = out + ((r / s.n_rep) * hq + h * s.n_rep + r % s.n_rep) * kDim + d0;
          const __m256 scale_r = _mm256_set1_ps(inv[r]);
          for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[t][c], scale_r));
        }
      }
    }
  }
}
#endif

template <int kDim>
void attend_all(const float* q, int64_t q_stride, int64_t num_tokens, const int64_t* q_start, const float* k_pool,
                const float* v_pool, const int64_t* tables, int64_t table_stride, const int64_t* lens, float* out,
                int64_t num_seqs, Shape s, float scale) {
  Scratch scratch;
  const int64_t hq = s.n_kv_heads * s.n_rep;
  std::vector<int64_t> kv_offset(static_cast<size_t>(num_tokens * hq));
  for (int64_t r = 0; r < num_tokens * hq; ++r) kv_offset[r] = r % hq / s.n_rep * s.head_dim;
  s.kv_offset = kv_offset.data();
  const int64_t out_stride = num_tokens * hq * s.head_dim;
  // Each sequence is walked over its own query tokens only: a group pads every sequence to its longest query, and
  // a decoding sequence next to verifying ones would otherwise score and weigh its padding rows against its whole
  // context (at 64 sequences, half of them verifying one draft, a verify token cost 0.17 ms of step time against
  // 0.12 ms when every sequence verified one). Padding rows are written as zeros.
  for (int64_t g = 0; g < num_seqs; ++g) {
    const int64_t real = std::clamp<int64_t>(lens[g] - q_start[g], 1, num_tokens);
    const float* q_g = q + g * num_tokens * q_stride;
    float* out_g = out + g * out_stride;
    s.num_rows = real * hq;
    bool tiled = false;
#ifdef SPECDEPLOY_AVX2
    if constexpr (kDim > 0 && kDim % kValueDims == 0) {
      if (real >= SPECDEPLOY_TILED_MIN_TOKENS) {
        attend_tiled<kDim>(q_g, q_stride, real, q_start[g], k_pool, v_pool, tables + g * table_stride, lens[g],
                           out_g, s, scale, scratch);
        tiled = true;
      }
    }
#endif
    if (!tiled)
      attend_one<kDim>(q_g, q_stride, real, q_start[g], k_pool, v_pool, tables + g * table_stride, lens[g], out_g,
                       s, scale, scratch);
    std::fill(out_g + real * hq * s.head_dim, out_g + out_stride, 0.0f);
  }
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
