//! The fp8 K/V cache (`LoadOptions::kv_storage = KvStorage::Fp8`, `--kv-fp8`; `prism_model::kv_fp8`):
//!
//! (a) the e4m3 codec against an independent implementation (ml_dtypes' `float8_e4m3fn`, tables below),
//!     saturation and NaN, and the per-row quantization's scale and error bound;
//! (b) the fixture model with fp8 keys and values stays close to the same model with native ones;
//! (c) it stays batch-invariant bit for bit: a prompt alone, in a batch, branched from a shared prefix,
//!     continued from a cached prefix state, or fed in pieces gives the same logits and the same stored
//!     cache (bytes and scales);
//! (d) the state's K/V bytes are what it holds: one byte a value plus an f32 scale per token and KV head,
//!     about half of bf16 and a quarter of f32;
//! (e) a state of the other storage is refused.
//!
//! The tables of (a) come from `tools/kv_fp8_reference.py`, run as
//! `python3 -m venv /tmp/e4m3 && /tmp/e4m3/bin/pip install ml_dtypes==0.7.0 && /tmp/e4m3/bin/python tools/kv_fp8_reference.py`
//! (ml_dtypes 0.7.0, numpy 2.4.6; 2026-12-02).

mod common;
mod quantized;

use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};
use common::*;
use prism_model::kv_fp8::{
    decode_e4m3, dequantize, dequantize_row, encode_e4m3, max_abs_error, quantize, quantize_row,
    row_scale, E4M3_NAN,
};
use prism_model::state::LayerState;
use prism_model::{
    BatchItem, KvStorage, LoadOptions, ModelError, Precision, Qwen35Model, SequenceState,
};
use prism_quant::Q8Scales;

