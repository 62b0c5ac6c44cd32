// Derives GPT-2's encoder.json and vocab.bpe from the gpt2 ranks bundled in
// the npm `tiktoken` package, so the GPT-2 tokenizer works offline.
//
// Usage: node gpt2_bpe_from_tiktoken.js TIKTOKEN_PACKAGE_DIR OUT_DIR
//
// tiktoken stores gpt2 as "mergeable ranks": token bytes -> rank, where the
// rank is also the token id and the merge priority. The original files are
// the same data in another form:
//   encoder.json  token -> id, each byte shown as the printable character of
//                 GPT-2's bytes_to_unicode table, written as Python's
//                 json.dumps writes it (ASCII only, ", " and ": ").
//   vocab.bpe     "#version: 0.2", then one merge "left right" per line for
//                 ids 256, 257, ...; the merge that makes a token is found by
//                 running BPE on its bytes with only the lower ranks, which
//                 must stop at exactly two parts.
// The result is checked twice before anything is written: loaded back
// through tiktoken's own data_gym_to_mergeable_bpe_ranks (tiktoken/load) it
// must give every bundled rank, and its SHA-256 must equal that of OpenAI's
// published files (the hashes tiktoken itself pins). The output is then
// byte-identical to the originals.
"use strict";
const crypto = require("crypto");
const fs = require("fs");
const path = require("path");

async function main() {
  const [packageDir, outDir] = process.argv.slice(2);
  if (!packageDir || !outDir) {
    throw new Error("usage: gpt2_bpe_from_tiktoken.js TIKTOKEN_DIR OUT_DIR");
  }
  const bundled = JSON.parse(
      fs.readFileSync(path.join(packageDir, "encoders", "gpt2.json"), "utf8"));
  const ranks = parseRanks(bundled.bpe_ranks);  // Array: rank -> Buffer.
  if (ranks.length !== 50256) {
    throw new Error(`expected 50256 gpt2 ranks, found ${ranks.length}`);
  }

  const byteToChar = bytesToUnicode();
  const show = (bytes) => Array.from(bytes, (b) => byteToChar[b]).join("");

  // encoder.json: ids in order, then the special token.
  const entries = ranks.map((bytes, id) => `${pyQuote(show(bytes))}: ${id}`);
  for (const [token, id] of Object.entries(bundled.special_tokens)) {
    entries.push(`${pyQuote(token)}: ${id}`);
  }
  const encoderJson = "{" + entries.join(", ") + "}";

  // vocab.bpe: the merge behind every multi-byte token.
  const rankOf = new Map(ranks.map((bytes, id) => [bytes.toString("latin1"), id]));
  const lines = ["#version: 0.2"];
  for (let id = 256; id < ranks.length; ++id) {
    const parts = bytePairMerge(ranks[id], rankOf, id);
    if (parts.length !== 2) {
      throw new Error(`token ${id} does not come from a single merge`);
    }
    lines.push(`${show(parts[0])} ${show(parts[1])}`);
  }
  const vocabBpe = lines.join("\n") + "\n";

  // Check: tiktoken's own loader must rebuild exactly the bundled ranks.
  const { load } = require(path.join(packageDir, "load.cjs"));
  const registry = JSON.parse(
      fs.readFileSync(path.join(packageDir, "registry.json"), "utf8")).gpt2;
  const loaded = await load(registry, async (url) => {
    if (url.endsWith("vocab.bpe")) return vocabBpe;
    if (url.endsWith("encoder.json")) return encoderJson;
    throw new Error(`unexpected url ${url}`);
  });
  const reloaded = loaded.bpe_ranks.trim().split("\n");
  if (reloaded.length !== ranks.length) {
    throw new Error("round trip through tiktoken/load changed the vocabulary");
  }
  for (const line of reloaded) {
    const [b64, rank] = line.split(" ");
    if (Buffer.from(b64, "base64").compare(ranks[Number(rank)]) !== 0) {
      throw new Error(`round trip through tiktoken/load changed rank ${rank}`);
    }
  }

  // The published files' SHA-256 (as tiktoken's openai_public.py pins them).
  const expected = {
    "encoder.json":
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe":
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
  };
  for (const [name, text] of [["encoder.json", encoderJson],
                              ["vocab.bpe", vocabBpe]]) {
    const digest = crypto.createHash("sha256").update(text, "utf8").digest("hex");
    if (digest !== expected[name]) {
      throw new Error(`derived ${name} has SHA-256 ${digest}, expected ${expected[name]}`);
    }
  }

  fs.mkdirSync(outDir, { recursive: true });
  for (const [name, text] of [["encoder.json", encoderJson],
                              ["vocab.bpe", vocabBpe]]) {
    const tmp = path.join(outDir, `.${name}.tmp`);
    fs.writeFileSync(tmp, text, "utf8");
    fs.renameSync(tmp, path.join(outDir, name));
  }
}

// tiktoken's compact rank format: lines "! OFFSET TOKEN TOKEN ...", each
// TOKEN base64, ranks OFFSET, OFFSET + 1, ...
function parseRanks(text) {
  const ranks = [];
  for (const line of text.split("\n")) {
    if (line === "") continue;
    const fields = line.split(" ");
    const offset = Number(fields[1]);
    fields.slice(2).forEach((b64, i) => {
      ranks[offset + i] = Buffer.from(b64, "base64");
    });
  }
  for (let i = 0; i < ranks.length; ++i) {
    if (ranks[i] === undefined) throw new Error(`rank ${i} missing`);
  }
  return ranks;
}

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the
// others map to U+0100 and up in byte order.
function bytesToUnicode() {
  const table = new Array(256);
  let next = 256;
  for (let b = 0; b < 256; ++b) {
    const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) ||
                      (b >= 0xae && b <= 0xff);
    table[b] = String.fromCharCode(printable ? b : next++);
  }
  return table;
}

// Python json.dumps quoting with ensure_ascii=True.
function pyQuote(s) {
  let out = '"';
  for (const ch of s) {
    const c = ch.codePointAt(0);
    if (ch === '"') out += '\\"';
    else if (ch === "\\") out += "\\\\";
    else if (ch === "\n") out += "\\n";
    else if (ch === "\r") out += "\\r";
    else if (ch === "\t") out += "\\t";
    else if (ch === "\b") out += "\\b";
    else if (ch === "\f") out += "\\f";
    else if (c < 0x20 || c > 0x7e) {
      // Code points above U+FFFF do not occur (bytes_to_unicode stays below).
      out += "\\u" + c.toString(16).padStart(4, "0");
    } else out += ch;
  }
  return out + '"';
}

// tiktoken's byte pair merge restricted to ranks below maxRank: repeatedly
// joins the adjacent pair whose concatenation has the lowest rank.
function bytePairMerge(bytes, rankOf, maxRank) {
  let parts = Array.from(bytes, (b) => Buffer.from([b]));
  for (;;) {
    let best = -1;
    let bestRank = maxRank;
    for (let i = 0; i + 1 < parts.length; ++i) {
      const joined = Buffer.concat([parts[i], parts[i + 1]]).toString("latin1");
      const rank = rankOf.get(joined);
      if (rank !== undefined && rank < bestRank) {
        bestRank = rank;
        best = i;
      }
    }
    if (best < 0) return parts;
    parts.splice(best, 2, Buffer.concat([parts[best], parts[best + 1]]));
  }
}

main().catch((error) => {
  console.error(`gpt2_bpe_from_tiktoken: ${error.message}`);
  process.exit(1);
});
