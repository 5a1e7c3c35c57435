// The few XML elements S3Store (s3_store.cc) reads from S3's responses:
// listings, upload ids and error codes, found by tag name. A minimal reading,
// not an XML parser: the first closing tag after an opening one ends it.
#pragma once

#include <string>
#include <vector>

namespace ls::s3_xml {

// Text with XML's five named entities and numeric character references
// (decimal and hex, written as UTF-8) replaced; any other '&' stays as is.
std::string xml_unescape(const std::string& s);
// Texts of every <tag>...</tag> in document order (unescaped).
std::vector<std::string> xml_all(const std::string& doc, const std::string& tag);
// The first of them, or "" when there is none.
std::string xml_first(const std::string& doc, const std::string& tag);

}  // namespace ls::s3_xml
