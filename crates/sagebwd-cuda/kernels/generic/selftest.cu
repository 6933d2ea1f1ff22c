// Checks the mma.sync fragment layouts of common.cuh on the device: one warp multiplies a 16 × 32
// INT8 and a 16 × 16 BF16 matrix by 8-column B operands (stored [n][k]); the host compares with an
// exact product. A wrong layout shows here before it shows as a wrong attention output.
extern "C" __global__ void sage_mma_selftest(const i8* a8, const i8* b8, int* c8, const u16* a16,
                                             const u16* b16, float* c16) {
    const View va8 = view(a8, 32, 1, 16, 32), vb8 = view(b8, 32, 1, 8, 32);
    const View va16 = view(a16, 16, 1, 16, 16), vb16 = view(b16, 16, 1, 8, 16);
    int ci[4] = {0, 0, 0, 0};
    float cf[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    tile_s8(ci, ReadI8(), va8, 0, ReadI8(), vb8, 0, 32);
    tile_bf16(cf, ReadBf16(), va16, 0, ReadBf16(), vb16, 0, 16);
    for (int e = 0; e < 4; ++e) {
        c8[c_row(e) * 8 + c_col(e)] = ci[e];
        c16[c_row(e) * 8 + c_col(e)] = cf[e];
    }
}

// Checks, for every FP32 argument x in [−∞, 16], the properties of exp2_ftz (common.cuh) that the
// INT8 forward relies on to know P̂'s group amax before the exponentials (ALGORITHM.md §4): monotone
// (x ≤ y ⇒ exp2_ftz(x) ≤ exp2_ftz(y)), so max_j exp2(fma(a_j, sc, −m)) = exp2(fma(a_max, sc, −m)) and
// no p exceeds the amax (then fl(p · fl(127/amax)) < 127.5 and the quantizer needs no clamp). The
// fused argument fma(a, sc, −m) is at most the row's largest score less the running max m, which the
// lazy rule (running_max) keeps within RESCALE_SLACK = 8 of it up to the rounding of fl(m + 8)
// and of fl(a_max·sc): ≤ 8 + ½ ulp(m) + ½ ulp of the largest score, hence ≤ 10 for every score below
// 2^24 in magnitude: the walk covers (0, 16] too. And exp2_ftz(0) = 1 with every value on [−∞, 0] ≤ 1.
// Bit patterns 0x80000000 (−0) to 0xff800000 (−∞) order the negative arguments from largest to
// smallest, 0x00000000 (+0) to 0x41800000 (16) the positive ones from smallest to largest; each thread
// walks one chunk of one. counts[0]: adjacent pairs out of order, counts[1]: values above 1 on
// [−∞, 0], counts[2]: exp2_ftz(0) ≠ 1.
#define EX2_CHUNK 4096u
extern "C" __global__ void sage_ex2_monotone(unsigned long long* counts) {
    const u32 n_neg = (0xff800000u - 0x80000000u) / EX2_CHUNK;  // exact: 0x7f800000 = 0x7f800·4096
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    const bool neg = i < n_neg;
    const u32 first = neg ? 0x80000000u : 0u, last = neg ? 0xff800000u : 0x41800000u;  // −∞, 16
    const u32 begin = first + (neg ? i : i - n_neg) * EX2_CHUNK;
    if (begin >= last) return;
    const u32 end = begin + EX2_CHUNK < last ? begin + EX2_CHUNK : last;
    unsigned long long out_of_order = 0, above_one = 0;
    float prev = exp2_ftz(__uint_as_float(begin));
    above_one += neg && prev > 1.0f;
    for (u32 b = begin + 1; b <= end; ++b) {  // end itself pairs with the next chunk's first
        const float y = exp2_ftz(__uint_as_float(b));
        out_of_order += neg ? y > prev : y < prev;
        above_one += neg && y > 1.0f;
        prev = y;
    }
    if (out_of_order) atomicAdd(&counts[0], out_of_order);
    if (above_one) atomicAdd(&counts[1], above_one);
    if (begin == 0x80000000u && (exp2_ftz(0.0f) != 1.0f || exp2_ftz(-0.0f) != 1.0f)) atomicAdd(&counts[2], 1ull);
}

// Checks pack_bf16x2_nan (common.cuh; the INT8 persistent forward's O pack) against
// f32_to_bf16 on every FP32 bit pattern in both halves: thread i walks the patterns x of chunk i
// (BF16_CHUNK of them) as the low half, with y = x·0x9e3779b1 (an odd multiplier: a bijection, so
// every pattern is a high half once too) as the high half. counts[0]: words whose cvt differs from
// the software pack while neither input is NaN (the claim the forward relies on: must be 0);
// counts[1]: words where the forward's rule (software pack when `nan` is set, else the cvt) differs
// from f32_to_bf16 (must be 0); counts[2]: `nan` wrong (must be 0); counts[3]: NaN halves whose cvt
// differs from f32_to_bf16's 0x7fc0 (informative); counts[4], counts[5]: OR and OR of the complement
// of the cvt's NaN halves (the NaN it writes: AND = ~counts[5]).
#define BF16_CHUNK 4096u
extern "C" __global__ void sage_bf16_pack_check(unsigned long long* counts) {
    const u32 begin = (blockIdx.x * blockDim.x + threadIdx.x) * BF16_CHUNK;
    u32 cvt_bad = 0, rule_bad = 0, flag_bad = 0, nan_diff = 0, nan_or = 0, nan_nor = 0;
    for (u32 k = 0; k < BF16_CHUNK; ++k) {
        const u32 xb = begin + k, yb = xb * 0x9e3779b1u;
        const float x = __uint_as_float(xb), y = __uint_as_float(yb);
        const bool xn = (xb & 0x7fffffffu) > 0x7f800000u, yn = (yb & 0x7fffffffu) > 0x7f800000u;
        u32 nan = 0;
        const u32 w = pack_bf16x2_nan(x, y, nan);
        const u32 sw = pack_bf16x2_sw(x, y);
        cvt_bad += !xn && !yn && w != sw;
        rule_bad += (nan ? sw : w) != sw;
        flag_bad += (nan != 0) != (xn || yn);
        const u32 lo = w & 0xffffu, hi = w >> 16;
        nan_diff += (xn && lo != 0x7fc0u) + (yn && hi != 0x7fc0u);
        if (xn) { nan_or |= lo; nan_nor |= ~lo & 0xffffu; }
        if (yn) { nan_or |= hi; nan_nor |= ~hi & 0xffffu; }
    }
    const u32 full = 0xffffffffu;
    cvt_bad = __reduce_add_sync(full, cvt_bad);
    rule_bad = __reduce_add_sync(full, rule_bad);
    flag_bad = __reduce_add_sync(full, flag_bad);
    nan_diff = __reduce_add_sync(full, nan_diff);
    nan_or = __reduce_or_sync(full, nan_or);
    nan_nor = __reduce_or_sync(full, nan_nor);
    if ((threadIdx.x & 31) == 0) {
        if (cvt_bad) atomicAdd(&counts[0], (unsigned long long)cvt_bad);
        if (rule_bad) atomicAdd(&counts[1], (unsigned long long)rule_bad);
        if (flag_bad) atomicAdd(&counts[2], (unsigned long long)flag_bad);
        if (nan_diff) atomicAdd(&counts[3], (unsigned long long)nan_diff);
        if (nan_or) atomicOr(&counts[4], (unsigned long long)nan_or);
        if (nan_nor) atomicOr(&counts[5], (unsigned long long)nan_nor);
    }
}
