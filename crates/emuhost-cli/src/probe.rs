//! `emuhost probe`.

use emuhost::import::{AnyBackend, Backend, BackendChoice, error_chain};
use emuhost::probe::{Offer, Probe};
use emuhost::settings::Settings;
use emuhost::watch;
use serde_json::json;

use crate::Outcome;

fn offer<T: serde::Serialize>(o: &Offer<T>) -> serde_json::Value {
    match o {
        Offer::Yes(v) => json!({ "ok": true, "value": v }),
        Offer::No(why) => json!({ "ok": false, "why": why }),
    }
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
        let platform = json!({
            "uffd_features": offer(&p.uffd_features),
            "uffd_wp_async": p.uffd_wp_async(),
            "uffd_wp_unpopulated": p.uffd_wp_unpopulated(),
            "pagemap_scan": offer(&p.pagemap_scan),
            "procmap_query": offer(&p.procmap_query),
            "thp": p.thp,
        });
        #[cfg(windows)]
        let platform = json!({
            "placeholders": offer(&p.placeholders),
            "write_watch": offer(&p.write_watch),
        });
        let mut v = json!({
            "kernel": p.kernel,
            "page_size": p.page_size,
            "cpus": offer(&p.cpus),
            "region_queries": offer(&p.region_queries),
            "watch": match &tracking {
                Ok(c) => json!({ "backend": c.kind.name(), "why": c.why }),
                Err(e) => json!({ "backend": null, "why": e.to_string() }),
            },
            "watch_self_tests": tried.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "import": import.json,
        });
        if let (Some(v), serde_json::Value::Object(more)) = (v.as_object_mut(), platform) {
            v.extend(more);
        }
        outln!("{v}");
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
    json: serde_json::Value,
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
            let passed: Vec<_> =
                p.passed_over.iter().map(|(k, why)| json!({ "backend": k.name(), "why": why })).collect();
            ImportProbe {
                json: json!({ "ok": true, "choice": choice, "backend": b.kind().name(), "device": b.describe(), "alignment": b.alignment(), "passed_over": passed }),
                text,
            }
        }
        Err(e) => ImportProbe {
            json: json!({ "ok": false, "choice": choice, "why": error_chain(&e) }),
            text: vec![format!("import backend    no ({})", error_chain(&e))],
        },
    }
}