/// f32 bits of e4m3 bytes 0x00..=0xFF (ml_dtypes.float8_e4m3fn -> float32).
const DECODE: [u32; 256] = [
    0x00000000, 0x3b000000, 0x3b800000, 0x3bc00000, 0x3c000000, 0x3c200000, 0x3c400000, 0x3c600000,
    0x3c800000, 0x3c900000, 0x3ca00000, 0x3cb00000, 0x3cc00000, 0x3cd00000, 0x3ce00000, 0x3cf00000,
    0x3d000000, 0x3d100000, 0x3d200000, 0x3d300000, 0x3d400000, 0x3d500000, 0x3d600000, 0x3d700000,
    0x3d800000, 0x3d900000, 0x3da00000, 0x3db00000, 0x3dc00000, 0x3dd00000, 0x3de00000, 0x3df00000,
    0x3e000000, 0x3e100000, 0x3e200000, 0x3e300000, 0x3e400000, 0x3e500000, 0x3e600000, 0x3e700000,
    0x3e800000, 0x3e900000, 0x3ea00000, 0x3eb00000, 0x3ec00000, 0x3ed00000, 0x3ee00000, 0x3ef00000,
    0x3f000000, 0x3f100000, 0x3f200000, 0x3f300000, 0x3f400000, 0x3f500000, 0x3f600000, 0x3f700000,
    0x3f800000, 0x3f900000, 0x3fa00000, 0x3fb00000, 0x3fc00000, 0x3fd00000, 0x3fe00000, 0x3ff00000,
    0x40000000, 0x40100000, 0x40200000, 0x40300000, 0x40400000, 0x40500000, 0x40600000, 0x40700000,
    0x40800000, 0x40900000, 0x40a00000, 0x40b00000, 0x40c00000, 0x40d00000, 0x40e00000, 0x40f00000,
    0x41000000, 0x41100000, 0x41200000, 0x41300000, 0x41400000, 0x41500000, 0x41600000, 0x41700000,
    0x41800000, 0x41900000, 0x41a00000, 0x41b00000, 0x41c00000, 0x41d00000, 0x41e00000, 0x41f00000,
    0x42000000, 0x42100000, 0x42200000, 0x42300000, 0x42400000, 0x42500000, 0x42600000, 0x42700000,
    0x42800000, 0x42900000, 0x42a00000, 0x42b00000, 0x42c00000, 0x42d00000, 0x42e00000, 0x42f00000,
    0x43000000, 0x43100000, 0x43200000, 0x43300000, 0x43400000, 0x43500000, 0x43600000, 0x43700000,
    0x43800000, 0x43900000, 0x43a00000, 0x43b00000, 0x43c00000, 0x43d00000, 0x43e00000, 0x7fc00000,
    0x80000000, 0xbb000000, 0xbb800000, 0xbbc00000, 0xbc000000, 0xbc200000, 0xbc400000, 0xbc600000,
    0xbc800000, 0xbc900000, 0xbca00000, 0xbcb00000, 0xbcc00000, 0xbcd00000, 0xbce00000, 0xbcf00000,
    0xbd000000, 0xbd100000, 0xbd200000, 0xbd300000, 0xbd400000, 0xbd500000, 0xbd600000, 0xbd700000,
    0xbd800000, 0xbd900000, 0xbda00000, 0xbdb00000, 0xbdc00000, 0xbdd00000, 0xbde00000, 0xbdf00000,
    0xbe000000, 0xbe100000, 0xbe200000, 0xbe300000, 0xbe400000, 0xbe500000, 0xbe600000, 0xbe700000,
    0xbe800000, 0xbe900000, 0xbea00000, 0xbeb00000, 0xbec00000, 0xbed00000, 0xbee00000, 0xbef00000,
    0xbf000000, 0xbf100000, 0xbf200000, 0xbf300000, 0xbf400000, 0xbf500000, 0xbf600000, 0xbf700000,
    0xbf800000, 0xbf900000, 0xbfa00000, 0xbfb00000, 0xbfc00000, 0xbfd00000, 0xbfe00000, 0xbff00000,
    0xc0000000, 0xc0100000, 0xc0200000, 0xc0300000, 0xc0400000, 0xc0500000, 0xc0600000, 0xc0700000,
    0xc0800000, 0xc0900000, 0xc0a00000, 0xc0b00000, 0xc0c00000, 0xc0d00000, 0xc0e00000, 0xc0f00000,
    0xc1000000, 0xc1100000, 0xc1200000, 0xc1300000, 0xc1400000, 0xc1500000, 0xc1600000, 0xc1700000,
    0xc1800000, 0xc1900000, 0xc1a00000, 0xc1b00000, 0xc1c00000, 0xc1d00000, 0xc1e00000, 0xc1f00000,
    0xc2000000, 0xc2100000, 0xc2200000, 0xc2300000, 0xc2400000, 0xc2500000, 0xc2600000, 0xc2700000,
    0xc2800000, 0xc2900000, 0xc2a00000, 0xc2b00000, 0xc2c00000, 0xc2d00000, 0xc2e00000, 0xc2f00000,
    0xc3000000, 0xc3100000, 0xc3200000, 0xc3300000, 0xc3400000, 0xc3500000, 0xc3600000, 0xc3700000,
    0xc3800000, 0xc3900000, 0xc3a00000, 0xc3b00000, 0xc3c00000, 0xc3d00000, 0xc3e00000, 0xffc00000,
];
/// (1166 pairs) f32 bits -> e4m3 byte (ml_dtypes, round to nearest even).
const ENCODE: [(u32, u8); 1166] = [
    (0x00000000, 0x00),
    (0x0da24260, 0x00),
    (0x36144c58, 0x00),
    (0x36e67af6, 0x00),
    (0x36fce7de, 0x00),
    (0x373dfe3d, 0x00),
    (0x378c5ad6, 0x00),
    (0x3881a71e, 0x00),
    (0x38c2e779, 0x00),
    (0x38c8cf26, 0x00),
    (0x38d6099c, 0x00),
    (0x38da171d, 0x00),
    (0x38f086f7, 0x00),
    (0x38f7d262, 0x00),
    (0x390b29d0, 0x00),
    (0x3911e17e, 0x00),
    (0x3942a98f, 0x00),
    (0x39878bc7, 0x00),
    (0x39880302, 0x00),
    (0x398f147b, 0x00),
    (0x39a1877a, 0x00),
    (0x39aea6b8, 0x00),
    (0x39c8132e, 0x00),
    (0x39d55b8b, 0x00),
    (0x39d5c809, 0x00),
    (0x39e9394a, 0x00),
    (0x39edefd6, 0x00),
    (0x39f2a5ac, 0x00),
    (0x39fc9a20, 0x00),
    (0x3a000000, 0x00),
    (0x3a03a671, 0x00),
    (0x3a07682d, 0x00),
    (0x3a079f63, 0x00),
    (0x3a0dc59e, 0x00),
    (0x3a21eb49, 0x00),
    (0x3a286c99, 0x00),
    (0x3a33263c, 0x00),
    (0x3a3d8684, 0x00),
    (0x3a405b47, 0x00),
    (0x3a422071, 0x00),
    (0x3a4c96d2, 0x00),
    (0x3a5650a8, 0x00),
    (0x3a5a7050, 0x00),
    (0x3a5c9b2e, 0x00),
    (0x3a743522, 0x00),
    (0x3a7fffff, 0x00),
    (0x3a800000, 0x00),
    (0x3a800001, 0x01),
    (0x3a8488ff, 0x01),
    (0x3a8f2d71, 0x01),
    (0x3a9971cb, 0x01),
    (0x3ac00000, 0x01),
    (0x3acbdcda, 0x01),
    (0x3adabf98, 0x01),
    (0x3ae49438, 0x01),
    (0x3ae4cfb6, 0x01),
    (0x3ae6de30, 0x01),
    (0x3aedc214, 0x01),
    (0x3b0029e1, 0x01),
    (0x3b11f40a, 0x01),
    (0x3b159b75, 0x01),
    (0x3b1ff7c1, 0x01),
    (0x3b246cdd, 0x01),
    (0x3b3fffff, 0x01),
    (0x3b400000, 0x02),
    (0x3b400001, 0x02),
    (0x3b48fbf7, 0x02),
    (0x3b4da3fd, 0x02),
    (0x3b5ba14b, 0x02),
    (0x3b5c979d, 0x02),
    (0x3b61f2ff, 0x02),
    (0x3b6377af, 0x02),
    (0x3b6e7001, 0x02),
    (0x3b787e44, 0x02),
    (0x3b7c3c44, 0x02),
    (0x3b849fb5, 0x02),
    (0x3b8507d0, 0x02),
    (0x3b968314, 0x02),
    (0x3b9a46aa, 0x02),
    (0x3b9fffff, 0x02),
    (0x3ba00000, 0x02),
    (0x3ba00001, 0x03),
    (0x3bbe9e98, 0x03),
    (0x3bc2fe28, 0x03),
    (0x3bd07f01, 0x03),
    (0x3bd1a1ca, 0x03),
    (0x3bdfffff, 0x03),
    (0x3be00000, 0x04),
    (0x3be00001, 0x04),
    (0x3c0995e4, 0x04),
    (0x3c0a21bb, 0x04),
    (0x3c0cb201, 0x04),
    (0x3c0fffff, 0x04),
    (0x3c100000, 0x04),
    (0x3c100001, 0x05),
    (0x3c19761f, 0x05),
    (0x3c250db2, 0x05),
    (0x3c25c1ae, 0x05),
    (0x3c2fffff, 0x05),
    (0x3c300000, 0x06),
    (0x3c300001, 0x06),
    (0x3c4fffff, 0x06),
    (0x3c500000, 0x06),
    (0x3c500001, 0x07),
    (0x3c5d8fb9, 0x07),
    (0x3c5e1b73, 0x07),
    (0x3c650788, 0x07),
    (0x3c662e62, 0x07),
    (0x3c6fffff, 0x07),
    (0x3c700000, 0x08),
    (0x3c700001, 0x08),
    (0x3c7cdd46, 0x08),
    (0x3c87ffff, 0x08),
    (0x3c880000, 0x08),
    (0x3c880001, 0x09),
    (0x3c8975af, 0x09),
    (0x3c97ffff, 0x09),
    (0x3c980000, 0x0a),
    (0x3c980001, 0x0a),
    (0x3c98fa52, 0x0a),
    (0x3ca714b9, 0x0a),
    (0x3ca7ffff, 0x0a),
    (0x3ca80000, 0x0a),
    (0x3ca80001, 0x0b),
    (0x3ca909c1, 0x0b),
    (0x3cabfe8a, 0x0b),
    (0x3cac4717, 0x0b),
    (0x3cb7ffff, 0x0b),
    (0x3cb80000, 0x0c),
    (0x3cb80001, 0x0c),
    (0x3cba10b3, 0x0c),
    (0x3cc1c7bc, 0x0c),
    (0x3cc7ffff, 0x0c),
    (0x3cc80000, 0x0c),
    (0x3cc80001, 0x0d),
    (0x3cd7ffff, 0x0d),
    (0x3cd80000, 0x0e),
    (0x3cd80001, 0x0e),
    (0x3ce0deb3, 0x0e),
    (0x3ce7ffff, 0x0e),
    (0x3ce80000, 0x0e),
    (0x3ce80001, 0x0f),
    (0x3ceb0467, 0x0f),
    (0x3cee1d92, 0x0f),
    (0x3cefb726, 0x0f),
    (0x3cf7ffff, 0x0f),
    (0x3cf80000, 0x10),
    (0x3cf80001, 0x10),
    (0x3cf805b4, 0x10),
    (0x3cfdf19b, 0x10),
    (0x3d07ffff, 0x10),
    (0x3d080000, 0x10),
    (0x3d080001, 0x11),
    (0x3d17ffff, 0x11),
    (0x3d180000, 0x12),
    (0x3d180001, 0x12),
    (0x3d1d4937, 0x12),
    (0x3d27ffff, 0x12),
    (0x3d280000, 0x12),
    (0x3d280001, 0x13),
    (0x3d2e3a4a, 0x13),
    (0x3d37ffff, 0x13),
    (0x3d380000, 0x14),
    (0x3d380001, 0x14),
    (0x3d3eda68, 0x14),
    (0x3d47ffff, 0x14),
    (0x3d480000, 0x14),
    (0x3d480001, 0x15),
    (0x3d4ade53, 0x15),
    (0x3d57ffff, 0x15),
    (0x3d580000, 0x16),
    (0x3d580001, 0x16),
    (0x3d60ff7d, 0x16),
    (0x3d63c939, 0x16),
    (0x3d67ffff, 0x16),
    (0x3d680000, 0x16),
    (0x3d680001, 0x17),
    (0x3d77ffff, 0x17),
    (0x3d780000, 0x18),
    (0x3d780001, 0x18),
    (0x3d7d227c, 0x18),
    (0x3d839a61, 0x18),
    (0x3d8691eb, 0x18),
    (0x3d87ffff, 0x18),
    (0x3d880000, 0x18),
    (0x3d880001, 0x19),
    (0x3d952be2, 0x19),
    (0x3d97ffff, 0x19),
    (0x3d980000, 0x1a),
    (0x3d980001, 0x1a),
    (0x3d9e906d, 0x1a),
    (0x3d9ee0a2, 0x1a),
    (0x3d9fd473, 0x1a),
    (0x3da22e80, 0x1a),
    (0x3da7ffff, 0x1a),
    (0x3da80000, 0x1a),
    (0x3da80001, 0x1b),
    (0x3db7ffff, 0x1b),
    (0x3db80000, 0x1c),
    (0x3db80001, 0x1c),
    (0x3dc7ffff, 0x1c),
    (0x3dc80000, 0x1c),
    (0x3dc80001, 0x1d),
    (0x3dce0918, 0x1d),
    (0x3dd05ea9, 0x1d),
    (0x3dd7ffff, 0x1d),
    (0x3dd80000, 0x1e),
    (0x3dd80001, 0x1e),
    (0x3dda7fde, 0x1e),
    (0x3ddef5a1, 0x1e),
    (0x3de0436d, 0x1e),
    (0x3de7ffff, 0x1e),
    (0x3de80000, 0x1e),
    (0x3de80001, 0x1f),
    (0x3df7ffff, 0x1f),
    (0x3df80000, 0x20),
    (0x3df80001, 0x20),
    (0x3e034487, 0x20),
    (0x3e07ffff, 0x20),
    (0x3e080000, 0x20),
    (0x3e080001, 0x21),
    (0x3e09a859, 0x21),
    (0x3e0f09eb, 0x21),
    (0x3e17ffff, 0x21),
    (0x3e180000, 0x22),
    (0x3e180001, 0x22),
    (0x3e1f7e30, 0x22),
    (0x3e27ffff, 0x22),
    (0x3e280000, 0x22),
    (0x3e280001, 0x23),
    (0x3e2a25da, 0x23),
    (0x3e37ffff, 0x23),
    (0x3e380000, 0x24),
    (0x3e380001, 0x24),
    (0x3e442d45, 0x24),
    (0x3e47ffff, 0x24),
    (0x3e480000, 0x24),
    (0x3e480001, 0x25),
    (0x3e54cc9b, 0x25),
    (0x3e57ffff, 0x25),
    (0x3e580000, 0x26),
    (0x3e580001, 0x26),
    (0x3e67ffff, 0x26),
    (0x3e680000, 0x26),
    (0x3e680001, 0x27),
    (0x3e6d8077, 0x27),
    (0x3e767fe6, 0x27),
    (0x3e77ffff, 0x27),
    (0x3e780000, 0x28),
    (0x3e780001, 0x28),
    (0x3e826cdd, 0x28),
    (0x3e87ffff, 0x28),
    (0x3e880000, 0x28),
    (0x3e880001, 0x29),
    (0x3e942e00, 0x29),
    (0x3e970429, 0x29),
    (0x3e97ffff, 0x29),
    (0x3e980000, 0x2a),
    (0x3e980001, 0x2a),
    (0x3e98fc1e, 0x2a),
    (0x3e9ea53d, 0x2a),
    (0x3ea4165d, 0x2a),
    (0x3ea7ffff, 0x2a),
    (0x3ea80000, 0x2a),
    (0x3ea80001, 0x2b),
    (0x3eb7ffff, 0x2b),
    (0x3eb80000, 0x2c),
    (0x3eb80001, 0x2c),
    (0x3ec7ffff, 0x2c),
    (0x3ec80000, 0x2c),
    (0x3ec80001, 0x2d),
    (0x3ecab2f2, 0x2d),
    (0x3ed7ffff, 0x2d),
    (0x3ed80000, 0x2e),
    (0x3ed80001, 0x2e),
    (0x3ee0302a, 0x2e),
    (0x3ee7ffff, 0x2e),
    (0x3ee80000, 0x2e),
    (0x3ee80001, 0x2f),
    (0x3eecaa66, 0x2f),
    (0x3ef7ffff, 0x2f),
    (0x3ef80000, 0x30),
    (0x3ef80001, 0x30),
    (0x3f0034ff, 0x30),
    (0x3f07ffff, 0x30),
    (0x3f080000, 0x30),
    (0x3f080001, 0x31),
    (0x3f138d49, 0x31),
    (0x3f17ffff, 0x31),
    (0x3f180000, 0x32),
    (0x3f180001, 0x32),
    (0x3f20fa3d, 0x32),
    (0x3f25d39b, 0x32),
    (0x3f27ffff, 0x32),
    (0x3f280000, 0x32),
    (0x3f280001, 0x33),
    (0x3f37ffff, 0x33),
    (0x3f380000, 0x34),
    (0x3f380001, 0x34),
    (0x3f47ffff, 0x34),
    (0x3f480000, 0x34),
    (0x3f480001, 0x35),
    (0x3f57ffff, 0x35),
    (0x3f580000, 0x36),
    (0x3f580001, 0x36),
    (0x3f67ffff, 0x36),
    (0x3f680000, 0x36),
    (0x3f680001, 0x37),
    (0x3f77ffff, 0x37),
    (0x3f780000, 0x38),
    (0x3f780001, 0x38),
    (0x3f815231, 0x38),
    (0x3f87ffff, 0x38),
    (0x3f880000, 0x38),
    (0x3f880001, 0x39),
    (0x3f8c3106, 0x39),
    (0x3f97ffff, 0x39),
    (0x3f980000, 0x3a),
    (0x3f980001, 0x3a),
    (0x3f9bce27, 0x3a),
    (0x3fa7ffff, 0x3a),
    (0x3fa80000, 0x3a),
    (0x3fa80001, 0x3b),
    (0x3fb7ffff, 0x3b),
    (0x3fb80000, 0x3c),
    (0x3fb80001, 0x3c),
    (0x3fbd398c, 0x3c),
    (0x3fc68d78, 0x3c),
    (0x3fc7ffff, 0x3c),
    (0x3fc80000, 0x3c),
    (0x3fc80001, 0x3d),
    (0x3fcfe0ba, 0x3d),
    (0x3fd7ffff, 0x3d),
    (0x3fd80000, 0x3e),
    (0x3fd80001, 0x3e),
    (0x3fe7ffff, 0x3e),
    (0x3fe80000, 0x3e),
    (0x3fe80001, 0x3f),
    (0x3ff7ffff, 0x3f),
    (0x3ff80000, 0x40),
    (0x3ff80001, 0x40),
    (0x3ffb0160, 0x40),
    (0x40024dec, 0x40),
    (0x4006b706, 0x40),
    (0x4007ffff, 0x40),
    (0x40080000, 0x40),
    (0x40080001, 0x41),
    (0x400af1b7, 0x41),
    (0x4012ae5a, 0x41),
    (0x4017ffff, 0x41),
    (0x40180000, 0x42),
    (0x40180001, 0x42),
    (0x4027ffff, 0x42),
    (0x40280000, 0x42),
    (0x40280001, 0x43),
    (0x4037ffff, 0x43),
    (0x40380000, 0x44),
    (0x40380001, 0x44),
    (0x4047ffff, 0x44),
    (0x40480000, 0x44),
    (0x40480001, 0x45),
    (0x4057ffff, 0x45),
    (0x40580000, 0x46),
    (0x40580001, 0x46),
    (0x405da085, 0x46),
    (0x4067ffff, 0x46),
    (0x40680000, 0x46),
    (0x40680001, 0x47),
    (0x40738cb6, 0x47),
    (0x4077ffff, 0x47),
    (0x40780000, 0x48),
    (0x40780001, 0x48),
    (0x408798e3, 0x48),
    (0x4087ffff, 0x48),
    (0x40880000, 0x48),
    (0x40880001, 0x49),
    (0x4088c5ea, 0x49),
    (0x408c7720, 0x49),
    (0x4094bdd3, 0x49),
    (0x4097ffff, 0x49),
    (0x40980000, 0x4a),
    (0x40980001, 0x4a),
    (0x4099db0d, 0x4a),
    (0x40a7ffff, 0x4a),
    (0x40a80000, 0x4a),
    (0x40a80001, 0x4b),
    (0x40af7bc6, 0x4b),
    (0x40b1d703, 0x4b),
    (0x40b6cf9e, 0x4b),
    (0x40b7ffff, 0x4b),
    (0x40b80000, 0x4c),
    (0x40b80001, 0x4c),
    (0x40c7ffff, 0x4c),
    (0x40c80000, 0x4c),
    (0x40c80001, 0x4d),
    (0x40d7ffff, 0x4d),
    (0x40d80000, 0x4e),
    (0x40d80001, 0x4e),
    (0x40e7ffff, 0x4e),
    (0x40e80000, 0x4e),
    (0x40e80001, 0x4f),
    (0x40ef3a84, 0x4f),
    (0x40f31360, 0x4f),
    (0x40f7ffff, 0x4f),
    (0x40f80000, 0x50),
    (0x40f80001, 0x50),
    (0x4101091a, 0x50),
    (0x41022f20, 0x50),
    (0x41035c30, 0x50),
    (0x4107ffff, 0x50),
    (0x41080000, 0x50),
    (0x41080001, 0x51),
    (0x4117ffff, 0x51),
    (0x41180000, 0x52),
    (0x41180001, 0x52),
    (0x411ad018, 0x52),
    (0x4127ffff, 0x52),
    (0x41280000, 0x52),
    (0x41280001, 0x53),
    (0x4137ffff, 0x53),
    (0x41380000, 0x54),
    (0x41380001, 0x54),
    (0x413987f6, 0x54),
    (0x4147ffff, 0x54),
    (0x41480000, 0x54),
    (0x41480001, 0x55),
    (0x4153a91f, 0x55),
    (0x4157ffff, 0x55),
    (0x41580000, 0x56),
    (0x41580001, 0x56),
    (0x415bc1d5, 0x56),
    (0x4167ffff, 0x56),
    (0x41680000, 0x56),
    (0x41680001, 0x57),
    (0x416a5e15, 0x57),
    (0x416f7181, 0x57),
    (0x416f75c0, 0x57),
    (0x4177ffff, 0x57),
    (0x41780000, 0x58),
    (0x41780001, 0x58),
    (0x41844577, 0x58),
    (0x4187ffff, 0x58),
    (0x41880000, 0x58),
    (0x41880001, 0x59),
    (0x4197ffff, 0x59),
    (0x41980000, 0x5a),
    (0x41980001, 0x5a),
    (0x4198fa90, 0x5a),
    (0x41a7ffff, 0x5a),
    (0x41a80000, 0x5a),
    (0x41a80001, 0x5b),
    (0x41b7ffff, 0x5b),
    (0x41b80000, 0x5c),
    (0x41b80001, 0x5c),
    (0x41bbb2bb, 0x5c),
    (0x41c02388, 0x5c),
    (0x41c0fd89, 0x5c),
    (0x41c7ffff, 0x5c),
    (0x41c80000, 0x5c),
    (0x41c80001, 0x5d),
    (0x41d7ffff, 0x5d),
    (0x41d80000, 0x5e),
    (0x41d80001, 0x5e),
    (0x41df9927, 0x5e),
    (0x41e7ffff, 0x5e),
    (0x41e80000, 0x5e),
    (0x41e80001, 0x5f),
    (0x41f7ffff, 0x5f),
    (0x41f80000, 0x60),
    (0x41f80001, 0x60),
    (0x4200403f, 0x60),
    (0x4201a7ac, 0x60),
    (0x42055eec, 0x60),
    (0x4207ffff, 0x60),
    (0x42080000, 0x60),
    (0x42080001, 0x61),
    (0x4210432a, 0x61),
    (0x4217ffff, 0x61),
    (0x42180000, 0x62),
    (0x42180001, 0x62),
    (0x42248035, 0x62),
    (0x4227ffff, 0x62),
    (0x42280000, 0x62),
    (0x42280001, 0x63),
    (0x4237ffff, 0x63),
    (0x42380000, 0x64),
    (0x42380001, 0x64),
    (0x4245eb44, 0x64),
    (0x4247ffff, 0x64),
    (0x42480000, 0x64),
    (0x42480001, 0x65),
    (0x4257ffff, 0x65),
    (0x42580000, 0x66),
    (0x42580001, 0x66),
    (0x4267ffff, 0x66),
    (0x42680000, 0x66),
    (0x42680001, 0x67),
    (0x4269b9a4, 0x67),
    (0x4272e422, 0x67),
    (0x4277ffff, 0x67),
    (0x42780000, 0x68),
    (0x42780001, 0x68),
    (0x4283f112, 0x68),
    (0x42872e7c, 0x68),
    (0x4287ffff, 0x68),
    (0x42880000, 0x68),
    (0x42880001, 0x69),
    (0x4288cc48, 0x69),
    (0x4297ffff, 0x69),
    (0x42980000, 0x6a),
    (0x42980001, 0x6a),
    (0x4298b1c9, 0x6a),
    (0x42a7ffff, 0x6a),
    (0x42a80000, 0x6a),
    (0x42a80001, 0x6b),
    (0x42ae590f, 0x6b),
    (0x42aefdc3, 0x6b),
    (0x42b7ffff, 0x6b),
    (0x42b80000, 0x6c),
    (0x42b80001, 0x6c),
    (0x42c7ffff, 0x6c),
    (0x42c80000, 0x6c),
    (0x42c80001, 0x6d),
    (0x42d7ffff, 0x6d),
    (0x42d80000, 0x6e),
    (0x42d80001, 0x6e),
    (0x42e7ffff, 0x6e),
    (0x42e80000, 0x6e),
    (0x42e80001, 0x6f),
    (0x42f4f946, 0x6f),
    (0x42f7ffff, 0x6f),
    (0x42f80000, 0x70),
    (0x42f80001, 0x70),
    (0x4307ffff, 0x70),
    (0x43080000, 0x70),
    (0x43080001, 0x71),
    (0x4317ffff, 0x71),
    (0x43180000, 0x72),
    (0x43180001, 0x72),
    (0x431e7615, 0x72),
    (0x4320ff54, 0x72),
    (0x4327ffff, 0x72),
    (0x43280000, 0x72),
    (0x43280001, 0x73),
    (0x432e3b24, 0x73),
    (0x433648f8, 0x73),
    (0x4337ffff, 0x73),
    (0x43380000, 0x74),
    (0x43380001, 0x74),
    (0x4347ffff, 0x74),
    (0x43480000, 0x74),
    (0x43480001, 0x75),
    (0x4357ffff, 0x75),
    (0x43580000, 0x76),
    (0x43580001, 0x76),
    (0x4367ffff, 0x76),
    (0x43680000, 0x76),
    (0x43680001, 0x77),
    (0x4377ffff, 0x77),
    (0x43780000, 0x78),
    (0x43780001, 0x78),
    (0x4387ffff, 0x78),
    (0x43880000, 0x78),
    (0x43880001, 0x79),
    (0x439196fb, 0x79),
    (0x4397ffff, 0x79),
    (0x43980000, 0x7a),
    (0x43980001, 0x7a),
    (0x43a7ffff, 0x7a),
    (0x43a80000, 0x7a),
    (0x43a80001, 0x7b),
    (0x43b7ffff, 0x7b),
    (0x43b80000, 0x7c),
    (0x43b80001, 0x7c),
    (0x43c7ffff, 0x7c),
    (0x43c80000, 0x7c),
    (0x43c80001, 0x7d),
    (0x43cac857, 0x7d),
    (0x43d7ffff, 0x7d),
    (0x43d80000, 0x7e),
    (0x43d80001, 0x7e),
    (0x43dffffd, 0x7e),
    (0x43e00000, 0x7e),
    (0x80000000, 0x80),
    (0x8da24260, 0x80),
    (0xb6144c58, 0x80),
    (0xb6e67af6, 0x80),
    (0xb6fce7de, 0x80),
    (0xb73dfe3d, 0x80),
    (0xb78c5ad6, 0x80),
    (0xb881a71e, 0x80),
    (0xb8c2e779, 0x80),
    (0xb8c8cf26, 0x80),
    (0xb8d6099c, 0x80),
    (0xb8da171d, 0x80),
    (0xb8f086f7, 0x80),
    (0xb8f7d262, 0x80),
    (0xb90b29d0, 0x80),
    (0xb911e17e, 0x80),
    (0xb942a98f, 0x80),
    (0xb9878bc7, 0x80),
    (0xb9880302, 0x80),
    (0xb98f147b, 0x80),
    (0xb9a1877a, 0x80),
    (0xb9aea6b8, 0x80),
    (0xb9c8132e, 0x80),
    (0xb9d55b8b, 0x80),
    (0xb9d5c809, 0x80),
    (0xb9e9394a, 0x80),
    (0xb9edefd6, 0x80),
    (0xb9f2a5ac, 0x80),
    (0xb9fc9a20, 0x80),
    (0xba000000, 0x80),
    (0xba03a671, 0x80),
    (0xba07682d, 0x80),
    (0xba079f63, 0x80),
    (0xba0dc59e, 0x80),
    (0xba21eb49, 0x80),
    (0xba286c99, 0x80),
    (0xba33263c, 0x80),
    (0xba3d8684, 0x80),
    (0xba405b47, 0x80),
    (0xba422071, 0x80),
    (0xba4c96d2, 0x80),
    (0xba5650a8, 0x80),
    (0xba5a7050, 0x80),
    (0xba5c9b2e, 0x80),
    (0xba743522, 0x80),
    (0xba7fffff, 0x80),
    (0xba800000, 0x80),
    (0xba800001, 0x81),
    (0xba8488ff, 0x81),
    (0xba8f2d71, 0x81),
    (0xba9971cb, 0x81),
    (0xbac00000, 0x81),
    (0xbacbdcda, 0x81),
    (0xbadabf98, 0x81),
    (0xbae49438, 0x81),
    (0xbae4cfb6, 0x81),
    (0xbae6de30, 0x81),
    (0xbaedc214, 0x81),
    (0xbb0029e1, 0x81),
    (0xbb11f40a, 0x81),
    (0xbb159b75, 0x81),
    (0xbb1ff7c1, 0x81),
    (0xbb246cdd, 0x81),
    (0xbb3fffff, 0x81),
    (0xbb400000, 0x82),
    (0xbb400001, 0x82),
    (0xbb48fbf7, 0x82),
    (0xbb4da3fd, 0x82),
    (0xbb5ba14b, 0x82),
    (0xbb5c979d, 0x82),
    (0xbb61f2ff, 0x82),
    (0xbb6377af, 0x82),
    (0xbb6e7001, 0x82),
    (0xbb787e44, 0x82),
    (0xbb7c3c44, 0x82),
    (0xbb849fb5, 0x82),
    (0xbb8507d0, 0x82),
    (0xbb968314, 0x82),
    (0xbb9a46aa, 0x82),
    (0xbb9fffff, 0x82),
    (0xbba00000, 0x82),
    (0xbba00001, 0x83),
    (0xbbbe9e98, 0x83),
    (0xbbc2fe28, 0x83),
    (0xbbd07f01, 0x83),
    (0xbbd1a1ca, 0x83),
    (0xbbdfffff, 0x83),
    (0xbbe00000, 0x84),
    (0xbbe00001, 0x84),
    (0xbc0995e4, 0x84),
    (0xbc0a21bb, 0x84),
    (0xbc0cb201, 0x84),
    (0xbc0fffff, 0x84),
    (0xbc100000, 0x84),
    (0xbc100001, 0x85),
    (0xbc19761f, 0x85),
    (0xbc250db2, 0x85),
    (0xbc25c1ae, 0x85),
    (0xbc2fffff, 0x85),
    (0xbc300000, 0x86),
    (0xbc300001, 0x86),
    (0xbc4fffff, 0x86),
    (0xbc500000, 0x86),
    (0xbc500001, 0x87),
    (0xbc5d8fb9, 0x87),
    (0xbc5e1b73, 0x87),
    (0xbc650788, 0x87),
    (0xbc662e62, 0x87),
    (0xbc6fffff, 0x87),
    (0xbc700000, 0x88),
    (0xbc700001, 0x88),
    (0xbc7cdd46, 0x88),
    (0xbc87ffff, 0x88),
    (0xbc880000, 0x88),
    (0xbc880001, 0x89),
    (0xbc8975af, 0x89),
    (0xbc97ffff, 0x89),
    (0xbc980000, 0x8a),
    (0xbc980001, 0x8a),
    (0xbc98fa52, 0x8a),
    (0xbca714b9, 0x8a),
    (0xbca7ffff, 0x8a),
    (0xbca80000, 0x8a),
    (0xbca80001, 0x8b),
    (0xbca909c1, 0x8b),
    (0xbcabfe8a, 0x8b),
    (0xbcac4717, 0x8b),
    (0xbcb7ffff, 0x8b),
    (0xbcb80000, 0x8c),
    (0xbcb80001, 0x8c),
    (0xbcba10b3, 0x8c),
    (0xbcc1c7bc, 0x8c),
    (0xbcc7ffff, 0x8c),
    (0xbcc80000, 0x8c),
    (0xbcc80001, 0x8d),
    (0xbcd7ffff, 0x8d),
    (0xbcd80000, 0x8e),
    (0xbcd80001, 0x8e),
    (0xbce0deb3, 0x8e),
    (0xbce7ffff, 0x8e),
    (0xbce80000, 0x8e),
    (0xbce80001, 0x8f),
    (0xbceb0467, 0x8f),
    (0xbcee1d92, 0x8f),
    (0xbcefb726, 0x8f),
    (0xbcf7ffff, 0x8f),
    (0xbcf80000, 0x90),
    (0xbcf80001, 0x90),
    (0xbcf805b4, 0x90),
    (0xbcfdf19b, 0x90),
    (0xbd07ffff, 0x90),
    (0xbd080000, 0x90),
    (0xbd080001, 0x91),
    (0xbd17ffff, 0x91),
    (0xbd180000, 0x92),
    (0xbd180001, 0x92),
    (0xbd1d4937, 0x92),
    (0xbd27ffff, 0x92),
    (0xbd280000, 0x92),
    (0xbd280001, 0x93),
    (0xbd2e3a4a, 0x93),
    (0xbd37ffff, 0x93),
    (0xbd380000, 0x94),
    (0xbd380001, 0x94),
    (0xbd3eda68, 0x94),
    (0xbd47ffff, 0x94),
    (0xbd480000, 0x94),
    (0xbd480001, 0x95),
    (0xbd4ade53, 0x95),
    (0xbd57ffff, 0x95),
    (0xbd580000, 0x96),
    (0xbd580001, 0x96),
    (0xbd60ff7d, 0x96),
    (0xbd63c939, 0x96),
    (0xbd67ffff, 0x96),
    (0xbd680000, 0x96),
    (0xbd680001, 0x97),
    (0xbd77ffff, 0x97),
    (0xbd780000, 0x98),
    (0xbd780001, 0x98),
    (0xbd7d227c, 0x98),
    (0xbd839a61, 0x98),
    (0xbd8691eb, 0x98),
    (0xbd87ffff, 0x98),
    (0xbd880000, 0x98),
    (0xbd880001, 0x99),
    (0xbd952be2, 0x99),
    (0xbd97ffff, 0x99),
    (0xbd980000, 0x9a),
    (0xbd980001, 0x9a),
    (0xbd9e906d, 0x9a),
    (0xbd9ee0a2, 0x9a),
    (0xbd9fd473, 0x9a),
    (0xbda22e80, 0x9a),
    (0xbda7ffff, 0x9a),
    (0xbda80000, 0x9a),
    (0xbda80001, 0x9b),
    (0xbdb7ffff, 0x9b),
    (0xbdb80000, 0x9c),
    (0xbdb80001, 0x9c),
    (0xbdc7ffff, 0x9c),
    (0xbdc80000, 0x9c),
    (0xbdc80001, 0x9d),
    (0xbdce0918, 0x9d),
    (0xbdd05ea9, 0x9d),
    (0xbdd7ffff, 0x9d),
    (0xbdd80000, 0x9e),
    (0xbdd80001, 0x9e),
    (0xbdda7fde, 0x9e),
    (0xbddef5a1, 0x9e),
    (0xbde0436d, 0x9e),
    (0xbde7ffff, 0x9e),
    (0xbde80000, 0x9e),
    (0xbde80001, 0x9f),
    (0xbdf7ffff, 0x9f),
    (0xbdf80000, 0xa0),
    (0xbdf80001, 0xa0),
    (0xbe034487, 0xa0),
    (0xbe07ffff, 0xa0),
    (0xbe080000, 0xa0),
    (0xbe080001, 0xa1),
    (0xbe09a859, 0xa1),
    (0xbe0f09eb, 0xa1),
    (0xbe17ffff, 0xa1),
    (0xbe180000, 0xa2),
    (0xbe180001, 0xa2),
    (0xbe1f7e30, 0xa2),
    (0xbe27ffff, 0xa2),
    (0xbe280000, 0xa2),
    (0xbe280001, 0xa3),
    (0xbe2a25da, 0xa3),
    (0xbe37ffff, 0xa3),
    (0xbe380000, 0xa4),
    (0xbe380001, 0xa4),
    (0xbe442d45, 0xa4),
    (0xbe47ffff, 0xa4),
    (0xbe480000, 0xa4),
    (0xbe480001, 0xa5),
    (0xbe54cc9b, 0xa5),
    (0xbe57ffff, 0xa5),
    (0xbe580000, 0xa6),
    (0xbe580001, 0xa6),
    (0xbe67ffff, 0xa6),
    (0xbe680000, 0xa6),
    (0xbe680001, 0xa7),
    (0xbe6d8077, 0xa7),
    (0xbe767fe6, 0xa7),
    (0xbe77ffff, 0xa7),
    (0xbe780000, 0xa8),
    (0xbe780001, 0xa8),
    (0xbe826cdd, 0xa8),
    (0xbe87ffff, 0xa8),
    (0xbe880000, 0xa8),
    (0xbe880001, 0xa9),
    (0xbe942e00, 0xa9),
    (0xbe970429, 0xa9),
    (0xbe97ffff, 0xa9),
    (0xbe980000, 0xaa),
    (0xbe980001, 0xaa),
    (0xbe98fc1e, 0xaa),
    (0xbe9ea53d, 0xaa),
    (0xbea4165d, 0xaa),
    (0xbea7ffff, 0xaa),
    (0xbea80000, 0xaa),
    (0xbea80001, 0xab),
    (0xbeb7ffff, 0xab),
    (0xbeb80000, 0xac),
    (0xbeb80001, 0xac),
    (0xbec7ffff, 0xac),
    (0xbec80000, 0xac),
    (0xbec80001, 0xad),
    (0xbecab2f2, 0xad),
    (0xbed7ffff, 0xad),
    (0xbed80000, 0xae),
    (0xbed80001, 0xae),
    (0xbee0302a, 0xae),
    (0xbee7ffff, 0xae),
    (0xbee80000, 0xae),
    (0xbee80001, 0xaf),
    (0xbeecaa66, 0xaf),
    (0xbef7ffff, 0xaf),
    (0xbef80000, 0xb0),
    (0xbef80001, 0xb0),
    (0xbf0034ff, 0xb0),
    (0xbf07ffff, 0xb0),
    (0xbf080000, 0xb0),
    (0xbf080001, 0xb1),
    (0xbf138d49, 0xb1),
    (0xbf17ffff, 0xb1),
    (0xbf180000, 0xb2),
    (0xbf180001, 0xb2),
    (0xbf20fa3d, 0xb2),
    (0xbf25d39b, 0xb2),
    (0xbf27ffff, 0xb2),
    (0xbf280000, 0xb2),
    (0xbf280001, 0xb3),
    (0xbf37ffff, 0xb3),
    (0xbf380000, 0xb4),
    (0xbf380001, 0xb4),
    (0xbf47ffff, 0xb4),
    (0xbf480000, 0xb4),
    (0xbf480001, 0xb5),
    (0xbf57ffff, 0xb5),
    (0xbf580000, 0xb6),
    (0xbf580001, 0xb6),
    (0xbf67ffff, 0xb6),
    (0xbf680000, 0xb6),
    (0xbf680001, 0xb7),
    (0xbf77ffff, 0xb7),
    (0xbf780000, 0xb8),
    (0xbf780001, 0xb8),
    (0xbf815231, 0xb8),
    (0xbf87ffff, 0xb8),
    (0xbf880000, 0xb8),
    (0xbf880001, 0xb9),
    (0xbf8c3106, 0xb9),
    (0xbf97ffff, 0xb9),
    (0xbf980000, 0xba),
    (0xbf980001, 0xba),
    (0xbf9bce27, 0xba),
    (0xbfa7ffff, 0xba),
    (0xbfa80000, 0xba),
    (0xbfa80001, 0xbb),
    (0xbfb7ffff, 0xbb),
    (0xbfb80000, 0xbc),
    (0xbfb80001, 0xbc),
    (0xbfbd398c, 0xbc),
    (0xbfc68d78, 0xbc),
    (0xbfc7ffff, 0xbc),
    (0xbfc80000, 0xbc),
    (0xbfc80001, 0xbd),
    (0xbfcfe0ba, 0xbd),
    (0xbfd7ffff, 0xbd),
    (0xbfd80000, 0xbe),
    (0xbfd80001, 0xbe),
    (0xbfe7ffff, 0xbe),
    (0xbfe80000, 0xbe),
    (0xbfe80001, 0xbf),
    (0xbff7ffff, 0xbf),
    (0xbff80000, 0xc0),
    (0xbff80001, 0xc0),
    (0xbffb0160, 0xc0),
    (0xc0024dec, 0xc0),
    (0xc006b706, 0xc0),
    (0xc007ffff, 0xc0),
    (0xc0080000, 0xc0),
    (0xc0080001, 0xc1),
    (0xc00af1b7, 0xc1),
    (0xc012ae5a, 0xc1),
    (0xc017ffff, 0xc1),
    (0xc0180000, 0xc2),
    (0xc0180001, 0xc2),
    (0xc027ffff, 0xc2),
    (0xc0280000, 0xc2),
    (0xc0280001, 0xc3),
    (0xc037ffff, 0xc3),
    (0xc0380000, 0xc4),
    (0xc0380001, 0xc4),
    (0xc047ffff, 0xc4),
    (0xc0480000, 0xc4),
    (0xc0480001, 0xc5),
    (0xc057ffff, 0xc5),
    (0xc0580000, 0xc6),
    (0xc0580001, 0xc6),
    (0xc05da085, 0xc6),
    (0xc067ffff, 0xc6),
    (0xc0680000, 0xc6),
    (0xc0680001, 0xc7),
    (0xc0738cb6, 0xc7),
    (0xc077ffff, 0xc7),
    (0xc0780000, 0xc8),
    (0xc0780001, 0xc8),
    (0xc08798e3, 0xc8),
    (0xc087ffff, 0xc8),
    (0xc0880000, 0xc8),
    (0xc0880001, 0xc9),
    (0xc088c5ea, 0xc9),
    (0xc08c7720, 0xc9),
    (0xc094bdd3, 0xc9),
    (0xc097ffff, 0xc9),
    (0xc0980000, 0xca),
    (0xc0980001, 0xca),
    (0xc099db0d, 0xca),
    (0xc0a7ffff, 0xca),
    (0xc0a80000, 0xca),
    (0xc0a80001, 0xcb),
    (0xc0af7bc6, 0xcb),
    (0xc0b1d703, 0xcb),
    (0xc0b6cf9e, 0xcb),
    (0xc0b7ffff, 0xcb),
    (0xc0b80000, 0xcc),
    (0xc0b80001, 0xcc),
    (0xc0c7ffff, 0xcc),
    (0xc0c80000, 0xcc),
    (0xc0c80001, 0xcd),
    (0xc0d7ffff, 0xcd),
    (0xc0d80000, 0xce),
    (0xc0d80001, 0xce),
    (0xc0e7ffff, 0xce),
    (0xc0e80000, 0xce),
    (0xc0e80001, 0xcf),
    (0xc0ef3a84, 0xcf),
    (0xc0f31360, 0xcf),
    (0xc0f7ffff, 0xcf),
    (0xc0f80000, 0xd0),
    (0xc0f80001, 0xd0),
    (0xc101091a, 0xd0),
    (0xc1022f20, 0xd0),
    (0xc1035c30, 0xd0),
    (0xc107ffff, 0xd0),
    (0xc1080000, 0xd0),
    (0xc1080001, 0xd1),
    (0xc117ffff, 0xd1),
    (0xc1180000, 0xd2),
    (0xc1180001, 0xd2),
    (0xc11ad018, 0xd2),
    (0xc127ffff, 0xd2),
    (0xc1280000, 0xd2),
    (0xc1280001, 0xd3),
    (0xc137ffff, 0xd3),
    (0xc1380000, 0xd4),
    (0xc1380001, 0xd4),
    (0xc13987f6, 0xd4),
    (0xc147ffff, 0xd4),
    (0xc1480000, 0xd4),
    (0xc1480001, 0xd5),
    (0xc153a91f, 0xd5),
    (0xc157ffff, 0xd5),
    (0xc1580000, 0xd6),
    (0xc1580001, 0xd6),
    (0xc15bc1d5, 0xd6),
    (0xc167ffff, 0xd6),
    (0xc1680000, 0xd6),
    (0xc1680001, 0xd7),
    (0xc16a5e15, 0xd7),
    (0xc16f7181, 0xd7),
    (0xc16f75c0, 0xd7),
    (0xc177ffff, 0xd7),
    (0xc1780000, 0xd8),
    (0xc1780001, 0xd8),
    (0xc1844577, 0xd8),
    (0xc187ffff, 0xd8),
    (0xc1880000, 0xd8),
    (0xc1880001, 0xd9),
    (0xc197ffff, 0xd9),
    (0xc1980000, 0xda),
    (0xc1980001, 0xda),
    (0xc198fa90, 0xda),
    (0xc1a7ffff, 0xda),
    (0xc1a80000, 0xda),
    (0xc1a80001, 0xdb),
    (0xc1b7ffff, 0xdb),
    (0xc1b80000, 0xdc),
    (0xc1b80001, 0xdc),
    (0xc1bbb2bb, 0xdc),
    (0xc1c02388, 0xdc),
    (0xc1c0fd89, 0xdc),
    (0xc1c7ffff, 0xdc),
    (0xc1c80000, 0xdc),
    (0xc1c80001, 0xdd),
    (0xc1d7ffff, 0xdd),
    (0xc1d80000, 0xde),
    (0xc1d80001, 0xde),
    (0xc1df9927, 0xde),
    (0xc1e7ffff, 0xde),
    (0xc1e80000, 0xde),
    (0xc1e80001, 0xdf),
    (0xc1f7ffff, 0xdf),
    (0xc1f80000, 0xe0),
    (0xc1f80001, 0xe0),
    (0xc200403f, 0xe0),
    (0xc201a7ac, 0xe0),
    (0xc2055eec, 0xe0),
    (0xc207ffff, 0xe0),
    (0xc2080000, 0xe0),
    (0xc2080001, 0xe1),
    (0xc210432a, 0xe1),
    (0xc217ffff, 0xe1),
    (0xc2180000, 0xe2),
    (0xc2180001, 0xe2),
    (0xc2248035, 0xe2),
    (0xc227ffff, 0xe2),
    (0xc2280000, 0xe2),
    (0xc2280001, 0xe3),
    (0xc237ffff, 0xe3),
    (0xc2380000, 0xe4),
    (0xc2380001, 0xe4),
    (0xc245eb44, 0xe4),
    (0xc247ffff, 0xe4),
    (0xc2480000, 0xe4),
    (0xc2480001, 0xe5),
    (0xc257ffff, 0xe5),
    (0xc2580000, 0xe6),
    (0xc2580001, 0xe6),
    (0xc267ffff, 0xe6),
    (0xc2680000, 0xe6),
    (0xc2680001, 0xe7),
    (0xc269b9a4, 0xe7),
    (0xc272e422, 0xe7),
    (0xc277ffff, 0xe7),
    (0xc2780000, 0xe8),
    (0xc2780001, 0xe8),
    (0xc283f112, 0xe8),
    (0xc2872e7c, 0xe8),
    (0xc287ffff, 0xe8),
    (0xc2880000, 0xe8),
    (0xc2880001, 0xe9),
    (0xc288cc48, 0xe9),
    (0xc297ffff, 0xe9),
    (0xc2980000, 0xea),
    (0xc2980001, 0xea),
    (0xc298b1c9, 0xea),
    (0xc2a7ffff, 0xea),
    (0xc2a80000, 0xea),
    (0xc2a80001, 0xeb),
    (0xc2ae590f, 0xeb),
    (0xc2aefdc3, 0xeb),
    (0xc2b7ffff, 0xeb),
    (0xc2b80000, 0xec),
    (0xc2b80001, 0xec),
    (0xc2c7ffff, 0xec),
    (0xc2c80000, 0xec),
    (0xc2c80001, 0xed),
    (0xc2d7ffff, 0xed),
    (0xc2d80000, 0xee),
    (0xc2d80001, 0xee),
    (0xc2e7ffff, 0xee),
    (0xc2e80000, 0xee),
    (0xc2e80001, 0xef),
    (0xc2f4f946, 0xef),
    (0xc2f7ffff, 0xef),
    (0xc2f80000, 0xf0),
    (0xc2f80001, 0xf0),
    (0xc307ffff, 0xf0),
    (0xc3080000, 0xf0),
    (0xc3080001, 0xf1),
    (0xc317ffff, 0xf1),
    (0xc3180000, 0xf2),
    (0xc3180001, 0xf2),
    (0xc31e7615, 0xf2),
    (0xc320ff54, 0xf2),
    (0xc327ffff, 0xf2),
    (0xc3280000, 0xf2),
    (0xc3280001, 0xf3),
    (0xc32e3b24, 0xf3),
    (0xc33648f8, 0xf3),
    (0xc337ffff, 0xf3),
    (0xc3380000, 0xf4),
    (0xc3380001, 0xf4),
    (0xc347ffff, 0xf4),
    (0xc3480000, 0xf4),
    (0xc3480001, 0xf5),
    (0xc357ffff, 0xf5),
    (0xc3580000, 0xf6),
    (0xc3580001, 0xf6),
    (0xc367ffff, 0xf6),
    (0xc3680000, 0xf6),
    (0xc3680001, 0xf7),
    (0xc377ffff, 0xf7),
    (0xc3780000, 0xf8),
    (0xc3780001, 0xf8),
    (0xc387ffff, 0xf8),
    (0xc3880000, 0xf8),
    (0xc3880001, 0xf9),
    (0xc39196fb, 0xf9),
    (0xc397ffff, 0xf9),
    (0xc3980000, 0xfa),
    (0xc3980001, 0xfa),
    (0xc3a7ffff, 0xfa),
    (0xc3a80000, 0xfa),
    (0xc3a80001, 0xfb),
    (0xc3b7ffff, 0xfb),
    (0xc3b80000, 0xfc),
    (0xc3b80001, 0xfc),
    (0xc3c7ffff, 0xfc),
    (0xc3c80000, 0xfc),
    (0xc3c80001, 0xfd),
    (0xc3cac857, 0xfd),
    (0xc3d7ffff, 0xfd),
    (0xc3d80000, 0xfe),
    (0xc3d80001, 0xfe),
    (0xc3dffffd, 0xfe),
    (0xc3e00000, 0xfe),
];

