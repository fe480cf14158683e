// Global-norm gradient clipping over sharded gradients (see grad_clip.h).
#include "optim/grad_clip.h"

#include <c10/core/GradMode.h>
#include <cmath>

#include "common/errors.h"
#include "distributed/communicator.h"
#include "optim/cpu_kernels.h"

namespace tessera::optim {

bool GradNorm::finite() const { return std::isfinite(norm); }

namespace {

// The real rows of a gradient, flat (empty when there are none).
at::Tensor realRowsOf(const at::Tensor& grad, const dtensor::ShardSpec& spec) {
  if (!grad.defined() || spec.localRows() == 0 || spec.rowNumel() == 0) return at::Tensor();
  return spec.realRows(grad.detach().reshape({-1}));
}

// A sum of squares kept where the gradients are: a double on the host for CPU gradients
// (one pass each); for accelerator gradients, their norms in one multi-tensor operation
// (_foreach_norm: a few launches for all of them instead of three per gradient), summed on
// the device, so that a step reads the device back once.
struct SquareSum {
  double host = 0.0;
  std::vector<at::Tensor> deviceGrads;  // fp32 or fp64, flat real rows

  void add(const at::Tensor& grad, const dtensor::ShardSpec& spec) {
    const at::Tensor real = realRowsOf(grad, spec);
    if (!real.defined()) return;
    if (real.device().is_cpu()) {
      host += localSquaredNorm(grad, spec);
      return;
    }
    const bool wide = real.scalar_type() == at::kDouble || real.scalar_type() == at::kFloat;
    deviceGrads.push_back(wide ? real : real.to(at::kFloat));
  }
  // The device part as a double scalar tensor (undefined when there is none).
  at::Tensor deviceSum() const {
    if (deviceGrads.empty()) return at::Tensor();
    return at::stack(at::_foreach_norm(deviceGrads, 2)).to(at::kDouble).square().sum();
  }
  // The sum as a [1] double tensor on `where`.
  at::Tensor on(c10::Device where) const {
    at::Tensor out = at::full({1}, host, at::TensorOptions().dtype(at::kDouble).device(where));
    const at::Tensor device = deviceSum();
    if (device.defined()) out.add_(device.reshape({1}).to(where));
    return out;
  }
  double value() const {
    const at::Tensor device = deviceSum();
    return device.defined() ? host + device.item<double>() : host;
  }
};

}  // namespace

double localSquaredNorm(const at::Tensor& grad, const dtensor::ShardSpec& spec) {
  c10::NoGradGuard noGrad;
  const at::Tensor real = realRowsOf(grad, spec);
  if (!real.defined()) return 0.0;
  if (real.device().is_cpu() && real.scalar_type() == at::kFloat && real.is_contiguous()) {
    return squaredNorm(real.data_ptr<float>(), real.numel());  // one pass, no temporaries
  }
  return real.to(at::kDouble).square().sum().item<double>();
}

double globalGradNorm(const std::vector<dtensor::ShardedParam>& params, distributed::Communicator& comm,
                      const at::Tensor& sumAlongside) {
  const bool alongside = sumAlongside.defined() && sumAlongside.numel() > 0;
  TESSERA_CHECK_AS(UsageError, !alongside || (sumAlongside.scalar_type() == at::kDouble &&
                                              sumAlongside.device().is_cpu() && sumAlongside.is_contiguous()),
                   "globalGradNorm: the values summed alongside must be a contiguous CPU double tensor, got ",
                   sumAlongside.toString());
  c10::NoGradGuard noGrad;
  SquareSum sharded, replicated;
  bool communicate = false;
  for (const dtensor::ShardedParam& p : params) {
    const dtensor::ShardSpec& spec = p.spec;
    if (spec.placement() == dtensor::Placement::kShard0 && spec.worldSize() > 1) {
      TESSERA_CHECK(spec.worldSize() == comm.worldSize() && spec.rank() == comm.rank(), "globalGradNorm: spec ",
                    spec.str(), " is not over ", comm.describe());
      sharded.add(p.grad, spec);
      communicate = true;
    } else {
      replicated.add(p.grad, spec);
    }
  }
  double shardedTotal = 0.0;
  if (communicate) {
    // One all-reduce on the communicator's device (the GPU for nccl), one read back.
    const c10::Device where = comm.tensorDevice();
    at::Tensor sum = sharded.on(where);
    if (alongside) sum = at::cat({sum, sumAlongside.reshape({-1}).to(where)});
    comm.allReduce(sum, distributed::ReduceOp::kSum);
    const at::Tensor back = sum.cpu();
    shardedTotal = back[0].item<double>();
    if (alongside) sumAlongside.view({-1}).copy_(back.narrow(0, 1, sumAlongside.numel()));
  } else {
    shardedTotal = sharded.value();
    if (alongside) distributed::allReduceHostTensor(comm, sumAlongside, distributed::ReduceOp::kSum);
  }
  return std::sqrt(shardedTotal + replicated.value());
}

double clipCoefficient(double norm, double maxNorm) {
  if (maxNorm <= 0 || !std::isfinite(norm)) return 1.0;
  return std::min(1.0, maxNorm / (norm + 1e-6));
}

GradNorm clipGradNorm(const std::vector<dtensor::ShardedParam>& params, double maxNorm, distributed::Communicator& comm,
                      const at::Tensor& sumAlongside) {
  GradNorm result;
  result.norm = globalGradNorm(params, comm, sumAlongside);
  result.clipCoef = clipCoefficient(result.norm, maxNorm);
  if (result.clipCoef < 1.0) {
    c10::NoGradGuard noGrad;
    for (const dtensor::ShardedParam& p : params) {
      if (p.grad.defined()) p.grad.mul_(result.clipCoef);
    }
  }
  return result;
}

}  // namespace tessera::optim
