//! `emuhost probe`.

use emuhost::import::{AnyBackend, Backend, BackendChoice, error_chain};
use emuhost::probe::{Offer, Probe};
use emuhost::settings::Settings;
use emuhost::watch;
use serde::Serialize;
use std::collections::BTreeMap;

use crate::Outcome;

/// The version of `probe --json`'s keys (raised when one changes name or meaning or goes away).
pub const SCHEMA: u32 = 1;

/// `probe --json`: what this machine offers the runtime.
#[derive(Serialize)]
struct Report<'a> {
    schema: u32,
    kernel: &'a str,
    page_size: u64,
    cpus: OfferJson<'a, usize>,
    region_queries: OfferJson<'a, &'static str>,
    watch: WatchJson,
    /// Each write-tracking backend's self-test: `passes`, or why not.
    watch_self_tests: BTreeMap<String, String>,
    import: ImportJson,
    #[serde(flatten)]
    platform: Platform<'a>,
}

/// Linux's offers.
#[cfg(target_os = "linux")]
#[derive(Serialize)]
struct Platform<'a> {
    uffd_features: OfferJson<'a, u64>,
    uffd_wp_async: bool,
    uffd_wp_unpopulated: bool,
    pagemap_scan: OfferJson<'a, ()>,
    procmap_query: OfferJson<'a, ()>,
    thp: Option<&'a str>,
}

/// Windows's offers.
#[cfg(windows)]
#[derive(Serialize)]
struct Platform<'a> {
    placeholders: OfferJson<'a, ()>,
    write_watch: OfferJson<'a, ()>,
}

/// An offer: `{"ok":true,"value":...}` or `{"ok":false,"why":"..."}`.
#[derive(Serialize)]
#[serde(untagged)]
enum OfferJson<'a, T: Serialize> {
    Yes { ok: bool, value: &'a T },
    No { ok: bool, why: &'a str },
}

fn offer<T: Serialize>(o: &Offer<T>) -> OfferJson<'_, T> {
    match o {
        Offer::Yes(value) => OfferJson::Yes { ok: true, value },
        Offer::No(why) => OfferJson::No { ok: false, why },
    }
}

/// The write-tracking backend chosen (`null` where none), and why.
#[derive(Serialize)]
struct WatchJson {
    backend: Option<&'static str>,
    why: String,
}

/// The import backend the choice picks, or why none.
#[derive(Serialize)]
#[serde(untagged)]
enum ImportJson {
    Picked {
        ok: bool,
        choice: &'static str,
        backend: &'static str,
        device: String,
        alignment: u64,
        passed_over: Vec<PassedOver>,
    },
    None {
        ok: bool,
        choice: &'static str,
        why: String,
    },
}

/// A backend the automatic choice passed over, and why.
#[derive(Serialize)]
struct PassedOver {
    backend: &'static str,
    why: String,
}

fn text<T: std::fmt::Debug>(o: &Offer<T>, show: impl Fn(&T) -> String) -> String {
    match o {
        Offer::Yes(v) => show(v),
        Offer::No(why) => format!("no ({why})"),
    }
}

