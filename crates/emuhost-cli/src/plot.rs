//! `--plot`: frame time on the render thread, with the frames that made imports marked.

use std::path::Path;

use anyhow::{Context, bail};
use emuhost_lab::replay::ReplayReport;
use plotters::prelude::*;

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

pub fn frames(path: &Path, r: &ReplayReport) -> anyhow::Result<()> {
    let png = path.extension().and_then(|e| e.to_str()).is_some_and(|e| e.eq_ignore_ascii_case("png"));
    // Text is laid out (and, in a PNG, drawn) with a font of its own: Debian's fonts-dejavu-core.
    let bytes = std::fs::read(FONT)
        .with_context(|| format!("a plot needs the font {FONT} (apt-get install fonts-dejavu-core)"))?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_err() {
        bail!("{FONT} is not a font plotters can read");
    }
    if png {
        draw(BitMapBackend::new(path, (1280, 480)).into_drawing_area(), r)
    } else {
        draw(SVGBackend::new(path, (1280, 480)).into_drawing_area(), r)
    }
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
    let mut chart = ChartBuilder::on(&area)
        .caption(
            format!("render thread in the runtime per frame ({}; {} imports)", r.import_backend, r.imports),
            ("sans-serif", 18),
        )
        .margin(10)
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
