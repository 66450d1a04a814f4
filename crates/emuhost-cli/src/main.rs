//! `emuhost`: replay a game session through the host layer, A/B two settings, and measure.
//! Glue only: argument parsing, reports. Exit status: 0 ok, 1 a check failed, 2 an error.

/// `println!` for stdout that ends the process quietly (exit 0) when the reader has gone
/// (`emuhost trace stats | head -3`), instead of panicking; another write error is exit 2.
macro_rules! outln {
    ($($t:tt)*) => { $crate::stdout(format_args!("{}\n", format_args!($($t)*))) };
}

/// `print!` as [`outln!`] does it.
macro_rules! out {
    ($($t:tt)*) => { $crate::stdout(format_args!($($t)*)) };
}

mod ab;
mod bench;
mod plan;
mod plot;
mod policy;
mod prepare;
mod probe;
mod progress;
mod replay;
mod soak;
mod switches;
mod trace;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "emuhost", version, about = "The host layer of console emulators: replay, measure, probe")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a game session (the built-in one by default) through the runtime and report frame
    /// times in the runtime, imports, collects and sleeps.
    Replay(replay::Args),
    /// Replay with two settings alternately (A B A B ...), each in a fresh process: per-round
    /// figures, medians and the ratio.
    Ab(ab::Args),
    /// Print what this machine offers the runtime (kernel, pages, userfaultfd, PAGEMAP_SCAN, CPUs).
    Probe {
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print the short-sleep rule and the compile-worker count as one JSON object (flags stand in
    /// for what the machine would say).
    Policy(policy::Args),
    /// The range each binding would import, given the game's pools (one `0xlo..0xhi` line each).
    Plan(plan::Args),
    /// Benchmarks: both arms in one run, several rounds, medians and the ratio (use a release build).
    Bench {
        #[command(subcommand)]
        which: bench::Which,
    },
    /// Shader preparation: translate a corpus of compute shaders (naga) and create every variant's
    /// pipeline through the Vulkan driver, with a pipeline cache on disk; resumable.
    Prepare(prepare::Args),
    /// Traces of game sessions: write a synthetic one, print a trace's figures.
    Trace {
        #[command(subcommand)]
        which: trace::Which,
    },
}

/// Writes to stdout for [`outln!`] and [`out!`].
pub fn stdout(args: std::fmt::Arguments) {
    use std::io::Write;
    if let Err(e) = std::io::stdout().lock().write_fmt(args) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("emuhost: error: writing to stdout: {e}");
        std::process::exit(2);
    }
}

/// What a command found: all well, or a check that failed (exit 1).
pub enum Outcome {
    Ok,
    CheckFailed,
}

/// Colour codes in log lines only where stderr is a terminal, and not where `NO_COLOR` is set to
/// anything but the empty string (no-color.org): a log file or a pipe gets plain text.
fn log_colour(stderr_is_terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// The settings a command runs with: the environment's switches, and for a replay its flags' on
/// top (applied in this process: no child is needed).
fn settings(cli: &Cli) -> anyhow::Result<emuhost::settings::Settings> {
    let mut s = switches::from_env()?;
    if let Command::Replay(a) = &cli.command {
        a.apply(&mut s)?;
    }
    Ok(s)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The settings: the environment's switches, then those a replay's flags set. A bad one is
    // refused before any work (exit 2), the log filter's and the fault switches' included.
    let settings = match settings(&cli) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("emuhost: error: {e:#}");
            return ExitCode::from(2);
        }
    };
    // Before any hook runs: the fault switches hold for the whole process.
    emuhost::faults::install(&settings.faults);
    progress::init(&settings.log, log_colour(progress::shown(), std::env::var_os("NO_COLOR")));
    let result = match cli.command {
        Command::Replay(a) => replay::run(a, settings),
        Command::Ab(a) => ab::run(a),
        Command::Probe { json } => probe::run(json, &settings),
        Command::Policy(a) => policy::run(a),
        Command::Plan(a) => plan::run(a, &settings),
        Command::Bench { which } => bench::run(which, &settings),
        Command::Trace { which } => trace::run(which),
        Command::Prepare(a) => prepare::run(a),
    };
    match result {
        Ok(Outcome::Ok) => ExitCode::SUCCESS,
        Ok(Outcome::CheckFailed) => ExitCode::from(1),
        Err(e) => {
            eprintln!("emuhost: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    /// Every argument of every command has help text (`--help` and `--version` are clap's).
    #[test]
    fn every_flag_has_help() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if arg.get_help().is_none() && arg.get_long_help().is_none() && id != "help" && id != "version" {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut cmd = <super::Cli as clap::CommandFactory>::command();
        cmd.build();
        let mut missing = Vec::new();
        walk(&cmd, "emuhost", &mut missing);
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
        // The walk sees the subcommands' flags.
        let bench = cmd.find_subcommand("bench").and_then(|b| b.find_subcommand("import")).expect("bench import");
        assert!(bench.get_arguments().count() > 10);
    }

    #[test]
    fn log_colour_needs_a_terminal_and_no_no_color() {
        use std::ffi::OsString;
        assert!(super::log_colour(true, None));
        assert!(super::log_colour(true, Some(OsString::new())), "NO_COLOR empty is as unset");
        assert!(!super::log_colour(true, Some("1".into())));
        assert!(!super::log_colour(true, Some(OsString::from("0"))), "any value but empty turns colour off");
        assert!(!super::log_colour(false, None));
        assert!(!super::log_colour(false, Some(OsString::new())));
    }
}
