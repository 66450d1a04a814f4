//! A corpus of compute shaders: programs (WGSL or GLSL source) and, for each, its variants (values
//! of the program's overridable constants: WGSL `override`, GLSL `layout(constant_id = N) const`).
//!
//! On disk a corpus is a folder with the sources and `corpus.txt`, a line-oriented manifest:
//!
//! ```text
//! emuhost-corpus 1
//! program p0000 p0000.wgsl
//! variant WG=64 ITERS=2 MODE=0
//! variant WG=128 ITERS=4 MODE=1
//! program p0001 p0001.comp
//! variant 0=64 1=3
//! ```
//!
//! A `program NAME FILE` line starts a program (the file's extension says its language: `.wgsl`,
//! or `.comp`/`.glsl` for GLSL); each `variant` line after it gives one variant as `KEY=VALUE`
//! pairs (KEY an override's name, or its numeric id; VALUE a number). A program without variant
//! lines has one variant with the defaults. Empty lines and lines starting with `#` are skipped.
//!
//! [`generate`] makes a corpus from a seed, deterministically: the same [`GenConfig`] gives the
//! same sources and variants byte for byte. The programs are emuhost's own code, built from a
//! small set of arithmetic statements, loops and function calls, sized by `statements`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use emuhost::rng::Rng;

use super::PrepareError;

/// The manifest's file name inside a corpus folder.
pub const MANIFEST: &str = "corpus.txt";
const MAGIC: &str = "emuhost-corpus 1";

/// A shader language the translator reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Language {
    /// WGSL (files `.wgsl`); overridable constants are `override` declarations.
    Wgsl,
    /// GLSL compute shaders (files `.comp` or `.glsl`); overridable constants are
    /// `layout(constant_id = N) const`.
    Glsl,
}

impl Language {
    fn from_path(path: &str) -> Option<Language> {
        match Path::new(path).extension()?.to_str()? {
            "wgsl" => Some(Language::Wgsl),
            "comp" | "glsl" => Some(Language::Glsl),
            _ => None,
        }
    }

    /// The language's name as the logs and reports write it: `wgsl` or `glsl`.
    pub fn name(self) -> &'static str {
        match self {
            Language::Wgsl => "wgsl",
            Language::Glsl => "glsl",
        }
    }
}

/// One variant: values for the program's overridable constants (by name or numeric id).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Variant {
    /// `(KEY, VALUE)` pairs in the manifest's order: KEY an override's name or its numeric id (as
    /// text), VALUE its value. Empty: every constant keeps its default.
    pub constants: Vec<(String, f64)>,
}

impl Variant {
    /// `KEY=VALUE KEY=VALUE` (empty for the defaults).
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self.constants.iter().map(|(k, v)| format!("{k}={v}")).collect();
        parts.join(" ")
    }
}

/// One program: its source and its variants (at least one).
#[derive(Clone, Debug, PartialEq)]
pub struct Program {
    /// The program's name in the manifest (unique in the corpus).
    pub name: String,
    /// The source's file name inside the corpus folder.
    pub file: String,
    /// The source's language, from the file's extension.
    pub language: Language,
    /// The source text.
    pub source: String,
    /// The variants whose pipelines a preparation creates (at least one).
    pub variants: Vec<Variant>,
}

/// A corpus: programs in order.
///
/// # Examples
///
/// A generated corpus written to a folder and read back (no device needed):
///
/// ```
/// use emuhost_prepare::{Corpus, GenConfig, Language, generate};
///
/// # fn main() -> Result<(), emuhost_prepare::PrepareError> {
/// let mut cfg = GenConfig::default();
/// cfg.programs = 4;
/// cfg.variants = 2;
/// cfg.glsl_every = 2; // programs 1 and 3 are GLSL
/// let corpus = generate(&cfg);
/// assert_eq!(corpus.variant_count(), 8);
/// assert_eq!(corpus.programs[1].language, Language::Glsl);
///
/// let dir = std::env::temp_dir().join(format!("emuhost-doc-corpus-{}", std::process::id()));
/// corpus.write(&dir, true)?;
/// assert_eq!(Corpus::load(&dir)?, corpus);
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Corpus {
    /// The programs, in the manifest's order.
    pub programs: Vec<Program>,
}

