// MoonEP planner, C++ twin of moonep/planner.py::_plan_torch (same steps, same tie-breaking,
// bit-identical output). CPU, int64. See the Python module docstring for the algorithm:
//   0. tolerance: when every rank's load is <= capacity (rows_per_rank + floor(tolerance * it)),
//      plan no replicas at all (everything stays home; feasible, receive counts <= capacity)
//   1. keep home experts (ascending count, ties by id) up to the target T; the rest is excess
//   2. excess pieces (descending, ties by id) x spare ranks (descending, ties by rank) on two lines;
//      each non-empty intersection is one replica
//   3. at most M replicas per rank: keep the M largest (ties by expert id); dropped rows stay home
//   4. split each copy (home, then replicas by rank) over sources by the same line trick
//   5. receive offsets: per rank, slot-major then source
// The torch version evaluates the line intersections densely ([E, R] and [S, R, J]); here they are
// two-pointer merges, so the cost is O(E log E + R*J + E*R) with small constants.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <tuple>
#include <vector>

namespace {

struct Replica {
  int64_t e, r, a;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> plan(const at::Tensor& counts_in,
                                                                            int64_t T, int64_t M,
                                                                            int64_t capacity) {
  TORCH_CHECK(counts_in.dim() == 2, "moonep planner: counts_RE must be [R, E]");
  TORCH_CHECK(M >= 0, "moonep planner: moonep.max_replicas_per_rank must be >= 0");
  at::Tensor counts = counts_in.to(at::kCPU, at::kLong).contiguous();
  const int64_t R = counts.size(0), E = counts.size(1);
  TORCH_CHECK(R >= 1 && E % R == 0, "moonep planner: num_experts must be divisible by parallel.ep");
  const int64_t E_loc = E / R, J = E_loc + M;
  const int64_t* C = counts.data_ptr<int64_t>();  // C[s * E + e]

  bool nonneg = true;
  std::vector<int64_t> c_E(E, 0);
  for (int64_t s = 0; s < R; ++s)
    for (int64_t e = 0; e < E; ++e) {
      c_E[e] += C[s * E + e];
      nonneg = nonneg && C[s * E + e] >= 0;
    }
  int64_t total = 0;
  std::vector<int64_t> load_R(R, 0);
  for (int64_t e = 0; e < E; ++e) {
    load_R[e / E_loc] += c_E[e];
    total += c_E[e];
  }

  // 0. tolerance: no replicas at all when the most loaded rank stays within capacity
  const bool within = *std::max_element(load_R.begin(), load_R.end()) <= std::max(capacity, T);

  // 1. keep at home
  std::vector<int64_t> x_E(E, 0), idx(E_loc);
  for (int64_t r = 0; r < R && !within; ++r) {
    const int64_t* c = c_E.data() + r * E_loc;
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t i, int64_t j) { return c[i] < c[j]; });
    int64_t excl = 0;
    for (int64_t i : idx) {
      const int64_t keep = std::min(c[i], std::max<int64_t>(T - excl, 0));
      x_E[r * E_loc + i] = c[i] - keep;
      excl += c[i];
    }
  }

  // 2. excess line x spare line
  std::vector<int64_t> p_order(E), r_order(R), sp_R(R);
  std::iota(p_order.begin(), p_order.end(), 0);
  std::stable_sort(p_order.begin(), p_order.end(), [&](int64_t i, int64_t j) { return x_E[i] > x_E[j]; });
  for (int64_t r = 0; r < R; ++r) sp_R[r] = std::max<int64_t>(T - load_R[r], 0);
  std::iota(r_order.begin(), r_order.end(), 0);
  std::stable_sort(r_order.begin(), r_order.end(), [&](int64_t i, int64_t j) { return sp_R[i] > sp_R[j]; });
  std::vector<std::vector<Replica>> by_rank(R);
  {
    int64_t pi = 0, ri = 0, p_lo = 0, r_lo = 0;
    while (pi < E && ri < R) {
      const int64_t e = p_order[pi], r = r_order[ri];
      const int64_t p_hi = p_lo + x_E[e], r_hi = r_lo + sp_R[r];
      const int64_t len = std::min(p_hi, r_hi) - std::max(p_lo, r_lo);
      if (len > 0) by_rank[r].push_back({e, r, len});
      if (p_hi <= r_hi) {
        p_lo = p_hi;
        ++pi;
      } else {
        r_lo = r_hi;
        ++ri;
      }
    }
  }

