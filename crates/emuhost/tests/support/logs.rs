//! Catching what the library logs, in a test that runs beside others in one process.

/// Runs `f` with `sub` as this thread's subscriber, so that every event `f` raises reaches it.
///
/// tracing caches, per call site, whether anyone wants its events. With one dispatcher alive it
/// asks only the default of whichever thread reaches the site first: a test on another thread
/// (no subscriber) could then cache "never" for a line this test waits for, and the line is lost
/// (seen once on Debian's 6.1 under qemu: `sched::logged_once_with_the_count` got no line). A
/// second, silent dispatcher makes tracing ask all live dispatchers, and rebuilding the cache
/// inside the scope undoes a "never" cached before this scope began.
pub fn scoped<S, R>(sub: S, f: impl FnOnce() -> R) -> R
where
    S: tracing::Subscriber + Send + Sync + 'static,
{
    let _second = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
    tracing::subscriber::with_default(sub, || {
        tracing::callsite::rebuild_interest_cache();
        f()
    })
}
