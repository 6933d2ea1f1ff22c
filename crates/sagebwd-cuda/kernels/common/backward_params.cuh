// Backward main kernel (ALGORITHM.md §5): one thread block per (key block of B_kv = 128 keys,
// batch·query head). The block keeps its dK, dV accumulators in registers and loops over the
// query blocks that can see its keys; per 64 × 128 tile it recomputes S and P, computes dP and
// dS, quantizes P and dS per tile when their products are INT8, updates dV and dK, and adds its
// dQ contribution to the FP32 global accumulator with atomicAdd. dK, dV are written per query
// head; the postprocess sums the heads of a GQA group. Scalar CUDA-core arithmetic (dp4a / FP32),
// operands read through the caches, the P and dS tiles in (dynamic) shared memory.

// Mirrored by `BackwardParams` in src/backward.rs.
struct BackwardParams {
    ScoreOperands op;
    Transposed tr;
    const i8* v_hat;        // [B, Hkv, Nk, d]
    const float* v_scale;   // [B, Hkv, n_kblk]
    const u16* v;           // [B, Hkv, Nk, d]
    const i8* do_hat;       // [B, Hq, Nq, d]
    const float* do_scale;  // [B, Hq, n_qblk]
    const u16* d_o;         // [B, Hq, Nq, d]
    const float* lse2;      // [B, Hq, Nq]
    const float* delta;     // [B, Hq, Nq]
    float* dq_acc;          // [B, Hq, Nq, d], zeroed by the preprocess
    float* ds_rowsum;       // [B, Hq, Nq], zeroed; Σ_j dS (only with the dQ correction)
    float* dk_acc;          // [B, Hq, Nk, d], written whole (null with dk_out)
    float* dv_acc;          // [B, Hq, Nk, d], written whole (null with dv_out)
    // [B, Hkv, Nk, d] BF16: set only for a staged path without GQA (H_q = H_kv), where one block
    // holds the whole dK, dV of its keys; the block then writes the postprocess's result itself.
    u16* dk_out;
    u16* dv_out;
    Dims dims;
    int flags;
    float c_lambda;
    float c;                // softmax scale 1/sqrt(d) (dK = fl(c·Σ dK))
};
// Layout contract with src/backward.rs (which asserts the same size).
static_assert(sizeof(BackwardParams) == 304, "BackwardParams layout changed: update src/backward.rs");

#define KV_PER_THREAD (BLOCK_KV * HEAD_DIM / THREADS)
#define Q_PER_THREAD (BLOCK_Q * HEAD_DIM / THREADS)

// Lives in dynamic shared memory (over the 48 KB static limit); the host passes sizeof of its
// mirror, and the kernel traps if it got less.
struct BackwardShared {
    float p[BLOCK_Q][BLOCK_KV];   // P (FP32, masked → 0)
    float ds[BLOCK_Q][BLOCK_KV];  // dS (FP32, masked → 0)
    float lse2[BLOCK_Q], delta[BLOCK_Q];  // L[r] of §5 (lse2, less b_r for an INT8 #3) and D[r]
    float q_mean[HEAD_DIM];
    float beta[BLOCK_KV];
    float colsum[BLOCK_KV];
    float scratch[THREADS / 32];
};

struct TileScales {
    GroupScale p, ds;
};

// First query block with a row that sees key block kb.
__device__ __forceinline__ int query_block_begin(const Dims& d, int kb) {
    if (!d.causal) return 0;
    const int r_min = max(0, kb * BLOCK_KV - (d.n_k - d.n_q));
    return r_min / BLOCK_Q;
}

