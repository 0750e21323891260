// qkv/modules/additive.hpp — one decoder step of additive (Bahdanau)
// attention over a batch of encoder outputs.
//
// The PyTorch module it matches (the seq2seq decoder attention of the
// project's reference essay on attention):
//
//   class Attention(nn.Module):
//       def __init__(self, hidden_size):
//           self.attn = nn.Linear(hidden_size * 2, hidden_size)
//           self.v = nn.Linear(hidden_size, 1, bias=False)
//       def forward(self, decoder_hidden, encoder_outputs):
//           src_len = encoder_outputs.shape[1]
//           decoder_hidden_repeated = decoder_hidden.unsqueeze(1).repeat(1, src_len, 1)
//           concat = torch.cat((encoder_outputs, decoder_hidden_repeated), dim=2)
//           energy = torch.tanh(self.attn(concat))
//           attention_scores = self.v(energy).squeeze(2)
//           attn_weights = F.softmax(attention_scores, dim=1)
//           context_vector = torch.bmm(attn_weights.unsqueeze(1), encoder_outputs).squeeze(1)
//           return context_vector, attn_weights
//
// The concatenation puts the encoder output FIRST: columns [0, H) of
// attn.weight multiply encoder_outputs (W_e) and columns [H, 2H) the
// decoder hidden state (W_h). Modules that concatenate (hidden, encoder)
// instead need those two column blocks swapped before loading.
//
// Per batch row b and source position s < len_b:
//   energy[b, s] = tanh(W_e enc[b, s] + W_h hidden[b] + attn.bias)   [H]
//   score[b, s]  = v . energy[b, s]
//   weights[b]   = softmax over s < len_b of score[b, s]; exactly 0 for
//                  s >= len_b (not the -1e10 fill's tiny leakage)
//   context[b]   = sum_s weights[b, s] enc[b, s]
// The step is one call of qkv::attention with Score::additive: the decoder
// state is the single query [B, 1, 1, H], the encoder outputs are keys and
// values [B, S, 1, H], W_q = W_h and W_k = W_e (column blocks of attn.weight,
// never copied apart), v = v.weight, bias = attn.bias, key_lengths =
// source_lengths, and the weights are its probabilities. The backward is
// qkv::attention_backward without the forward's out and lse: in f32 the
// fast additive backward computes the weights from its own projections (no
// forward runs again); f64 runs the forward, then the reference. With
// d_weights, the values are [enc | I_S] ([B, S, 1, H + S]), whose outputs are
// [context | weights], so that d_weights enters as part of dout. The
// [B, S, 2H] concatenation is never built.
// Threads: the library's kernels and GEMMs split work by sizes only, so
// results are bitwise identical for any thread count.
//
// Shapes:
//   decoder_hidden    [B, H]      f32, f64, bf16 or f16, any strides
//   encoder_outputs   [B, S, H]   dtype of decoder_hidden, any strides
//   source_lengths    [B] valid positions per row, each in [0, S]; empty = all S
//   context           [B, H]      dtype of the inputs
//   weights           [B, S]      dtype of the inputs; rows sum to 1, and a row of
//                                 length 0 is all zeros (its context is 0)
// Computes in f64 for f64 inputs (on the library's reference backend:
// plain loops in double, far slower than f32), else in f32 (the fused
// forward and the fast additive backward); 16-bit inputs and weights are
// widened exactly and the outputs rounded once.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "qkv/modules/parameter.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {

struct AdditiveAttentionOutput {
  Tensor context;  // [B, H]
  Tensor weights;  // [B, S]
};

struct AdditiveAttentionGradients {
  Tensor d_decoder_hidden;   // [B, H], dtype of decoder_hidden
  Tensor d_encoder_outputs;  // [B, S, H], dtype of encoder_outputs; 0 at padded positions
};

class AdditiveAttention {
 public:
  // Zeroed parameters (fill them with init_uniform or load_parameters).
  // Throws qkv::Error unless hidden_size >= 1 and dtype is floating.
  explicit AdditiveAttention(std::int64_t hidden_size, DType dtype = DType::f32);

  std::int64_t hidden_size() const { return hidden_; }

  // The step above. Throws qkv::Error, listing every problem, for inputs of
  // the wrong rank, sizes or dtype, or lengths of the wrong count or range.
  AdditiveAttentionOutput forward(ConstTensorView decoder_hidden, ConstTensorView encoder_outputs,
                                  std::span<const std::int64_t> source_lengths = {}) const;

  // Given the forward's inputs and the gradients of the loss with respect to
  // its outputs, d_context [B, H] and d_weights [B, S] (undefined = zero),
  // returns the input gradients and adds to the gradients of attn.weight,
  // attn.bias and v.weight. Padded positions contribute nothing, whatever
  // they hold.
  AdditiveAttentionGradients backward(ConstTensorView decoder_hidden,
                                      ConstTensorView encoder_outputs,
                                      std::span<const std::int64_t> source_lengths,
                                      ConstTensorView d_context, ConstTensorView d_weights = {});

  // "attn.weight", "attn.bias", "v.weight", each preceded by `prefix`.
  NamedParameters named_parameters(std::string_view prefix = "");

  Parameter attn_weight;  // [H, 2H]: columns [0, H) act on the encoder output, [H, 2H) on the
                          // decoder hidden state
  Parameter attn_bias;    // [H]
  Parameter v_weight;     // [1, H]

 private:
  std::int64_t hidden_ = 0;
};

}  // namespace qkv::nn
