// The MLX primitive that runs a row kernel on MLX's CPU stream, and reading its 2-D inputs.
#pragma once

#include "runtime.h"

namespace {

// A primitive whose CPU work is `fn(inputs, outputs)` on row-contiguous inputs, run on MLX's CPU stream.
template <class Impl>
class RowPrimitive : public mx::Primitive {
 public:
  RowPrimitive(mx::Stream stream, Impl impl) : mx::Primitive(stream), impl_(std::move(impl)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> ins, outs;
    for (auto& in : inputs) {
      encoder.set_input_array(in);
      ins.push_back(mx::array::unsafe_weak_copy(in));
    }
    for (auto& out : outputs) {
      encoder.set_output_array(out);
      outs.push_back(mx::array::unsafe_weak_copy(out));
    }
    dispatch(encoder, [impl = impl_, ins = std::move(ins), outs = std::move(outs)]() mutable { impl(ins, outs); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string("samplec_native.") + Impl::kName + " runs on the CPU only");
  }

  const char* name() const override {
    return Impl::kName;
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const RowPrimitive<Impl>*>(&other);
    return o != nullptr && o->impl_ == impl_;
  }

 private:
  Impl impl_;
};

template <class Impl>
std::vector<mx::array> make(Impl impl, std::vector<mx::Shape> shapes, std::vector<mx::Dtype> dtypes,
                            std::vector<mx::array> inputs) {
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays(std::move(shapes), dtypes, std::make_shared<RowPrimitive<Impl>>(stream, impl),
                                inputs);
}

// A per-row parameter as the kernels read it through Rows (which broadcasts a dimension of size 1): [B, 1], [B],
// [1], [1, 1] or a scalar.
bool is_column(const mx::array& a, int B) {
  const bool rows = a.ndim() >= 1 && (a.shape(0) == B || a.shape(0) == 1);
  return a.ndim() == 0 || (a.ndim() == 1 && rows) || (a.ndim() == 2 && rows && a.shape(1) == 1);
}

void need_rows(const mx::array& a, mx::Dtype dtype, const char* what) {
  if (a.dtype() != dtype || a.ndim() != 2) {
    throw std::invalid_argument(std::string(what) + ": expected a 2-D array of the right dtype");
  }
}

// Element (r, c) of a 2-D input with any strides (MLX views: slices, broadcasts, transposes).
template <class T>
struct Rows {
  const T* p;
  int64_t s0, s1;
  // (a 1-D or 0-D array reads as a column; a dimension of size 1 broadcasts)
  explicit Rows(const mx::array& a)
      : p(a.data<T>()), s0(a.ndim() >= 1 && a.shape(0) > 1 ? a.strides()[0] : 0),
        s1(a.ndim() >= 2 && a.shape(1) > 1 ? a.strides()[1] : 0) {}
  T operator()(int64_t r, int64_t c) const { return p[r * s0 + c * s1]; }
  // Row r as a contiguous pointer: in place, or (a strided view) copied into buf.
  const T* row(int64_t r, int64_t n, std::vector<T>& buf) const {
    if (s1 == 1) return p + r * s0;
    buf.resize(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = (*this)(r, i);
    return buf.data();
  }
};

}  // namespace
