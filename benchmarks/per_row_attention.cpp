// A hand-written per-row forward of the fused polar attention core, for benchmarks/attention_kernel_bound.py only:
// the yardstick that the package's compiled kernel (inductor's loops) is measured against.  Not used by the model.
//
// One (slice, query row) at a time, everything of that row in registers or L1: the exact chords
// 1/2 ||q_i - k_j||^2 by coordinate differences (App. D.1), Eq. 5's s^2 = 1/2 (cosh(a_i - b_j) - 1) + 1/2 sinh a_i
// sinh b_j chord with cosh(x) - 1 from e^{a_i} e^{-b_j} and e^{-a_i} e^{b_j}, or 2 sinh^2(x/2) by its series below
// |x| = 3 (stable_math.pair_cosh_minus_one), w = sqrt(4 k scale) asinh s (Eq. 9), the softmax exp(w_min^2 - w^2)
// with weights below the cutoff set to zero, the centroid sums (T, E, V) of Eq. 22, ||V||, u_hat = V / ||V|| and
// S = sum_j p_ij sinh beta_j 1/2 ||u_hat - v_j||^2 / sum_j p_ij.  Vectorised over the keys with at::vec (Sleef).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

float horizontal_sum(const Vec& v) {
  alignas(64) float lanes[kLanes];
  v.store(lanes);
  float sum = 0.f;
  for (int64_t k = 0; k < kLanes; ++k) sum += lanes[k];
  return sum;
}

float horizontal_min(const Vec& v) {
  alignas(64) float lanes[kLanes];
  v.store(lanes);
  float low = INFINITY;
  for (int64_t k = 0; k < kLanes; ++k) low = std::min(low, lanes[k]);
  return low;
}

// 1/2 ||x - y_j||^2 for the kLanes keys at column j of y_t (coordinate-major, row stride `stride`).
Vec half_square_distance(const float* x, const float* y_t, int64_t stride, int64_t j, int64_t dim) {
  Vec acc(0.f);
  for (int64_t c = 0; c < dim; ++c) {
    Vec diff = Vec(x[c]) - Vec::loadu(y_t + c * stride + j);
    acc = at::vec::fmadd(diff, diff, acc);
  }
  return acc * Vec(0.5f);
}

// 2 sinh^2(x/2) = cosh x - 1 for |x| < 3: sinh(y)/y = sum_k y^(2k) / (2k+1)!, seven terms (y = x/2).
Vec cosh_minus_one_series(const Vec& x) {
  const Vec y = x * Vec(0.5f), z = y * y;
  Vec series(1.f / 6227020800.f);  // 1/13!
  for (float inverse : {1.f / 39916800.f, 1.f / 362880.f, 1.f / 5040.f, 1.f / 120.f, 1.f / 6.f, 1.f})
    series = at::vec::fmadd(series, z, Vec(inverse));
  const Vec sinh_y = y * series;
  return Vec(2.f) * sinh_y * sinh_y;
}

}  // namespace