#[test]
fn decoding_matches_ml_dtypes_for_all_256_bytes() {
    for (b, &want) in DECODE.iter().enumerate() {
        let got = decode_e4m3(b as u8);
        let want = f32::from_bits(want);
        if want.is_nan() {
            assert!(got.is_nan(), "{b:#04x}: {got}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{b:#04x}: {got} vs {want}");
        }
    }
}

#[test]
fn encoding_matches_ml_dtypes_ties_to_even() {
    let mut ties = 0;
    for &(x, want) in ENCODE.iter() {
        let x = f32::from_bits(x);
        let got = encode_e4m3(x);
        assert_eq!(
            got,
            want,
            "{x:e} ({:#010x}): {got:#04x} vs {want:#04x}",
            x.to_bits()
        );
        // Exactly halfway between `want` and a neighbour: `want` has the even mantissa.
        let m = want & 0x7F;
        for n in [m.wrapping_sub(1), m + 1]
            .into_iter()
            .filter(|&n| n <= 0x7E)
        {
            if x.abs() == (decode_e4m3(m) + decode_e4m3(n)) / 2.0 {
                assert_eq!(m & 1, 0, "{x:e}: a tie must round to the even mantissa");
                ties += 1;
            }
        }
    }
    assert!(
        ENCODE.len() > 500 && ties > 100,
        "{} values, {ties} ties",
        ENCODE.len()
    );
}

