//! `emuhost bench import`, part (4), printed: a binding's small import beside background imports
//! ([`emuhost_lab::bench::import::beside`]).

use emuhost_lab::bench::import::beside::{Beside, BesideResult, FIGURES, Round};
use serde_json::json;

use super::Report;

impl Report for BesideResult {
    fn print(&self) {
        outln!(
            "a binding's import of {} KiB beside background imports ({} backend, {} rounds, medians, ms)",
            self.small >> 10,
            self.backend,
            self.rounds.len()
        );
        outln!(
            "  {:<18} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9}",
            "",
            "imp p50",
            "imp p99",
            "imp max",
            "max/alone",
            "rel p50",
            "rel p99",
            "rel max",
            "bg import",
            "bg rel",
            "bg MiB/s"
        );
        let base = self.alone().map(|i| self.med(i, |r| r.import_worst));
        for (i, a) in self.arms.iter().enumerate() {
            let m = |f: fn(&Round) -> f64| self.med(i, f);
            let ratio = base.map_or(f64::NAN, |b| m(|r| r.import_worst) / b);
            let bg = |x: f64| {
                if matches!(a, Beside::Imports(n) if *n > 0) { format!("{x:>9.3}") } else { format!("{:>9}", "-") }
            };
            outln!(
                "  {:<18} {:>8.3} {:>8.3} {:>8.3} {:>8.2}x {:>8.3} {:>8.3} {:>8.3} {} {} {}",
                a.name(),
                m(|r| r.import_p50),
                m(|r| r.import_p99),
                m(|r| r.import_worst),
                ratio,
                m(|r| r.release_p50),
                m(|r| r.release_p99),
                m(|r| r.release_worst),
                bg(m(|r| r.bg_import)),
                bg(m(|r| r.bg_release)),
                bg(m(|r| r.bg_mib_per_s)),
            );
        }
    }

    fn json(&self) -> serde_json::Value {
        let arm = |i: usize| {
            let mut m = serde_json::Map::new();
            m.insert("arm".into(), json!(self.arms[i].name()));
            let (kib, live) = match self.arms[i] {
                Beside::Imports(n) => (n >> 10, 0),
                Beside::Live(n) => (0, n),
            };
            m.insert("beside_kib".into(), json!(kib));
            m.insert("live".into(), json!(live));
            for (name, f) in FIGURES {
                m.insert(name.into(), json!(self.med(i, f)));
            }
            if let Some(b) = self.alone() {
                m.insert(
                    "import_worst_ratio".into(),
                    json!(self.med(i, |r| r.import_worst) / self.med(b, |r| r.import_worst)),
                );
            }
            serde_json::Value::Object(m)
        };
        json!({
            "backend": self.backend, "rounds": self.rounds.len(), "small_kib": self.small >> 10,
            "arms": (0..self.arms.len()).map(arm).collect::<Vec<_>>(),
        })
    }
}
