// The raw kernels behind ops.cpp's torch ops: plain pointers and sizes, each documented at its
// definition (sparse_mla.cpp, head.cpp, indexer.cpp, elementwise.cpp). DSV4_NS is the build's own
// namespace (`build.py` passes -DDSV4_NS=dsv4batch_<isa>), so that libraries built for two
// instruction sets can live in one process without their symbols meeting.
#pragma once
#include "common.h"

#ifndef DSV4_NS
#define DSV4_NS dsv4batch_default
#endif

namespace DSV4_NS {

int sparse_mla_fwd(const float *q, const float *kv, const int32_t *idx, const int32_t *len, const float *sink,
                   float *out, float *maxl, float *lse, int64_t s_q, int64_t h, int64_t d, int64_t d_v,
                   int64_t s_kv, int64_t topk, float scale, int threads);
int head_panel_width();
int head_stats(const float *x, const float *panels, int64_t n, int64_t K, int64_t V, const int64_t *targets,
               float *sums, float *peaks, float *picked, int threads);
int indexer_tile();
int indexer_topk(const float *q, const float *w, const float *kt, const int64_t *lo, const int64_t *n, int64_t s,
                 int64_t H, int64_t D, int64_t E, int64_t width, int64_t *out, int threads);
int rope_inplace(float *x, const float *cos, const float *sin, int64_t n, int64_t m, int64_t d, int64_t rd,
                 int threads);
int hc_collapse_fwd(const float *x, const float *w, float *out, int64_t n, int64_t hc, int64_t H, int threads);
int hc_post_fwd(const float *x, const float *out, const float *post, const float *comb, float *y, int64_t n,
                int64_t hc, int64_t H, int threads);
int hc_pre_fwd(const float *mixes, const float *x, const float *scale, const float *base, int64_t n, int64_t hc,
               int64_t H, int64_t iters, float eps, float *post, float *comb, float *collapsed, int threads);
int rms_norm_fwd(const float *x, const float *w, float *y, int64_t n, int64_t d, float eps, int threads);
int swiglu_fwd(const float *gate, const float *up, float *y, int64_t n, float limit, int threads);

}  // namespace DSV4_NS