#[test]
fn saturation_nan_and_signed_zero() {
    // Past 448 (where ml_dtypes gives NaN) the codec saturates, like CUDA's cvt.rn.satfinite.
    for (x, want) in [
        (448.0f32, 0x7E),
        (448.000_03, 0x7E),
        (463.99, 0x7E),
        (464.0, 0x7E),
        (480.0, 0x7E),
        (1e30, 0x7E),
        (f32::INFINITY, 0x7E),
        (f32::MAX, 0x7E),
    ] {
        assert_eq!(encode_e4m3(x), want, "{x}");
        assert_eq!(encode_e4m3(-x), want | 0x80, "{}", -x);
    }
    assert_eq!(encode_e4m3(f32::NAN), E4M3_NAN);
    assert_eq!(encode_e4m3(-f32::NAN), E4M3_NAN);
    assert!(decode_e4m3(0x7F).is_nan() && decode_e4m3(0xFF).is_nan());
    assert_eq!(encode_e4m3(0.0), 0x00);
    assert_eq!(encode_e4m3(-0.0), 0x80);
    assert_eq!(decode_e4m3(0x80).to_bits(), (-0.0f32).to_bits());
    // Half the smallest subnormal is a tie with zero (even): 0; just above it rounds up.
    assert_eq!(encode_e4m3(2f32.powi(-10)), 0x00);
    assert_eq!(
        encode_e4m3(f32::from_bits(2f32.powi(-10).to_bits() + 1)),
        0x01
    );
    // Subnormal f32 inputs are zeros of their sign.
    assert_eq!(encode_e4m3(f32::from_bits(1)), 0x00);
    assert_eq!(encode_e4m3(-f32::from_bits(1)), 0x80);
}

