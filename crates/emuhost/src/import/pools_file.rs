//! A pools file: the pools of a layout as text, for `emuhost plan` and for tests.
//!
//! One pool a line, `LO SIZE`, each a number in hex (`0x...`) or decimal; `#` starts a comment that
//! runs to the end of the line; blank lines are skipped. A pool is non-empty and ends at or below
//! 2^64 - 1 (`LO + SIZE` does not wrap). [`render`] writes a list back in the same form.

use std::fmt::Write as _;

/// What is wrong with a line of a pools file. Values are in hex.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadLine {
    /// The line does not hold exactly two fields: the line's text (at most 40 characters).
    #[error("expected `LO SIZE`, got {0:?}")]
    Fields(String),
    /// A field is not a number: the field's text (at most 40 characters).
    #[error("{0:?} is not a number (hex with 0x, or decimal, below 2^64)")]
    Number(String),
    /// The pool has zero size.
    #[error("the pool at {lo:#x} has zero size")]
    ZeroSize {
        /// The pool's first byte.
        lo: u64,
    },
    /// `LO + SIZE` passes `u64::MAX`.
    #[error("the pool {lo:#x}+{size:#x} runs past the end of the address space")]
    Wraps {
        /// The pool's first byte.
        lo: u64,
        /// Its size in bytes.
        size: u64,
    },
}

/// A pools file that does not parse: the first bad line (counted from 1) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {what}")]
pub struct PoolsFileError {
    /// The line's number, from 1.
    pub line: usize,
    /// What is wrong with it.
    pub what: BadLine,
}

/// At most 40 characters of some bad text, for an error message.
fn clip(s: &str) -> String {
    s.chars().take(40).collect()
}

/// A number in hex (`0x` or `0X`, then hex digits) or decimal (digits only), surrounding whitespace
/// ignored. No sign, no empty digits, nothing past `u64::MAX`.
pub fn parse_num(s: &str) -> Result<u64, BadLine> {
    let t = s.trim();
    let bad = || BadLine::Number(clip(t));
    let (digits, radix) = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => (h, 16),
        None => (t, 10),
    };
    // `from_str_radix` alone would take a leading `+`.
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return Err(bad());
    }
    u64::from_str_radix(digits, radix).map_err(|_| bad())
}

/// Parses a pools file into `(lo, size)` pairs, in file order. The first bad line is the error.
///
/// # Errors
/// [`PoolsFileError`] naming the first bad line and what is wrong with it ([`BadLine`]).
pub fn parse(text: &str) -> Result<Vec<(u64, u64)>, PoolsFileError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let at = |what| PoolsFileError { line: i + 1, what };
        let body = line.split('#').next().unwrap_or("").trim();
        if body.is_empty() {
            continue;
        }
        let mut fields = body.split_whitespace();
        let (Some(lo), Some(size), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(at(BadLine::Fields(clip(body))));
        };
        let lo = parse_num(lo).map_err(at)?;
        let size = parse_num(size).map_err(at)?;
        if size == 0 {
            return Err(at(BadLine::ZeroSize { lo }));
        }
        if lo.checked_add(size).is_none() {
            return Err(at(BadLine::Wraps { lo, size }));
        }
        out.push((lo, size));
    }
    Ok(out)
}

/// Writes pools as a pools file (`0xLO 0xSIZE` a line) that [`parse`] reads back as the same list.
pub fn render(pools: &[(u64, u64)]) -> String {
    let mut s = String::with_capacity(pools.len() * 24);
    for (lo, size) in pools {
        let _ = writeln!(s, "{lo:#x} {size:#x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_decimal_comments_and_blank_lines() {
        let text = "# pools\n0x1021745000 0x1000000\n\n  8192 4096 # a small one\r\n0X10 0XfF\n";
        let want = vec![(0x10_2174_5000, 0x100_0000), (8192, 4096), (0x10, 0xff)];
        assert_eq!(parse(text).unwrap(), want);
        assert_eq!(parse(&render(&want)).unwrap(), want);
        assert_eq!(render(&want[1..2]), "0x2000 0x1000\n");
        assert_eq!(parse("").unwrap(), vec![]);
    }

    #[test]
    fn the_first_bad_line_is_named_with_its_value() {
        let err = |text| parse(text).unwrap_err();
        assert_eq!(
            err("0x1000 0x1000\n0x2000 0\n"),
            PoolsFileError { line: 2, what: BadLine::ZeroSize { lo: 0x2000 } }
        );
        assert_eq!(err("\n\nzz 1\n").line, 3);
        assert_eq!(err("0x1000\n").what, BadLine::Fields("0x1000".into()));
        assert_eq!(err("0x1000 1 2 # c\n").what, BadLine::Fields("0x1000 1 2".into()));
        let wraps = err("0xffffffffffffff00 0x100\n");
        assert_eq!(wraps.what, BadLine::Wraps { lo: 0xffff_ffff_ffff_ff00, size: 0x100 });
        assert_eq!(
            wraps.to_string(),
            "line 1: the pool 0xffffffffffffff00+0x100 runs past the end of the address space"
        );
        // The largest pool that does not wrap is fine.
        assert_eq!(parse("0xffffffffffffff00 0xff").unwrap(), vec![(0xffff_ffff_ffff_ff00, 0xff)]);
    }

    #[test]
    fn numbers_are_digits_only() {
        assert_eq!(parse_num(" 0x1F "), Ok(0x1f));
        assert_eq!(parse_num("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(parse_num("0xffffffffffffffff"), Ok(u64::MAX));
        // `u64::from_str_radix` takes a sign; a pools file does not.
        for bad in ["", "0x", "+5", "0x+10", "-1", "1_000", "18446744073709551616", "0x10000000000000000", "1e3"] {
            assert_eq!(parse_num(bad), Err(BadLine::Number(bad.trim().into())), "{bad:?}");
        }
        // A long bad value is clipped in the message.
        let long = "9".repeat(100);
        assert_eq!(parse_num(&long), Err(BadLine::Number("9".repeat(40))));
    }
}
