// Tessera as a library, several models: an encoder (zero3, its blocks are units) and a
// decoder (zero2) trained together as an autoencoder, each by its own strategy and fused
// optimizer; a sharded EMA of the decoder; one checkpoint holding both models, both
// optimizers and the EMA, written halfway and loaded into fresh models that finish the
// run — which must end exactly where the uninterrupted run ends. The same wiring serves a
// generator and a critic, or any models with a step of your own.
//
//   two_models_one_checkpoint --dir runs/two_models
//   tessera-run --standalone --nproc-per-node 2 two_models_one_checkpoint --dir runs/two_models
//
// Exits 0 when the loss fell and the resumed run equals the uninterrupted one, 1 otherwise
// (the test that builds this against the installed package checks that).
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "checkpoint/checkpointer.h"
#include "checkpoint/exporter.h"
#include "checkpoint/reader.h"
#include "checkpoint/state.h"
#include "distributed/rank_env.h"
#include "distributed/runtime.h"
#include "ema/ema_manager.h"
#include "ema/strategy_ema.h"
#include "sharding/fully_shard.h"

namespace {

using namespace tessera;

constexpr int64_t kWidth = 16, kCode = 4, kSteps = 40;

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width) : fc(register_module("fc", torch::nn::Linear(width, width))) {}
  at::Tensor forward(const at::Tensor& x) { return x + torch::tanh(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

// Two residual blocks (the zero3 units), then a projection to the code.
struct EncoderImpl : torch::nn::Module {
  EncoderImpl() : proj(register_module("proj", torch::nn::Linear(kWidth, kCode))) {
    blocks = register_module("blocks", sharding::UnitList<Block>());
    for (int i = 0; i < 2; ++i) blocks->emplace_back(kWidth);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& block : *blocks) h = block->forward(h);
    return proj(h);
  }
  sharding::UnitList<Block> blocks{nullptr};
  torch::nn::Linear proj;
};
TORCH_MODULE(Encoder);

struct DecoderImpl : torch::nn::Module {
  DecoderImpl()
      : hidden(register_module("hidden", torch::nn::Linear(kCode, kWidth))),
        out(register_module("out", torch::nn::Linear(kWidth, kWidth))) {}
  at::Tensor forward(const at::Tensor& z) { return out(torch::tanh(hidden(z))); }
  torch::nn::Linear hidden, out;
};
TORCH_MODULE(Decoder);

// Everything one run holds: two models with their strategies (each with its fused
// optimizer) and the decoder's EMA.
struct Parts {
  sharding::Unit<Encoder> encoder{nullptr};
  Decoder decoder{nullptr};
  std::unique_ptr<sharding::ShardingStrategy> encoderStrategy, decoderStrategy;
  std::unique_ptr<ema::ShardedModelEMAManager> ema;

  explicit Parts(const std::shared_ptr<distributed::Communicator>& comm) {
    torch::manual_seed(0);  // the same initial weights on every rank and in every Parts
    encoder = sharding::Unit<Encoder>();
    decoder = Decoder();
    encoderStrategy = sharding::fullyShard(*encoder, comm);
    sharding::StrategyOptions zero2;
    zero2.strategy = sharding::StrategyKind::kZero2;
    decoderStrategy = sharding::makeStrategy(*decoder, comm, zero2);
    ema::EmaOptions emaOptions;
    emaOptions.decays = {0.9};
    emaOptions.prefix = "decoder_ema";
    ema = std::make_unique<ema::ShardedModelEMAManager>(emaOptions);
    ema::followStrategy(*ema, *decoderStrategy);
  }

  // The one checkpoint: each component under its key, and the key of the model it serves
  // (recorded for tessera-ckpt info). The same keys in every run are what lets a
  // checkpoint saved by N ranks load into M.
  checkpoint::StateMap states() {
    return {{"encoder", *encoderStrategy}, {"optim/encoder", encoderStrategy->optimizer(), "encoder"},
            {"decoder", *decoderStrategy}, {"optim/decoder", decoderStrategy->optimizer(), "decoder"},
            {"ema", *ema, "decoder"}};
  }

  // One step on this rank's slice of the global batch; returns the mean loss over all ranks.
  // The data lies in a kCode-dimensional subspace, so the autoencoder can reconstruct it.
  double step(int64_t step, distributed::Communicator& comm) {
    const int rank = comm.rank(), world = comm.worldSize();
    torch::manual_seed(7);
    const at::Tensor mixing = torch::randn({kCode, kWidth}) / std::sqrt(static_cast<double>(kCode));
    torch::manual_seed(100 + step);  // every rank draws the same global batch
    const at::Tensor x = torch::randn({8 * world, kCode}).mm(mixing).narrow(0, 8 * rank, 8);
    encoderStrategy->zeroGrad();
    decoderStrategy->zeroGrad();
    const at::Tensor loss = torch::mse_loss(decoder->forward(encoder->forward(x)), x);
    loss.backward();
    // Each strategy reduces its own gradients and steps its own optimizer; the loss rides
    // on the decoder's gradient-norm all-reduce.
    encoderStrategy->step(1e-2);
    sharding::StepSums sums;
    sums.add("loss", loss.item<double>());
    decoderStrategy->step(1e-2, &sums);
    ema->update(step + 1);
    return sums["loss"] / world;
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "runs/two_models";
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--dir") dir = argv[i + 1];
  }
  try {
    auto runtime = distributed::Runtime::init(distributed::RankEnv::fromEnvironment());
    auto comm = runtime->comm();

    // The uninterrupted run, with one checkpoint halfway.
    Parts run(comm);
    checkpoint::Checkpointer checkpointer(dir + "/checkpoints", comm);
    double first = 0, last = 0;
    for (int64_t step = 0; step < kSteps; ++step) {
      last = run.step(step, *comm);
      if (step == 0) first = last;
      if (step + 1 == kSteps / 2) checkpointer.save(step + 1, run.states());
    }
    checkpointer.finish();

    // Fresh models loaded from the checkpoint (each rank reads only its shards), then the
    // second half again.
    Parts resumed(comm);
    const auto loaded = checkpoint::load(dir + "/checkpoints/step_00000020", resumed.states(), comm.get());
    double resumedLast = 0;
    for (int64_t step = loaded.step; step < kSteps; ++step) resumedLast = resumed.step(step, *comm);

    // The decoder's EMA as one safetensors file (rank 0 writes it).
    checkpoint::ExportOptions exportOptions;
    exportOptions.what = "decoder_ema";
    checkpoint::exportOnline(resumed.states(), runtime->cpuComm().get(), dir + "/decoder_ema.safetensors", exportOptions);
    const bool same = std::abs(resumedLast - last) <= 1e-6 * std::abs(last);
    if (comm->rank() == 0) {
      std::printf("two_models_one_checkpoint: %d rank(s), encoder zero3 + decoder zero2, loss %.4f -> %.4f; resumed "
                  "from %s: %.6f (%s the uninterrupted run)\n",
                  comm->worldSize(), first, last, loaded.dir.c_str(), resumedLast, same ? "equals" : "DIFFERS from");
    }
    return last < first * 0.5 && same ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "two_models_one_checkpoint: error: %s\n", e.what());
    return 1;
  }
}