/// Deterministic values in [-1, 1) (xorshift).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn rows_quantize_to_their_own_scale_within_the_bound() {
    for (seed, amp) in [(1u64, 1.0f32), (2, 37.5), (3, 1e-3), (4, 3e4)] {
        let row: Vec<f32> = noise(256, seed).iter().map(|x| x * amp).collect();
        let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        let mut bytes = vec![0u8; row.len()];
        let scale = quantize_row(&row, &mut bytes);
        assert_eq!(scale, amax / 448.0, "seed {seed}");
        // The largest element maps to ±448 exactly (its quotient is 448 up to one rounding).
        let top = row.iter().position(|x| x.abs() == amax).unwrap();
        assert_eq!(bytes[top] & 0x7F, 0x7E, "seed {seed}");
        let mut back = vec![0f32; row.len()];
        dequantize_row(&bytes, scale, &mut back);
        let bound = max_abs_error(amax);
        for (i, (x, y)) in row.iter().zip(&back).enumerate() {
            let err = (x - y).abs();
            assert!(err <= bound, "seed {seed}, {i}: {x} -> {y}");
            // 3 mantissa bits: half a step is 2⁻⁴ of the value above the subnormal range.
            if x.abs() / scale >= 1.0 / 64.0 {
                assert!(
                    err <= x.abs() / 16.0 * 1.000_001,
                    "seed {seed}, {i}: {x} -> {y}"
                );
            }
        }
    }
    // A row of zeros: scale 1, all bytes zero, no NaN.
    let mut bytes = [0xAAu8; 8];
    assert_eq!(quantize_row(&[0.0; 8], &mut bytes), 1.0);
    assert_eq!(bytes, [0; 8]);
    assert_eq!(row_scale(0.0), 1.0);
}

