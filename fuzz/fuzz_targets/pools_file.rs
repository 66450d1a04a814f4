//! Arbitrary bytes (as UTF-8, invalid sequences replaced) as a pools file. A file that parses has
//! only non-empty pools that do not wrap, a registry takes them all, and rendering them back gives
//! a file that parses to the same list. An error names a line that exists, that line alone fails
//! the same way, and the lines before it parse.
#![no_main]

use emuhost::import::Pools;
use emuhost::import::pools_file::{parse, render};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match parse(&text) {
        Ok(pools) => {
            for &(lo, size) in &pools {
                assert!(size > 0 && lo.checked_add(size).is_some(), "{lo:#x}+{size:#x}");
            }
            assert_eq!(Pools::new().extend(pools.iter().copied()).map(|ids| ids.len()), Some(pools.len()));
            let back = render(&pools);
            assert_eq!(parse(&back).as_ref(), Ok(&pools), "{back}");
        }
        Err(e) => {
            let lines: Vec<&str> = text.lines().collect();
            assert!(e.line >= 1 && e.line <= lines.len(), "{e} in a file of {} lines", lines.len());
            let alone = parse(lines[e.line - 1]).expect_err("the bad line alone");
            assert_eq!((alone.line, &alone.what), (1, &e.what));
            parse(&lines[..e.line - 1].join("\n")).expect("the lines before the bad one");
        }
    }
});
