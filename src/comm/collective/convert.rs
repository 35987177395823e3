//! bf16 / fp16 <-> f32 conversions with round-to-nearest-even, as the CUDA intrinsics do; and
//! f32 -> FP8 e4m3 (`e4m3fn`) as `cvt.rn.satfinite.e4m3x2.f32` does, with its inverse.

pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

pub fn f32_to_bf16(f: f32) -> u16 {
    let bits = f.to_bits();
    if f.is_nan() {
        return ((bits >> 16) as u16) | 0x40;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // subnormal: normalise
            let mut e = 127 - 15 + 1;
            let mut m = m;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | ((e as u32) << 23) | ((m & 0x3ff) << 13)
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

pub fn f32_to_f16(f: f32) -> u16 {
    let bits = f.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rest = m & ((1 << shift) - 1);
        let mut r = m >> shift;
        if rest > half || (rest == half && (r & 1) == 1) {
            r += 1;
        }
        return sign | r as u16;
    }
    let mut r = ((e as u32) << 10) | (man >> 13);
    let rest = man & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && (r & 1) == 1) {
        r += 1;
    }
    sign | r as u16
}

/// The largest finite e4m3 value, and its encoding.
pub const E4M3_MAX: f32 = 448.0;
const E4M3_MAX_BITS: u8 = 0x7e;
/// The NaN `cvt.rn.satfinite.e4m3x2.f32` gives for a NaN input.
pub const E4M3_NAN: u8 = 0x7f;

/// f32 to e4m3 (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities): round to
/// nearest even, saturated to +-448 (an infinity too), NaN to 0x7f, as the hardware's
/// `cvt.rn.satfinite.e4m3x2.f32`.
pub fn f32_to_e4m3(f: f32) -> u8 {
    if f.is_nan() {
        return E4M3_NAN;
    }
    let sign = if f.is_sign_negative() { 0x80u8 } else { 0 };
    let a = f.abs();
    if a >= E4M3_MAX {
        return sign | E4M3_MAX_BITS;
    }
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127;
    let mag = if exp < -6 {
        // Subnormal: multiples of 2^-9 (a * 512 is exact), 8 of them reach the smallest normal.
        (a * 512.0).round_ties_even() as u8
    } else {
        let man = bits & 0x7f_ffff;
        let mut q = (((exp + 7) as u32) << 3) | (man >> 20);
        let rest = man & 0xf_ffff;
        if rest > 0x8_0000 || (rest == 0x8_0000 && q & 1 == 1) {
            q += 1;
        }
        q.min(E4M3_MAX_BITS as u32) as u8
    };
    sign | mag
}

/// e4m3 to f32 (exact).
pub fn e4m3_to_f32(q: u8) -> f32 {
    let sign = if q & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((q >> 3) & 0xf, q & 7);
    if e == 0xf && m == 7 {
        return f32::NAN;
    }
    let v = if e == 0 {
        m as f32 / 512.0
    } else {
        (1.0 + m as f32 / 8.0) * 2f32.powi(e as i32 - 7)
    };
    sign * v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_rounds_to_even_saturates_and_keeps_nan() {
        // Every code round-trips; halfway values between neighbours go to the even code.
        for q in 0..=0xffu8 {
            let f = e4m3_to_f32(q);
            if f.is_nan() {
                assert_eq!(f32_to_e4m3(f), E4M3_NAN);
                continue;
            }
            if q == 0x80 {
                assert_eq!(f32_to_e4m3(f), 0x80, "-0");
                continue;
            }
            assert_eq!(f32_to_e4m3(f), q, "code {q:#x} = {f}");
            let next = q.wrapping_add(1);
            if q & 0x7f < 0x7e {
                let mid = (f + e4m3_to_f32(next)) / 2.0;
                let even = if q & 1 == 0 { q } else { next };
                assert_eq!(f32_to_e4m3(mid), even, "halfway above {q:#x} ({mid})");
                let above = f32::from_bits(mid.to_bits() + if mid > 0.0 { 1 } else { 0 });
                if mid > 0.0 {
                    assert_eq!(f32_to_e4m3(above), next, "just above halfway ({above})");
                }
            }
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(f32_to_e4m3(449.0), 0x7e);
        assert_eq!(f32_to_e4m3(463.9), 0x7e);
        assert_eq!(f32_to_e4m3(1e30), 0x7e);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7e);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xfe);
        assert_eq!(f32_to_e4m3(-f32::NAN), E4M3_NAN);
        assert_eq!(
            f32_to_e4m3(2f32.powi(-11)),
            0x00,
            "below half the smallest subnormal"
        );
        assert_eq!(
            f32_to_e4m3(-2f32.powi(-10)),
            0x80,
            "half the smallest subnormal: to even 0"
        );
        assert_eq!(
            f32_to_e4m3(3.0 * 2f32.powi(-10)),
            0x02,
            "1.5 subnormal steps: to even 2"
        );
    }

    #[test]
    fn conversions_round_trip_and_round_to_even() {
        for v in [0.0f32, 1.0, -2.5, 0.1, 65504.0, 1e-5, -3.0e-7] {
            let h = f16_to_f32(f32_to_f16(v));
            assert!((h - v).abs() <= v.abs() * 1e-3 + 6e-8, "{v} -> {h}");
            let b = bf16_to_f32(f32_to_bf16(v));
            assert!((b - v).abs() <= v.abs() * 8e-3, "{v} -> {b}");
        }
        assert_eq!(f32_to_f16(1.0), 0x3c00);
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between two bf16 values: ties to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(f32_to_f16(1e6), 0x7c00);
        assert!(f16_to_f32(f32_to_f16(f32::NAN)).is_nan());
        for h in 0..=0xffffu16 {
            let f = f16_to_f32(h);
            if !f.is_nan() {
                assert_eq!(f32_to_f16(f), h, "f16 {h:#x} round trip");
            }
        }
    }
}
