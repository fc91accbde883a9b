// A SentencePiece model through the SentencePiece library.
//
// Note [SentencePiece models]
// A .model file is a serialized ModelProto; its bytes are read through core's opener (Note
// [Opening an input file]) and handed to SentencePieceProcessor::LoadFromSerializedProto, which
// checks them (a file that is not a model is the library's error, in a DataError naming the
// file). The library is Debian's 0.1.97; the ids must be the Python sentencepiece package's
// (0.2.3), and the two differ, so:
//   - BPE (and word and char) models encode with the library: its Encode to ids on the text made
//     valid UTF-8 (Note [Text to tokens]). The same ids as 0.2.3, on every fortunes file and the
//     hostile strings of the test, with and without byte fallback.
//   - Unigram models do not: 0.1.97 compares a candidate path score in double with the stored
//     one in float, 0.2.3 does both in float, so equal-scoring segmentations ("▁2" "00" "0"
//     against "▁2" "0" "00") and near-equal ones deep into a long text come out otherwise. The
//     library normalizes (the pieces it returns, joined, are the normalized text) and
//     UnigramViterbi segments it as 0.2.3 does: unigram::Model::EncodeOptimized with float
//     scores, ties to the candidate found first, and the scores rebased to 0 where the best score
//     at a position falls below -1e5 (0.2.3's choices between paths 0.004 apart repeat with a
//     period of 100,000 in the score, which float alone would not do; this rule, found by
//     probing the package, gives its ids on every input tried: the fortunes, texts of up to
//     50,000 words, the test's hostile strings). Unknown characters are then one unknown piece
//     per run, or their bytes with byte fallback, as the library's PopulateSentencePieceText
//     writes them. The pieces, their scores and types are read from the proto with a small
//     walker of the protobuf wire format (the library does not install the proto headers), which
//     also gives the model's type and byte fallback for describe().
//   - 0.1.97 joins a run of unknown characters into one piece by copying the run for every
//     character: quadratic, 13 s for a megabyte of characters a model lacks. A copy of the model
//     with byte fallback on (the 256 byte pieces appended where missing) writes each unknown
//     character as bytes instead; the unigram path normalizes through it, and a model without
//     byte fallback encodes through it and turns each run of byte pieces back into one unknown
//     piece (a model with byte fallback never joins runs).
// decode is the library's Decode. Encode adds no BOS and no EOS, whatever the model's pieces:
// Llama's <s> comes from its Hugging Face tokenizer's add_bos_token, not from the model;
// pipemat's callers write bos_id() themselves where they want it. eos_id and bos_id are the
// model's </s> and <s> where they are control pieces (-1 in the model: none). token_bytes (for
// StreamDecoder) follows the library's Decode: a control piece writes nothing, the unknown piece
// its surface (" \u2047 "), a byte piece <0xNN> its byte, any other piece its text with U+2581
// as a space, less the space that begins the first piece of a text.

#include <sentencepiece_processor.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>

#include "tokenizers.h"
#include "utf8.h"

