// Shared device helpers of the sagebwd kernels: types, BF16 conversion, the §2.2 quantizer,
// block reductions, and the parameter structs (mirrored by `#[repr(C)]` structs in src/*.rs).
//
// The kernels need NO CUDA header: NVRTC provides the built-in variables, intrinsics, math
// functions and atomics, and everything else is defined here. They are compiled with
// `--fmad=false`, so that every `a * b + c` the specification writes as two FP32 operations
// (`fl(fl(O·α) + PV)`, ...) is two rounded operations, exactly as the CPU simulator does them;
// where it writes one fused operation (the quantizer's exact `x·inv`, §2.2; dequantize-and-
// accumulate, §2.3) the kernels call `__fmaf_rn` explicitly. Products of two BF16 values are exact
// in FP32, so the BF16 products lose nothing from this.
//
// Compile-time constants (NVRTC `-D` options): HEAD_DIM (64 or 128). The block sizes are the
// method's defaults, B_q = 64 and B_kv = 128 (ALGORITHM.md §2.1); the host rejects others.
#pragma once

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined (64 or 128)"
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "HEAD_DIM must be 64 or 128"
#endif

#define BLOCK_Q 64
#define BLOCK_KV 128
#define THREADS 256

// The FP32 dQ accumulator of the sagebwd path at d = 128 on sm_90a (written by backward_main.cu's
// StagedSage128, read by backward_post.cu's sage_bwd_post_dq_int8) holds query row q's 8-value chunk m
// of each 64-column half at chunk position m ^ (q mod 4): the order in which the staging tile's
// bank-conflict-free stores land (pipelined_stage_dq_rot), kept instead of undone by register selects in
// the main kernel's loop. Every other path and build keeps the natural order.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && HEAD_DIM == 128
#define SAGE_DQ_ACC_ROT 1
#else
#define SAGE_DQ_ACC_ROT 0
#endif
// The XOR that takes query row q's logical chunk index (8 values) to its position in that accumulator: only
// the low two bits move, so a chunk stays in its 64-column half and its 128 bytes.
__device__ __forceinline__ int sage_dq_acc_chunk_xor(long q) { return SAGE_DQ_ACC_ROT ? (int)(q & 3) : 0; }

typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Precision flags: bit p set = product p (ALGORITHM.md §1, 0-based: 0 qk, 1 pv, 2 qk-bwd, 3 dv,
// 4 dp, 5 dq, 6 dk) is INT8; then the switches.
#define F_QK 1
#define F_PV 2
#define F_QK_BWD 4
#define F_DV 8
#define F_DP 16
#define F_DQ 32
#define F_DK 64
#define F_SMOOTH_K 256
#define F_SMOOTH_Q 512
#define F_DQ_CORR 1024
// Launch switch of the persistent INT8 forward (not a method flag): K̂ and Q̂ copied by TMA (wsp_producer_tma).
#define F_TMA_KQ 2048

// Programmatic dependent launch (PDL, sm_90+; src/quantize.rs `launch_pdl`; the glue kernels and the
// main attention kernels). A kernel launched with programmatic stream serialization may start while
// its predecessor in the stream (the primary) still runs, once every CTA of the primary has executed
// pdl_trigger() or exited. pdl_wait() blocks
// until the primary has completed and its memory operations are visible. Both are no-ops when the
// launch did not ask for PDL (and on sm_80, where they compile to nothing). The rules that make the
// glue's uses safe by construction: a PDL kernel reads before its pdl_wait() only tensors written
// before its primary started (the primary itself had a normal launch, or triggered only after its
// own pdl_wait(), so everything queued before the primary is complete), writes before pdl_wait()
// only buffers its primary neither reads nor writes, and every thread executes pdl_wait() before
// it exits, so the PDL kernel never completes before its primary.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// The softmax's exp2 (ALGORITHM.md §4): the bare MUFU.EX2, ex2.approx.ftz. exp2f would add a compare
// and two predicated multiplies per score only to produce subnormal results (p < 2^-126), which
// change l by less than its last bit and P̂ only in a block whose amax is itself below ~2^-118.
// exp2_ftz(−∞) = +0, so masked scores need no select.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The online softmax's running max (ALGORITHM.md §4) after a block whose row max is row_max. With INT8 #1
// (lazy, FlashAttention-4's rescaling) it moves only when row_max exceeds it by more than RESCALE_SLACK
// (base-2 units), so that almost every block after the first leaves m, and so α = 1 (the O rescale
// skipped), unchanged; p = exp2(t − m) ≤ 2^8 (times the rounding of fl(m + 8)). fl(−∞ + 8) = −∞: the first
// visible block always moves it; a NaN row max never does. BF16 #1 keeps the eager max (the BF16 d 64
// forward is slower with the lazy one).
#define RESCALE_SLACK 8.0f
__device__ __forceinline__ float running_max(bool lazy, float m_old, float row_max) {
    if (lazy) return row_max > __fadd_rn(m_old, RESCALE_SLACK) ? row_max : m_old;
    return fmaxf(m_old, row_max);
}

// ---------------------------------------------------------------------------------------------
// BF16 <-> FP32 by bit manipulation (round to nearest, ties to even; NaN stays NaN).
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0;  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// bf16(x) as an FP32 value.
__device__ __forceinline__ float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// ---------------------------------------------------------------------------------------------
// The quantizer of ALGORITHM.md §2.2. `inv` is 0 for an all-zero group (then every x̂ is 0).
struct GroupScale {
    float scale;  // fl(amax / 127), to dequantize
    float inv;    // fl(127 / amax), to quantize
};

// fl(x / 127) for every finite x ≥ 0, without a division: q0 = fl(x·y) with y = fl(1/127), the exact
// remainder r = x − q0·127 (one FMA), then fl(q0 + r·y) (one FMA). Correctly rounded on all 2³¹
// non-negative finite floats (checked exhaustively: quant.rs test `div127_by_reciprocal_is_exact`);
// an IEEE division costs ~8 instructions, a branch to its slow path and the MUFU.
__device__ __forceinline__ float div127_rn(float x) {
    const float y = 0x1.020408p-7f;  // fl(1/127)
    const float q0 = __fmul_rn(x, y);
    return __fmaf_rn(__fmaf_rn(-q0, 127.0f, x), y, q0);
}

__device__ __forceinline__ GroupScale group_scale(float amax) {
    GroupScale g;
    if (amax == 0.0f) {
        g.scale = 0.0f;
        g.inv = 0.0f;
    } else {
        g.scale = div127_rn(amax);  // = __fdiv_rn(amax, 127.0f), bit for bit
        g.inv = __fdiv_rn(127.0f, amax);
    }
    return g;
}

// fl(127/amax), group_scale's inv (0 for amax = 0), without the IEEE division's branches:
// the division's fast path (MUFU.RCP, one Newton step, the quotient, its exact remainder, one
// correction), applied to b = amax·s with s = 2^32 (amax ≤ 2^62) or 2^-64 (larger), so that b, 1/b
// and 127/b lie far inside the normal range, where that sequence is correctly rounded; 127/amax =
// (127/b)·s, and fl(127/b)·s is exactly fl(127/amax) (scaling by a power of two commutes with the
// rounding; a quotient ≥ 2^128 becomes +∞ in the product as in the division). amax = 0 and +∞ give
// 0 (the division's 127/+∞), NaN stays NaN. Checked on the device against __fdiv_rn(127, amax) for
// every non-negative FP32 bit pattern. Used by the INT8 forward and the INT8 backward's branch-free
// group scales (group_scale_of_amax). With `__fdiv_rn` behind group_scale's
// `amax == 0` test, ptxas put each row's division (FCHK, the branch to its slow path) between the
// row max and the exponentials; this form is straight-line and interleaves with them.
__device__ __forceinline__ float rcp_approx_ftz(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float inv127_rn(float amax) {
    const bool big = amax > 0x1p62f;
    const float b = __fmul_rn(amax, big ? 0x1p-64f : 0x1p32f);  // exact
    float r = rcp_approx_ftz(b);
    r = __fmaf_rn(r, __fmaf_rn(-b, r, 1.0f), r);
    const float q0 = __fmul_rn(r, 127.0f);
    const float q = __fmaf_rn(r, __fmaf_rn(-b, q0, 127.0f), q0);  // fl(127/b)
    const float inv = __fmul_rn(q, big ? 0x1p-64f : 0x1p32f);  // fl(127/amax) = fl(127/b)·s, b = amax·s
    return amax == 0.0f || amax == pos_inf() ? 0.0f : inv;
}

// clamp(rne(x · inv), −127, 127) with the product exact (ALGORITHM.md §2.2): fma(x, inv, 1.5·2^23)
// rounds the exact x·inv + 1.5·2^23 once, to the nearest integer with ties to even (ulp 1 on
// [2^23, 2^24), and 1.5·2^23 is even) when |x·inv| < 2^22; subtracting 1.5·2^23 again is exact.
// For |x·inv| ≥ 2^22 (never the case for |x| ≤ amax, where |x·inv| ≤ 127(1 + 2^-24)) the result
// keeps the sign of x·inv and a magnitude ≥ 2^21, so the clamp still gives ±127.
__device__ __forceinline__ int quantize(float x, float inv) {
    float y = __fsub_rn(__fmaf_rn(x, inv, 12582912.0f), 12582912.0f);
    y = fminf(fmaxf(y, -127.0f), 127.0f);
    return (int)y;
}

// Dequantization of an exact INT32 accumulator, ALGORITHM.md §2.3: fl(float(acc) · fl(sa · sb)).
__device__ __forceinline__ float dequant(int acc, float sa, float sb) {
    return __fmul_rn((float)acc, __fmul_rn(sa, sb));
}
// Dequantize-and-accumulate (§2.3, products #2, #4, #7): fma(float(acc), fl(sa · sb), sum), one
// rounding — the explicit __fmaf_rn, since the kernels compile with --fmad=false.
__device__ __forceinline__ float dequant_add(int acc, float sa, float sb, float sum) {
    return __fmaf_rn((float)acc, __fmul_rn(sa, sb), sum);
}

// ---------------------------------------------------------------------------------------------
// Block-wide max of non-negative values (all THREADS threads must call it). `scratch` holds
// THREADS/32 floats. Max is exact and order-independent.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float m = scratch[0];
    for (int w = 1; w < THREADS / 32; ++w) m = fmaxf(m, scratch[w]);
    return m;
}

// ---------------------------------------------------------------------------------------------
// Dot products over the head dimension, for one query-side row and one key-side row.

// Exact INT8 dot product (INT32, dp4a). Rows are HEAD_DIM bytes, 4-byte aligned.
__device__ __forceinline__ int dot_i8(const i8* a, const i8* b) {
    const int* a4 = (const int*)a;
    const int* b4 = (const int*)b;
    int acc = 0;
#pragma unroll 8
    for (int c = 0; c < HEAD_DIM / 4; ++c) acc = __dp4a(a4[c], b4[c], acc);
    return acc;
}

// FP32 sum of exact BF16 × BF16 products.
__device__ __forceinline__ float dot_bf16(const u16* a, const u16* b) {
    const u32* a2 = (const u32*)a;
    const u32* b2 = (const u32*)b;
    float acc = 0.0f;
#pragma unroll 8
    for (int c = 0; c < HEAD_DIM / 2; ++c) {
        u32 x = a2[c], y = b2[c];
        acc = __fadd_rn(acc, __fmul_rn(__uint_as_float(x << 16), __uint_as_float(y << 16)));
        acc = __fadd_rn(acc, __fmul_rn(__uint_as_float(x & 0xffff0000u), __uint_as_float(y & 0xffff0000u)));
    }
    return acc;
}

// ---------------------------------------------------------------------------------------------
// Problem dimensions (mirrored by `Dims` in src/runtime.rs).
struct Dims {
    int batch, heads_q, heads_kv, n_q, n_k;
    int causal;
    int n_qblk, n_kblk;  // ⌈n_q / B_q⌉, ⌈n_k / B_kv⌉
    int n_qpad, n_kpad;  // n_qblk·B_q, n_kblk·B_kv: row length of the transposed copies
};

// The (batch, kv head) row of K/V that query head bh = b·H_q + h reads (GQA: H_q / H_kv query heads
// per kv head).
__device__ __forceinline__ int kv_head_of(const Dims& d, int bh) {
    const int group = d.heads_q / d.heads_kv;
    return (bh / d.heads_q) * d.heads_kv + (bh % d.heads_q) / group;
}

// Kernels that take their shared memory from the dynamic allocation trap on a launch that gave
// less than `need` bytes, rather than corrupt memory.
__device__ __forceinline__ void require_dynamic_smem(u32 need) {
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < need) __trap();
}

