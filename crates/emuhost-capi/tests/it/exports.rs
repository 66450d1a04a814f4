//! The shared library's exports are the header's functions, both ways: a function the header
//! declares that the library does not export fails to link (or to load), and an export the header
//! does not declare is ABI nobody documented. The library is the one this very test build made
//! (cargo builds every crate type of the library into the `deps` folder beside the test binary):
//! `emuhost_capi.dll` on Windows, whose export table is read here from the file; on Linux
//! `libemuhost_capi.so`, whose dynamic symbols `nm -D` lists. `.ci/windows capi` checks the
//! release-shaped DLL the same way with `llvm-readobj --coff-exports`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The functions `include/emuhost.h` declares: every `emuhost_NAME(` outside comments (a
/// function-pointer typedef's name is followed by `)`, not `(`).
fn header_functions(header: &str) -> BTreeSet<String> {
    let mut code = String::with_capacity(header.len());
    let mut rest = header;
    while !rest.is_empty() {
        let line = rest.find("//");
        let block = rest.find("/*");
        match (line, block) {
            (Some(l), b) if b.is_none_or(|b| l < b) => {
                code.push_str(&rest[..l]);
                rest = rest[l..].find('\n').map_or("", |e| &rest[l + e..]);
            }
            (_, Some(b)) => {
                code.push_str(&rest[..b]);
                rest = rest[b + 2..].find("*/").map_or("", |e| &rest[b + 2 + e + 2..]);
            }
            _ => {
                code.push_str(rest);
                rest = "";
            }
        }
    }
    let mut names = BTreeSet::new();
    let bytes = code.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut at = 0;
    while let Some(i) = code[at..].find("emuhost_").map(|i| at + i) {
        let end = i + code[i..].bytes().take_while(|&c| ident(c)).count();
        let starts_word = i == 0 || !ident(bytes[i - 1]);
        let next = code[end..].trim_start().as_bytes().first();
        if starts_word && next == Some(&b'(') {
            names.insert(code[i..end].to_string());
        }
        at = end;
    }
    names
}

/// What one side has that the other lacks, as a message naming each (empty where they are equal).
fn differences(header: &BTreeSet<String>, exports: &BTreeSet<String>, library: &str) -> String {
    let mut out = String::new();
    for name in header.difference(exports) {
        out += &format!("declared in include/emuhost.h, not exported by {library}: {name}\n");
    }
    for name in exports.difference(header) {
        out += &format!("exported by {library}, not declared in include/emuhost.h: {name}\n");
    }
    out
}

/// The library's file: beside the test binary, or in its parent folder.
fn library(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary's folder");
    [deps.join(name), deps.parent().unwrap_or(deps).join(name)]
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("no {name} beside {} or in its parent", exe.display()))
}

/// The names a PE image (a DLL) exports, from its export directory.
#[cfg(windows)]
fn pe_exports(image: &[u8]) -> Result<BTreeSet<String>, String> {
    let u16_at = |o: usize| image.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u32_at = |o: usize| image.get(o..o + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
    let pe = u32_at(0x3c).ok_or("no DOS header")?;
    if image.get(pe..pe + 4) != Some(b"PE\0\0") {
        return Err(format!("no PE signature at {pe:#x}"));
    }
    let (coff, sections) = (pe + 4, u16_at(pe + 6).ok_or("no COFF header")?);
    let optional = coff + 20;
    let optional_len = u16_at(coff + 16).ok_or("no COFF header")?;
    if u16_at(optional) != Some(0x20b) {
        return Err("not a PE32+ (64-bit) image".into());
    }
    // Data directory 0 (exports) of a PE32+ optional header is at 112.
    let export_rva = u32_at(optional + 112).ok_or("no data directories")?;
    if export_rva == 0 {
        return Ok(BTreeSet::new());
    }
    // An RVA to a file offset, through the section table.
    let table = optional + optional_len;
    let file = |rva: usize| -> Option<usize> {
        (0..sections).find_map(|i| {
            let s = table + i * 40;
            let (size, addr, raw) = (u32_at(s + 8)?, u32_at(s + 12)?, u32_at(s + 20)?);
            (addr..addr + size).contains(&rva).then(|| rva - addr + raw)
        })
    };
    let dir = file(export_rva).ok_or("the export directory is in no section")?;
    let (count, names) = (u32_at(dir + 24).ok_or("short export directory")?, u32_at(dir + 32).ok_or("short")?);
    let names = file(names).ok_or("the name table is in no section")?;
    let mut out = BTreeSet::new();
    for i in 0..count {
        let name = file(u32_at(names + 4 * i).ok_or("short name table")?).ok_or("a name in no section")?;
        let text = image.get(name..).ok_or("a name past the end")?;
        let len = text.iter().position(|&c| c == 0).ok_or("a name without its NUL")?;
        out.insert(String::from_utf8_lossy(&text[..len]).into_owned());
    }
    Ok(out)
}

#[cfg(windows)]
fn library_exports() -> (String, BTreeSet<String>) {
    let path = library("emuhost_capi.dll");
    let image = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let names = pe_exports(&image).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (path.display().to_string(), names)
}

#[cfg(not(windows))]
fn library_exports() -> (String, BTreeSet<String>) {
    let path = library("libemuhost_capi.so");
    let out = std::process::Command::new("nm")
        .args(["-D", "--defined-only", "--format=posix"])
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("nm -D {}: {e}", path.display()));
    assert!(out.status.success(), "nm -D {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    // `NAME TYPE VALUE SIZE`: the functions (T) the library defines; the Rust runtime's own
    // symbols a cdylib may carry are no part of the ABI.
    let names = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (name, kind) = (f.next()?, f.next()?);
            (kind == "T" && !name.starts_with("rust_") && !name.starts_with("__rust")).then(|| name.to_string())
        })
        .collect();
    (path.display().to_string(), names)
}

#[test]
fn the_librarys_exports_are_the_headers_functions() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let header = std::fs::read_to_string(root.join("include/emuhost.h")).expect("include/emuhost.h");
    let declared = header_functions(&header);
    assert!(declared.len() > 50 && declared.contains("emuhost_version"), "{declared:?}");
    let (library, exported) = library_exports();
    let missing = differences(&declared, &exported, &library);
    assert!(missing.is_empty(), "{missing}");
    // The snapshots (issue 39), by name: the header's reading finds them, the library exports them.
    for name in ["new", "take", "restore", "release", "read", "live", "stats", "delete"]
        .map(|f| format!("emuhost_snapshots_{f}"))
    {
        assert!(declared.contains(&name) && exported.contains(&name), "{name}: declared or exported no more");
    }
}

/// The header's reading and the comparison find a function missing on either side, and nothing in
/// comments or function-pointer typedefs.
#[test]
fn the_exports_check_names_what_either_side_lacks() {
    let header = "/* emuhost_in_block(a) */\n// emuhost_in_line(b)\ntypedef void (*emuhost_fn_t)(void);\n\
                  emuhost_error_t *emuhost_a(const emuhost_space_t *s);\nbool emuhost_b (void);\n\
                  int not_emuhost_c(void);\n";
    let declared = header_functions(header);
    assert_eq!(declared, ["emuhost_a", "emuhost_b"].map(String::from).into());
    let exported: BTreeSet<String> = ["emuhost_a", "emuhost_extra"].map(String::from).into();
    assert_eq!(
        differences(&declared, &exported, "lib"),
        "declared in include/emuhost.h, not exported by lib: emuhost_b\n\
         exported by lib, not declared in include/emuhost.h: emuhost_extra\n"
    );
}