#[test]
fn tensor_quantization_is_per_row_and_round_trips() {
    let (n_kv, t, hd) = (2, 5, 64);
    let mut values = noise(n_kv * t * hd, 9);
    // One row of zeros, one of huge values, one with an infinity and a NaN.
    values[hd..2 * hd].iter_mut().for_each(|x| *x = 0.0);
    values[2 * hd..3 * hd].iter_mut().for_each(|x| *x *= 1e30);
    values[3 * hd] = f32::INFINITY;
    values[3 * hd + 1] = f32::NAN;
    let x = Tensor::from_vec(values.clone(), (n_kv, t, hd), &Device::Cpu).unwrap();
    let (q, s) = quantize(&x).unwrap();
    assert_eq!(q.dtype(), DType::U8);
    assert_eq!(q.dims(), [n_kv, t, hd]);
    assert_eq!(s.dims(), [n_kv, t]);
    let (qv, sv) = (
        q.flatten_all().unwrap().to_vec1::<u8>().unwrap(),
        s.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
    );
    for r in 0..n_kv * t {
        let mut want = vec![0u8; hd];
        let scale = quantize_row(&values[r * hd..(r + 1) * hd], &mut want);
        assert_eq!(&qv[r * hd..(r + 1) * hd], want.as_slice(), "row {r}");
        assert_eq!(sv[r].to_bits(), scale.to_bits(), "row {r}");
        assert!(sv[r].is_finite() && sv[r] > 0.0, "row {r}: scale {}", sv[r]);
    }
    assert_eq!(sv[1], 1.0, "the zero row");
    // The row with an infinity: scale 1 (amax is infinite), the infinity saturates, NaN stays NaN.
    assert_eq!(sv[3], 1.0);
    assert_eq!(qv[3 * hd], 0x7E);
    assert_eq!(qv[3 * hd + 1], E4M3_NAN);
    // Dequantization is decode · scale, in f32 and widened to f64 exactly.
    let back = dequantize(&q, &s, DType::F32).unwrap();
    let back64 = dequantize(&q, &s, DType::F64).unwrap();
    let bv = back.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let bv64 = back64.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    for (i, (&b, &b64)) in bv.iter().zip(&bv64).enumerate() {
        let want = decode_e4m3(qv[i]) * sv[i / hd];
        assert!(
            b.to_bits() == want.to_bits() || (b.is_nan() && want.is_nan()),
            "{i}"
        );
        assert!(f64::from(b) == b64 || (b.is_nan() && b64.is_nan()), "{i}");
    }
    // Shapes that do not fit are refused.
    assert!(dequantize(&q, &s.narrow(1, 0, 4).unwrap(), DType::F32).is_err());
    assert!(dequantize(&x, &s, DType::F32).is_err());
}

