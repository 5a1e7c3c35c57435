#include "store/s3_xml.h"

#include <cstdlib>

namespace ls::s3_xml {

std::string xml_unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out += s[i];
      continue;
    }
    const size_t semi = s.find(';', i);
    if (semi == std::string::npos) {
      out += s[i];
      continue;
    }
    const std::string ent = s.substr(i + 1, semi - i - 1);
    if (ent == "amp") out += '&';
    else if (ent == "lt") out += '<';
    else if (ent == "gt") out += '>';
    else if (ent == "quot") out += '"';
    else if (ent == "apos") out += '\'';
    else if (!ent.empty() && ent[0] == '#') {
      const unsigned long cp = ent.size() > 1 && (ent[1] == 'x' || ent[1] == 'X')
                                   ? std::strtoul(ent.c_str() + 2, nullptr, 16)
                                   : std::strtoul(ent.c_str() + 1, nullptr, 10);
      // UTF-8 encode the code point.
      if (cp < 0x80) out += static_cast<char>(cp);
      else if (cp < 0x800) {
        out += static_cast<char>(0xC0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      } else if (cp < 0x10000) {
        out += static_cast<char>(0xE0 | (cp >> 12));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      } else {
        out += static_cast<char>(0xF0 | (cp >> 18));
        out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      }
    } else {
      out += s.substr(i, semi - i + 1);
    }
    i = semi;
  }
  return out;
}

std::vector<std::string> xml_all(const std::string& doc, const std::string& tag) {
  const std::string open = "<" + tag + ">", close = "</" + tag + ">";
  std::vector<std::string> out;
  size_t pos = 0;
  while ((pos = doc.find(open, pos)) != std::string::npos) {
    pos += open.size();
    const size_t end = doc.find(close, pos);
    if (end == std::string::npos) break;
    out.push_back(xml_unescape(doc.substr(pos, end - pos)));
    pos = end + close.size();
  }
  return out;
}

std::string xml_first(const std::string& doc, const std::string& tag) {
  auto all = xml_all(doc, tag);
  return all.empty() ? std::string() : all[0];
}

}  // namespace ls::s3_xml
