// AdamW over flat fp32 arrays, one pass in chunks, parallel over chunks with OpenMP.
// Roundings follow torch's CPU kernels: lerp and addcmul use a fused multiply-add.
#include <cmath>
#include <cstdint>
#include <algorithm>
#ifdef _OPENMP
#include <omp.h>
#endif
extern "C" void memlab_adamw(float* p, const float* g, float* m, float* v, int64_t n, int64_t chunk,
                             int threads, int decay_on, float decay, float w1, int small_w1,
                             float beta2, float w2, float neg_step, float bc2_sqrt, float eps) {
  const int64_t nchunks = (n + chunk - 1) / chunk;
#ifdef _OPENMP
  #pragma omp parallel for schedule(static) num_threads(threads)
#endif
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
    const float w1m1 = w1 - 1.0f;
    #pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
      const float gi = g[i];
      float pi = p[i];
      if (decay_on) pi = pi * decay;
      const float mi0 = m[i];
      // torch lerp: weight < 0.5 ? self + w*(end-self) : end - (end-self)*(1-w), as an fma
      const float mi = small_w1 ? std::fma(w1, gi - mi0, mi0) : std::fma(w1m1, gi - mi0, gi);
      const float vi = std::fma(w2 * gi, gi, v[i] * beta2);   // mul_(beta2).addcmul_(g, g, 1-beta2)
      const float denom = std::sqrt(vi) / bc2_sqrt + eps;
      p[i] = pi + (neg_step * mi) / denom;                      // addcdiv_(m, denom, -step_size)
      m[i] = mi;
      v[i] = vi;
    }
  }
}