namespace pipemat::data {
namespace sp_impl {

// The fields of a protobuf message: calls `field(number, wire type, varint value, bytes)`.
// false when the bytes are not a message.
template <class F>
bool walk_proto(std::string_view bytes, F&& field) {
  size_t pos = 0;
  auto varint = [&](uint64_t& value) {
    value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos >= bytes.size()) return false;
      const auto b = static_cast<uint8_t>(bytes[pos++]);
      value |= uint64_t{b & 0x7Fu} << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  };
  while (pos < bytes.size()) {
    uint64_t key = 0;
    if (!varint(key)) return false;
    const auto type = static_cast<int>(key & 7);
    const auto number = static_cast<int>(key >> 3);
    uint64_t value = 0;
    std::string_view payload;
    if (type == 0) {
      if (!varint(value)) return false;
    } else if (type == 1 || type == 5) {
      const size_t size = type == 1 ? 8 : 4;
      if (bytes.size() - pos < size) return false;
      for (size_t i = 0; i < size; ++i) {
        value |= uint64_t{static_cast<uint8_t>(bytes[pos + i])} << (8 * i);
      }
      pos += size;
    } else if (type == 2) {
      if (!varint(value) || value > bytes.size() - pos) return false;
      payload = bytes.substr(pos, static_cast<size_t>(value));
      pos += static_cast<size_t>(value);
    } else {
      return false;
    }
    field(number, type, value, payload);
  }
  return true;
}

// The pieces of a unigram model, as the model reads them from the proto.
struct Piece {
  std::string text;
  float score = 0;
  int type = 1;  // ModelProto.SentencePiece.Type: NORMAL 1, UNKNOWN 2, CONTROL 3,
                 // USER_DEFINED 4, UNUSED 5, BYTE 6
};
constexpr int kNormal = 1;
constexpr int kUserDefined = 4;
constexpr int kUnused = 5;

// SentencePiece's unigram Viterbi (unigram::Model::EncodeOptimized) as the sentencepiece 0.2
// package runs it (Note [SentencePiece models]): path scores in float, rebased to 0 where the best
// score at a position falls below -1e5.
class UnigramViterbi {
 public:
  explicit UnigramViterbi(std::vector<Piece> pieces) : pieces_(std::move(pieces)) {
    nodes_.emplace_back();
    float min_score = std::numeric_limits<float>::max();
    max_score_ = std::numeric_limits<float>::min();
    for (size_t id = 0; id < pieces_.size(); ++id) {
      const Piece& p = pieces_[id];
      if (p.type == kNormal) {
        min_score = std::min(min_score, p.score);
        max_score_ = std::max(max_score_, p.score);
      }
      if (p.type != kNormal && p.type != kUserDefined && p.type != kUnused) continue;
      if (p.text.empty()) continue;
      int32_t node = 0;
      for (const char c : p.text) node = add_child(node, static_cast<uint8_t>(c));
      if (nodes_[static_cast<size_t>(node)].piece < 0) {
        nodes_[static_cast<size_t>(node)].piece = static_cast<int32_t>(id);
      }
      longest_ = std::max(longest_, p.text.size());
    }
    unk_score_ = min_score - 10.0f;  // kUnkPenalty
  }

  // The (id, length) of the best segmentation of `normalized`; `unk_id` for a character no piece
  // covers.
  std::vector<std::pair<int32_t, size_t>> encode(std::string_view normalized,
                                                 int32_t unk_id) const {
    struct Best {
      int32_t id = -1;
      float score = 0;
      int64_t starts_at = -1;
    };
    constexpr float kRebaseBelow = -1e5f;
    const size_t size = normalized.size();
    std::vector<Best> best(size + 1);
    size_t starts_at = 0;
    while (starts_at < size) {
      float till_here = best[starts_at].score;
      if (till_here < kRebaseBelow) {
        // Every score written so far at or after this position, less this one's (the positions
        // before are final): the sums stay small enough for float to tell paths apart.
        const size_t last = std::min(size, starts_at + longest_ + 4);
        for (size_t q = starts_at; q <= last; ++q) {
          if (q == starts_at || best[q].starts_at != -1) best[q].score -= till_here;
        }
        till_here = best[starts_at].score;
      }
      bool has_single_node = false;
      static constexpr char kLengths[] = "\1\1\1\1\1\1\1\1\1\1\1\1\2\2\3\4";
      const size_t mblen = std::min<size_t>(
          static_cast<size_t>(kLengths[static_cast<uint8_t>(normalized[starts_at]) >> 4]),
          size - starts_at);
      auto offer = [&](size_t end, int32_t id, float score) {
        const float candidate = score + till_here;
        Best& target = best[end];
        if (target.starts_at == -1 || candidate > target.score) {
          target.score = candidate;
          target.starts_at = static_cast<int64_t>(starts_at);
          target.id = id;
        }
      };
      int32_t node = 0;
      for (size_t key = starts_at; key < size; ++key) {
        node = child(node, static_cast<uint8_t>(normalized[key]));
        if (node < 0) break;
        const int32_t id = nodes_[static_cast<size_t>(node)].piece;
        if (id < 0) continue;
        const Piece& p = pieces_[static_cast<size_t>(id)];
        if (p.type == kUnused) continue;
        const size_t length = key + 1 - starts_at;
        // A user-defined piece gets a bonus that makes it win (SentencePiece's formula).
        const float score =
            p.type == kUserDefined ? static_cast<float>(length) * max_score_ - 0.1f : p.score;
        offer(key + 1, id, score);
        if (length == mblen) has_single_node = true;
      }
      if (!has_single_node) offer(starts_at + mblen, unk_id, unk_score_);
      starts_at += mblen;
    }
    std::vector<std::pair<int32_t, size_t>> out;
    for (size_t end = size; end > 0;) {
      const Best& b = best[end];
      const auto start = static_cast<size_t>(b.starts_at);
      out.emplace_back(b.id, end - start);
      end = start;
    }
    std::reverse(out.begin(), out.end());
    return out;
  }

