// Model FLOPs counted from the models' shapes, checked against hand counts and against the
// DiT paper's figure; throughput figures and MFU from a window's samples/s.
#include <gtest/gtest.h>

#include "models/dit.h"
#include "models/models.h"
#include "kernels/cpu_matmul.h"
#include "trainer/throughput.h"

namespace tessera::trainer {
namespace {

// A GPT of width 32, 2 layers, context 16, vocabulary 256, untied head, counted by hand:
// per token, per block: c_attn 2*32*96 = 6144, attn c_proj 2*32*32 = 2048, c_fc 2*32*128 =
// 8192, mlp c_proj 2*128*32 = 8192 -> 24576; two blocks 49152; lm_head 2*32*256 = 16384;
// 65536 per token, 16 tokens: 1048576. Attention per block: q k^T 2*16*16*32 = 16384 and
// weights x v the same, 32768; two blocks 65536. Total 1114112.
TEST(ThroughputTest, GptForwardFlopsMatchAHandCount) {
  models::ModelOptions o;
  o.arch = "gpt";
  o.vocab_size = 256;
  o.context = 16;
  o.embed_dim = 32;
  o.layers = 2;
  o.heads = 4;
  o.tie_head = false;
  const auto model = models::makeModel(o);
  EXPECT_DOUBLE_EQ(model->forwardFlopsPerSample(), 1114112.0);
  EXPECT_EQ(model->tokensPerSample(), 16);
  o.tie_head = true;  // the tied head is the same product with wte's transpose
  EXPECT_DOUBLE_EQ(models::makeModel(o)->forwardFlopsPerSample(), 1114112.0);
}

// The DiT paper (Peebles & Xie, Table 4) gives DiT-XL/2 on 32x32x4 latents 118.6 GFLOPs,
// counted as fvcore does (one per multiply-add, attention included); ours counts two.
TEST(ThroughputTest, DitXl2ForwardFlopsMatchTheDitPaper) {
  models::ModelOptions o;
  o.arch = "dit";
  o.patch_size = 2;
  o.embed_dim = 1152;
  o.layers = 28;
  o.heads = 16;
  o.mlp_ratio = 4.0;
  models::DiT model(o, {4, 32, 32}, /*classes=*/1000);  // deferred parameters: nothing allocated
  const double gflops = model.forwardFlopsPerSample() / 2.0 / 1e9;
  EXPECT_NEAR(gflops, 118.6, 118.6 * 0.01) << gflops;
}

// The MLP families: every linear once per sample.
TEST(ThroughputTest, MlpForwardFlopsAreTheirLinears) {
  models::ModelOptions o;
  o.arch = "mlp";
  o.vocab_size = 256;
  o.context = 16;
  o.embed_dim = 8;
  o.hidden = {64, 32};
  // 16*8 -> 64 -> 32 -> 256: 2 * (128*64 + 64*32 + 32*256)
  const auto model = models::makeModel(o);
  EXPECT_DOUBLE_EQ(model->forwardFlopsPerSample(), 2.0 * (128 * 64 + 64 * 32 + 32 * 256));
  EXPECT_EQ(model->tokensPerSample(), 1);
}

TEST(ThroughputTest, FiguresOfAWindow) {
  // 1000 samples/s over 4 ranks of 3 MFLOP each against a peak of 1.5 GFLOP/s per rank.
  auto f = throughputFigures(1000, 4, 3e6, 16, false, 1.5e9);
  EXPECT_DOUBLE_EQ(f.at("tokens_per_sec"), 16000);
  EXPECT_DOUBLE_EQ(f.at("tokens_per_sec_per_rank"), 4000);
  EXPECT_DOUBLE_EQ(f.at("tflops_per_rank"), 250 * 3e6 / 1e12);
  EXPECT_DOUBLE_EQ(f.at("mfu"), 0.5);
  f = throughputFigures(1000, 4, 0, 0, true, 1.5e9);  // images, FLOPs not counted: no MFU
  EXPECT_DOUBLE_EQ(f.at("images_per_sec"), 1000);
  EXPECT_DOUBLE_EQ(f.at("images_per_sec_per_rank"), 250);
  EXPECT_FALSE(f.count("mfu"));
  EXPECT_FALSE(f.count("mfu_datasheet"));
  f = throughputFigures(1000, 4, 3e6, 16, false, 1.5e9, 3e9);  // a datasheet peak twice the probe's
  EXPECT_DOUBLE_EQ(f.at("mfu"), 0.5);
  EXPECT_DOUBLE_EQ(f.at("mfu_datasheet"), 0.25);
}

// The clock from dependent adds is a clock (a VM's TSC is no upper bound: boost runs above
// it), and the datasheet peak is the product its line spells out. Where this core is in the
// table, the probe (oneDNN sgemm on one thread) cannot beat the datasheet: if it does, the
// table's FLOP per cycle is wrong for this core.
TEST(ThroughputTest, DatasheetPeakIsFlopsPerCycleTimesTheMeasuredClock) {
  const double hz = measureCoreClockHz(0.05);
  EXPECT_GT(hz, 0.3e9);
  EXPECT_LT(hz, 8e9);
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const DatasheetPeak fp32 = cpuDatasheetPeak(at::kFloat, 1);
  const DatasheetPeak bf16 = cpuDatasheetPeak(at::kBFloat16, 2);
  if (fp32.flopsPerCycle == 0) {
    at::set_num_threads(threads);
    GTEST_SKIP() << "this core is not in the datasheet table";
  }
  EXPECT_DOUBLE_EQ(fp32.flopsPerSec, fp32.flopsPerCycle * fp32.clockHz);
  EXPECT_NE(fp32.source.find(" fp32 FLOP/cycle x "), std::string::npos) << fp32.source;
  EXPECT_NE(fp32.source.find("GFLOP/s per rank"), std::string::npos) << fp32.source;
  EXPECT_GE(bf16.flopsPerCycle, fp32.flopsPerCycle);
  EXPECT_DOUBLE_EQ(bf16.flopsPerSec, bf16.flopsPerCycle * bf16.clockHz * 2);
  const PeakFlops probe = peakFlops(0, at::kCPU, at::kFloat);
  at::set_num_threads(threads);
  EXPECT_LE(probe.flopsPerSec, 1.1 * fp32.flopsPerSec) << "probe " << probe.flopsPerSec / 1e9 << " GFLOP/s above "
                                                       << fp32.source;
}

// The probe measures something plausible: a CPU does more than 100 MFLOP/s and less than
// a GPU's peak.
TEST(ThroughputTest, MatmulProbeMeasuresARate) {
  const PeakFlops peak = peakFlops(0, at::kCPU, at::kFloat);
  EXPECT_GT(peak.flopsPerSec, 1e8);
  EXPECT_LT(peak.flopsPerSec, 1e15);
  // On a CPU in fp32 the peak is oneDNN's (the core's speed), whatever BLAS LibTorch uses,
  // and the path the model's products take is named with its speed.
  const std::string probe = tessera::kernels::haveOnednn() ? "1024x1024 fp32 matrix products through oneDNN sgemm"
                                                           : "1024x1024 fp32 matrix products through LibTorch";
  EXPECT_NE(peak.source.find(probe), std::string::npos) << peak.source;
  EXPECT_NE(peak.matmulPath.find(" GFLOP/s per rank on 1024x1024 fp32 matrix products"), std::string::npos)
      << peak.matmulPath;
  EXPECT_EQ(peak.slowWarning, "") << "the path in use is the one measured as the peak";
  const PeakFlops configured = peakFlops(7e12, at::kCPU, at::kFloat);
  EXPECT_DOUBLE_EQ(configured.flopsPerSec, 7e12);
  EXPECT_EQ(configured.source, "run.peak_flops");
  // bf16: LibTorch's own product (it sends bf16 to oneDNN itself); no path line.
  const PeakFlops bf16 = peakFlops(0, at::kCPU, at::kBFloat16);
  EXPECT_GT(bf16.flopsPerSec, 1e8);
  EXPECT_NE(bf16.source.find("1024x1024 bf16 matrix products on cpu"), std::string::npos) << bf16.source;
  EXPECT_EQ(bf16.matmulPath, "");
}

// run.matmul_dtype bf16: fp32 parameters whose Linear products run in bf16. The peak is then
// oneDNN's bf16 matmul, named with its kernel and its speed against fp32's.
TEST(ThroughputTest, Bf16LinearsAreMeasuredAgainstTheBf16Probe) {
  tessera::kernels::setCpuLinearDtype(at::kBFloat16);
  const PeakFlops peak = peakFlops(0, at::kCPU, at::kFloat);
  tessera::kernels::setCpuLinearDtype(at::kFloat);
  EXPECT_GT(peak.flopsPerSec, 1e8);
  EXPECT_NE(peak.source.find("1024x1024 bf16 matrix products (run.matmul_dtype bf16"),
            std::string::npos)
      << peak.source;
  EXPECT_NE(peak.matmulPath.find("Linear layers in bf16 (" + tessera::kernels::bf16MatmulKernel() + ", fp32 accumulation)"),
            std::string::npos)
      << peak.matmulPath;
  EXPECT_NE(peak.matmulPath.find("x fp32's "), std::string::npos) << peak.matmulPath;
}

}  // namespace
}  // namespace tessera::trainer
