// A run of Llama-shaped decoder layers in one call (worker/layers/native_stack.py builds it).
//
// Each layer runs exactly the ops the Python forward runs (worker/models/decoder.py with the
// native kernels: add_rms_norm, the qkv matmul, rotary in place, write_kv,
// paged_attention_rows on q read in place, the o matmul, add_rms_norm, gate_up, silu_mul,
// down; the _bf16 ops for a bf16 model, the _f32 ones for a float32 one), in the same order
// and on the same tensors, so a step's results are bit for bit the Python loop's; what goes
// is the ~25 Python calls per layer between them (a few milliseconds a step on a small model,
// as much as its matmuls at one row).
//
// The ops are called through the dispatcher, handles looked up once: each costs about a
// microsecond, against tens of microseconds through Python.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

namespace {

// kF32 and kInt4F32 serve float32 stacks (gemm_f32, gemm_int4_f32), the others bf16 ones.
enum LinearKind : int64_t {
  kBf16 = 0, kBf16Amx = 1, kInt4 = 2, kF32 = 3, kInt4F32 = 4, kInt4Amx = 5, kInt4Vnni = 6
};

struct Linear {
  at::Tensor packed;
  std::optional<at::Tensor> bias;  // none: no bias
  int64_t kind = kBf16;
  int64_t out_features = 0;
};

struct Layer {
  at::Tensor input_norm, post_norm, k_cache, v_cache;
  Linear qkv, o, gate_up, down;
};

struct Stack {
  std::vector<Layer> layers;
  at::Tensor cos, sin;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double eps = 0.0, scale = 0.0;
  bool f32 = false;          // float32 weights and activations (float32 or float16 caches)
  at::ScalarType cache_dtype = at::kBFloat16;
  bool packed_keys = false;  // the caches' keys packed (attention.cpp's header)
  bool tiles = false;        // attention on the AMX tiles, values packed (attention.cpp)
};

std::mutex registry_mutex;
std::vector<std::shared_ptr<const Stack>> registry;

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Gemm = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&);
using GemmBf16 = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            bool);
using GemmQuant = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                             const c10::optional<at::Tensor>&);
using GemmInt4 = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                            const c10::optional<at::Tensor>&, bool);
using AddNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, double, double);
using Unary = at::Tensor(const at::Tensor&);
using Rotary = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using WriteKv = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                     const at::Tensor&, bool, bool);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, double,
                             const std::optional<at::Tensor>&, double, bool, bool);

// The small ops of one activation dtype.
struct Glue {
  c10::TypedOperatorHandle<AddNorm> add_rms_norm;
  c10::TypedOperatorHandle<Unary> silu_mul;
  c10::TypedOperatorHandle<Rotary> rotary;
};

struct Ops {
  c10::TypedOperatorHandle<GemmBf16> gemm_bf16 = op<GemmBf16>("ladle_native::gemm_bf16");
  c10::TypedOperatorHandle<Gemm> gemm_f32 = op<Gemm>("ladle_native::gemm_f32");
  c10::TypedOperatorHandle<GemmInt4> gemm_int4 = op<GemmInt4>("ladle_native::gemm_int4");
  c10::TypedOperatorHandle<GemmQuant> gemm_int4_f32 = op<GemmQuant>("ladle_native::gemm_int4_f32");
  c10::TypedOperatorHandle<GemmQuant> gemm_int4_q8 = op<GemmQuant>("ladle_native::gemm_int4_q8");
  Glue bf16{op<AddNorm>("ladle_native::add_rms_norm_bf16"), op<Unary>("ladle_native::silu_mul_bf16"),
            op<Rotary>("ladle_native::rotary_bf16_")};
  Glue f32{op<AddNorm>("ladle_native::add_rms_norm_f32"), op<Unary>("ladle_native::silu_mul_f32"),
           op<Rotary>("ladle_native::rotary_f32_")};
  c10::TypedOperatorHandle<WriteKv> write_kv = op<WriteKv>("ladle_native::write_kv");
  c10::TypedOperatorHandle<Attention> attention = op<Attention>("ladle_native::paged_attention_rows");
};