impl Corpus {
    /// Variants over all programs: the pipelines a preparation creates.
    pub fn variant_count(&self) -> usize {
        self.programs.iter().map(|p| p.variants.len()).sum()
    }

    /// Reads a corpus folder (its `corpus.txt` and the sources it names).
    ///
    /// # Errors
    ///
    /// [`PrepareError::Io`] for a file that cannot be read; [`PrepareError::Manifest`] (with the
    /// line) for a manifest that does not parse, a program named twice, a file name that is not
    /// inside the folder or has an unknown extension, or a variant that is not `KEY=VALUE` pairs
    /// of finite numbers.
    pub fn load(dir: &Path) -> Result<Corpus, PrepareError> {
        let manifest = dir.join(MANIFEST);
        let text =
            std::fs::read_to_string(&manifest).map_err(|source| PrepareError::Io { path: manifest.clone(), source })?;
        let bad = |line: usize, what: String| PrepareError::Manifest { path: manifest.clone(), line, what };
        let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim()));
        match lines.next() {
            Some((_, MAGIC)) => {}
            Some((n, l)) => return Err(bad(n, format!("the first line is {l:?}, not {MAGIC:?}"))),
            None => return Err(bad(1, "empty".into())),
        }
        let mut programs: Vec<Program> = Vec::new();
        for (n, line) in lines {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut words = line.split_whitespace();
            match words.next() {
                Some("program") => {
                    let (Some(name), Some(file), None) = (words.next(), words.next(), words.next()) else {
                        return Err(bad(n, "expected `program NAME FILE`".into()));
                    };
                    if programs.iter().any(|p| p.name == name) {
                        return Err(bad(n, format!("program {name:?} is named twice")));
                    }
                    if file.contains('/') || file.starts_with('.') {
                        return Err(bad(n, format!("{file:?}: a file name inside the corpus folder, please")));
                    }
                    let language = Language::from_path(file)
                        .ok_or_else(|| bad(n, format!("{file:?}: the extension must be .wgsl, .comp or .glsl")))?;
                    let path = dir.join(file);
                    let source = std::fs::read_to_string(&path).map_err(|source| PrepareError::Io { path, source })?;
                    programs.push(Program {
                        name: name.into(),
                        file: file.into(),
                        language,
                        source,
                        variants: Vec::new(),
                    });
                }
                Some("variant") => {
                    let Some(p) = programs.last_mut() else {
                        return Err(bad(n, "a variant before any program".into()));
                    };
                    let mut v = Variant::default();
                    for kv in words {
                        let (k, val) = kv.split_once('=').ok_or_else(|| bad(n, format!("{kv:?} is not KEY=VALUE")))?;
                        let x: f64 = val.parse().map_err(|_| bad(n, format!("{kv:?}: the value is not a number")))?;
                        if k.is_empty() || !x.is_finite() {
                            return Err(bad(n, format!("{kv:?} is not KEY=VALUE with a finite number")));
                        }
                        v.constants.push((k.into(), x));
                    }
                    p.variants.push(v);
                }
                Some(w) => return Err(bad(n, format!("unknown line kind {w:?} (program or variant)"))),
                None => {}
            }
        }
        for p in &mut programs {
            if p.variants.is_empty() {
                p.variants.push(Variant::default());
            }
        }
        Ok(Corpus { programs })
    }

    /// Writes the corpus into `dir` (made if missing): the sources and `corpus.txt`. A file of
    /// those names that is there already is written over only where `force` is set; otherwise
    /// the first one found is an error ([`PrepareError::Exists`]) and nothing is written.
    ///
    /// # Errors
    ///
    /// [`PrepareError::Exists`] as said; [`PrepareError::Io`] for a folder or file that cannot be
    /// made or written (files written before it stay).
    pub fn write(&self, dir: &Path, force: bool) -> Result<(), PrepareError> {
        let io = |path: PathBuf| move |source| PrepareError::Io { path, source };
        std::fs::create_dir_all(dir).map_err(io(dir.to_path_buf()))?;
        let mut manifest = format!("{MAGIC}\n");
        let mut files: Vec<(PathBuf, &str)> = Vec::with_capacity(self.programs.len() + 1);
        for p in &self.programs {
            files.push((dir.join(&p.file), &p.source));
            let _ = writeln!(manifest, "program {} {}", p.name, p.file);
            for v in &p.variants {
                let _ = writeln!(manifest, "variant {}", v.describe());
            }
        }
        files.push((dir.join(MANIFEST), &manifest));
        if !force {
            // All checked first, so a refused corpus leaves the folder as it was.
            if let Some((path, _)) = files.iter().find(|(path, _)| std::fs::symlink_metadata(path).is_ok()) {
                return Err(PrepareError::Exists { path: path.clone() });
            }
        }
        for (path, text) in files {
            let made = if force {
                std::fs::write(&path, text)
            } else {
                // `create_new`: a file that appeared since the check is not written over either.
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()))
            };
            match made {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Err(PrepareError::Exists { path }),
                other => other.map_err(io(path))?,
            }
        }
        Ok(())
    }
}

