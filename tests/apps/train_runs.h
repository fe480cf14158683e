// What the end-to-end training suites share (DiT, webdataset): the command that starts
// tessera-train on N ranks, running a command that must succeed, and comparing two runs'
// losses and EMA exports (parity of sharded, resumed and one-process runs).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>

namespace tessera::test {

// tessera-train, under tessera-run --standalone --nproc-per-node `ranks` when ranks > 1.
std::string trainCommand(int ranks);

// Runs `command` (sh -c, stdin from /dev/null), fails the test unless it exits 0; returns
// its output.
std::string mustRun(const std::string& command, int timeoutSeconds = 600);

// Every logged loss, eval_loss and eval_loss_ema of two runs' metrics.jsonl agree to 1e-5
// relative, window by window.
void expectSameLosses(const std::string& referenceDir, const std::string& otherDir, const std::string& what);

// <runDir>/export/<name>.safetensors.
std::map<std::string, at::Tensor> exportOf(const std::string& runDir, const std::string& name = "model_ema");

// <runDir>/export/generator_ema.safetensors.
std::map<std::string, at::Tensor> emaExport(const std::string& runDir);

// The two runs' generator_ema exports hold the same tensors, equal to 1e-4 relative.
void expectCloseExports(const std::string& referenceDir, const std::string& otherDir, const std::string& what);

}  // namespace tessera::test