// Transposed copies [B, H, d, n_pad] written by the quantization kernels, so that the tensor-core
// products whose reduction runs over tokens (P·V, Pᵀ·dO, dSᵀ·Q, dS·K) read their B operand with the
// reduction index contiguous (one 32-bit load per fragment register). INT8 ones are of the
// quantized values, BF16 ones of the original inputs; entries past n are never read.
struct Transposed {
    const i8* q_hat_t;
    const u16* q_t;
    const i8* k_hat_t;
    const u16* k_t;
    const i8* v_hat_t;
    const u16* v_t;
    const i8* do_hat_t;  // backward only
    const u16* do_t;     // backward only
};

// Query row r sees key j iff j ≤ r + (n_k − n_q) (end-aligned causal mask, ALGORITHM.md §8).
__device__ __forceinline__ bool visible(const Dims& d, int r, int j) {
    if (r >= d.n_q || j >= d.n_k) return false;
    return !d.causal || j <= r + (d.n_k - d.n_q);
}

// The same rule as one limit per row: for a key j ≥ 0, visible(d, r, j) ⇔ j < visible_end(d, r)
// (a row's visible keys are a prefix); the end may be ≤ 0 (nothing visible). The BF16 forward's
// mask compares against it once per row instead of testing every entry.
__device__ __forceinline__ int visible_end(const Dims& d, int r) {
    if (r >= d.n_q) return 0;
    return d.causal ? min(d.n_k, r + 1 + (d.n_k - d.n_q)) : d.n_k;
}

