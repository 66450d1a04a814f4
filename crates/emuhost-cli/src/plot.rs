//! `--plot`: frame time on the render thread, with the frames that made imports marked.
//!
//! Text is laid out (and, in a PNG, drawn) with a TrueType or OpenType font of the system's:
//! fontconfig's choice for `sans-serif` where `fc-match` runs, else the first font found under the
//! usual folders ([`font_dirs`]), a regular sans-serif one first. None found is an error naming
//! what was searched. The title is made smaller, then cut, until it fits the image.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use emuhost_lab::replay::ReplayReport;
use plotters::prelude::*;

/// The image's size in pixels.
const SIZE: (u32, u32) = (1280, 480);
/// The chart's margin in pixels, each side.
const MARGIN: u32 = 10;
/// The title's font size: at most, and at least (smaller, it is cut instead).
const TITLE_PX: (u32, u32) = (18, 10);
/// How deep the folder search goes below each folder (fonts sit in `truetype/dejavu/`).
const MAX_DEPTH: usize = 4;

pub fn frames(path: &Path, r: &ReplayReport) -> anyhow::Result<()> {
    let png = path.extension().and_then(|e| e.to_str()).is_some_and(|e| e.eq_ignore_ascii_case("png"));
    let font = find_font(fc_match(), &font_dirs())?;
    let bytes = std::fs::read(&font).with_context(|| format!("reading the font {}", font.display()))?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_err() {
        bail!("{} is not a font plotters can read", font.display());
    }
    tracing::debug!("plot: font {}", font.display());
    if png {
        draw(BitMapBackend::new(path, SIZE).into_drawing_area(), r)
    } else {
        draw(SVGBackend::new(path, SIZE).into_drawing_area(), r)
    }
}

/// The font file fontconfig picks for `sans-serif`, where `fc-match` runs and names one.
fn fc_match() -> Option<PathBuf> {
    let out =
        std::process::Command::new("fc-match").args(["-f", "%{file}", "sans-serif:style=Regular"]).output().ok()?;
    let p = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    (out.status.success() && is_font(&p)).then_some(p)
}

/// The folders searched for a font when `fc-match` gives none: the system's and the user's.
fn font_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if cfg!(windows) {
        let windir = std::env::var_os("WINDIR").map_or_else(|| PathBuf::from(r"C:\Windows"), PathBuf::from);
        dirs.push(windir.join("Fonts"));
        if let Some(local) = std::env::var_os("LOCALAPPDATA") {
            dirs.push(PathBuf::from(local).join(r"Microsoft\Windows\Fonts"));
        }
    } else {
        dirs.extend(
            ["/usr/share/fonts", "/usr/local/share/fonts", "/System/Library/Fonts", "/Library/Fonts"]
                .map(PathBuf::from),
        );
        if let Some(home) = std::env::var_os("HOME").map(PathBuf::from) {
            dirs.extend([home.join(".local/share/fonts"), home.join(".fonts")]);
        }
    }
    dirs
}

fn is_font(p: &Path) -> bool {
    p.is_file()
        && p.extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e.eq_ignore_ascii_case("ttf") || e.eq_ignore_ascii_case("otf"))
}

/// How well a font file's name suits the plot: lower is better. Known regular sans-serif faces
/// first, then any regular sans-serif, then any regular face, then the rest.
fn rank(p: &Path) -> u32 {
    let name = p.file_stem().and_then(|s| s.to_str()).unwrap_or("").to_ascii_lowercase();
    const KNOWN: [&str; 6] =
        ["dejavusans", "liberationsans-regular", "notosans-regular", "arial", "segoeui", "freesans"];
    if let Some(i) = KNOWN.iter().position(|k| name == *k) {
        return i as u32;
    }
    let styled = ["bold", "italic", "oblique", "light", "condensed", "narrow", "mono"].iter().any(|s| name.contains(s));
    match (name.contains("sans") && !name.contains("serif"), styled) {
        (true, false) => 10,
        (false, false) => 20,
        _ => 30,
    }
}

