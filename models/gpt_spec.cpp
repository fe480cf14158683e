// model.arch gpt: a GPT-2-style decoder over token windows (nanoGPT's names); its code is
// gpt.cpp.
#include "common/errors.h"
#include "datasets/dataset.h"
#include "models/architecture.h"
#include "models/model_options.h"

namespace tessera::models {

std::shared_ptr<TrainModel> makeGpt(const ModelOptions& options, const datasets::DataSpec& data, c10::Device device);

namespace {

std::vector<KeyProblem> checkGpt(const ModelOptions& m, const ArchitectureContext& context) {
  std::vector<KeyProblem> problems;
  if (m.embed_dim % m.heads != 0) {
    problems.push_back({"heads", strCat(m.heads, " does not divide ", context.keyPrefix, "embed_dim (", m.embed_dim, ")")});
  }
  if (context.dataKind == "tensors") problems.push_back({"arch", "gpt needs token data (data.kind text or tokens), not tensors"});
  return problems;
}

std::string gptFileProblem(const ModelOptions& m, const datasets::DataSpec&, const FileShapes& file) {
  if (m.layers > file.tensors) return strCat("says layers ", m.layers, ", but the file holds only ", file.tensors, " tensors");
  if (m.embed_dim > file.largestDim) {
    return strCat("says embed_dim ", m.embed_dim, ", wider than any tensor of the file (largest dimension ",
                  file.largestDim, ")");
  }
  return "";
}

// The attention scores of a micro-batch and the logits: what grows with the context and
// the vocabulary.
std::vector<PlannedTensor> gptPlanned(const ModelOptions& m, const datasets::DataSpec&, int64_t microBatch) {
  const double context = static_cast<double>(m.context), batch = static_cast<double>(microBatch);
  return {{"the attention scores of a micro-batch", batch * static_cast<double>(m.heads) * context * context * 4.0,
           "model.context, model.heads, data.micro_batch"},
          {"the logits of a micro-batch", batch * context * static_cast<double>(m.vocab_size) * 4.0,
           "model.context, model.vocab_size, data.micro_batch"}};
}

}  // namespace

const ArchitectureSpec& gptArchitecture() {
  static const ArchitectureSpec spec{"gpt",
                                     "a GPT-2-style decoder with nanoGPT's names (token data)",
                                     "Gpt",
                                     /*denoiser=*/false,
                                     /*predictsEveryPosition=*/true,
                                     {"vocab_size", "context", "embed_dim", "layers", "heads", "tie_head"},
                                     checkGpt,
                                     /*resolve=*/nullptr,
                                     gptFileProblem,
                                     gptPlanned,
                                     TESSERA_MODEL_FACTORY(makeGpt)};
  return spec;
}

}  // namespace tessera::models
