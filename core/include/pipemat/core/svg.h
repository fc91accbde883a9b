#pragma once
// SVG documents as text: XML escaping, number formatting and a writer of the few elements the
// timelines and charts draw (rect, line, circle, polyline, text, groups with a tooltip). Every
// element takes its attributes in the order they are written; nothing adds a line break but
// newline(), so a caller lays out its document as it chooses.

#include <concepts>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pipemat {

// `text` with &, <, > and " escaped: safe as element text and as a quoted attribute value.
std::string xml_escape(std::string_view text);

// `value` as a C++ stream prints a double by default (printf's %g: six significant digits):
// "70", "18.3333", "0.35", "1.23457e+06".
std::string svg_number(double value);

// Polyline points: "x,y " per point, one decimal each ("60.0,40.5 66.2,41.0 ").
std::string svg_points(const std::vector<std::pair<double, double>>& points);

// One attribute: its name and its value as written. Integers in full, doubles by svg_number (a
// fixed number of decimals: pass format_fixed's string), text escaped.
struct SvgAttr {
  SvgAttr(std::string_view attr, std::string_view text);
  SvgAttr(std::string_view attr, double number);
  template <std::integral T>
  SvgAttr(std::string_view attr, T number) : name(attr), value(std::to_string(number)) {}

  std::string_view name;
  std::string value;
};

class SvgWriter {
 public:
  // Written in this order; a braced list, or a vector built up when some are optional.
  using Attrs = std::vector<SvgAttr>;

  // The opening tag (xmlns, width, height, then `attrs`) and a rect of colour `background` that
  // fills the picture, each on its line.
  SvgWriter(double width, double height, const Attrs& attrs, std::string_view background);

  // <tag a="1" b="2"/>
  SvgWriter& element(std::string_view tag, const Attrs& attrs);
  SvgWriter& rect(const Attrs& attrs) { return element("rect", attrs); }
  SvgWriter& line(const Attrs& attrs) { return element("line", attrs); }
  SvgWriter& circle(const Attrs& attrs) { return element("circle", attrs); }
  SvgWriter& polyline(const Attrs& attrs) { return element("polyline", attrs); }
  // <text a="1">content</text>, the content escaped.
  SvgWriter& text(const Attrs& attrs, std::string_view content);
  // <g><title>tooltip</title>: what follows until end_group() shows `tooltip` on hover.
  SvgWriter& group(std::string_view tooltip);
  SvgWriter& end_group();
  SvgWriter& newline();

  // The document: what was written and the closing tag on its line.
  std::string finish() const;

 private:
  void attributes(const Attrs& attrs);

  std::string out_;
};

}  // namespace pipemat
