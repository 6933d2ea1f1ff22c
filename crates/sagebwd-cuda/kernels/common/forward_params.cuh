// Forward attention (ALGORITHM.md §4): one thread block per (query block of B_q = 64 rows,
// batch·query head); it walks the key blocks of B_kv = 128 keys with FlashAttention-2's online
// softmax in base 2. Design: scalar CUDA-core arithmetic (dp4a for INT8, FP32 for BF16), operands
// read from global memory through the caches, the 64 × 128 score/probability tile in shared memory.

// Mirrored by `ForwardParams` in src/forward.rs.
struct ForwardParams {
    ScoreOperands op;
    Transposed tr;
    const i8* v_hat;       // [B, Hkv, Nk, d]
    const float* v_scale;  // [B, Hkv, n_kblk]
    const u16* v;          // [B, Hkv, Nk, d] BF16
    u16* o;                // [B, Hq, Nq, d] BF16 output
    float* lse2;           // [B, Hq, Nq]
    float* lse;            // [B, Hq, Nq]
    Dims dims;
    int flags;
    float c_lambda;  // fl(c · log2 e)
    float ln2;       // FP32 ln 2
};
// Layout contract with src/forward.rs (which asserts the same size).
static_assert(sizeof(ForwardParams) == 240, "ForwardParams layout changed: update src/forward.rs");

#define O_PER_THREAD (BLOCK_Q * HEAD_DIM / THREADS)

struct ForwardShared {
    float tile[BLOCK_Q][BLOCK_KV];  // t, then p, then P̂ or bf16(p)
    float m[BLOCK_Q], l[BLOCK_Q], alpha[BLOCK_Q], p_scale[BLOCK_Q];
    float q_mean[HEAD_DIM];
    float beta[BLOCK_KV];
};

// Last key block any row of query block qb can see (exclusive bound), 0 if none.
__device__ __forceinline__ int key_block_end(const Dims& d, int qb) {
    if (!d.causal) return d.n_kblk;
    const int r_last = min((qb + 1) * BLOCK_Q, d.n_q) - 1;
    const int j_max = r_last + d.n_k - d.n_q;
    if (j_max < 0) return 0;
    return min(d.n_kblk, j_max / BLOCK_KV + 1);
}