/// The font for the plot: `fc` (fontconfig's choice) where given, else the best-ranked font file
/// under `dirs`; an error naming what was searched when there is none.
fn find_font(fc: Option<PathBuf>, dirs: &[PathBuf]) -> anyhow::Result<PathBuf> {
    if let Some(p) = fc {
        return Ok(p);
    }
    let mut found = Vec::new();
    for d in dirs {
        collect_fonts(d, MAX_DEPTH, &mut found);
    }
    found.sort_by_key(|p| (rank(p), p.clone()));
    match found.into_iter().next() {
        Some(p) => Ok(p),
        None => bail!(
            "a plot needs a TrueType or OpenType font and none was found: fc-match gave none, and no .ttf or .otf file is under {} (on Debian: apt-get install fonts-dejavu-core)",
            dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// The font files under `dir`, `depth` folders down at most; folders that cannot be read are
/// passed over.
fn collect_fonts(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if is_font(&p) {
            out.push(p);
        } else if depth > 0 && e.file_type().is_ok_and(|t| t.is_dir()) {
            collect_fonts(&p, depth - 1, out);
        }
    }
}

/// The title and its font size so that it fits `width` pixels: the largest size from
/// [`TITLE_PX`] at which `measure(text, size)` fits, else the least size with the text cut
/// (ending in `…`) until it does.
fn fit_title(title: &str, width: u32, measure: impl Fn(&str, u32) -> u32) -> (String, u32) {
    let (most, least) = TITLE_PX;
    if let Some(px) = (least..=most).rev().find(|px| measure(title, *px) <= width) {
        return (title.to_string(), px);
    }
    let chars: Vec<char> = title.chars().collect();
    for keep in (0..chars.len()).rev() {
        let cut: String = chars[..keep].iter().collect::<String>().trim_end().to_string() + "…";
        if measure(&cut, least) <= width {
            return (cut, least);
        }
    }
    ("…".to_string(), least)
}

fn draw<DB: DrawingBackend>(area: DrawingArea<DB, plotters::coord::Shift>, r: &ReplayReport) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow::anyhow!("{e:?}");
    area.fill(&WHITE).map_err(err)?;
    let ms: Vec<(u64, f64)> = r.frames.iter().map(|f| (f.index, f.runtime.as_secs_f64() * 1e3)).collect();
    let top = ms.iter().map(|x| x.1).fold(1.0, f64::max) * 1.1;
    let last = ms.last().map_or(1, |x| x.0 + 1);
    let title = format!("render thread in the runtime per frame ({}; {} imports)", r.import_backend, r.imports);
    // A size the font cannot measure counts as too wide.
    let measure = |t: &str, px: u32| {
        area.estimate_text_size(t, &("sans-serif", px).into_text_style(&area)).map_or(u32::MAX, |s| s.0)
    };
    let (title, px) = fit_title(&title, area.dim_in_pixel().0.saturating_sub(2 * MARGIN), measure);
    let mut chart = ChartBuilder::on(&area)
        .caption(title, ("sans-serif", px))
        .margin(MARGIN)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0..last, 0.0..top)
        .map_err(err)?;
    chart.configure_mesh().x_desc("frame").y_desc("ms").draw().map_err(err)?;
    chart
        .draw_series(LineSeries::new(ms.iter().copied(), &BLUE))
        .map_err(err)?
        .label("frame time in the runtime")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    let imports = r.frames.iter().filter(|f| f.imports_made > 0).map(|f| (f.index, f.runtime.as_secs_f64() * 1e3));
    chart
        .draw_series(imports.map(|p| Circle::new(p, 4, RED.filled())))
        .map_err(err)?
        .label("frame with an import")
        .legend(|(x, y)| Circle::new((x, y), 4, RED.filled()));
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(err)?;
    area.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("emuhost-plot-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn no_font_is_an_error_naming_what_was_searched() {
        let d = scratch("none");
        std::fs::write(d.join("readme.txt"), b"not a font").unwrap();
        let e = find_font(None, &[d.clone(), d.join("absent")]).unwrap_err().to_string();
        assert!(e.contains("fc-match") && e.contains(&d.display().to_string()), "{e}");
        assert!(e.contains(&d.join("absent").display().to_string()), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_font_is_found_below_the_folders_a_regular_sans_one_first() {
        let d = scratch("some");
        for f in ["a/b/Zed-Bold.ttf", "a/Serifish-Regular.otf", "c/DejaVuSans.ttf", "c/DejaVuSans-Bold.ttf"] {
            std::fs::create_dir_all(d.join(f).parent().unwrap()).unwrap();
            std::fs::write(d.join(f), b"").unwrap();
        }
        assert_eq!(find_font(None, std::slice::from_ref(&d)).unwrap(), d.join("c/DejaVuSans.ttf"));
        std::fs::remove_file(d.join("c/DejaVuSans.ttf")).unwrap();
        assert_eq!(find_font(None, std::slice::from_ref(&d)).unwrap(), d.join("a/Serifish-Regular.otf"));
        // fontconfig's choice comes first.
        assert_eq!(find_font(Some(d.join("x.ttf")), std::slice::from_ref(&d)).unwrap(), d.join("x.ttf"));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn titles_shrink_then_are_cut_to_fit() {
        // 1 pixel per character per point of size, as a stand-in for a font.
        let measure = |t: &str, px: u32| t.chars().count() as u32 * px;
        assert_eq!(fit_title("short", 1000, measure), ("short".into(), 18));
        assert_eq!(fit_title(&"x".repeat(80), 1000, measure), ("x".repeat(80), 12));
        let (cut, px) = fit_title(&"y".repeat(200), 1000, measure);
        assert_eq!(px, 10);
        assert_eq!(cut, format!("{}…", "y".repeat(99)));
        assert!(measure(&cut, px) <= 1000);
    }
}
