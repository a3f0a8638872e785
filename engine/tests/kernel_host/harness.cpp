// kernels/quant.cu built for the CPU (with the stand-in headers beside this file), run one lane at a time:
//   harness FORMAT BLOCKS_FILE N K GROUPS_OUT UNITS_OUT
// reads an [N, K] weight of FORMAT's blocks and writes two f32 [N, K] files: every group of 8 through
// gemm_load_w8 (the dequant8 that gemm_*, dequantize_* and embedding_* read), and every element as the GEMV's
// FmtDeq unit walk places it (load + load_x over element indices). Exits 1 when the walk misses an element or
// reads one twice.
#include "quant.cu"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

Dim3 threadIdx, blockIdx, blockDim, gridDim;

static bool write_f32(const char* path, const std::vector<float>& v) {
    FILE* f = std::fopen(path, "wb");
    if (f == nullptr) return false;
    const bool ok = std::fwrite(v.data(), 4, v.size(), f) == v.size();
    return std::fclose(f) == 0 && ok;
}

template <typename B>
static int run(const std::vector<unsigned char>& w, int n, int k, const char* groups_out, const char* units_out) {
    std::vector<float> groups((size_t)n * k), units((size_t)n * k);
    std::vector<int> seen((size_t)n * k, 0);
    std::vector<float> index(k);
    for (int i = 0; i < k; ++i) index[i] = (float)i;
    for (int r = 0; r < n; ++r) {
        for (int j8 = 0; j8 < k / 8; ++j8) {
            float o[8];
            gemm_load_w8<B>(w.data(), r, k, j8, o);
            for (int i = 0; i < 8; ++i) groups[(size_t)r * k + j8 * 8 + i] = o[i];
        }
        const u8* row = w.data() + (size_t)r * FmtDeq<B>::row_bytes(k);
        for (int u = 0; u < k / FmtDeq<B>::UNIT; ++u) {
            float q[FmtDeq<B>::UNIT], at[FmtDeq<B>::UNIT], d, mn;
            FmtDeq<B>::load(row, u, q, d, mn);
            FmtDeq<B>::load_x(index.data(), u, at);  // which elements the unit's weights meet
            for (int i = 0; i < FmtDeq<B>::UNIT; ++i) {
                const size_t e = (size_t)r * k + (size_t)at[i];
                units[e] = d * q[i] + mn;
                seen[e]++;
            }
        }
    }
    for (size_t i = 0; i < seen.size(); ++i) {
        if (seen[i] != 1) {
            std::fprintf(stderr, "the unit walk reads element %zu %d times\n", i, seen[i]);
            return 1;
        }
    }
    return write_f32(groups_out, groups) && write_f32(units_out, units) ? 0 : 3;
}

int main(int argc, char** argv) {
    if (argc != 7) return 2;
    const std::string fmt = argv[1];
    std::vector<unsigned char> w;
    FILE* f = std::fopen(argv[2], "rb");
    if (f == nullptr) return 3;
    unsigned char buf[4096];
    for (size_t got; (got = std::fread(buf, 1, sizeof buf, f)) > 0;) w.insert(w.end(), buf, buf + got);
    std::fclose(f);
    const int n = std::atoi(argv[3]), k = std::atoi(argv[4]);
    if (fmt == "q8_0") return run<block_q8_0>(w, n, k, argv[5], argv[6]);
    if (fmt == "q4_0") return run<block_q4_0>(w, n, k, argv[5], argv[6]);
    if (fmt == "q4_1") return run<block_q4_1>(w, n, k, argv[5], argv[6]);
    if (fmt == "q5_0") return run<block_q5_0>(w, n, k, argv[5], argv[6]);
    if (fmt == "q5_1") return run<block_q5_1>(w, n, k, argv[5], argv[6]);
    if (fmt == "q2_k") return run<block_q2_K>(w, n, k, argv[5], argv[6]);
    if (fmt == "q3_k") return run<block_q3_K>(w, n, k, argv[5], argv[6]);
    if (fmt == "q4_k") return run<block_q4_K>(w, n, k, argv[5], argv[6]);
    if (fmt == "q5_k") return run<block_q5_K>(w, n, k, argv[5], argv[6]);
    if (fmt == "q6_k") return run<block_q6_K>(w, n, k, argv[5], argv[6]);
    std::fprintf(stderr, "unknown format %s\n", fmt.c_str());
    return 2;
}
