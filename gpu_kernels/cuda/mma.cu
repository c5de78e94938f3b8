// Tensor-core matrix products of one warp for the CUDA prefill kernel (cuda/prefill_mma.py).
//
// The Numba kernel owns everything else (paging, cp.async staging, masking, online softmax,
// output); these functions only run the two matrix products of a key tile on mma.sync
// (m16n8k16, fp16 or bf16 operands, fp32 accumulators). mma.py appends extern "C" wrappers
// for the template parameters a kernel needs; Numba calls them with the convention
// `int f(int* ret, args...)`.
//
// Shared memory (32-bit words, rows of STR halves = D + 8: the padding puts the 8 rows of
// every ldmatrix phase on distinct banks):
//   Q rows [rows of the warp][STR], K tile [BK keys][STR], V tile [BK keys][STR].
// Register fragments (PTX ISA, mma.m16n8k16): lane = 4 g + t holds, of a 16 x 8 accumulator
// tile, rows g and g + 8 x columns 2t, 2t + 1, stored c0 c1 (row g) c2 c3 (row g + 8).
//   S: float s[MT][NT][4]  (MT tiles of 16 query rows x NT tiles of 8 keys)
//   O: float o[MT][D/8][4] (MT tiles of 16 query rows x D/8 tiles of 8 dims)

typedef unsigned int u32;

__device__ __forceinline__ u32 shared_address(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (u32)a;
}

__device__ __forceinline__ void ldsm4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm4_t(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// KIND: 1 = float16, 2 = bfloat16 (primitives.F16 / BF16)
template <int KIND>
__device__ __forceinline__ void mma16816(float* c, const u32 (&a)[4], u32 b0, u32 b1) {
  if (KIND == 1)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// two floats -> one word of two halves, `lo` in the low 16 bits (round to nearest even)
template <int KIND>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if (KIND == 1)
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// s = Q K^T for the warp's MT x 16 query rows (word q_word of smem) and the BK = 8 NT keys of
// the tile at word k_word.
template <int KIND, int MT, int NT, int D>
__device__ __forceinline__ void qk_tile(float* s, const u32* smem, int q_word, int k_word) {
  constexpr int STR = D + 8;
  const int lane = threadIdx.x & 31;
  const u32 base = shared_address(smem);
  // ldmatrix row addresses: A (Q) 16 rows x 16 dims; B (K) 16 keys x 16 dims
  const u32 qa = base + 4 * q_word + ((lane & 15) * STR + (lane >> 4) * 8) * 2;
  const u32 ka = base + 4 * k_word + (((lane & 7) + ((lane >> 4) << 3)) * STR
                                      + ((lane >> 3) & 1) * 8) * 2;
  float acc[MT][NT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[m][n][c] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    u32 a[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) ldsm4(a[m], qa + (m * 16 * STR + kk * 16) * 2);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 b[4];
      ldsm4(b, ka + (np * 16 * STR + kk * 16) * 2);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        mma16816<KIND>(acc[m][2 * np], a[m], b[0], b[1]);
        mma16816<KIND>(acc[m][2 * np + 1], a[m], b[2], b[3]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[(m * NT + n) * 4 + c] = acc[m][n][c];
}

// o = o * alpha + P V: alpha[2 m + h] rescales row g + 8 h of m-tile m; P is the warp's
// probabilities in the S layout (float, rounded to KIND here), V the tile at word v_word.
template <int KIND, int MT, int NT, int D>
__device__ __forceinline__ void pv_tile(float* o, const float* alpha, const float* p,
                                        const u32* smem, int v_word) {
  constexpr int STR = D + 8;
  constexpr int DT = D / 8;
  const int lane = threadIdx.x & 31;
  const u32 va = shared_address(smem) + 4 * v_word + ((lane & 15) * STR + (lane >> 4) * 8) * 2;
  float acc[MT][DT][4];
  bool same = true;     // no row of the warp has a new maximum: no rescale
#pragma unroll
  for (int x = 0; x < 2 * MT; ++x) same = same && alpha[x] == 1.f;
  same = __all_sync(0xffffffffu, same);
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < DT; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[m][n][c] = o[(m * DT + n) * 4 + c];
  if (!same) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < DT; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][n][c] *= alpha[2 * m + c / 2];
  }
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    u32 a[MT][4];      // the accumulator layout of two key tiles is the A layout of 16 keys
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const float* p0 = p + (m * NT + 2 * kk) * 4;
      a[m][0] = pack2<KIND>(p0[0], p0[1]);
      a[m][1] = pack2<KIND>(p0[2], p0[3]);
      a[m][2] = pack2<KIND>(p0[4], p0[5]);
      a[m][3] = pack2<KIND>(p0[6], p0[7]);
    }
#pragma unroll
    for (int np = 0; np < DT / 2; ++np) {
      u32 b[4];
      ldsm4_t(b, va + (kk * 16 * STR + np * 16) * 2);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        mma16816<KIND>(acc[m][2 * np], a[m], b[0], b[1]);
        mma16816<KIND>(acc[m][2 * np + 1], a[m], b[2], b[3]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < DT; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[(m * DT + n) * 4 + c] = acc[m][n][c];
}