// The operands of the score product (#1 forward / #3 backward), of the β bias and of the BF16
// products #6, #7 (which take the original Q, K: smoothing belongs to quantization, §1).
struct ScoreOperands {
    const i8* q_hat;          // [B, Hq, Nq, d] quantized from Q_s
    const float* q_scale;     // [B, Hq, n_qblk]
    const u16* q;             // [B, Hq, Nq, d] the BF16 input Q
    const i8* k_hat;          // [B, Hkv, Nk, d] quantized from K_s
    const float* k_scale;     // [B, Hkv, n_kblk]
    const u16* k;             // [B, Hkv, Nk, d] the BF16 input K
    const float* k_mean;      // [B, Hkv, d]
    const float* q_mean;      // [B, Hq, n_qblk, d] (Q-smoothing only)
    const float* row_offset;  // [B, Hq, Nq] b_r = fl(cλ·q_r·K_m) (§3.5)
};

// Base-2 score t[r, j] of ALGORITHM.md §4 (visible entries only). INT8: of the smoothed operands
// (lower than the true score by b_r), plus the Q-smoothing bias fl(cλ·β) when on; BF16: of Q and K.
__device__ __forceinline__ float score(const ScoreOperands& op, bool int8, long q_row, long k_row,
                                       int q_scale_idx, int k_scale_idx, float c_lambda,
                                       bool smooth_q, float beta_j) {
    if (int8) {
        int acc = dot_i8(op.q_hat + q_row * HEAD_DIM, op.k_hat + k_row * HEAD_DIM);
        float s = __fmul_rn(__fmul_rn(op.q_scale[q_scale_idx], c_lambda), op.k_scale[k_scale_idx]);
        float t = __fmul_rn((float)acc, s);
        if (smooth_q) t = __fadd_rn(t, __fmul_rn(c_lambda, beta_j));
        return t;
    }
    return __fmul_rn(c_lambda, dot_bf16(op.q + q_row * HEAD_DIM, op.k + k_row * HEAD_DIM));
}

// The forward's score t[r, j] as two factors t = fl(a·sc), for its softmax p = exp2(fma(a, sc, −m))
// (§4: fused for INT8 #1 without Q-smoothing). score_scale: sc = fl(fl(s_Q·cλ)·s_K) there, else 1.
// score_factor (visible entries only): a = float(acc) there (exact), else a = t itself (score()),
// so that fma(t, 1, −m) = fl(t − m), the unfused form §4 keeps for BF16 #1 and Q-smoothing.
__device__ __forceinline__ float score_scale(const ScoreOperands& op, bool int8, int q_scale_idx, int k_scale_idx,
                                             float c_lambda, bool smooth_q) {
    if (!int8 || smooth_q) return 1.0f;
    return __fmul_rn(__fmul_rn(op.q_scale[q_scale_idx], c_lambda), op.k_scale[k_scale_idx]);
}
__device__ __forceinline__ float score_factor(const ScoreOperands& op, bool int8, long q_row, long k_row,
                                              int q_scale_idx, int k_scale_idx, float c_lambda,
                                              bool smooth_q, float beta_j) {
    if (int8 && !smooth_q) return (float)dot_i8(op.q_hat + q_row * HEAD_DIM, op.k_hat + k_row * HEAD_DIM);
    return score(op, int8, q_row, k_row, q_scale_idx, k_scale_idx, c_lambda, smooth_q, beta_j);
}

