// Global-norm gradient clipping over sharded gradients (see grad_clip.h).
#include "sharding/grad_clip.h"

#include <c10/core/GradMode.h>
#include <cmath>

#include "common/errors.h"
#include "distributed/communicator.h"
#include "sharding/cpu_kernels.h"

namespace tessera::sharding {

bool GradNorm::finite() const { return std::isfinite(norm); }

double localSquaredNorm(const at::Tensor& grad, const ShardSpec& spec) {
  if (!grad.defined() || spec.localRows() == 0 || spec.rowNumel() == 0) return 0.0;
  c10::NoGradGuard noGrad;
  const at::Tensor real = spec.realRows(grad.detach().reshape({-1}));
  if (real.device().is_cpu() && real.scalar_type() == at::kFloat && real.is_contiguous()) {
    return squaredNorm(real.data_ptr<float>(), real.numel());  // one pass, no temporaries
  }
  return real.to(at::kDouble).square().sum().item<double>();
}

double globalGradNorm(const std::vector<ShardedParam>& params, distributed::Communicator& comm,
                      const at::Tensor& sumAlongside) {
  const bool alongside = sumAlongside.defined() && sumAlongside.numel() > 0;
  TESSERA_CHECK_AS(UsageError, !alongside || (sumAlongside.scalar_type() == at::kDouble &&
                                              sumAlongside.device().is_cpu() && sumAlongside.is_contiguous()),
                   "globalGradNorm: the values summed alongside must be a contiguous CPU double tensor, got ",
                   sumAlongside.toString());
  double sharded = 0.0, replicated = 0.0;
  bool communicate = false;
  for (const ShardedParam& p : params) {
    const ShardSpec& spec = p.spec;
    if (spec.placement() == Placement::kShard0 && spec.worldSize() > 1) {
      TESSERA_CHECK(spec.worldSize() == comm.worldSize() && spec.rank() == comm.rank(), "globalGradNorm: spec ",
                    spec.str(), " is not over ", comm.describe());
      sharded += localSquaredNorm(p.grad, spec);
      communicate = true;
    } else {
      replicated += localSquaredNorm(p.grad, spec);
    }
  }
  if (communicate) {
    at::Tensor sum = at::full({1}, sharded, at::TensorOptions().dtype(at::kDouble));
    if (alongside) sum = at::cat({sum, sumAlongside.reshape({-1})});
    comm.allReduce(sum, distributed::ReduceOp::kSum);
    sharded = sum[0].item<double>();
    if (alongside) sumAlongside.view({-1}).copy_(sum.narrow(0, 1, sumAlongside.numel()));
  } else if (alongside) {
    comm.allReduce(sumAlongside, distributed::ReduceOp::kSum);
  }
  return std::sqrt(sharded + replicated);
}

double clipCoefficient(double norm, double maxNorm) {
  if (maxNorm <= 0 || !std::isfinite(norm)) return 1.0;
  return std::min(1.0, maxNorm / (norm + 1e-6));
}

GradNorm clipGradNorm(const std::vector<ShardedParam>& params, double maxNorm, distributed::Communicator& comm,
                      const at::Tensor& sumAlongside) {
  GradNorm result;
  result.norm = globalGradNorm(params, comm, sumAlongside);
  result.clipCoef = clipCoefficient(result.norm, maxNorm);
  if (result.clipCoef < 1.0) {
    c10::NoGradGuard noGrad;
    for (const ShardedParam& p : params) {
      if (p.grad.defined()) p.grad.mul_(result.clipCoef);
    }
  }
  return result;
}

}  // namespace tessera::sharding