/// What [`generate`] makes.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GenConfig {
    /// Programs in the corpus.
    pub programs: usize,
    /// Variants of each program.
    pub variants: usize,
    /// The seed: the same seed (and the same other fields) gives the same corpus.
    pub seed: u64,
    /// Arithmetic statements in each of a program's helper functions (its size).
    pub statements: usize,
    /// Every `glsl_every`-th program is GLSL (0: none), the others WGSL.
    pub glsl_every: usize,
    /// This many programs (spread over the corpus) carry a type error: translation fails.
    pub broken_translate: usize,
    /// This many programs get one extra variant with a workgroup of 4,096 invocations, past what
    /// devices allow (1,024 on lavapipe and NVIDIA): its pipeline is refused.
    pub broken_compile: usize,
}

impl Default for GenConfig {
    /// The small corpus the tests and CI prepare.
    fn default() -> GenConfig {
        GenConfig {
            programs: 12,
            variants: 3,
            seed: 8,
            statements: 12,
            glsl_every: 4,
            broken_translate: 0,
            broken_compile: 0,
        }
    }
}

/// A constant with one decimal, 0.1–9.9.
fn lit(rng: &mut Rng) -> String {
    format!("{}.{}", 1 + rng.below(9), rng.below(10))
}

const WORKGROUPS: [u32; 4] = [32, 64, 128, 256];

/// Picks the program indices that get a fault: `count` of them, spread evenly, from `offset`.
fn spread(programs: usize, count: usize, offset: usize) -> Vec<usize> {
    if count == 0 || programs == 0 {
        return Vec::new();
    }
    let count = count.min(programs);
    (0..count).map(|k| (k * programs / count + offset) % programs).collect()
}

