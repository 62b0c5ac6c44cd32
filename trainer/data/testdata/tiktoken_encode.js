// Reference encoder for gpt2_tokenizer_test: encodes a UTF-8 file with the
// npm tiktoken package's "gpt2" encoding (encode_ordinary) and writes the ids
// as little-endian uint32.
//
// Usage: node tiktoken_encode.js TIKTOKEN_PACKAGE_DIR INPUT OUTPUT
"use strict";
const fs = require("fs");

const [packageDir, input, output] = process.argv.slice(2);
const { get_encoding } = require(packageDir);
const encoding = get_encoding("gpt2");
const ids = encoding.encode_ordinary(fs.readFileSync(input, "utf8"));
encoding.free();
fs.writeFileSync(output, Buffer.from(new Uint32Array(ids).buffer));
