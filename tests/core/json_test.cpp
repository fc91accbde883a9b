#include "pipemat/core/json.h"

#include <gtest/gtest.h>

#include <string>

namespace pipemat {
namespace {

// The JsonError parse_json throws for `text` (fails the test when it throws none).
JsonError json_error(const std::string& text, int max_depth = kMaxJsonDepth) {
  try {
    parse_json(text, max_depth);
  } catch (const JsonError& e) {
    return e;
  }
  ADD_FAILURE() << "no JsonError for " << text;
  return JsonError(JsonError::Kind::kSyntax, "");
}

TEST(StrictJson, ReadsWhatNlohmannReads) {
  const std::string text =
      R"({"a": 1, "b": [true, null, -2, 18446744073709551615, 1.5e-3, "x\u00e9"],)"
      R"( "c": {"d": {}, "e": []}, "f": "\ud83d\ude00"})";
  EXPECT_EQ(parse_json(text), nlohmann::json::parse(text));
  EXPECT_TRUE(parse_json(text).at("b").at(3).is_number_unsigned());
  EXPECT_EQ(parse_json("  7 \n"), nlohmann::json(7));
  EXPECT_EQ(parse_json("[]"), nlohmann::json::array());
  // The same key in two objects is no duplicate.
  EXPECT_EQ(parse_json(R"({"a": {"k": 1}, "b": {"k": 2}, "k": 3})").at("b").at("k"), 2);
}

TEST(StrictJson, ADuplicateKeyAtAnyDepthNamesTheKeyAndItsObject) {
  JsonError e = json_error(R"({"hidden_size": 64, "hidden_size": 128})");
  EXPECT_EQ(e.kind(), JsonError::Kind::kDuplicateKey);
  EXPECT_STREQ(e.what(), "key 'hidden_size' appears twice in the top-level object");
  EXPECT_EQ(e.key(), "hidden_size");
  EXPECT_TRUE(e.path().empty());

  e = json_error(R"({"rope_parameters": {"rope_theta": 1.0, "rope_type": "x", "rope_theta": 2}})");
  EXPECT_STREQ(e.what(), "key 'rope_theta' appears twice in the object at 'rope_parameters'");
  EXPECT_EQ(e.path(), std::vector<std::string>{"rope_parameters"});

  e = json_error(R"({"a": [1, {"b": {"c": 1}}, {"b": {"c": 1, "c": 1}}]})");
  EXPECT_STREQ(e.what(), "key 'c' appears twice in the object at 'a[2].b'");
  EXPECT_EQ(e.path(), (std::vector<std::string>{"a", "[2]", "b"}));

  e = json_error(R"([{"x": 1, "x": 1}])");
  EXPECT_STREQ(e.what(), "key 'x' appears twice in the object at '[0]'");
  // Keys are compared after unescaping: "\u0061" is "a".
  e = json_error(R"({"a": 1, "\u0061": 2})");
  EXPECT_STREQ(e.what(), "key 'a' appears twice in the top-level object");
  // A control character of a key is written as \xNN.
  e = json_error(R"({"a\nb": 1, "a\nb": 2})");
  EXPECT_STREQ(e.what(), "key 'a\\x0ab' appears twice in the top-level object");
  EXPECT_EQ(e.key(), "a\nb");
}

TEST(StrictJson, TextThatIsNotJsonSaysWhereAndWhy) {
  struct Case {
    std::string text;
    std::string what;
  };
  for (const Case& c : std::vector<Case>{
           {"{\"eps\": NaN}",
            "parse error at line 1, column 9: syntax error while parsing value - invalid literal; "
            "last read: '\"eps\": N'"},
           {"{\"eps\":\n Infinity}",
            "parse error at line 2, column 2: syntax error while parsing value - invalid literal; "
            "last read: '\"eps\":<U+000A> I'"},
           {"{\"theta\": 1e999}",
            "parse error at line 1, column 15: number overflow parsing '1e999'"},
           {"{\"t\": \"a\xff\"}",
            "parse error at line 1, column 9: syntax error while parsing value - invalid string: "
            "ill-formed UTF-8 byte; last read: '\"a\\xff'"},
           {"{\"a\": 1} x",
            "parse error at line 1, column 10: syntax error while parsing value - invalid "
            "literal; last read: '1} x'; expected end of input"},
           {"{\"a\": 1,}",
            "parse error at line 1, column 9: syntax error while parsing object key - unexpected "
            "'}'; expected string literal"},
           {"",
            "parse error at line 1, column 1: syntax error while parsing value - unexpected "
            "end of input; expected '[', '{', or a literal"},
           {"{\"a\": 1 /* no */}",
            "parse error at line 1, column 9: syntax error while parsing object - invalid "
            "literal; last read: '1 /'; expected '}'"},
       }) {
    const JsonError e = json_error(c.text);
    EXPECT_EQ(e.kind(), JsonError::Kind::kSyntax) << c.text;
    EXPECT_EQ(e.what(), c.what) << c.text;
  }
  // nlohmann's own parser agrees that each is not JSON.
  EXPECT_FALSE(nlohmann::json::accept("{\"eps\": NaN}"));
}

TEST(StrictJson, NestingDeeperThanTheLimitIsRefusedNamingWhere) {
  EXPECT_NO_THROW(parse_json(std::string(128, '[') + std::string(128, ']')));
  JsonError e = json_error(std::string(129, '[') + std::string(129, ']'));
  EXPECT_EQ(e.kind(), JsonError::Kind::kTooDeep);
  EXPECT_NE(std::string(e.what()).find("is nested deeper than 128 levels"), std::string::npos)
      << e.what();
  e = json_error(R"({"a": {"b": [{}]}})", 3);
  EXPECT_STREQ(e.what(),
               "the value at 'a.b[0]' is nested deeper than 3 levels of objects and "
               "arrays");
  EXPECT_EQ(e.path(), (std::vector<std::string>{"a", "b", "[0]"}));
  // A million brackets end in an error, not in a stack overflow.
  EXPECT_EQ(json_error(std::string(1 << 20, '[')).kind(), JsonError::Kind::kTooDeep);
}

TEST(StrictJson, PathText) {
  EXPECT_EQ(json_path_text({}), "");
  EXPECT_EQ(json_path_text({"a"}), "a");
  EXPECT_EQ(json_path_text({"a", "[2]", "b"}), "a[2].b");
  EXPECT_EQ(json_path_text({"[0]", "x"}), "[0].x");
}

}  // namespace
}  // namespace pipemat
