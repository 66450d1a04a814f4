//! Arbitrary bytes as a trace: plain text, or zstd where the bytes start with zstd's magic number.
//! The reader must not panic; what it reads (the whole trace, or the records before its first
//! error) must write back through the trace writer and read again as the same header and events.
#![no_main]

use std::io::{BufRead, BufReader, Cursor, Read};

use emuhost_lab::trace::{Header, Reader, Record, TraceError, TraceWriter, read_str};
use libfuzzer_sys::fuzz_target;

/// zstd's frame magic number, little-endian.
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];
/// What a zstd input may decompress to: a few bytes of RLE blocks can make gigabytes of blank
/// lines, which the reader streams in bounded memory but slowly. Past this the input just ends.
const MAX_PLAIN: u64 = 4 << 20;

fuzz_target!(|data: &[u8]| {
    if data.starts_with(&ZSTD_MAGIC) {
        // The library's `Reader::zstd` is this decoder without the cap; the round trip below goes
        // through it.
        if let Ok(d) = zstd::Decoder::new(data) {
            check(Reader::new(BufReader::new(d.take(MAX_PLAIN))), true);
        }
    } else {
        check(Reader::new(Cursor::new(data)), false);
    }
});

fn check<R: BufRead>(reader: Result<Reader<R>, TraceError>, zstd: bool) {
    let mut r = match reader {
        Ok(r) => r,
        Err(e) => {
            assert_eq!(e.line(), Some(1), "a header error names line 1: {e}");
            return;
        }
    };
    let header = r.header().clone();
    let mut records = Vec::new();
    for item in r.by_ref() {
        match item {
            Ok(rec) => records.push(rec),
            Err(e) => {
                assert!(e.line().is_some_and(|l| l >= 2), "an error after the header names its line: {e}");
                let _ = e.to_string();
                break;
            }
        }
    }
    assert!(r.next().is_none(), "the reader stops at the end or at its first error");
    round_trip(&header, &records);
    if zstd {
        round_trip_zstd(&header, &records);
    }
}

/// The records a reader accepted, written by the writer, read back the same.
fn round_trip(header: &Header, records: &[Record]) {
    let mut w = TraceWriter::new(Vec::new(), header.clone()).expect("writing into memory");
    for rec in records {
        w.write(rec).unwrap_or_else(|e| panic!("the writer refuses {rec} that the reader took: {e}"));
    }
    let text = String::from_utf8(w.finish().expect("finishing into memory")).expect("the writer writes UTF-8");
    let (h, back) = read_str(&text).unwrap_or_else(|e| panic!("the writer's trace does not read back: {e}\n{text}"));
    assert_eq!(&h, header);
    assert_eq!(back, records);
}

fn round_trip_zstd(header: &Header, records: &[Record]) {
    let mut w = TraceWriter::zstd(Vec::new(), header.clone()).expect("writing into memory");
    for rec in records {
        w.write(rec).expect("the writer took it as text");
    }
    let bytes = w.finish().expect("finishing into memory");
    let mut r = Reader::zstd(Cursor::new(bytes)).expect("the writer's zstd trace opens");
    let back = r.by_ref().collect::<Result<Vec<_>, _>>().expect("the writer's zstd trace reads back");
    assert_eq!(r.header(), header);
    assert_eq!(back, records);
}
