//! `emuhost plan`: the range each binding would import, planned as the first binding into an
//! empty importer over the pools of a file. One line per binding on stdout, `0xlo..0xhi`. Under
//! the pools policy that is the binding's pools whole, at the host page (a binding whose pools
//! would take longer than the wait imports its part first; the pools follow whole).

use std::path::PathBuf;

use anyhow::Context;
use emuhost::import::{Pools, plan, pool_range, pools_file};
use emuhost::settings::{ImportPolicyName, Settings};

use crate::Outcome;

#[derive(clap::Args)]
pub struct Args {
    /// The pools: one `LO SIZE` a line (hex with 0x, or decimal); `#` starts a comment.
    #[arg(long)]
    pools: PathBuf,
    /// Chunk size in MiB (a power of two; default EMUHOST_IMPORT_CHUNK_MB or 16).
    #[arg(long)]
    chunk_mib: Option<u64>,
    /// Span cap in MiB, 0 for off (default EMUHOST_IMPORT_SPAN_MB or 64).
    #[arg(long)]
    span_mib: Option<u64>,
    /// `pools` or `chunks` (default EMUHOST_IMPORT_POLICY or pools); --chunk-mib and --span-mib
    /// are the chunks policy's.
    #[arg(long, value_parser = parse_policy)]
    policy: Option<ImportPolicyName>,
    /// A binding, `ADDR:SIZE` (hex with 0x, or decimal). Repeat for more.
    #[arg(long = "bind", required = true, value_parser = parse_binding)]
    binds: Vec<(u64, u64)>,
}

fn parse_policy(s: &str) -> Result<ImportPolicyName, String> {
    let mut c = Settings::default();
    c.set("EMUHOST_IMPORT_POLICY", s).map_err(|e| e.to_string())?;
    Ok(c.import.policy)
}

/// A number in hex (`0x`) or decimal.
pub fn parse_num(s: &str) -> Result<u64, String> {
    pools_file::parse_num(s).map_err(|e| e.to_string())
}

fn parse_binding(s: &str) -> Result<(u64, u64), String> {
    let (a, n) = s.split_once(':').ok_or_else(|| format!("{s:?} is not ADDR:SIZE"))?;
    let (addr, size) = (parse_num(a)?, parse_num(n)?);
    if size == 0 {
        return Err(format!("{s:?}: the size is zero"));
    }
    if addr.checked_add(size).is_none() {
        return Err(format!("{s:?}: runs past the end of the address space"));
    }
    Ok((addr, size))
}

/// Reads a pools file (`LO SIZE` a line); a bad line is named `path:line`.
pub fn read_pools(path: &PathBuf) -> anyhow::Result<Vec<(u64, u64)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    pools_file::parse(&text).map_err(|e| anyhow::anyhow!("{}:{}: {}", path.display(), e.line, e.what))
}

pub fn run(a: Args, settings: &Settings) -> anyhow::Result<Outcome> {
    let policy = a.policy.unwrap_or(settings.import.policy);
    let mut cfg = settings.import.plan;
    if let Some(mb) = a.chunk_mib {
        cfg.chunk = mb
            .checked_mul(1 << 20)
            .filter(|c| c.is_power_of_two())
            .with_context(|| format!("--chunk-mib {mb}: a power of two is needed"))?;
    }
    if let Some(mb) = a.span_mib {
        cfg.span_cap = mb.checked_mul(1 << 20).with_context(|| format!("--span-mib {mb}: too large"))?;
    }
    let mut pools = Pools::new();
    pools.extend(read_pools(&a.pools)?).context("pools")?;
    let mut out = String::new();
    for (addr, size) in a.binds {
        let r = match policy {
            ImportPolicyName::Chunks => plan(&pools, cfg, addr, size, true),
            ImportPolicyName::Pools => pool_range(&pools, addr, size, emuhost::space::page_size()),
        };
        let r = r.with_context(|| format!("--bind {addr:#x}:{size:#x}"))?;
        out.push_str(&format!("{:#x}..{:#x}\n", r.lo, r.hi));
    }
    out!("{out}");
    Ok(Outcome::Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> PathBuf {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "emuhost-plan-{}-{}.txt",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn pools_files_take_hex_decimal_comments_and_blank_lines() {
        let p = file("# pools\n0x1021745000 0x1000000\n\n  8192 4096 # a small one\n");
        assert_eq!(read_pools(&p).unwrap(), vec![(0x10_2174_5000, 0x100_0000), (8192, 4096)]);
    }

    #[test]
    fn bad_lines_are_named_by_file_and_line() {
        for (text, want) in [
            ("0x1000 0x1000\n0x2000 0\n", ":2: the pool at 0x2000 has zero size"),
            ("\n\nzz 1\n", ":3: \"zz\" is not a number"),
            ("0x1000\n", ":1: expected `LO SIZE`"),
            ("0x1000 1 2\n", ":1: expected `LO SIZE`"),
            ("0xffffffffffffff00 0x100\n", ":1: the pool 0xffffffffffffff00+0x100 runs past"),
        ] {
            let p = file(text);
            let e = read_pools(&p).unwrap_err().to_string();
            assert!(e.starts_with(&p.display().to_string()) && e.contains(want), "{e}");
        }
    }

    #[test]
    fn bindings_parse_and_refuse_zero_and_wrap() {
        assert_eq!(parse_binding("0x1021ffff00:0x160").unwrap(), (0x10_21ff_ff00, 0x160));
        assert_eq!(parse_binding("4096:16").unwrap(), (4096, 16));
        assert!(parse_binding("4096").is_err());
        assert!(parse_binding("4096:0").is_err());
        assert!(parse_binding("0xffffffffffffffff:2").is_err());
    }
}