// Inputs (float32, contiguous): directions uq (G, N, D), uk (G, M, D), uv (G, M, D); radii over sqrt(k) a (G, N),
// b (G, M); e^a, e^{-a}, e^b, e^{-b}, sinh a, sinh b, sinh beta, cosh beta, e^{-beta}; root_coef = sqrt(4 k scale)
// (G,).  Returns
// (lse (G, N), sums = (T, E, V) (G, N, D+2), ||V|| (G, N), u_hat (G, N, D), S (G, N)).
std::vector<torch::Tensor> forward(torch::Tensor uq, torch::Tensor uk, torch::Tensor uv, torch::Tensor a,
                                   torch::Tensor b, torch::Tensor exp_a, torch::Tensor exp_minus_a,
                                   torch::Tensor exp_b, torch::Tensor exp_minus_b, torch::Tensor sinh_a,
                                   torch::Tensor sinh_b,
                                   torch::Tensor sinh_beta, torch::Tensor cosh_beta, torch::Tensor exp_beta,
                                   torch::Tensor root_coef, double cutoff) {
  const int64_t groups = uq.size(0), rows = uq.size(1), keys = uk.size(1), dim = uq.size(2);
  const int64_t padded = (keys + kLanes - 1) / kLanes * kLanes;
  auto lse = torch::empty({groups, rows}, uq.options());
  auto sums = torch::empty({groups, rows, dim + 2}, uq.options());
  auto v_norm = torch::empty({groups, rows}, uq.options());
  auto u_hat = torch::empty({groups, rows, dim}, uq.options());
  auto big_s = torch::empty({groups, rows}, uq.options());
  const float *q_ptr = uq.data_ptr<float>(), *k_ptr = uk.data_ptr<float>(), *v_ptr = uv.data_ptr<float>();
  const float *a_ptr = a.data_ptr<float>(), *b_ptr = b.data_ptr<float>();
  const float *ea_ptr = exp_a.data_ptr<float>(), *ema_ptr = exp_minus_a.data_ptr<float>();
  const float *eb_ptr = exp_b.data_ptr<float>(), *emb_ptr = exp_minus_b.data_ptr<float>();
  const float *sa_ptr = sinh_a.data_ptr<float>(), *sb_ptr = sinh_b.data_ptr<float>();
  const float *sbeta_ptr = sinh_beta.data_ptr<float>(), *cbeta_ptr = cosh_beta.data_ptr<float>();
  const float *ebeta_ptr = exp_beta.data_ptr<float>(), *coef_ptr = root_coef.data_ptr<float>();
  float *lse_ptr = lse.data_ptr<float>(), *sums_ptr = sums.data_ptr<float>(), *norm_ptr = v_norm.data_ptr<float>();
  float *hat_ptr = u_hat.data_ptr<float>(), *s_ptr = big_s.data_ptr<float>();
  const Vec one(1.f), half(0.5f), three(3.f), cut(static_cast<float>(cutoff));

  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    // per slice, keys padded to whole vectors: transposed directions, radii and value terms (padding: weight 0)
    std::vector<float> k_t(dim * padded), v_t(dim * padded), b_row(padded), eb_row(padded), emb_row(padded),
        sb_row(padded), sbeta(padded), cbeta(padded), ebeta(padded), w_sq(padded), probs(padded);
    std::vector<Vec> v_sum(dim, Vec(0.f));
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t j = 0; j < padded; ++j) {
        const bool real = j < keys;
        for (int64_t c = 0; c < dim; ++c) {
          k_t[c * padded + j] = real ? k_ptr[(g * keys + j) * dim + c] : 0.f;
          v_t[c * padded + j] = real ? v_ptr[(g * keys + j) * dim + c] : 0.f;
        }
        b_row[j] = real ? b_ptr[g * keys + j] : 0.f;
        eb_row[j] = real ? eb_ptr[g * keys + j] : 1.f;
        emb_row[j] = real ? emb_ptr[g * keys + j] : 1.f;
        sb_row[j] = real ? sb_ptr[g * keys + j] : 0.f;
        sbeta[j] = real ? sbeta_ptr[g * keys + j] : 0.f;
        cbeta[j] = real ? cbeta_ptr[g * keys + j] : 0.f;
        ebeta[j] = real ? ebeta_ptr[g * keys + j] : 0.f;
      }
      const Vec coef(coef_ptr[g]);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t row = g * rows + i;
        const float* q = q_ptr + row * dim;
        const Vec a_i(a_ptr[row]), half_sinh_a(0.5f * sa_ptr[row]);
        const Vec exp_a_i(ea_ptr[row]), exp_minus_a_i(ema_ptr[row]);
        Vec low(INFINITY);
        for (int64_t j = 0; j < padded; j += kLanes) {  // Eq. 5 and 9: w^2 per pair
          Vec chord = half_square_distance(q, k_t.data(), padded, j, dim);
          Vec x = a_i - Vec::loadu(&b_row[j]);
          Vec exp_sum = at::vec::fmadd(exp_a_i, Vec::loadu(&emb_row[j]), exp_minus_a_i * Vec::loadu(&eb_row[j]));
          Vec cosh_minus = Vec::blendv(at::vec::fmsub(exp_sum, half, one), cosh_minus_one_series(x), x.abs() < three);
          Vec s_sq = at::vec::fmadd(cosh_minus, half, chord * Vec::loadu(&sb_row[j]) * half_sinh_a);
          Vec root = (one + s_sq).sqrt();
          Vec w = (s_sq.sqrt() + s_sq / (one + root)).log1p() * coef;
          Vec sq = w * w;
          if (j + kLanes > keys) sq = Vec::set(Vec(INFINITY), sq, keys - j);  // padding: no weight
          sq.store(&w_sq[j]);
          low = at::vec::minimum(low, sq);
        }
        const float w_min_sq = horizontal_min(low);
        Vec total(0.f), t_sum(0.f), e_sum(0.f);
        for (auto& v : v_sum) v = Vec(0.f);
        for (int64_t j = 0; j < padded; j += kLanes) {  // softmax weights and the centroid sums (Eq. 22)
          Vec x = Vec(w_min_sq) - Vec::loadu(&w_sq[j]);
          Vec p = Vec::blendv(at::vec::maximum(x, cut).exp(), Vec(0.f), x < cut);
          p.store(&probs[j]);
          total = total + p;
          t_sum = at::vec::fmadd(p, Vec::loadu(&cbeta[j]), t_sum);
          e_sum = at::vec::fmadd(p, Vec::loadu(&ebeta[j]), e_sum);
          Vec p_sinh = p * Vec::loadu(&sbeta[j]);
          for (int64_t c = 0; c < dim; ++c) v_sum[c] = at::vec::fmadd(p_sinh, Vec::loadu(&v_t[c * padded + j]), v_sum[c]);
        }
        const float denominator = horizontal_sum(total);
        float* out = sums_ptr + row * (dim + 2);
        out[0] = horizontal_sum(t_sum) / denominator;
        out[1] = horizontal_sum(e_sum) / denominator;
        float norm_sq = 0.f;
        for (int64_t c = 0; c < dim; ++c) {
          out[2 + c] = horizontal_sum(v_sum[c]) / denominator;
          norm_sq += out[2 + c] * out[2 + c];
        }
        const float norm = std::sqrt(norm_sq);
        norm_ptr[row] = norm;
        float* hat = hat_ptr + row * dim;
        for (int64_t c = 0; c < dim; ++c) hat[c] = norm > 0.f ? out[2 + c] / norm : (c == 0 ? 1.f : 0.f);
        Vec s(0.f);
        for (int64_t j = 0; j < padded; j += kLanes) {  // S: softmax-weighted chords to the mean direction
          Vec chord = half_square_distance(hat, v_t.data(), padded, j, dim);
          s = at::vec::fmadd(chord * Vec::loadu(&probs[j]), Vec::loadu(&sbeta[j]), s);
        }
        s_ptr[row] = horizontal_sum(s) / denominator;
        lse_ptr[row] = std::log(denominator) - w_min_sq;
      }
    }
  });
  return {lse, sums, v_norm, u_hat, big_s};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward, "per-row polar attention forward"); }
