// Small sequence models trained with the qkv::nn modules' backward passes,
// for `qkv demo`: a token embedding, sinusoidal positions, self-attention
// (qkv::nn::MultiHeadAttention) with a residual, a layer norm and an output
// projection (qkv::nn::Linear), or a decoder step of additive attention
// (qkv::nn::AdditiveAttention) over the encoded input; softmax cross-entropy
// and Adam.
//
// Every task maps a window of kWindow digit slots to kWindow output slots.
// A sequence holds 8 to 12 digits; the slots it does not fill hold the
// padding token. Each output slot copies one input slot fixed in advance,
// so the attention map the model should learn is known:
//   reverse           the digits right-aligned in the input and left-aligned
//                     in the output: output slot i = input slot 11 - i (the
//                     anti-diagonal), one head.
//   rotate            the digits left-aligned in the input: output slot i =
//                     input slot (i + 6) mod 12 (the window's halves
//                     exchanged: two diagonals, offset by 6), 2 heads. One
//                     head usually learns the whole map and the other idles
//                     on a padding slot; they may also share it.
//   reverse_additive  the reversal of `reverse`, decoded one output slot at a
//                     time as in a seq2seq decoder: step i (i < n for n
//                     digits) attends to the encoded digits (padding masked
//                     with source_lengths) with the additive (Bahdanau)
//                     score; expected alignment, in window slots: the
//                     anti-diagonal.
// Positions are sinusoidal (qkv::sinusoidal_positions, base 100, times 4),
// added to the token vectors. Training (Adam, batches of 64 sequences, 32 for
// the additive decoder, which runs 12 steps on each) stops early once the
// held-out accuracy reaches 99.8%. It draws fresh sequences from
// std::mt19937_64 (own integer draws, so every platform gets the same data),
// skipping the held-out sequences the accuracy is measured on. For a given
// seed and thread count the run is bitwise reproducible.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace qkv::tools {

inline constexpr std::int64_t kWindow = 12;  // slots per sequence
inline constexpr std::int64_t kMinDigits = 8;
inline constexpr std::int64_t kMaxDigits = 12;

enum class TaskKind { reverse, rotate, reverse_additive };

struct TrainOptions {
  std::int64_t steps = 0;  // step budget; 0 = the task's default
  std::uint64_t seed = 1;
  std::ostream* progress = nullptr;  // progress, or none
  bool live = false;                 // one rewritten line (a terminal) instead of plain lines
  std::int64_t threads = 0;          // OpenMP threads; 0 = as set
};

struct TrainResult {
  TaskKind kind = TaskKind::reverse;
  std::string title;      // "reversal: dot-product self-attention, 1 head"
  std::string expected;   // the pattern the attention should learn
  std::string file_stem;  // "reversal" (for pictures and .npy files)
  std::int64_t heads = 1;
  std::int64_t steps_run = 0;
  double seconds = 0.0;
  double accuracy = 0.0;          // whole sequences right, held-out set
  double token_accuracy = 0.0;    // output slots (decoder steps) right, held-out set
  double pattern_mass = 0.0;      // mean weight (heads averaged) on the expected key, held-out set
  std::vector<double> head_mass;  // the same per head
  std::vector<float> losses;      // training loss per step
  std::uint64_t parameter_hash = 0;  // FNV-1a of every parameter's bytes

  // The attention of one held-out example: [heads, rows, cols] (rows =
  // output slots, cols = input slots) with labels, and the expected key per row.
  std::vector<float> example_maps;
  std::vector<std::string> row_labels, col_labels;
  // The weights averaged over the held-out set, [heads, rows, cols].
  std::vector<float> mean_maps;
  std::vector<std::int64_t> expected_key;  // [rows]
};

// Trains one task from scratch; throws qkv::Error on a library error.
TrainResult train_task(TaskKind kind, const TrainOptions& options);

// The default step budget of a task.
std::int64_t default_steps(TaskKind kind);

}  // namespace qkv::tools
