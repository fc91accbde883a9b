#include "pipemat/core/svg.h"

#include <cstdio>

#include "pipemat/core/format.h"

namespace pipemat {

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string svg_number(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

std::string svg_points(const std::vector<std::pair<double, double>>& points) {
  std::string out;
  for (const auto& [x, y] : points) out += format_fixed(x, 1) + "," + format_fixed(y, 1) + " ";
  return out;
}

SvgAttr::SvgAttr(std::string_view attr, std::string_view text)
    : name(attr), value(xml_escape(text)) {}

SvgAttr::SvgAttr(std::string_view attr, double number) : name(attr), value(svg_number(number)) {}

SvgWriter::SvgWriter(double width, double height, const Attrs& attrs, std::string_view background) {
  out_ = "<svg";
  attributes({{"xmlns", "http://www.w3.org/2000/svg"}, {"width", width}, {"height", height}});
  attributes(attrs);
  out_ += ">\n";
  rect({{"width", "100%"}, {"height", "100%"}, {"fill", background}}).newline();
}

SvgWriter& SvgWriter::element(std::string_view tag, const Attrs& attrs) {
  out_ += '<';
  out_ += tag;
  attributes(attrs);
  out_ += "/>";
  return *this;
}

SvgWriter& SvgWriter::text(const Attrs& attrs, std::string_view content) {
  out_ += "<text";
  attributes(attrs);
  out_ += '>';
  out_ += xml_escape(content);
  out_ += "</text>";
  return *this;
}

SvgWriter& SvgWriter::group(std::string_view tooltip) {
  out_ += "<g><title>";
  out_ += xml_escape(tooltip);
  out_ += "</title>";
  return *this;
}

SvgWriter& SvgWriter::end_group() {
  out_ += "</g>";
  return *this;
}

SvgWriter& SvgWriter::newline() {
  out_ += '\n';
  return *this;
}

std::string SvgWriter::finish() const { return out_ + "</svg>\n"; }

void SvgWriter::attributes(const Attrs& attrs) {
  for (const SvgAttr& a : attrs) {
    out_ += ' ';
    out_ += a.name;
    out_ += "=\"";
    out_ += a.value;
    out_ += '"';
  }
}

}  // namespace pipemat