 private:
  struct Node {
    int32_t piece = -1;
    std::vector<std::pair<uint8_t, int32_t>> children;
  };
  int32_t child(int32_t node, uint8_t byte) const {
    if (node == 0) return root_[byte] == 0 ? -1 : root_[byte];
    for (const auto& [b, n] : nodes_[static_cast<size_t>(node)].children) {
      if (b == byte) return n;
    }
    return -1;
  }
  int32_t add_child(int32_t node, uint8_t byte) {
    if (const int32_t existing = child(node, byte); existing >= 0) return existing;
    const auto made = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
    if (node == 0) {
      root_[byte] = made;
    } else {
      nodes_[static_cast<size_t>(node)].children.emplace_back(byte, made);
    }
    return made;
  }

  std::vector<Piece> pieces_;
  std::vector<Node> nodes_;
  std::array<int32_t, 256> root_{};
  float max_score_ = 0;
  float unk_score_ = 0;
  size_t longest_ = 0;  // the longest piece, in bytes
};

void append_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out += static_cast<char>((value & 0x7F) | 0x80);
    value >>= 7;
  }
  out += static_cast<char>(value);
}

void append_message(std::string& out, int field, std::string_view payload) {
  append_varint(out, (static_cast<uint64_t>(field) << 3) | 2);
  append_varint(out, payload.size());
  out.append(payload);
}

// The serialized model `bytes` with trainer_spec.byte_fallback true and the 256 byte pieces
// <0x00>..<0xFF> it then needs (appended where the model lacks them: a second trainer_spec is
// merged into the first, appended pieces come after the others).
std::string with_byte_fallback(std::string_view bytes) {
  std::vector<bool> have(256, false);
  walk_proto(bytes, [&](int number, int type, uint64_t, std::string_view payload) {
    if (number != 1 || type != 2) return;
    walk_proto(payload, [&](int n, int t, uint64_t, std::string_view text) {
      if (n == 1 && t == 2 && text.size() == 6 && text.substr(0, 3) == "<0x" && text[5] == '>') {
        have[static_cast<size_t>(std::stoi(std::string(text.substr(3, 2)), nullptr, 16))] = true;
      }
    });
  });
  std::string out(bytes);
  std::string spec;
  append_varint(spec, (uint64_t{35} << 3) | 0);  // byte_fallback
  append_varint(spec, 1);
  append_message(out, 2, spec);
  static constexpr char kHex[] = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    if (have[static_cast<size_t>(b)]) continue;
    std::string piece;
    append_message(piece, 1, std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">");
    piece += static_cast<char>((2 << 3) | 5);  // score: 0.0f
    piece.append(4, '\0');
    piece += static_cast<char>((3 << 3) | 0);  // type: BYTE
    piece += static_cast<char>(6);
    append_message(out, 1, piece);
  }
  return out;
}

