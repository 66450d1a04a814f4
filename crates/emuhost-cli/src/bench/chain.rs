//! `emuhost bench import`, part (3), printed: the collects beside commits and pins
//! ([`emuhost_lab::bench::import::chain`]).

use emuhost_lab::bench::import::chain::{ARMS, ChainResult};
use serde_json::json;

use super::Report;

const MIB: u64 = 1 << 20;

impl Report for ChainResult {
    fn print(&self) {
        outln!(
            "collects beside commits and pins of {} MiB ({} tracker, {} pins, pieces of {} KiB, {} rounds, medians)",
            self.pinned / MIB,
            self.tracker,
            self.backend,
            self.piece >> 10,
            self.rounds.len()
        );
        outln!("  {:<20} {:>26} {:>26} {:>26} {:>8} {:>8}", "", ARMS[0], ARMS[1], ARMS[2], "1st/2nd", "2nd/3rd");
        for (name, f) in Self::FIGURES {
            let (a, b, c) = (self.med(0, f), self.med(1, f), self.med(2, f));
            outln!("  {name:<20} {a:>26.3} {b:>26.3} {c:>26.3} {:>7.2}x {:>7.2}x", a / b, b / c);
        }
    }

    fn json(&self) -> serde_json::Value {
        let arm = |i: usize| {
            let mut m = serde_json::Map::new();
            m.insert("arm".into(), json!(ARMS[i]));
            for (name, f) in Self::FIGURES {
                m.insert(name.into(), json!(self.med(i, f)));
            }
            serde_json::Value::Object(m)
        };
        json!({
            "tracker": self.tracker, "backend": self.backend, "rounds": self.rounds.len(), "pinned_mib": self.pinned / MIB,
            "piece_kib": self.piece >> 10,
            "old": arm(0), "new": arm(1), "pieces": arm(2),
            "collect_worst_ratio": self.med(0, |r| r.collect_worst) / self.med(1, |r| r.collect_worst),
            "collect_p99_ratio": self.med(0, |r| r.collect_p99) / self.med(1, |r| r.collect_p99),
            "change_p99_ratio_pieces": self.med(1, |r| r.change_p99) / self.med(2, |r| r.change_p99),
        })
    }
}