// β[b, j] = Σ_d Q_m[b] · K_s[j] with the FP32 K_s = fl(K − K_m) (ALGORITHM.md §3 step 4). Summed
// in FP64 (the products are exact there) and rounded once, as the simulator does.
__device__ __forceinline__ float beta_of(const float* s_qm, const u16* k_row, const float* km) {
    double acc = 0.0;
    for (int c = 0; c < HEAD_DIM; ++c)
        acc = __dadd_rn(acc, __dmul_rn((double)s_qm[c], (double)__fsub_rn(bf16_to_f32(k_row[c]), km[c])));
    return __double2float_rn(acc);
}

// ---------------------------------------------------------------------------------------------
// Tensor-core products: mma.sync wrappers and fragment gathers (PTX ISA fragment layouts).
// groupID g = lane / 4, thread-in-group t = lane % 4. Fragments are gathered element by element
// from any strided view (global or shared memory), so a transposed operand is just another view:
// the INT8 "K-major" rule costs no transposed copy. Accumulator C (16×8): c0, c1 at (g, 2t + {0,1}),
// c2, c3 at (g + 8, 2t + {0,1}).

// d += a·b, m16n8k32, INT8 × INT8 → INT32 (exact).
__device__ __forceinline__ void mma_s8(int* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a·b, m16n8k16, BF16 × BF16 → FP32.
__device__ __forceinline__ void mma_bf16(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A strided view of an operand: element (o, k), o the row of A or the column of B, k the reduction
// index; entries with o ≥ n_o or k ≥ n_k read as 0 (padding past the sequence end).
struct View {
    const void* p;
    long so, sk;
    int n_o, n_k;
};

__device__ __forceinline__ View view(const void* p, long so, long sk, int n_o, int n_k) {
    View v;
    v.p = p; v.so = so; v.sk = sk; v.n_o = n_o; v.n_k = n_k;
    return v;
}

// Element readers: INT8 tensor; BF16 tensor; FP32 tile quantized on the fly with `inv`
// (§2.2); FP32 tile rounded to BF16.
struct ReadI8 {
    __device__ __forceinline__ u32 operator()(const View& v, int o, int k) const {
        if (o >= v.n_o || k >= v.n_k) return 0u;
        return (u32)(unsigned char)((const i8*)v.p)[o * v.so + k * v.sk];
    }
};
struct ReadBf16 {
    __device__ __forceinline__ u32 operator()(const View& v, int o, int k) const {
        if (o >= v.n_o || k >= v.n_k) return 0u;
        return (u32)((const u16*)v.p)[o * v.so + k * v.sk];
    }
};
struct ReadF32Quant {
    float inv;
    __device__ __forceinline__ u32 operator()(const View& v, int o, int k) const {
        if (o >= v.n_o || k >= v.n_k) return 0u;
        return (u32)(unsigned char)(i8)quantize(((const float*)v.p)[o * v.so + k * v.sk], inv);
    }
};
struct ReadF32Bf16 {
    __device__ __forceinline__ u32 operator()(const View& v, int o, int k) const {
        if (o >= v.n_o || k >= v.n_k) return 0u;
        return (u32)f32_to_bf16(((const float*)v.p)[o * v.so + k * v.sk]);
    }
};

// Whether the reader takes stored bytes as they are (then a contiguous, in-range run of the
// reduction index is one aligned 32-bit load: k0 is a multiple of 4 INT8 / 2 BF16 values and rows
// are multiples of 64 bytes).
template <class R> struct RawBits { static const bool value = false; };
template <> struct RawBits<ReadI8> { static const bool value = true; };
template <> struct RawBits<ReadBf16> { static const bool value = true; };

// Four INT8 values at (o, k0..k0+3), lowest k in the lowest byte.
template <class R>
__device__ __forceinline__ u32 pack4(const R& rd, const View& v, int o, int k0) {
    if (RawBits<R>::value && v.sk == 1 && o < v.n_o && k0 + 3 < v.n_k)
        return *(const u32*)((const i8*)v.p + o * v.so + k0);
    return rd(v, o, k0) | (rd(v, o, k0 + 1) << 8) | (rd(v, o, k0 + 2) << 16) | (rd(v, o, k0 + 3) << 24);
}
// Two BF16 values at (o, k0..k0+1), lower k in the low half.
template <class R>
__device__ __forceinline__ u32 pack2(const R& rd, const View& v, int o, int k0) {
    if (RawBits<R>::value && v.sk == 1 && o < v.n_o && k0 + 1 < v.n_k)
        return *(const u32*)((const u16*)v.p + o * v.so + k0);
    return rd(v, o, k0) | (rd(v, o, k0 + 1) << 16);
}

// INT8 A fragment (16 × 32) with rows o0.., reduction k0..; B fragment (32 × 8) with columns o0...
template <class R>
__device__ __forceinline__ void frag_a_s8(u32* a, const R& rd, const View& v, int o0, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    a[0] = pack4(rd, v, o0 + g, k0 + 4 * t);
    a[1] = pack4(rd, v, o0 + g + 8, k0 + 4 * t);
    a[2] = pack4(rd, v, o0 + g, k0 + 16 + 4 * t);
    a[3] = pack4(rd, v, o0 + g + 8, k0 + 16 + 4 * t);
}
template <class R>
__device__ __forceinline__ void frag_b_s8(u32* b, const R& rd, const View& v, int o0, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    b[0] = pack4(rd, v, o0 + g, k0 + 4 * t);
    b[1] = pack4(rd, v, o0 + g, k0 + 16 + 4 * t);
}
// BF16 A fragment (16 × 16) and B fragment (16 × 8).
template <class R>
__device__ __forceinline__ void frag_a_bf16(u32* a, const R& rd, const View& v, int o0, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    a[0] = pack2(rd, v, o0 + g, k0 + 2 * t);
    a[1] = pack2(rd, v, o0 + g + 8, k0 + 2 * t);
    a[2] = pack2(rd, v, o0 + g, k0 + 8 + 2 * t);
    a[3] = pack2(rd, v, o0 + g + 8, k0 + 8 + 2 * t);
}
template <class R>
__device__ __forceinline__ void frag_b_bf16(u32* b, const R& rd, const View& v, int o0, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    b[0] = pack2(rd, v, o0 + g, k0 + 2 * t);
    b[1] = pack2(rd, v, o0 + g, k0 + 8 + 2 * t);
}

// One 16 × 8 output tile C += A·B over the reduction [0, k_len) (k_len a multiple of 32 for INT8,
// 16 for BF16), operands gathered from views with A rows a_o0.., B columns b_o0...
template <class RA, class RB>
__device__ __forceinline__ void tile_s8(int* c, const RA& ra, const View& va, int a_o0, const RB& rb,
                                        const View& vb, int b_o0, int k_len) {
    for (int k0 = 0; k0 < k_len; k0 += 32) {
        u32 a[4], b[2];
        frag_a_s8(a, ra, va, a_o0, k0);
        frag_b_s8(b, rb, vb, b_o0, k0);
        mma_s8(c, a, b);
    }
}
template <class RA, class RB>
__device__ __forceinline__ void tile_bf16(float* c, const RA& ra, const View& va, int a_o0, const RB& rb,
                                          const View& vb, int b_o0, int k_len) {
    for (int k0 = 0; k0 < k_len; k0 += 16) {
        u32 a[4], b[2];
        frag_a_bf16(a, ra, va, a_o0, k0);
        frag_b_bf16(b, rb, vb, b_o0, k0);
        mma_bf16(c, a, b);
    }
}

// The same with the A fragments loaded once (frags_a_*) and reused across output tiles: the A
// operand of a warp is often fixed while it walks the columns of B (and gathering it can cost more
// than the multiply, e.g. when P̂ or dŜ is quantized on the fly).
template <int K, class R>
__device__ __forceinline__ void frags_a_s8(u32 (*a)[4], const R& rd, const View& v, int o0) {
#pragma unroll
    for (int ks = 0; ks < K / 32; ++ks) frag_a_s8(a[ks], rd, v, o0, ks * 32);
}
template <int K, class R>
__device__ __forceinline__ void frags_a_bf16(u32 (*a)[4], const R& rd, const View& v, int o0) {
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) frag_a_bf16(a[ks], rd, v, o0, ks * 16);
}
template <int K, class R>
__device__ __forceinline__ void tile_s8_a(int* c, const u32 (*a)[4], const R& rb, const View& vb, int b_o0) {
#pragma unroll
    for (int ks = 0; ks < K / 32; ++ks) {
        u32 b[2];
        frag_b_s8(b, rb, vb, b_o0, ks * 32);
        mma_s8(c, a[ks], b);
    }
}
template <int K, class R>
__device__ __forceinline__ void tile_bf16_a(float* c, const u32 (*a)[4], const R& rb, const View& vb, int b_o0) {
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
        u32 b[2];
        frag_b_bf16(b, rb, vb, b_o0, ks * 16);
        mma_bf16(c, a[ks], b);
    }
}