const Ops& ops() {
  static const Ops handles;  // after every op is registered: the first forward, not load
  return handles;
}

// What `Linear.forward` computes with the layer's kernel: the bf16 and float32 kernels add
// the bias inside, the int4 ones after, in the activations' dtype (as `WeightOnlyKernel`).
at::Tensor linear(const Linear& l, const at::Tensor& x) {
  const Ops& o = ops();
  switch (l.kind) {
    case kInt4:
    case kInt4Amx:
    case kInt4F32:
    case kInt4Vnni: {
      at::Tensor out =
          l.kind == kInt4F32    ? o.gemm_int4_f32.call(x, l.packed, l.out_features, c10::nullopt)
          : l.kind == kInt4Vnni ? o.gemm_int4_q8.call(x, l.packed, l.out_features, c10::nullopt)
                                : o.gemm_int4.call(x, l.packed, l.out_features, c10::nullopt,
                                                   l.kind == kInt4Amx);
      return l.bias ? out + *l.bias : out;
    }
    case kF32:
      return o.gemm_f32.call(x, l.packed, l.bias);
    default:
      return o.gemm_bf16.call(x, l.packed, l.bias, l.kind == kBf16Amx);
  }
}

Linear linear_from(const std::vector<at::Tensor>& t, size_t at_index, const int64_t* ints) {
  Linear l;
  l.packed = t[at_index];
  if (t[at_index + 1].numel() > 0) l.bias = t[at_index + 1];
  l.kind = ints[0];
  l.out_features = ints[1];
  TORCH_CHECK(l.kind >= kBf16 && l.kind <= kInt4Vnni, "unknown linear kind");
  return l;
}

constexpr size_t kTensorsPerLayer = 12;  // norms 2, linears 4 x (packed, bias), caches 2
constexpr size_t kIntsPerLayer = 8;      // linears 4 x (kind, out_features)

// tensors: per layer input_norm, post_norm, qkv, qkv_bias, o, o_bias, gate_up, gate_up_bias,
// down, down_bias, k_cache, v_cache (an empty bias: none), then cos and sin; ints: per layer
// (kind, out_features) of qkv, o, gate_up, down; `packed_keys`: the caches' keys are packed;
// `tiles`: attention on the AMX tiles.
// Returns the stack's handle.
int64_t stack_create(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& ints,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                     double scale, bool packed_keys, bool tiles) {
  TORCH_CHECK(tensors.size() >= 2 && (tensors.size() - 2) % kTensorsPerLayer == 0,
              "stack_create: tensors must be 12 per layer, then cos and sin");
  const size_t num_layers = (tensors.size() - 2) / kTensorsPerLayer;
  TORCH_CHECK(ints.size() == num_layers * kIntsPerLayer, "stack_create: 8 ints per layer");
  auto stack = std::make_shared<Stack>();
  for (size_t i = 0; i < num_layers; ++i) {
    const size_t t = i * kTensorsPerLayer;
    const int64_t* n = ints.data() + i * kIntsPerLayer;
    Layer layer;
    layer.input_norm = tensors[t];
    layer.post_norm = tensors[t + 1];
    layer.qkv = linear_from(tensors, t + 2, n);
    layer.o = linear_from(tensors, t + 4, n + 2);
    layer.gate_up = linear_from(tensors, t + 6, n + 4);
    layer.down = linear_from(tensors, t + 8, n + 6);
    layer.k_cache = tensors[t + 10];
    layer.v_cache = tensors[t + 11];
    if (i == 0) stack->cache_dtype = layer.k_cache.scalar_type();
    TORCH_CHECK(layer.k_cache.scalar_type() == stack->cache_dtype,
                "stack_create: every layer's cache must have one dtype");
    stack->f32 = stack->cache_dtype != at::kBFloat16;  // a float16 cache: float32 activations
    for (const Linear* l : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
      TORCH_CHECK((l->kind == kF32 || l->kind == kInt4F32) == stack->f32,
                  "stack_create: a linear's kind does not match the cache's dtype");
    stack->layers.push_back(std::move(layer));
  }
  stack->cos = tensors[tensors.size() - 2];
  stack->sin = tensors[tensors.size() - 1];
  stack->num_heads = num_heads;
  stack->num_kv_heads = num_kv_heads;
  stack->head_dim = head_dim;
  stack->eps = eps;
  stack->scale = scale;
  stack->packed_keys = packed_keys;
  stack->tiles = tiles;
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.push_back(std::move(stack));
  return static_cast<int64_t>(registry.size() - 1);
}

void stack_free(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(registry.size()), "no such stack");
  registry[handle].reset();  // the caches and weights are the model's: only references go
}

