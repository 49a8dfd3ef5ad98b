// StepProgram: a straight-line list of dispatcher calls, recorded once from an eager run of a step
// function (../compiled_step.py) and replayed here in one C++ loop. A replay pays one boxed
// dispatcher call per op instead of the Python frames, module calls and argument parsing around
// it. Tensors the step makes live in numbered slots, each reset after its last use (so a replay
// holds no more memory than the eager step); every other argument is a constant captured with
// the call (weights, the KV caches, the static inputs, whose values may change between replays).
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

namespace {

// A Python number where the schema takes a Tensor (x * 2): a wrapped number, as the Python binding
// makes it, so that type promotion treats it as a number and not as a 0-dim tensor
at::Tensor wrapped_number(const c10::Scalar& s) {
  auto t = c10::scalar_to_tensor(s);
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

struct Arg {
  int kind;                      // 0: constant, 1: slot, 2: list of slots (a Tensor[] or Tensor?[] argument)
  bool optional_list;            // kind 2 for a Tensor?[] argument
  c10::IValue value;             // the constant
  std::vector<int64_t> slots;    // kind 1: one slot; kind 2: one per element
};

struct Call {
  c10::OperatorHandle op;
  std::vector<Arg> args;         // one per schema argument
  std::vector<int64_t> outs;     // a slot per returned tensor (Tensor[] returns flattened), -1: unused
  std::vector<int64_t> release;  // slots whose last reader is this call
};

class StepProgram {
 public:
  explicit StepProgram(int64_t num_slots) : slots_(num_slots) {}

  // args: per schema argument, ("c", value) a constant, ("s", slot) or ("l", [slots])
  void add(const std::string& name, const std::string& overload, const py::list& args,
           const std::vector<int64_t>& outs, const std::vector<int64_t>& release) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = op.schema();
    TORCH_CHECK(args.size() == schema.arguments().size(), name, ": ", args.size(), " arguments for a schema of ",
                schema.arguments().size());
    Call call{op, {}, outs, release};
    for (size_t i = 0; i < args.size(); ++i) {
      auto item = args[i].cast<py::tuple>();
      const auto tag = item[0].cast<std::string>();
      Arg a{0, false, c10::IValue(), {}};
      if (tag == "c") {
        const auto& type = schema.arguments()[i].type();
        if (type->kind() == c10::TypeKind::TensorType && py::isinstance<py::bool_>(item[1])) {
          a.value = wrapped_number(c10::Scalar(item[1].cast<bool>()));
        } else if (type->kind() == c10::TypeKind::TensorType && py::isinstance<py::int_>(item[1])) {
          a.value = wrapped_number(c10::Scalar(item[1].cast<int64_t>()));
        } else if (type->kind() == c10::TypeKind::TensorType && py::isinstance<py::float_>(item[1])) {
          a.value = wrapped_number(c10::Scalar(item[1].cast<double>()));
        } else {
          a.value = torch::jit::toIValue(item[1], type);
        }
      } else if (tag == "s") {
        a.kind = 1;
        a.slots.push_back(item[1].cast<int64_t>());
      } else {
        TORCH_CHECK(tag == "l", "argument tag must be c, s or l");
        a.kind = 2;
        a.slots = item[1].cast<std::vector<int64_t>>();
        const auto& type = schema.arguments()[i].type();
        TORCH_CHECK(type->kind() == c10::TypeKind::ListType, name, ": a list of slots for a non-list argument");
        a.optional_list = type->containedType(0)->kind() == c10::TypeKind::OptionalType;
      }
      for (auto s : a.slots) TORCH_CHECK(s >= 0 && s < static_cast<int64_t>(slots_.size()), "slot out of range");
      call.args.push_back(std::move(a));
    }
    for (auto s : outs) TORCH_CHECK(s < static_cast<int64_t>(slots_.size()), "slot out of range");
    calls_.push_back(std::move(call));
  }

  void set_results(const std::vector<int64_t>& results) { results_ = results; }

  std::vector<at::Tensor> run() {
    c10::InferenceMode guard;
    torch::jit::Stack stack;
    for (const auto& call : calls_) {
      stack.clear();
      for (const auto& a : call.args) {
        if (a.kind == 0) {
          stack.push_back(a.value);
        } else if (a.kind == 1) {
          stack.push_back(slots_[a.slots[0]]);
        } else if (a.optional_list) {
          c10::List<std::optional<at::Tensor>> list;
          for (auto s : a.slots) list.push_back(slots_[s].toTensor());
          stack.push_back(std::move(list));
        } else {
          c10::List<at::Tensor> list;
          for (auto s : a.slots) list.push_back(slots_[s].toTensor());
          stack.push_back(std::move(list));
        }
      }
      call.op.callBoxed(&stack);
      size_t k = 0;
      for (auto& v : stack) {
        if (v.isTensorList()) {
          for (const auto& t : v.toTensorList()) store(call.outs, k++, t);
        } else if (v.isTensor()) {
          store(call.outs, k++, v.toTensor());
        }
      }
      for (auto s : call.release) slots_[s] = c10::IValue();
    }
    std::vector<at::Tensor> out;
    for (auto s : results_) {
      out.push_back(slots_[s].toTensor());
      slots_[s] = c10::IValue();
    }
    return out;
  }

  int64_t size() const { return static_cast<int64_t>(calls_.size()); }

 private:
  void store(const std::vector<int64_t>& outs, size_t k, const at::Tensor& t) {
    if (k < outs.size() && outs[k] >= 0) slots_[outs[k]] = t;
  }

  std::vector<c10::IValue> slots_;
  std::vector<Call> calls_;
  std::vector<int64_t> results_;
};

}  // namespace

void bind_replay(py::module& m) {
  py::class_<StepProgram>(m, "StepProgram")
      .def(py::init<int64_t>())
      .def("add", &StepProgram::add)
      .def("set_results", &StepProgram::set_results)
      .def("run", &StepProgram::run, py::call_guard<py::gil_scoped_release>())
      .def("__len__", &StepProgram::size);
}