/// Makes a corpus (see the module's docs). Program `k` is named `pNNNN`.
pub fn generate(cfg: &GenConfig) -> Corpus {
    let mut rng = Rng::new(cfg.seed);
    let bad_translate = spread(cfg.programs, cfg.broken_translate, 1);
    let is_glsl = |k: usize| cfg.glsl_every > 0 && k % cfg.glsl_every == cfg.glsl_every - 1;
    // The workgroup size is a variant's constant in WGSL only (naga's GLSL reader has no
    // `local_size_x_id`), so the oversized workgroups go to WGSL programs that translate.
    let wgsl: Vec<usize> = (0..cfg.programs).filter(|k| !is_glsl(*k) && !bad_translate.contains(k)).collect();
    let bad_compile: Vec<usize> = spread(wgsl.len(), cfg.broken_compile, 1).into_iter().map(|i| wgsl[i]).collect();
    let programs = (0..cfg.programs)
        .map(|k| {
            let name = format!("p{k:04}");
            let glsl = is_glsl(k);
            let functions = 2 + rng.below(3) as usize;
            let bodies: Vec<Vec<String>> = (0..functions).map(|_| statements(&mut rng, cfg.statements)).collect();
            let broken = bad_translate.contains(&k);
            let (file, language, source) = if glsl {
                let wg = WORKGROUPS[k % WORKGROUPS.len()];
                (format!("{name}.comp"), Language::Glsl, glsl_source(&name, cfg.seed, &bodies, broken, wg))
            } else {
                (format!("{name}.wgsl"), Language::Wgsl, wgsl_source(&name, cfg.seed, &bodies, broken))
            };
            let mut variants: Vec<Variant> = (0..cfg.variants.max(1))
                .map(|v| {
                    let wg = WORKGROUPS[(v + k) % WORKGROUPS.len()];
                    let iters = 1 + (v / WORKGROUPS.len()) as u32 % 8;
                    let mode = (v % 3) as u32;
                    variant(language, wg, iters, mode, v as f64 * 0.5 + 1.0)
                })
                .collect();
            if bad_compile.contains(&k) {
                variants.push(variant(language, 4096, 1, 0, 1.0));
            }
            Program { name, file, language, source, variants }
        })
        .collect();
    Corpus { programs }
}

/// A variant's constants: by name in WGSL (WG, ITERS, MODE, SCALE), by `constant_id` in GLSL
/// (1 ITERS, 2 MODE, 3 SCALE; its workgroup size is the program's).
fn variant(language: Language, wg: u32, iters: u32, mode: u32, scale: f64) -> Variant {
    let named = [("ITERS", "1", f64::from(iters)), ("MODE", "2", f64::from(mode)), ("SCALE", "3", scale)];
    let mut constants = Vec::new();
    if language == Language::Wgsl {
        constants.push(("WG".to_string(), f64::from(wg)));
    }
    for (name, id, v) in named {
        constants.push((if language == Language::Wgsl { name } else { id }.to_string(), v));
    }
    Variant { constants }
}

/// Statements over `a` and `b` (floats), written the same in WGSL and GLSL except for loops,
/// which are marked with a leading `L` and a count and written by each language's writer.
fn statements(rng: &mut Rng, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| {
            let (c1, c2) = (lit(rng), lit(rng));
            match rng.below(9) {
                0 => format!("a = a * {c1} + b;"),
                1 => format!("b = sin(a) * {c1} - b;"),
                2 => format!("a = max(a, b) - {c1};"),
                3 => format!("b = fract(a * {c1}) + b * {c2};"),
                4 => format!("a = clamp(a, -{c1}, {c2}) + b * b;"),
                5 => format!("b = sqrt(abs(a) + {c1});"),
                6 => format!("a = mix(a, b, 0.{}) + cos(b);", 1 + rng.below(9)),
                7 => format!("b = exp2(min(a, {c1})) - floor(b * {c2});"),
                _ => format!("L{} a = a + b * {c1}; b = b * 0.5 + a;", 2 + rng.below(4)),
            }
        })
        .collect()
}

fn loop_line(s: &str, wgsl: bool) -> String {
    let Some(rest) = s.strip_prefix('L') else { return format!("    {s}\n") };
    let (count, body) = rest.split_once(' ').unwrap_or(("2", rest));
    if wgsl {
        format!("    for (var j: u32 = 0u; j < {count}u; j = j + 1u) {{ {body} }}\n")
    } else {
        format!("    for (uint j = 0u; j < {count}u; j++) {{ {body} }}\n")
    }
}

