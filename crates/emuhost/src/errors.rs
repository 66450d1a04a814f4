//! What the modules' errors share: how one is written on one line with its sources.

/// An error and its sources, on one line (`outer: inner: the OS's error`): a backend's failure
/// names the OS or driver error under it.
///
/// ```
/// use emuhost::import::error_chain;
/// use emuhost::sched::SchedError;
///
/// let e = SchedError::Read { path: "/proc/meminfo".into(), source: std::io::Error::other("denied") };
/// assert_eq!(error_chain(&e), "reading /proc/meminfo failed: denied");
/// ```
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}
