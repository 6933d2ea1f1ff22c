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