fn wgsl_source(name: &str, seed: u64, bodies: &[Vec<String>], broken: bool) -> String {
    let mut s = format!("// emuhost generated compute program {name} (seed {seed}): WGSL\n");
    s.push_str(
        "override WG: u32 = 64u;\noverride ITERS: u32 = 1u;\noverride MODE: u32 = 0u;\noverride SCALE: f32 = 1.0;\n\n\
         struct Params { n: u32, k: u32, x: f32, y: f32 }\n\
         @group(0) @binding(0) var<storage, read> src: array<f32>;\n\
         @group(0) @binding(1) var<storage, read_write> dst: array<f32>;\n\
         @group(0) @binding(2) var<uniform> params: Params;\n\
         var<workgroup> tile: array<f32, 256>;\n\n",
    );
    for (i, body) in bodies.iter().enumerate() {
        let _ = writeln!(s, "fn f{i}(x: f32, y: f32) -> f32 {{\n    var a = x;\n    var b = y;");
        for st in body {
            s.push_str(&loop_line(st, true));
        }
        s.push_str("    return a + b;\n}\n\n");
    }
    s.push_str(
        "@compute @workgroup_size(WG)\n\
         fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_index) li: u32) {\n\
         \x20   let n = max(params.n, 1u);\n\
         \x20   let i = gid.x % n;\n\
         \x20   var acc = src[i] + params.x;\n\
         \x20   for (var it: u32 = 0u; it < ITERS; it = it + 1u) {\n",
    );
    for i in 0..bodies.len() {
        let _ = writeln!(s, "        acc = f{i}(acc, src[(i + it + {i}u) % n]) * SCALE;");
    }
    s.push_str(
        "        if (MODE == 1u) { acc = acc * params.y; } else if (MODE == 2u) { acc = acc + f32(it); }\n    }\n",
    );
    if broken {
        // A type error: an f32 where a u32 is declared.
        s.push_str("    let wrong: u32 = acc;\n");
    }
    s.push_str("    tile[li % 256u] = acc;\n    workgroupBarrier();\n    dst[i] = acc + tile[(li + 1u) % 256u];\n}\n");
    s
}

