#include "pipemat/remat/values.h"

#include <sstream>

namespace pipemat::remat {
namespace {

void visit(const c10::IValue& value, std::string& path, const LeafVisitor& fn) {
  if (value.isTensor()) {
    const auto& t = value.toTensor();
    if (t.defined()) fn(path, t);
    return;
  }
  auto nested = [&](size_t i, const c10::IValue& child) {
    const size_t len = path.size();
    path += "[" + std::to_string(i) + "]";
    visit(child, path, fn);
    path.resize(len);
  };
  if (value.isTuple()) {
    const auto& elems = value.toTupleRef().elements();
    for (size_t i = 0; i < elems.size(); ++i) nested(i, elems[i]);
  } else if (value.isList()) {
    auto list = value.toListRef();
    for (size_t i = 0; i < list.size(); ++i) nested(i, list[i]);
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) {
      const size_t len = path.size();
      std::ostringstream key;
      if (entry.key().isString()) {
        key << "['" << entry.key().toStringRef() << "']";
      } else {
        key << "[" << entry.key() << "]";
      }
      path += key.str();
      visit(entry.value(), path, fn);
      path.resize(len);
    }
  }
}

}  // namespace

void for_each_tensor_leaf(const c10::IValue& value, const std::string& root,
                          const LeafVisitor& fn) {
  std::string path = root;
  visit(value, path, fn);
}

c10::IValue map_tensor_leaves(const c10::IValue& value, const LeafMapper& map) {
  if (value.isTensor()) {
    const auto& t = value.toTensor();
    return t.defined() ? c10::IValue(map(t)) : value;
  }
  if (value.isTuple()) {
    const auto& elems = value.toTupleRef().elements();
    std::vector<c10::IValue> out;
    out.reserve(elems.size());
    for (const auto& e : elems) out.push_back(map_tensor_leaves(e, map));
    return c10::ivalue::Tuple::create(std::move(out));
  }
  if (value.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : value.toTensorList()) out.push_back(t.defined() ? map(t) : t);
    return out;
  }
  if (value.isList()) {
    auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    out.reserve(list.size());
    for (const c10::IValue& e : list) out.push_back(map_tensor_leaves(e, map));
    return out;
  }
  if (value.isGenericDict()) {
    auto dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& entry : dict) out.insert(entry.key(), map_tensor_leaves(entry.value(), map));
    return out;
  }
  return value;
}

int64_t count_tensor_leaves(const c10::IValue& value) {
  int64_t n = 0;
  for_each_tensor_leaf(value, "", [&](const std::string&, const at::Tensor&) { ++n; });
  return n;
}

std::string describe_tensor(const at::Tensor& t) {
  if (!t.defined()) return "undefined tensor";
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << " " << t.sizes();
  return os.str();
}

}  // namespace pipemat::remat