pub fn run(as_json: bool, settings: &Settings) -> anyhow::Result<Outcome> {
    let p = Probe::run();
    let tracking = watch::choose(&settings.tracker_config());
    let tried: Vec<(String, String)> = watch::BackendKind::AUTO
        .into_iter()
        .map(|k| (k.name().to_string(), watch::self_test(k).map_or_else(|e| e.to_string(), |_| "passes".to_string())))
        .collect();
    let import = import_backend(settings.import_backend);
    if as_json {
        #[cfg(target_os = "linux")]
        let platform = Platform {
            uffd_features: offer(&p.uffd_features),
            uffd_wp_async: p.uffd_wp_async(),
            uffd_wp_unpopulated: p.uffd_wp_unpopulated(),
            pagemap_scan: offer(&p.pagemap_scan),
            procmap_query: offer(&p.procmap_query),
            thp: p.thp.as_deref(),
        };
        #[cfg(windows)]
        let platform = Platform { placeholders: offer(&p.placeholders), write_watch: offer(&p.write_watch) };
        let report = Report {
            schema: SCHEMA,
            kernel: &p.kernel,
            page_size: p.page_size,
            cpus: offer(&p.cpus),
            region_queries: offer(&p.region_queries),
            watch: match &tracking {
                Ok(c) => WatchJson { backend: Some(c.kind.name()), why: c.why.to_string() },
                Err(e) => WatchJson { backend: None, why: e.to_string() },
            },
            watch_self_tests: tried.iter().cloned().collect(),
            import: import.json,
            platform,
        };
        outln!("{}", serde_json::to_string(&report)?);
    } else {
        outln!("kernel            {}", p.kernel);
        outln!("page size         {} bytes", p.page_size);
        outln!("logical CPUs      {} (in this process's affinity mask)", text(&p.cpus, |n| n.to_string()));
        #[cfg(target_os = "linux")]
        {
            outln!(
                "userfaultfd       {}",
                text(&p.uffd_features, |f| format!(
                    "features {f:#x}; WP_ASYNC {}, WP_UNPOPULATED {}",
                    yes(p.uffd_wp_async()),
                    yes(p.uffd_wp_unpopulated())
                ))
            );
            outln!("PAGEMAP_SCAN      {}", text(&p.pagemap_scan, |_| "yes".into()));
            outln!("PROCMAP_QUERY     {}", text(&p.procmap_query, |_| "yes".into()));
        }
        #[cfg(windows)]
        {
            outln!("placeholders      {}", text(&p.placeholders, |_| "yes".into()));
            outln!("write watch       {}", text(&p.write_watch, |_| "yes".into()));
        }
        outln!("region queries    {}", text(&p.region_queries, |s| s.to_string()));
        #[cfg(target_os = "linux")]
        outln!("THP               {}", p.thp.as_deref().unwrap_or("not in this kernel"));
        match &tracking {
            Ok(c) => outln!("write tracking    {} ({})", c.kind.name(), c.why),
            Err(e) => outln!("write tracking    none ({e})"),
        }
        for (k, v) in &tried {
            outln!("  self-test {k:<9} {v}");
        }
        for line in import.text {
            outln!("{line}");
        }
    }
    Ok(Outcome::Ok)
}

/// `yes` or `no` (for userfaultfd's features, Linux's).
#[cfg(target_os = "linux")]
fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

struct ImportProbe {
    json: ImportJson,
    text: Vec<String>,
}

/// Which import backend `EMUHOST_IMPORT_BACKEND` (auto: Vulkan, then CUDA, then pin) picks here,
/// after its start-up check, and why the ones before it were passed over.
fn import_backend(choice: BackendChoice) -> ImportProbe {
    let picked = AnyBackend::pick(choice);
    let choice = match choice {
        BackendChoice::Auto => "auto",
        BackendChoice::Only(k) => k.name(),
    };
    match picked {
        Ok(p) => {
            let b = &p.backend;
            let mut text = vec![format!(
                "import backend    {} ({}): {}",
                b.kind().name(),
                if p.passed_over.is_empty() {
                    format!("EMUHOST_IMPORT_BACKEND={choice}, first choice")
                } else {
                    format!("EMUHOST_IMPORT_BACKEND={choice}")
                },
                b.describe()
            )];
            for (k, why) in &p.passed_over {
                text.push(format!("  passed over     {}: {why}", k.name()));
            }
            let passed_over =
                p.passed_over.iter().map(|(k, why)| PassedOver { backend: k.name(), why: why.to_string() }).collect();
            let json = ImportJson::Picked {
                ok: true,
                choice,
                backend: b.kind().name(),
                device: b.describe(),
                alignment: b.alignment(),
                passed_over,
            };
            ImportProbe { json, text }
        }
        Err(e) => ImportProbe {
            json: ImportJson::None { ok: false, choice, why: error_chain(&e) },
            text: vec![format!("import backend    no ({})", error_chain(&e))],
        },
    }
}
