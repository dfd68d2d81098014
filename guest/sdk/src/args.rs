//! The plugin's command line (what follows `--` on `llamabox run`): words (a mode, say),
//! `--name value` flags and `--name` switches, read by name with defaults, and anything
//! nobody read refused, so a misspelt flag fails the run instead of being ignored.

use std::collections::{BTreeMap, VecDeque};
use std::str::FromStr;

use crate::types::Error;

/// Words and flags not yet read: flags by name (without the `--`), a repeated flag
/// keeping its last value.
pub struct Args {
    words: VecDeque<String>,
    flags: BTreeMap<String, Option<String>>,
}

/// A command plugin's `main`: reads its options with `read` (from the process's
/// arguments; `switches` take no value), refuses what `read` left, runs `run`, and on
/// any error prints it after the plugin's `name` and exits with status 1.
pub fn command<O>(
    name: &str,
    switches: &[&str],
    read: impl FnOnce(&mut Args) -> Result<O, String>,
    run: impl FnOnce(&O) -> Result<(), Error>,
) {
    let options = Args::from_env(switches).and_then(|mut args| {
        let options = read(&mut args)?;
        args.finish().map(|()| options)
    });
    if let Err(e) = options.and_then(|o| run(&o).map_err(|e| format!("{e:?}"))) {
        eprintln!("{name}: {e}");
        std::process::exit(1);
    }
}

impl Args {
    /// The process's arguments after argv[0]. `switches` are the flags that take no value.
    pub fn from_env(switches: &[&str]) -> Result<Args, String> {
        Args::parse(std::env::args().skip(1), switches)
    }

    pub fn parse(
        args: impl IntoIterator<Item = String>,
        switches: &[&str],
    ) -> Result<Args, String> {
        let (mut words, mut flags) = (VecDeque::new(), BTreeMap::new());
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            let Some(name) = arg.strip_prefix("--").filter(|n| !n.is_empty()) else {
                words.push_back(arg);
                continue;
            };
            let value = if switches.contains(&name) {
                None
            } else {
                Some(args.next().ok_or(format!("{arg} needs a value"))?)
            };
            flags.insert(name.to_string(), value);
        }
        Ok(Args { words, flags })
    }

    /// The next word that is not a flag, if any.
    pub fn word(&mut self) -> Option<String> {
        self.words.pop_front()
    }

    /// Flag `name`'s value, if given.
    pub fn value(&mut self, name: &str) -> Option<String> {
        self.flags.remove(name).flatten()
    }

    /// Flag `name`'s value, or `default`.
    pub fn string(&mut self, name: &str, default: &str) -> String {
        self.value(name).unwrap_or_else(|| default.to_string())
    }

    /// Flag `name` parsed as a number (or anything `FromStr`), or `default`.
    pub fn number<T: FromStr>(&mut self, name: &str, default: T) -> Result<T, String> {
        match self.value(name) {
            Some(v) => v.parse().map_err(|_| format!("--{name}: {v:?} is not a number")),
            None => Ok(default),
        }
    }

    /// A flag with two values: `false` for `off` (and when absent), `true` for `on`.
    pub fn either(&mut self, name: &str, off: &str, on: &str) -> Result<bool, String> {
        match self.value(name) {
            None => Ok(false),
            Some(v) if v == off => Ok(false),
            Some(v) if v == on => Ok(true),
            Some(v) => Err(format!("--{name}: expected {off}|{on}, got {v:?}")),
        }
    }

    /// Whether switch `name` was given.
    pub fn switch(&mut self, name: &str) -> bool {
        self.flags.remove(name).is_some()
    }

    /// Refuses every word and flag that was not read.
    pub fn finish(self) -> Result<(), String> {
        match (self.words.front(), self.flags.keys().next()) {
            (Some(word), _) => Err(format!("unexpected argument {word:?}")),
            (None, Some(name)) => Err(format!("unknown argument \"--{name}\"")),
            (None, None) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &[&str]) -> Result<Args, String> {
        Args::parse(line.iter().map(|s| s.to_string()), &["spin"])
    }

    #[test]
    fn flags_are_read_by_name_with_defaults() {
        let mut a = args(&["decode", "--model", "m", "--spin", "--tokens", "12", "--tokens", "13"])
            .unwrap();
        assert_eq!(a.word().as_deref(), Some("decode"));
        assert_eq!(a.word(), None);
        assert_eq!(a.string("model", "default"), "m");
        assert_eq!(a.string("prompt", "hi"), "hi");
        assert_eq!(a.number("tokens", 0u32), Ok(13), "the last value wins");
        assert!(a.switch("spin"));
        assert_eq!(a.either("mode", "blocking", "pending"), Ok(false), "absent: off");
        assert!(!a.switch("spin"), "read once");
        assert_eq!(a.finish(), Ok(()));
    }

    #[test]
    fn bad_command_lines_are_refused_by_name() {
        assert_eq!(args(&["--model"]).err().unwrap(), "--model needs a value");
        assert_eq!(
            args(&["model"]).unwrap().finish().unwrap_err(),
            "unexpected argument \"model\""
        );
        assert_eq!(args(&["--"]).unwrap().finish().unwrap_err(), "unexpected argument \"--\"");
        let mut a = args(&["--tokens", "many", "--typo", "1", "--mode", "fast"]).unwrap();
        assert_eq!(
            a.either("mode", "blocking", "pending").unwrap_err(),
            "--mode: expected blocking|pending, got \"fast\""
        );
        assert_eq!(a.number("tokens", 0u32).unwrap_err(), "--tokens: \"many\" is not a number");
        assert_eq!(a.finish().unwrap_err(), "unknown argument \"--typo\"");
    }
}