fn glsl_source(name: &str, seed: u64, bodies: &[Vec<String>], broken: bool, wg: u32) -> String {
    let mut s = format!("#version 450\n// emuhost generated compute program {name} (seed {seed}): GLSL\n");
    s.push_str(
        "layout(constant_id = 1) const uint ITERS = 1u;\n\
         layout(constant_id = 2) const uint MODE = 0u;\nlayout(constant_id = 3) const float SCALE = 1.0;\n\n\
         layout(set = 0, binding = 0) readonly buffer Src { float src[]; };\n\
         layout(set = 0, binding = 1) buffer Dst { float dst[]; };\n\
         layout(set = 0, binding = 2) uniform Params { uint n; uint k; float x; float y; } params;\n\
         shared float tile[256];\n\n",
    );
    let _ = writeln!(s, "layout(local_size_x = {wg}) in;\n");
    for (i, body) in bodies.iter().enumerate() {
        let _ = writeln!(s, "float f{i}(float x, float y) {{\n    float a = x;\n    float b = y;");
        for st in body {
            s.push_str(&loop_line(st, false));
        }
        s.push_str("    return a + b;\n}\n\n");
    }
    s.push_str(
        "void main() {\n\
         \x20   uint n = max(params.n, 1u);\n\
         \x20   uint i = gl_GlobalInvocationID.x % n;\n\
         \x20   float acc = src[i] + params.x;\n\
         \x20   for (uint it = 0u; it < ITERS; it++) {\n",
    );
    for i in 0..bodies.len() {
        let _ = writeln!(s, "        acc = f{i}(acc, src[(i + it + {i}u) % n]) * SCALE;");
    }
    s.push_str(
        "        if (MODE == 1u) { acc = acc * params.y; } else if (MODE == 2u) { acc = acc + float(it); }\n    }\n",
    );
    if broken {
        s.push_str("    uint wrong = acc;\n");
    }
    // No barrier(): naga's GLSL reader makes it a barrier of every scope, subgroups included,
    // which needs a capability the default validator does not grant.
    s.push_str(
        "    tile[gl_LocalInvocationIndex % 256u] = acc;\n    dst[i] = acc + tile[(gl_LocalInvocationIndex + 1u) % 256u];\n}\n",
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_sized() {
        let cfg = GenConfig { programs: 9, variants: 5, ..GenConfig::default() };
        let a = generate(&cfg);
        assert_eq!(a, generate(&cfg));
        assert_eq!(a.programs.len(), 9);
        assert_eq!(a.variant_count(), 45);
        assert_ne!(a, generate(&GenConfig { seed: 9, ..cfg.clone() }));
        assert_eq!(a.programs.iter().filter(|p| p.language == Language::Glsl).count(), 2);
    }

    #[test]
    fn faults_are_placed() {
        let cfg = GenConfig { programs: 10, broken_translate: 2, broken_compile: 3, ..GenConfig::default() };
        let c = generate(&cfg);
        assert_eq!(c.programs.iter().filter(|p| p.source.contains("wrong")).count(), 2);
        assert_eq!(c.variant_count(), 10 * 3 + 3);
    }

    #[test]
    fn round_trip_through_a_folder() {
        let dir = std::env::temp_dir().join(format!("emuhost-corpus-{}", std::process::id()));
        let c = generate(&GenConfig::default());
        let _ = std::fs::remove_dir_all(&dir);
        c.write(&dir, false).unwrap();
        assert_eq!(Corpus::load(&dir).unwrap(), c);
        std::fs::write(dir.join(MANIFEST), "emuhost-corpus 1\nvariant A=1\n").unwrap();
        let e = Corpus::load(&dir).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("before any program"), "{e}");
        std::fs::write(dir.join(MANIFEST), "emuhost-corpus 1\nprogram p0000 p0000.wgsl\nvariant WG=x\n").unwrap();
        assert!(Corpus::load(&dir).unwrap_err().to_string().contains("not a number"));
        std::fs::write(dir.join(MANIFEST), "hello\n").unwrap();
        assert!(Corpus::load(&dir).unwrap_err().to_string().contains("line 1"));
        std::fs::write(dir.join(MANIFEST), "emuhost-corpus 1\nprogram a ../x.wgsl\n").unwrap();
        assert!(Corpus::load(&dir).unwrap_err().to_string().contains("inside the corpus folder"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_corpus_is_written_over_files_only_when_forced() {
        let dir = std::env::temp_dir().join(format!("emuhost-corpus-force-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let c = generate(&GenConfig { programs: 3, variants: 1, ..GenConfig::default() });
        std::fs::create_dir_all(&dir).unwrap();
        // A user's file of a name the corpus uses, and one it does not.
        std::fs::write(dir.join("p0001.wgsl"), "mine").unwrap();
        std::fs::write(dir.join("notes.txt"), "mine too").unwrap();
        let e = c.write(&dir, false).unwrap_err();
        assert!(matches!(&e, PrepareError::Exists { path } if path.ends_with("p0001.wgsl")), "{e}");
        assert!(e.to_string().contains("p0001.wgsl"), "{e}");
        assert_eq!(std::fs::read_to_string(dir.join("p0001.wgsl")).unwrap(), "mine", "left as it was");
        assert!(!dir.join("p0000.wgsl").exists() && !dir.join(MANIFEST).exists(), "nothing written");
        // Forced: written over; the other file stays.
        c.write(&dir, true).unwrap();
        assert_eq!(Corpus::load(&dir).unwrap(), c);
        assert_eq!(std::fs::read_to_string(dir.join("notes.txt")).unwrap(), "mine too");
        // Its own earlier corpus is not written over without force either.
        let e = c.write(&dir, false).unwrap_err();
        assert!(matches!(e, PrepareError::Exists { .. }), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
