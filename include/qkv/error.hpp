// qkv/error.hpp — the one exception type qkv throws for bad input.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace qkv {

// Thrown for every invalid argument. `what()` names the argument, the expected
// and the actual value; when several checks fail, it lists every reason, one a
// line, and `reasons()` returns them separately.
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& reason) : Error(std::vector<std::string>{reason}) {}
  explicit Error(std::vector<std::string> reasons)
      : std::invalid_argument(join(reasons)), reasons_(std::move(reasons)) {}

  const std::vector<std::string>& reasons() const noexcept { return reasons_; }

 private:
  static std::string join(const std::vector<std::string>& reasons) {
    if (reasons.size() == 1) return "qkv: " + reasons[0];
    std::string text = "qkv: " + std::to_string(reasons.size()) + " problems:";
    for (const std::string& r : reasons) text += "\n  - " + r;
    return text;
  }

  std::vector<std::string> reasons_;
};

}  // namespace qkv