std::shared_ptr<const Stack> stack_at(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(registry.size()) && registry[handle],
              "no such stack");
  return registry[handle];
}

// One layer, as DecoderLayer.forward: (previous block's output, stream) -> (output, stream).
std::tuple<at::Tensor, at::Tensor> layer_forward(const Stack& s, const Layer& l,
                                                 const at::Tensor& hidden,
                                                 const at::Tensor& residual,
                                                 const at::Tensor& positions,
                                                 const at::Tensor& slots, const at::Tensor& tables,
                                                 const at::Tensor& lens) {
  const Ops& o = ops();
  const Glue& g = s.f32 ? o.f32 : o.bf16;
  auto [x, stream] = g.add_rms_norm.call(hidden, residual, l.input_norm, s.eps, 0.0);
  const at::Tensor qkv = linear(l.qkv, x);
  const int64_t tokens = qkv.size(0), num_qk = s.num_heads + s.num_kv_heads;
  at::Tensor heads = qkv.view({tokens, -1, s.head_dim});
  g.rotary.call(heads, positions, s.cos, s.sin, num_qk);
  const at::Tensor q = heads.slice(1, 0, s.num_heads);
  const at::Tensor k = heads.slice(1, s.num_heads, num_qk);
  const at::Tensor v = heads.slice(1, num_qk);
  at::Tensor k_cache = l.k_cache, v_cache = l.v_cache;
  o.write_kv.call(k, v, k_cache, v_cache, slots, s.packed_keys, s.tiles);
  const at::Tensor attended = o.attention.call(q, l.k_cache, l.v_cache, tables, lens, s.scale,
                                               std::nullopt, 0.0, s.packed_keys, s.tiles);
  const at::Tensor projected = linear(l.o, attended.view({tokens, -1}));
  auto [y, stream2] = g.add_rms_norm.call(projected, stream, l.post_norm, s.eps, 0.0);
  const at::Tensor out = linear(l.down, g.silu_mul.call(linear(l.gate_up, y)));
  return {out, stream2};
}

std::tuple<at::Tensor, at::Tensor> stack_forward(int64_t handle, const at::Tensor& hidden,
                                                 const at::Tensor& residual,
                                                 const at::Tensor& positions,
                                                 const at::Tensor& slots, const at::Tensor& tables,
                                                 const at::Tensor& lens) {
  const std::shared_ptr<const Stack> stack = stack_at(handle);
  at::Tensor h = hidden, r = residual;
  for (const Layer& layer : stack->layers)
    std::tie(h, r) = layer_forward(*stack, layer, h, r, positions, slots, tables, lens);
  return {h, r};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ladle_native, m) {
  m.def(
      "stack_create(Tensor[] tensors, int[] ints, int num_heads, int num_kv_heads, "
      "int head_dim, float eps, float scale, bool packed_keys=False, bool tiles=False) -> int",
      &stack_create);
  m.def("stack_free(int handle) -> ()", &stack_free);
  m.def(
      "stack_forward(int handle, Tensor hidden, Tensor residual, Tensor positions, "
      "Tensor slots, Tensor tables, Tensor context_lens) -> (Tensor, Tensor)",
      &stack_forward);
}