class SentencePiece final : public Tokenizer {
 public:
  SentencePiece(std::string bytes, const std::string& path) : path_(path) {
    const auto status = processor_.LoadFromSerializedProto(bytes);
    PIPEMAT_CHECK(status.ok(), DataError, path_,
                  ": not a SentencePiece model (the SentencePiece library: ", status.ToString(),
                  ")");
    size_ = processor_.GetPieceSize();
    PIPEMAT_CHECK(size_ > 0, DataError, path_, ": the SentencePiece model has no pieces");
    // pieces (field 1: piece 1, score 2, type 3) and trainer_spec (field 2: model_type 3,
    // byte_fallback 35).
    std::vector<Piece> pieces;
    const bool parsed =
        walk_proto(bytes, [&](int number, int type, uint64_t, std::string_view payload) {
          if (number == 1 && type == 2) {
            Piece& p = pieces.emplace_back();
            walk_proto(payload, [&](int n, int t, uint64_t value, std::string_view text) {
              if (n == 1 && t == 2) p.text = text;
              if (n == 2 && t == 5) {
                const auto bits = static_cast<uint32_t>(value);
                std::memcpy(&p.score, &bits, sizeof(p.score));
              }
              if (n == 3 && t == 0) p.type = static_cast<int>(value);
            });
          }
          if (number == 2 && type == 2) {
            walk_proto(payload, [&](int n, int t, uint64_t value, std::string_view) {
              if (n == 3 && t == 0) model_type_ = static_cast<int>(value);
              if (n == 35 && t == 0) byte_fallback_ = value != 0;
            });
          }
        });
    PIPEMAT_CHECK(parsed && pieces.size() == static_cast<size_t>(size_), DataError, path_,
                  ": the SentencePiece library reads ", size_,
                  " pieces, pipemat's reading of the "
                  "model ",
                  pieces.size(), "; expected a model the two read alike");
    if (model_type_ == 1) {
      unk_id_ = processor_.unk_id();
      PIPEMAT_CHECK(unk_id_ >= 0, DataError, path_, ": the unigram model has no unknown piece");
      if (byte_fallback_) {
        for (int b = 0; b < 256; ++b) {
          static constexpr char kHex[] = "0123456789ABCDEF";
          const std::string piece = std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">";
          byte_ids_[static_cast<size_t>(b)] = processor_.PieceToId(piece);
        }
      }
      viterbi_ = std::make_unique<UnigramViterbi>(std::move(pieces));
    }
    // A copy of the model with byte fallback on: the library then writes an unknown character as
    // byte pieces instead of joining a run of them into one unknown piece, which 0.1.97 does by
    // copying the run for every character (quadratic: a megabyte of characters the model lacks
    // took 13 s). The unigram path reads its normalization from it; a model without byte
    // fallback encodes with it and turns each run of byte pieces back into one unknown piece.
    if ((viterbi_ || !byte_fallback_) && processor_.unk_id() >= 0 &&
        fallback_.LoadFromSerializedProto(with_byte_fallback(bytes)).ok()) {
      normalizing_ = &fallback_;
    }
    if (const int id = processor_.eos_id(); id >= 0) eos_ = id;
    if (const int id = processor_.bos_id(); id >= 0) bos_ = id;
    if (const int id = processor_.unk_id(); id >= 0) unk_surface_ = decode_ids({id});
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::string cleaned;
    if (!utf8::is_valid(text)) {
      cleaned = valid_utf8(text);
      text = cleaned;
    }
    if (viterbi_) return encode_unigram(text);
    std::vector<int> ids;
    const auto status = normalizing_->Encode(text, &ids);
    PIPEMAT_CHECK(status.ok(), DataError, path_, ": SentencePiece could not encode a text of ",
                  text.size(), " bytes (", status.ToString(), ")");
    if (normalizing_ == &processor_) return {ids.begin(), ids.end()};
    // The copy with byte fallback: each run of byte pieces is one unknown piece of the model.
    std::vector<int32_t> out;
    out.reserve(ids.size());
    const int32_t unk = processor_.unk_id();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!fallback_.IsByte(ids[i])) {
        out.push_back(ids[i]);
      } else if (i == 0 || !fallback_.IsByte(ids[i - 1])) {
        out.push_back(unk);
      }
    }
    return out;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    for (const int32_t id : ids) check(id);
    return decode_ids(std::vector<int>(ids.begin(), ids.end()));
  }

  std::string token_bytes(int32_t id, bool at_start) const override {
    check(id);
    if (processor_.IsControl(id)) return "";
    if (processor_.IsUnknown(id)) return unk_surface_;
    const std::string& piece = processor_.IdToPiece(id);
    if (processor_.IsByte(id)) {
      // "<0xNN>"
      return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
    }
    if (at_start) return decode_ids({id});
    std::string text;
    constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581
    for (size_t pos = 0; pos < piece.size();) {
      if (piece.compare(pos, kSpace.size(), kSpace) == 0) {
        text += ' ';
        pos += kSpace.size();
      } else {
        text += piece[pos++];
      }
    }
    return text;
  }

  int64_t vocab_size() const override { return size_; }
  std::optional<int32_t> eos_id() const override { return eos_; }
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::string describe() const override {
    static constexpr const char* kTypes[] = {"", "unigram", "BPE", "word", "char"};
    const char* type = model_type_ >= 1 && model_type_ <= 4 ? kTypes[model_type_] : "unigram";
    return std::string("SentencePiece ") + type + ", " + with_commas(size_) + " pieces" +
           (byte_fallback_ ? " with byte fallback" : "") + " (" + path_ + ")";
  }
  std::string path() const override { return path_; }

 private:
  void check(int32_t id) const {
    PIPEMAT_CHECK(id >= 0 && id < size_, DataError, path_, ": cannot decode token id ", id,
                  ": the model's ids are 0..", size_ - 1);
  }
  // The library normalizes (its pieces of the text, joined, are the normalized text), pipemat
  // segments it, then unknown pieces become bytes (byte fallback) or one unknown token per run,
  // as SentencePieceProcessor::PopulateSentencePieceText does.
  std::vector<int32_t> encode_unigram(std::string_view text) const {
    const auto spt = normalizing_->EncodeAsImmutableProto(text);
    std::string normalized;
    for (const auto& piece : spt.pieces()) {
      const auto id = static_cast<int>(piece.id());
      if (normalizing_->IsByte(id)) {
        normalized += static_cast<char>(std::stoi(piece.piece().substr(3, 2), nullptr, 16));
      } else {
        normalized += piece.piece();
      }
    }
    std::vector<int32_t> ids;
    bool previous_unknown = false;
    size_t at = 0;
    for (const auto& [id, length] : viterbi_->encode(normalized, unk_id_)) {
      const bool unknown = id == unk_id_;
      if (unknown && byte_fallback_) {
        for (size_t i = 0; i < length; ++i) {
          ids.push_back(byte_ids_[static_cast<uint8_t>(normalized[at + i])]);
        }
      } else if (!(unknown && previous_unknown)) {
        ids.push_back(id);
      }
      previous_unknown = unknown;
      at += length;
    }
    return ids;
  }

  std::string decode_ids(const std::vector<int>& ids) const {
    std::string text;
    const auto status = processor_.Decode(ids, &text);
    PIPEMAT_CHECK(status.ok(), DataError, path_, ": SentencePiece could not decode ", ids.size(),
                  " ids (", status.ToString(), ")");
    return text;
  }

  std::string path_;
  sentencepiece::SentencePieceProcessor processor_;
  int32_t size_ = 0;
  int model_type_ = 1;  // trainer_spec.model_type; UNIGRAM when the proto leaves it out
  bool byte_fallback_ = false;
  std::optional<int32_t> eos_;
  std::optional<int32_t> bos_;
  std::string unk_surface_;
  std::unique_ptr<UnigramViterbi> viterbi_;         // a unigram model
  sentencepiece::SentencePieceProcessor fallback_;  // the model with byte fallback on
  // What encodes (a model with byte fallback, or where the copy did not load) or normalizes (a
  // unigram model): processor_ or fallback_.
  const sentencepiece::SentencePieceProcessor* normalizing_ = &processor_;
  int32_t unk_id_ = -1;
  std::array<int32_t, 256> byte_ids_{};
};

}  // namespace sp_impl

std::unique_ptr<Tokenizer> make_sentencepiece(std::string bytes, const std::string& path) {
  return std::make_unique<sp_impl::SentencePiece>(std::move(bytes), path);
}

}  // namespace pipemat::data