  // 3. replica bound; slots in expert-id order
  bool bound_ok = true;
  int64_t num_replicas = 0;
  std::vector<int64_t> h_E(c_E);
  std::vector<std::vector<Replica>> by_expert(E);  // filled in rank order below
  at::Tensor slot_t = at::full({R, J}, -1, counts.options());
  int64_t* slot = slot_t.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < E_loc; ++j) slot[r * J + j] = r * E_loc + j;
    auto& v = by_rank[r];
    if (static_cast<int64_t>(v.size()) > M) {
      bound_ok = false;
      std::stable_sort(v.begin(), v.end(), [](const Replica& x, const Replica& y) {
        return x.a > y.a || (x.a == y.a && x.e < y.e);
      });
      v.resize(M);
    }
    std::sort(v.begin(), v.end(), [](const Replica& x, const Replica& y) { return x.e < y.e; });
    for (size_t k = 0; k < v.size(); ++k) {
      slot[r * J + E_loc + static_cast<int64_t>(k)] = v[k].e;
      h_E[v[k].e] -= v[k].a;
      by_expert[v[k].e].push_back({static_cast<int64_t>(E_loc + k), r, v[k].a});  // e field: slot j
    }
    num_replicas += static_cast<int64_t>(v.size());
  }

  // 4. split each copy over sources: copies of e = home, then replicas by rank (ranks visited in order)
  at::Tensor rows_t = at::zeros({R, R, J}, counts.options());
  int64_t* rows = rows_t.data_ptr<int64_t>();  // rows[(s * R + r) * J + j]
  std::vector<Replica> copies;
  at::Tensor counts_ES = counts.t().contiguous();  // expert-major: the per-expert source walk is contiguous
  const int64_t* CT = counts_ES.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e) {
    if (c_E[e] == 0) continue;
    copies.clear();
    copies.push_back({e % E_loc, e / E_loc, h_E[e]});
    copies.insert(copies.end(), by_expert[e].begin(), by_expert[e].end());
    int64_t ci = 0, s = 0, c_lo = 0, s_lo = 0;
    const int64_t nc = static_cast<int64_t>(copies.size());
    while (ci < nc && s < R) {
      const int64_t c_hi = c_lo + copies[ci].a, s_hi = s_lo + CT[e * R + s];
      const int64_t len = std::min(c_hi, s_hi) - std::max(c_lo, s_lo);
      if (len > 0) rows[(s * R + copies[ci].r) * J + copies[ci].e] = len;
      if (c_hi <= s_hi) {
        c_lo = c_hi;
        ++ci;
      } else {
        s_lo = s_hi;
        ++s;
      }
    }
  }

  // 5. receive offsets (slot-major, then source) and balance
  at::Tensor offs_t = at::empty({R, R, J}, counts.options());
  int64_t* offs = offs_t.data_ptr<int64_t>();
  // contiguous passes: per-(r, j) totals -> slot bases (exclusive over j) -> running sum over s
  std::vector<int64_t> run((size_t)(R * J), 0);
  for (int64_t s = 0; s < R; ++s)
    for (int64_t rj = 0; rj < R * J; ++rj) run[rj] += rows[s * R * J + rj];
  bool balanced = true;
  for (int64_t r = 0; r < R; ++r) {
    int64_t acc = 0;
    for (int64_t j = 0; j < J; ++j) {
      const int64_t tot = run[r * J + j];
      run[r * J + j] = acc;
      acc += tot;
    }
    balanced = balanced && acc == T;
  }
  for (int64_t s = 0; s < R; ++s)
    for (int64_t rj = 0; rj < R * J; ++rj) {
      offs[s * R * J + rj] = run[rj];
      run[rj] += rows[s * R * J + rj];
    }
  const bool feasible = bound_ok && nonneg && total == R * T && (balanced || within);
  return {slot_t, rows_t, offs_t, at::scalar_tensor(num_replicas, counts.options()),
          at::scalar_tensor(feasible, counts.options().dtype(at::kBool))};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "MoonEP replica planner (C++ twin of moonep/planner.py)";
  m.def("plan", &plan, "plan(counts_RE int64 [R,E], rows_per_rank, max_replicas_per_rank, capacity) -> "
        "(slot_expert_RJ, rows_SRJ, recv_offset_SRJ, num_replicas, feasible)",
        pybind11::arg("counts_RE"), pybind11::arg("rows_per_rank"), pybind11::arg("max_replicas_per_rank"),
        pybind11::arg("capacity"));
}
