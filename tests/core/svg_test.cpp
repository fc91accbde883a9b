#include "pipemat/core/svg.h"

#include <gtest/gtest.h>

#include "pipemat/core/format.h"

namespace pipemat {
namespace {

TEST(SvgTest, EscapesMarkupAndQuotes) {
  EXPECT_EQ(xml_escape("a <b> & \"c\" 'd'"), "a &lt;b&gt; &amp; &quot;c&quot; 'd'");
  EXPECT_EQ(xml_escape(""), "");
}

TEST(SvgTest, NumbersAsAStreamPrintsThem) {
  EXPECT_EQ(svg_number(70), "70");
  EXPECT_EQ(svg_number(18.333333), "18.3333");
  EXPECT_EQ(svg_number(0.35), "0.35");
  EXPECT_EQ(svg_number(-2.5), "-2.5");
  EXPECT_EQ(svg_number(1234567), "1.23457e+06");
}

TEST(SvgTest, PointsHaveOneDecimalAndATrailingSpace) {
  EXPECT_EQ(svg_points({{60, 40.46}, {66.25, 41}}), "60.0,40.5 66.2,41.0 ");
  EXPECT_EQ(svg_points({}), "");
}

TEST(SvgTest, WritesElementsWithAttributesInOrder) {
  SvgWriter svg(320.5, 200, {{"font-family", "sans-serif"}, {"font-size", 12}}, "white");
  svg.rect({{"x", 70}, {"y", 1.5}, {"width", "a&b"}}).newline();
  svg.group("F0 [0, 1)")
      .line({{"x1", int64_t{3}}, {"stroke", "#555"}})
      .text({{"x", format_fixed(2.25, 1)}}, "<1>")
      .end_group()
      .newline();
  SvgWriter::Attrs dashed = {{"points", svg_points({{1, 2}})}};
  dashed.emplace_back("stroke-dasharray", "5,4");
  svg.polyline(dashed).circle({{"r", 3}}).newline();
  EXPECT_EQ(svg.finish(),
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"320.5\" height=\"200\" "
            "font-family=\"sans-serif\" font-size=\"12\">\n"
            "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
            "<rect x=\"70\" y=\"1.5\" width=\"a&amp;b\"/>\n"
            "<g><title>F0 [0, 1)</title><line x1=\"3\" stroke=\"#555\"/>"
            "<text x=\"2.2\">&lt;1&gt;</text></g>\n"
            "<polyline points=\"1.0,2.0 \" stroke-dasharray=\"5,4\"/><circle r=\"3\"/>\n"
            "</svg>\n");
}

}  // namespace
}  // namespace pipemat