// Row and column of accumulator element e (0..3) of a 16 × 8 tile, relative to the tile.
__device__ __forceinline__ int c_row(int e) { return ((threadIdx.x & 31) >> 2) + (e >= 2 ? 8 : 0); }
__device__ __forceinline__ int c_col(int e) { return 2 * (threadIdx.x & 3) + (e & 1); }

// ---------------------------------------------------------------------------------------------
// Shared-memory staging (sm_80+): cp.async 16-byte copies global → shared and ldmatrix loads of
// 8-bit fragments (an 8 × 16-byte row block read as an 8 × 8 b16 matrix gives thread (g, t) the
// 4 bytes at byte 4t of row g: exactly an m16n8k32 B register, or an A register for rows g).

// The shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global → shared, asynchronous; with `valid` false the destination is zero-filled and
// nothing is read (src-size 0).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Four 8 × 8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Four 8 × 8 b16 matrices, transposed: lane l gives the address of row l % 8 of matrix l / 8, and
// thread (g, t) receives elements (rows 2t, 2t + 1; column g). For a [key][d] BF16 tile (8 keys ×
// one 16-byte chunk per matrix) that is an m16n8k16 B register with k = key, n = d column.
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// bf16(lo) in the low half, bf16(hi) in the high half (round to nearest even, subnormals kept: the
// same values as f32_to_bf16 for finite inputs), one instruction.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// pack_bf16x2 for stores that promise f32_to_bf16's bits (the INT8 forward's O): the cvt gives
// them for every non-NaN input, and `nan` collects whether lo or hi is NaN, where the caller takes
// f32_to_bf16 instead (its NaN is 0x7fc0). Checked on all 2^32 FP32 patterns in both halves by
// sage_bf16_pack_check (selftest.cu, sagebwd-gpu-check). One F2FP (+ one FSETP) per pair where
// f32_to_bf16 takes ~7 integer instructions per value.
__device__ __forceinline__ u32 pack_bf16x2_nan(float lo, float hi, u32& nan) {
    // nan = nan != 0 || lo or hi NaN (setp.nan: unordered), as 0 / 1: ptxas chains FSETP.NAN.OR.
    asm("{\n.reg .pred p, q;\nsetp.ne.u32 q, %1, 0;\nsetp.nan.or.f32 p, %2, %3, q;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(nan) : "r"(nan), "f"(lo), "f"(hi));
    return pack_bf16x2(lo, hi);
}
// f32_to_bf16(lo) | f32_to_bf16(hi) << 16: the same word by the software rounding.
__device__ __forceinline__ u32 pack_bf16x2_sw(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

// ---------------------------------------------------------------------------------------------
// Exact integer/float tricks of the staged paths (forward.cu, backward_main.cu).

// float(a) for |a| < 2^22 (every INT32 accumulator here: |a| ≤ 127²·d < 2^21), exact like the
// conversion instruction but on the FP32/INT pipes (conversions issue at 1/4 rate or less):
// 1.5·2^23 + a has ulp 1, and subtracting 1.5·2^23 again is exact.
__device__ __forceinline__ float i2f_exact(int a) { return __fsub_rn(__int_as_float(0x4B400000 + a), 12582912.0f); }

// e4m3 (ALGORITHM.md §10.1: nearest, ties to even, saturating to ±448) of lo and hi as two bytes, lo the low one
// (cvt puts its first source in the upper byte). sm_89 and later; traps before.
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    __trap();
    return 0;
#endif
}

// The exponent e of Fp8::pow2_scale (fp8.rs) for e4m3: the smallest power of two 2^e with amax / 2^e ≤ 448, amax > 0
// and finite. ldexpf is exact (0 ulp), so every comparison is on the exact quotient.
__device__ __forceinline__ int e4m3_scale_exponent(float amax) {
    int e = ilogbf(amax) - 8;
    while (ldexpf(amax, -e) > 448.0f) ++e;
    while (e > -149 && ldexpf(amax, -(e - 1)) <= 448.0f) --e;
    return e;
}

// The low bytes of a, b, c, d as one word (a lowest).
__device__ __forceinline__ u32 pack_lo_bytes(u32 a, u32 b, u32 c, u32 d) {
    u32 lo, hi, r;
    asm("prmt.b32 %0, %1, %2, 0x0040;" : "=r"(lo) : "r"(a), "r"(b));
    asm("prmt.b32 %0, %1, %2, 0x0040;" : "=r"(hi) : "r"(c), "r"(d));
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(r) : "r"(lo), "r"(hi));
    return r;
}