// ---- the model ----

fn load_kv(file: &str, precision: Precision, kv: KvStorage) -> Qwen35Model {
    single_threaded_matmuls();
    let options = LoadOptions {
        kv_storage: kv,
        ..quantized::options(precision)
    };
    Qwen35Model::from_gguf_with_q8_scales(&quantized::open(file), &options, Q8Scales::PerRun)
        .unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// tiny-Q8_0.gguf at int8 (the serving precision of a Q8_0 file), fp8 keys and values.
fn int8_fp8() -> &'static Qwen35Model {
    static M: OnceLock<Qwen35Model> = OnceLock::new();
    M.get_or_init(|| load_kv("tiny-Q8_0.gguf", Precision::Int8, KvStorage::Fp8))
}

/// tiny-Q8_0.gguf at int8, native (f32) keys and values.
fn int8_native() -> &'static Qwen35Model {
    quantized::int8_model()
}

/// tiny-Q8_0.gguf in f32 (weights dequantized), fp8 and native: the fp8 error alone.
fn f32_models() -> &'static [Qwen35Model; 2] {
    static M: OnceLock<[Qwen35Model; 2]> = OnceLock::new();
    M.get_or_init(|| {
        [
            load_kv("tiny-Q8_0.gguf", Precision::F32, KvStorage::Native),
            load_kv("tiny-Q8_0.gguf", Precision::F32, KvStorage::Fp8),
        ]
    })
}

fn prompt_refs() -> Vec<&'static [u32]> {
    prompts().iter().map(|p| p.as_slice()).collect()
}

/// Last-position logits of the 12 fixture prompts run as one batch, `[12, vocab]` f32.
fn batch_logits(model: &Qwen35Model) -> Tensor {
    let hidden = model.last_hidden(&prompt_refs()).unwrap();
    model.logits(&hidden).unwrap().to_dtype(DType::F32).unwrap()
}

fn argmax_rows(logits: &Tensor) -> Vec<u32> {
    (0..logits.dim(0).unwrap())
        .map(|i| prism_model::argmax(&logits.get(i).unwrap()).unwrap())
        .collect()
}

/// Bounds on max |Δlogit| between fp8 and native (f32) keys and values over the 12 fixture prompts'
/// last-position logits (|logit| up to 11.3), twice what was measured on 2026-12-02 (f32 path 0.0709,
/// int8 path 0.301). Why that size is right: e4m3 keeps 3 mantissa bits, so every stored key and value
/// is off by up to 2⁻⁴ of itself (about 2 % rms); attention averages many of them and the softmax sees
/// q·k sums of 64 products, so the f32 path's logits move by well under 1 % of their range. The int8
/// path moves more because the random tiny model turns every int8 rounding that the perturbation
/// flips into a visible change (the same effect makes the int8 and f32 paths differ by 1.07); a wrong
/// scale, a misplaced row or a cache read in the wrong format moves logits by whole units.
const FP8_F32_PATH_BOUND: f64 = 0.15;
const FP8_INT8_PATH_BOUND: f64 = 0.6;

