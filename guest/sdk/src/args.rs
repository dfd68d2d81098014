//! The plugin's command line (what follows `--` on `llamabox run`): `--name value` flags
//! and `--name` switches, read by name with defaults, and any flag nobody read refused,
//! so a misspelt flag fails the run instead of being ignored.

use std::collections::BTreeMap;
use std::str::FromStr;

/// Flags not yet read, by name (without the `--`); a repeated flag keeps its last value.
pub struct Args {
    flags: BTreeMap<String, Option<String>>,
}

impl Args {
    /// The process's arguments after argv[0]. `switches` are the flags that take no value.
    pub fn from_env(switches: &[&str]) -> Result<Args, String> {
        Args::parse(std::env::args().skip(1), switches)
    }

    pub fn parse(args: impl IntoIterator<Item = String>, switches: &[&str]) -> Result<Args, String> {
        let mut flags = BTreeMap::new();
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            let name = arg.strip_prefix("--").filter(|n| !n.is_empty()).ok_or(format!("unexpected argument {arg:?}"))?;
            let value = if switches.contains(&name) { None } else { Some(args.next().ok_or(format!("{arg} needs a value"))?) };
            flags.insert(name.to_string(), value);
        }
        Ok(Args { flags })
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

    /// Refuses every flag that was not read.
    pub fn finish(self) -> Result<(), String> {
        match self.flags.keys().next() {
            Some(name) => Err(format!("unknown argument \"--{name}\"")),
            None => Ok(()),
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
        let mut a = args(&["--model", "m", "--spin", "--tokens", "12", "--tokens", "13"]).unwrap();
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
        assert_eq!(args(&["model"]).err().unwrap(), "unexpected argument \"model\"");
        assert_eq!(args(&["--"]).err().unwrap(), "unexpected argument \"--\"");
        let mut a = args(&["--tokens", "many", "--typo", "1", "--mode", "fast"]).unwrap();
        assert_eq!(a.either("mode", "blocking", "pending").unwrap_err(), "--mode: expected blocking|pending, got \"fast\"");
        assert_eq!(a.number("tokens", 0u32).unwrap_err(), "--tokens: \"many\" is not a number");
        assert_eq!(a.finish().unwrap_err(), "unknown argument \"--typo\"");
    }
}