// quantize(x, inv) of the §2.2 quantizer for |x| ≤ amax with inv = fl(127/amax), the result in the
// low byte of the returned bits (two's complement): the exact y = x·inv has |y| ≤ 127(1 + 2^-24) (so
// the clamp to [−127, 127] can never act: the rounding of y is at most 127 in magnitude), and
// fma(x, inv, 1.5·2^23) rounds y + 1.5·2^23 once, to the nearest integer, ties to even (ulp 1 there,
// 1.5·2^23 even), giving the bits 0x4B400000 + n: one instruction. inv = 0 (an all-zero group) gives
// n = 0.
__device__ __forceinline__ u32 quant_bits(float x, float inv) {
    return __float_as_uint(__fmaf_rn(x, inv, 12582912.0f));
}

// quant(x, inv) of the four accumulator values (n0, 2h), (n0, 2h + 1), (n0 + 1, 2h), (n0 + 1, 2h + 1),
// packed as bytes: with n0 = 4s + 2·half, the m16n8k32 A-fragment register [s][2·half + h] of the
// staged paths' permuted key (or query) order. Quant returns its result in the low byte (QuantBits;
// the forward's P̂ uses its non-negative variant).
struct QuantBits {
    __device__ __forceinline__ u32 operator()(float x, float inv) const { return quant_bits(x, inv); }
};
template <class Quant>
__device__ __forceinline__ u32 quant_quad(float (*t)[4], int n0, int h, float inv, Quant quant) {
    return pack_lo_bytes(quant(t[n0][2 * h], inv), quant(t[n0][2 * h + 1], inv),
                         quant(t[n0 + 1][2 * h], inv), quant(t[n0 + 1][2 * h + 1], inv));
}