#[test]
fn fp8_kv_logits_stay_close_to_native_kv() {
    let fp8 = batch_logits(int8_fp8());
    let native = batch_logits(int8_native());
    let [f32_native, f32_fp8] = f32_models();
    let (f32_native, f32_fp8) = (batch_logits(f32_native), batch_logits(f32_fp8));
    let d_int8 = max_abs_diff_tensors(&fp8, &native);
    let d_f32 = max_abs_diff_tensors(&f32_fp8, &f32_native);
    let mean = |a: &Tensor, b: &Tensor| {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .mean_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let (m_int8, m_f32) = (mean(&fp8, &native), mean(&f32_fp8, &f32_native));
    // The integer path's own distance to the f32 path on the same file, for scale.
    let d_path = max_abs_diff_tensors(&native, &f32_native);
    let range = max_abs(&f32_native);
    let same = argmax_rows(&fp8)
        .iter()
        .zip(argmax_rows(&native))
        .filter(|(a, b)| **a == *b)
        .count();
    eprintln!(
        "fp8 vs native KV, 12 prompts: max |Δlogit| int8 {d_int8:.4e}, f32 {d_f32:.4e}; \
         mean |Δlogit| int8 {m_int8:.4e}, f32 {m_f32:.4e}; int8 vs f32 path {d_path:.4e}; \
         max |logit| {range:.3}; same argmax {same}/12"
    );
    for (what, d, bound) in [
        ("int8", d_int8, FP8_INT8_PATH_BOUND),
        ("f32", d_f32, FP8_F32_PATH_BOUND),
    ] {
        assert!(
            d > 0.0,
            "{what}: fp8 keys and values changed nothing: is the cache quantized?"
        );
        assert!(d <= bound, "{what}: max |Δlogit| {d:.4e} > {bound}");
    }
    assert!(
        d_int8 <= d_path,
        "fp8 KV moves the logits more ({d_int8:.4e}) than int8 does ({d_path:.4e})"
    );
    assert_eq!(same, 12, "fp8 KV changed a prompt's top token");
}

/// One-shot prefill of prompt `i` alone: last-position logits and the state left behind.
fn alone(model: &Qwen35Model, i: usize) -> (Tensor, SequenceState) {
    let mut state = model.new_state().unwrap();
    let hidden = model.prefill(&mut state, &prompts()[i]).unwrap();
    (model.logits(&hidden).unwrap(), state)
}

/// Every attention layer's cache of two states holds the same bytes and scales, in the same shapes (and
/// is fp8).
fn assert_same_fp8_caches(what: &str, a: &SequenceState, b: &SequenceState) {
    assert_eq!(a.n_tokens(), b.n_tokens(), "{what}: token counts");
    let mut layers = 0;
    for (l, (x, y)) in a.layers().iter().zip(b.layers()).enumerate() {
        if let (LayerState::Attention(x), LayerState::Attention(y)) = (x, y) {
            assert!(x.is_fp8() && y.is_fp8(), "{what}: layer {l} is not fp8");
            for (p, q) in [
                (&x.k, &y.k),
                (&x.v, &y.v),
                (&x.k_scale, &y.k_scale),
                (&x.v_scale, &y.v_scale),
            ] {
                let (p, q) = (p.as_ref().unwrap(), q.as_ref().unwrap());
                assert_eq!(p.dtype(), q.dtype());
                assert_eq!(p.dims(), q.dims(), "{what}: layer {l} cache shapes");
                let (p, q) = (
                    p.to_dtype(DType::F32).unwrap(),
                    q.to_dtype(DType::F32).unwrap(),
                );
                assert!(bits(&p) == bits(&q), "{what}: layer {l} cache differs");
            }
            layers += 1;
        }
    }
    assert!(layers > 0, "{what}: no attention layer");
}

#[test]
fn fp8_kv_is_batch_invariant_bit_for_bit() {
    let model = int8_fp8();
    let refs = prompt_refs();
    let batched = batch_logits(model);
    let (alone3, state3) = alone(model, 3);
    assert!(
        bits(&alone3) == bits(&batched.narrow(0, 3, 1).unwrap()),
        "prompt 3 alone vs in the batch of 12"
    );
    // Between two other prompts, with its states kept.
    let mut states: Vec<SequenceState> = (0..3).map(|_| model.new_state().unwrap()).collect();
    let mut items: Vec<BatchItem<'_>> = states
        .iter_mut()
        .zip([refs[7], refs[3], refs[1]])
        .map(|(s, p)| BatchItem::new(s, p))
        .collect();
    let out = model.forward(&mut items).unwrap();
    let mixed = model.logits(&out.last_hidden().unwrap()).unwrap();
    assert!(
        bits(&mixed.narrow(0, 1, 1).unwrap()) == bits(&alone3),
        "prompt 3 between prompts 7 and 1"
    );
    assert_same_fp8_caches("prompt 3 batched vs alone", &states[1], &state3);
    // Branched from the prompts' shared prefix (the chat template's opening) in one pass.
    let shared = model
        .logits(&model.last_hidden_shared_prefix(&refs[..4]).unwrap())
        .unwrap();
    assert!(
        bits(&shared) == bits(&batched.narrow(0, 0, 4).unwrap()),
        "4 prompts branched from their shared prefix vs one batch"
    );
    // A cached prefix: prompt 3's first 40 tokens computed and kept (as the prefix cache does), then
    // its rest continued from a clone of that state.
    let p3 = &prompts()[3];
    let mut prefix = model.new_state().unwrap();
    model.prefill(&mut prefix, &p3[..40]).unwrap();
    let mut from_cache = prefix.clone();
    let hidden = model.prefill(&mut from_cache, &p3[40..]).unwrap();
    assert!(
        bits(&model.logits(&hidden).unwrap()) == bits(&alone3),
        "prompt 3 continued from a cached prefix"
    );
    assert_same_fp8_caches(
        "prompt 3 from a cached prefix vs alone",
        &from_cache,
        &state3,
    );
    // In pieces of 1, 7, 64 and the rest, then decode steps.
    let p0 = &prompts()[0];
    let (alone0, state0) = alone(model, 0);
    let mut state = model.new_state().unwrap();
    let mut at = 0;
    let mut last = None;
    for piece in [1usize, 7, 64, usize::MAX] {
        let n = piece.min(p0.len() - at);
        last = Some(model.prefill(&mut state, &p0[at..at + n]).unwrap());
        at += n;
    }
    assert!(
        bits(&model.logits(&last.unwrap()).unwrap()) == bits(&alone0),
        "prompt 0 in pieces 1/7/64/rest"
    );
    assert_same_fp8_caches("prompt 0 in pieces vs one call", &state, &state0);
    let (mut a, mut b) = (state.clone(), state0.clone());
    for token in [5u32, 17, 99] {
        let (ha, hb) = (
            model.prefill(&mut a, &[token]).unwrap(),
            model.prefill(&mut b, &[token]).unwrap(),
        );
        assert!(bits(&ha) == bits(&hb), "decode step {token}");
    }
}

#[test]
fn fp8_kv_bytes_are_what_the_cache_holds() {
    let cfg = int8_fp8().config().clone();
    let attention_layers = cfg
        .layer_kinds
        .iter()
        .filter(|k| matches!(k, prism_model::LayerKind::Attention))
        .count();
    let (n_kv, hd) = (cfg.n_kv_heads, cfg.head_dim);
    let n = prompts()[3].len();
    let (_, fp8) = alone(int8_fp8(), 3);
    let (_, native) = alone(int8_native(), 3);
    // Keys and values: one byte a value and one f32 scale per token and KV head, in every attention layer;
    // native storage counts its rooms' positions (the tokens and the room to grow).
    let want_fp8 = attention_layers * 2 * n_kv * n * (hd + 4);
    let rows = prism_model::state::KvRoom::rows_for(n, 0);
    assert!(rows >= n + 256 && rows % 256 == 0);
    let want_f32 = attention_layers * 2 * n_kv * rows * hd * 4;
    assert_eq!(fp8.kv_bytes(), want_fp8);
    assert_eq!(native.kv_bytes(), want_f32);
    // The rest of the state (DeltaNet) is the same.
    assert_eq!(
        fp8.bytes() - fp8.kv_bytes(),
        native.bytes() - native.kv_bytes()
    );
    // Against bf16 keys and values (the GPU's native cache): (hd + 4) / 2hd, 0.53 at head dim 64 and
    // 0.51 at 256.
    let bf16 = attention_layers * 2 * n_kv * n * hd * 2;
    let ratio = fp8.kv_bytes() as f64 / bf16 as f64;
    eprintln!(
        "K/V bytes of prompt 3 ({n} tokens): fp8 {} vs bf16 {bf16} ({ratio:.3}) vs f32 {}",
        fp8.kv_bytes(),
        native.kv_bytes()
    );
    assert!((0.5..0.55).contains(&ratio), "fp8 / bf16 = {ratio}");
    // The cache is really u8 with [n_kv, len] f32 scales.
    for layer in fp8.layers() {
        if let LayerState::Attention(kv) = layer {
            assert_eq!(kv.k.as_ref().unwrap().dtype(), DType::U8);
            assert_eq!(kv.v.as_ref().unwrap().dtype(), DType::U8);
            assert_eq!(kv.k_scale.as_ref().unwrap().dims(), [n_kv, n]);
            assert_eq!(kv.v_scale.as_ref().unwrap().dtype(), DType::F32);
        }
    }
}

#[test]
fn a_state_of_the_other_kv_storage_is_refused() {
    let p = &prompts()[1];
    let (_, native_state) = alone(int8_native(), 1);
    let (_, fp8_state) = alone(int8_fp8(), 1);
    for (model, state, what) in [
        (int8_fp8(), native_state, "native state, fp8 model"),
        (int8_native(), fp8_state, "fp8 state, native model"),
    ] {
        let mut state = state;
        match model.forward(&mut [BatchItem::new(&mut state, &p[..3])]) {
            Err(ModelError::InvalidInput(msg)) => {
                assert!(msg.contains("K/V cache"), "{what}: {msg}")
            }
            other => panic!("{what}: {:?}", other.map(|_| ())),
        }
    }
    assert_eq!(int8_fp8().kv_storage(), KvStorage::Fp8);
    assert_eq!(int8_native().kv_storage(), KvStorage::Native);
    assert!(prism_model::kv_fp8::check_device(&Device::Cpu).is_ok());
}

/// With fp8 keys and values, a snapshot inside an item (the engine's evidence state from one pass over
/// evidence and question) holds the evidence's own bytes and scales, and a follow-up from it reads the
/// logits of a follow-up from the evidence run alone.
#[test]
fn an_fp8_snapshot_is_the_prefix_cache_its_prefix_leaves() {
    let model = int8_fp8();
    let seq = &prompts()[3][..120];
    let question = &prompts()[6][40..57];
    for point in [2usize, 64, 90] {
        let mut alone = model.new_state().unwrap();
        model
            .forward(&mut [BatchItem::new(&mut alone, &seq[..point])])
            .unwrap();
        let mut state = model.new_state().unwrap();
        let mut item = BatchItem::new(&mut state, seq);
        item.snapshot = Some(point);
        let mut out = model.forward(&mut [item]).unwrap();
        let snapshot = out.snapshots[0].take().expect("a snapshot");
        assert_same_fp8_caches(&format!("after {point}"), &snapshot, &alone);
        let read = |mut state: SequenceState| {
            let hidden = model
                .forward(&mut [BatchItem::new(&mut state, question)])
                .unwrap()
                .hidden;
            bits(
                &model
                    .logits(&hidden.narrow(0, question.len() - 1, 1).unwrap())
                    .unwrap(),
            )
        };
        assert_eq!(read(snapshot), read(alone), "a follow-up after {point}");
    }
}
