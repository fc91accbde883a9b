#pragma once
// Region inputs and outputs as c10::IValue trees.
//
// Every wrapper converts the arguments and the result of the wrapped callable to IValues once,
// so the core sees one representation: tensors, tuples, lists and string-keyed dicts nest
// freely; other values pass through untouched (as opaque capsules when they have no IValue form).
// A tensor leaf is addressed by a path such as `args[1]['mask']` or `output[0][2]`.
//
// Supported typed forms (ValueTraits): at::Tensor, c10::optional<at::Tensor>,
// std::vector<at::Tensor>, std::vector<int64_t>, std::tuple<...> of supported forms,
// c10::Dict<std::string, at::Tensor> (keyword-style named inputs), c10::IValue, bool, integral and
// floating scalars, std::string. Any other type is carried as an opaque value: tensors hidden
// inside it are not seen by remat (they are neither rederived nor detached), which is always safe
// for inputs.

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace pipemat::remat {

// --- typed <-> IValue -------------------------------------------------------------------------

template <typename T>
struct OpaqueBox : torch::CustomClassHolder {
  explicit OpaqueBox(T v) : value(std::move(v)) {}
  T value;
};

template <typename T, typename Enable = void>
struct ValueTraits {
  static c10::IValue to(T v) {
    return c10::IValue::make_capsule(c10::make_intrusive<OpaqueBox<T>>(std::move(v)));
  }
  static T from(const c10::IValue& v) {
    auto capsule = v.toCapsule();
    auto* box = dynamic_cast<OpaqueBox<T>*>(capsule.get());
    TORCH_CHECK(box != nullptr, "pipemat remat: opaque value has an unexpected C++ type");
    return box->value;
  }
};

template <>
struct ValueTraits<at::Tensor> {
  static c10::IValue to(at::Tensor v) { return c10::IValue(std::move(v)); }
  static at::Tensor from(const c10::IValue& v) { return v.isNone() ? at::Tensor() : v.toTensor(); }
};

template <>
struct ValueTraits<c10::IValue> {
  static c10::IValue to(c10::IValue v) { return v; }
  static c10::IValue from(const c10::IValue& v) { return v; }
};

template <>
struct ValueTraits<c10::optional<at::Tensor>> {
  static c10::IValue to(c10::optional<at::Tensor> v) {
    return v.has_value() ? c10::IValue(*v) : c10::IValue();
  }
  static c10::optional<at::Tensor> from(const c10::IValue& v) {
    if (v.isNone()) return c10::nullopt;
    return v.toTensor();
  }
};

template <>
struct ValueTraits<std::vector<at::Tensor>> {
  static c10::IValue to(std::vector<at::Tensor> v) { return c10::IValue(c10::List<at::Tensor>(v)); }
  static std::vector<at::Tensor> from(const c10::IValue& v) {
    if (v.isTensor()) return {v.toTensor()};  // one placeholder (Note [Placeholder leaf count])
    if (v.isNone()) return {};
    return v.toTensorVector();
  }
};

template <>
struct ValueTraits<std::vector<int64_t>> {
  static c10::IValue to(std::vector<int64_t> v) { return c10::IValue(c10::List<int64_t>(v)); }
  static std::vector<int64_t> from(const c10::IValue& v) { return v.toIntVector(); }
};

template <>
struct ValueTraits<c10::Dict<std::string, at::Tensor>> {
  static c10::IValue to(c10::Dict<std::string, at::Tensor> v) { return c10::IValue(v); }
  static c10::Dict<std::string, at::Tensor> from(const c10::IValue& v) {
    return c10::impl::toTypedDict<std::string, at::Tensor>(v.toGenericDict());
  }
};

template <>
struct ValueTraits<std::string> {
  static c10::IValue to(std::string v) { return c10::IValue(std::move(v)); }
  static std::string from(const c10::IValue& v) { return v.toStringRef(); }
};

template <typename T>
struct ValueTraits<T, std::enable_if_t<std::is_arithmetic_v<T>>> {
  static c10::IValue to(T v) {
    if constexpr (std::is_same_v<T, bool>) {
      return c10::IValue(v);
    } else if constexpr (std::is_integral_v<T>) {
      return c10::IValue(static_cast<int64_t>(v));
    } else {
      return c10::IValue(static_cast<double>(v));
    }
  }
  static T from(const c10::IValue& v) {
    if constexpr (std::is_same_v<T, bool>) {
      return v.toBool();
    } else if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(v.toInt());
    } else {
      return static_cast<T>(v.toDouble());
    }
  }
};

template <typename... Ts>
struct ValueTraits<std::tuple<Ts...>> {
  static c10::IValue to(std::tuple<Ts...> v) {
    return std::apply(
        [](auto&&... xs) {
          return c10::IValue(c10::ivalue::Tuple::create(std::vector<c10::IValue>{
              ValueTraits<std::decay_t<decltype(xs)>>::to(std::forward<decltype(xs)>(xs))...}));
        },
        std::move(v));
  }
  static std::tuple<Ts...> from(const c10::IValue& v) {
    if (v.isTensorList()) {  // placeholders of a save_output=false region: one per tensor leaf
      std::vector<c10::IValue> elems;
      for (const at::Tensor& t : v.toTensorList()) elems.emplace_back(t);
      TORCH_CHECK(elems.size() == sizeof...(Ts), "pipemat remat: ", elems.size(),
                  " placeholders for a tuple of ", sizeof...(Ts),
                  " (Note [Placeholder leaf count])");
      return from_impl(elems, std::index_sequence_for<Ts...>{});
    }
    const auto& elems = v.toTupleRef().elements();
    return from_impl(elems, std::index_sequence_for<Ts...>{});
  }

 private:
  template <size_t... I>
  static std::tuple<Ts...> from_impl(const std::vector<c10::IValue>& elems,
                                     std::index_sequence<I...>) {
    return std::tuple<Ts...>(ValueTraits<Ts>::from(elems[I])...);
  }
};

template <typename T>
c10::IValue to_ivalue(T&& v) {
  return ValueTraits<std::decay_t<T>>::to(std::forward<T>(v));
}

template <typename T>
T from_ivalue(const c10::IValue& v) {
  return ValueTraits<T>::from(v);
}

// --- tensor leaves ----------------------------------------------------------------------------

using LeafVisitor = std::function<void(const std::string& path, const at::Tensor& leaf)>;
using LeafMapper = std::function<at::Tensor(const at::Tensor& leaf)>;

// Visits the defined tensor leaves of `value` depth-first in a fixed order.
void for_each_tensor_leaf(const c10::IValue& value, const std::string& root,
                          const LeafVisitor& visit);

// Rebuilds `value` with each defined tensor leaf replaced by map(leaf); containers are copied,
// non-tensor values are shared.
c10::IValue map_tensor_leaves(const c10::IValue& value, const LeafMapper& map);

// Number of defined tensor leaves.
int64_t count_tensor_leaves(const c10::IValue& value);

// "float [4, 8]": how errors describe a tensor.
std::string describe_tensor(const at::Tensor& t);

}  // namespace pipemat::remat