// *addr += {x, y} (FP32, relaxed, device scope), one 8-byte vector reduction on sm_90, two scalar
// ones before; addr 8-byte aligned. The order of additions into one address is not fixed.
__device__ __forceinline__ void red_add_f32x2(float* addr, float x, float y) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(x), "f"(y) : "memory");
#else
    atomicAdd(addr, x);
    atomicAdd(addr + 1, y);
#endif
}

// ---- shared-memory swizzles for ldmatrix ---------------------------------------------------------
// Physical 16-byte chunk of logical chunk c in a tile row. One ldmatrix phase reads the same chunk
// column of 8 rows; XOR-ing the chunk index with bits of the row sends those 8 rows to different
// bank groups. Which bits depends on which 8 rows a phase reads and on the row length.
//
// 8 consecutive rows, 128-byte rows (8 chunks):
__device__ __forceinline__ int swz_rows8(int row, int c) { return c ^ (row & 7); }
// 8 consecutive rows, 64-byte rows (4 chunks; two rows share 128 bytes):
__device__ __forceinline__ int swz_rows8_half(int row, int c) { return c ^ ((row >> 1) & 3); }
// Rows in the permuted order base + {0, 1, 4, 5, 8, 9, 12, 13} (they differ in row bits 0, 2, 3),
// 128-byte rows:
__device__ __forceinline__ int swz_permuted(int row, int c) { return c ^ ((row & 1) | ((row >> 1) & 6)); }
// ... 64-byte rows:
__device__ __forceinline__ int swz_permuted_half(int row, int c) { return c ^ ((row >> 2) & 3); }
// INT8 rows of HEAD_DIM bytes (128 or 64), in natural and in permuted order.
__device__ __forceinline__ int swz_i8_rows8(int row, int c) {
#if HEAD_DIM == 128
    return swz_rows8(row, c);
#else
    return swz_rows8_half(row, c);
#endif
}
__device__ __forceinline__ int swz_i8_permuted(int row, int c) {
#if HEAD_DIM == 128
    return swz_permuted(row, c);
#else
    return swz_permuted_half(row, c);
#endif
}
