#!/usr/bin/env python3
"""Reference values for the e4m3 ("float8_e4m3fn") codec of the fp8 K/V cache (crates/prism-model/src/kv_fp8.rs).

Prints the Rust tables of crates/prism-model/tests/kv_fp8.rs, computed by ml_dtypes (an independent
implementation: JAX's float8 types):
  - DECODE: the f32 bits of all 256 e4m3 bytes;
  - ENCODE: (f32 bits, byte) pairs for every tie between neighbouring e4m3 values and the floats just above and
    below it, both signs, the subnormal range, and 200 seeded random values with |x| <= 448.
ml_dtypes turns magnitudes that round past 448 into NaN (no saturation), so no value above 448 is listed here;
the saturation of the Rust codec (and of CUDA's cvt.rn.satfinite) is tested separately.

Run: python3 -m venv /tmp/e4m3 && /tmp/e4m3/bin/pip install ml_dtypes==0.7.0 && /tmp/e4m3/bin/python tools/kv_fp8_reference.py
"""
import ml_dtypes
import numpy as np

F8 = ml_dtypes.float8_e4m3fn


def bits(x):
    return int(np.array(x, dtype=np.float32).view(np.uint32))


def encode(x):
    return int(np.array([x], dtype=np.float32).astype(F8).view(np.uint8)[0])


codes = np.arange(256, dtype=np.uint8)
decoded = codes.view(F8).astype(np.float32)
print("/// f32 bits of e4m3 bytes 0x00..=0xFF (ml_dtypes.float8_e4m3fn -> float32).")
print("const DECODE: [u32; 256] = [")
for row in range(0, 256, 8):
    print("    " + " ".join(f"0x{bits(v):08x}," for v in decoded[row:row + 8]))
print("];")

finite = sorted({float(v) for v in decoded if np.isfinite(v) and v >= 0})
values = []
for a, b in zip(finite, finite[1:]):
    mid = np.float32((np.float64(a) + np.float64(b)) / 2)
    values += [mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(1e9))]
values += [np.float32(v) for v in (2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-30, 448.0, 447.9999, 0.0)]
rng = np.random.default_rng(20261202)
values += list((rng.uniform(-1, 1, 200) * np.exp2(rng.uniform(-12, np.log2(448), 200))).astype(np.float32))
values = [np.float32(v) for v in values]
values += [-v for v in values]
pairs = sorted({(bits(v), encode(v)) for v in values if abs(v) <= 448})
print(f"/// ({len(pairs)} pairs) f32 bits -> e4m3 byte (ml_dtypes, round to nearest even).")
print(f"const ENCODE: [(u32, u8); {len(pairs)}] = [")
for i in range(0, len(pairs), 5):
    print("    " + " ".join(f"(0x{b:08x}, 0x{c:02x})," for b, c in pairs[i:i + 5]))
print("];")
