//! Which versions of `llamabox:inference` this host links. Every change to `wit/` bumps
//! the package's version (wit/CHANGELOG.md) and keeps the released text under
//! `wit/released/VERSION/`. An addition (a function, a method, an interface) is a patch
//! release: plugins built against an earlier patch import `...@0.1.0`, and wasmtime's
//! linker satisfies that import with this host's `...@0.1.1` (semver-compatible names,
//! and the plugin's types are a subset of the host's). A change that is not an addition
//! (a record's fields, a variant's cases) is a minor release, and the previous minor
//! stays linked by bindings generated from its `wit/released/` text, whose host traits
//! convert its records to the current ones here, at the component boundary.

/// The version of `llamabox:inference` in `wit/`, the one plugins are built against.
pub const WIT_VERSION: &str = "0.1.1";

/// The oldest version whose plugins this host still links.
pub const OLDEST_WIT_VERSION: &str = "0.1.0";

/// The import names of llamabox's interfaces: `llamabox:inference/NAME@VERSION`.
pub(crate) const PACKAGE: &str = "llamabox:inference/";

/// The first of `imports` (a component's import names) that names a version of
/// `llamabox:inference` outside [`OLDEST_WIT_VERSION`, `WIT_VERSION`]: a plugin built
/// against a later host, or one too old to link.
pub(crate) fn first_unsupported<'a>(imports: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    imports.into_iter().find(|import| {
        let Some(rest) = import.strip_prefix(PACKAGE) else { return false };
        let version = rest.split_once('@').map(|(_, v)| v);
        !version
            .and_then(parse)
            .is_some_and(|v| parse(OLDEST_WIT_VERSION) <= Some(v) && Some(v) <= parse(WIT_VERSION))
    })
}

/// `MAJOR.MINOR.PATCH`, without pre-release or build (none are published).
fn parse(version: &str) -> Option<(u64, u64, u64)> {
    let mut parts = version.split('.').map(|p| p.parse().ok());
    let v = (parts.next()??, parts.next()??, parts.next()??);
    parts.next().is_none().then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wit_dir() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../wit")
    }

    /// The `.wit` files of `llamabox:inference` in `dir`, by name.
    fn package_files(dir: &std::path::Path) -> Vec<(String, String)> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "wit"))
            .map(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read_to_string(&p).unwrap())
            })
            .collect();
        files.sort();
        files
    }

    /// The digest of a folder's `llamabox:inference` text: SHA-256 over each `.wit`
    /// file's name and contents, in name order.
    fn digest(dir: &std::path::Path) -> String {
        use sha2::Digest;
        let mut hash = sha2::Sha256::new();
        for (name, text) in package_files(dir) {
            hash.update(format!("{name}\0{}\0", text.len()));
            hash.update(text);
        }
        hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The digest recorded for `version` in wit/released/SHA256.
    fn recorded(version: &str) -> Option<String> {
        let list = std::fs::read_to_string(wit_dir().join("released/SHA256")).unwrap();
        list.lines().find_map(|line| {
            let (v, digest) = line.split_once(' ')?;
            (v == version).then(|| digest.trim().to_string())
        })
    }

    /// The text of a released version never changes: wit/ is the text of WIT_VERSION
    /// as recorded, and each older version that still links keeps its text under
    /// wit/released/ (the plugins built against it are tested there).
    #[test]
    fn wit_changes_are_released_under_a_new_version() {
        let current = package_files(&wit_dir());
        let world = &current.iter().find(|(name, _)| name == "world.wit").unwrap().1;
        assert!(
            world.starts_with(&format!("package llamabox:inference@{WIT_VERSION};")),
            "wit/world.wit declares another version than WIT_VERSION {WIT_VERSION}"
        );
        let current_digest = digest(&wit_dir());
        assert_eq!(
            recorded(WIT_VERSION).as_deref(),
            Some(current_digest.as_str()),
            "wit/ is not the text released as {WIT_VERSION}: a change to the WIT is a new \
             version (bump it in wit/world.wit and WIT_VERSION, record `NEW {current_digest}` in \
             wit/released/SHA256, and say what changed in wit/CHANGELOG.md)"
        );
        let oldest = wit_dir().join("released").join(OLDEST_WIT_VERSION);
        assert!(oldest.join("world.wit").is_file(), "{} is missing", oldest.display());
        assert_eq!(recorded(OLDEST_WIT_VERSION), Some(digest(&oldest)), "{}", oldest.display());
    }

    #[test]
    fn versions_outside_the_linked_range_are_named() {
        let imports = |v: &str| {
            [
                "wasi:io/poll@0.2.12".to_string(),
                format!("llamabox:inference/types@{v}"),
                format!("llamabox:inference/llm@{v}"),
            ]
        };
        for linked in [OLDEST_WIT_VERSION, WIT_VERSION] {
            let names = imports(linked);
            assert_eq!(first_unsupported(names.iter().map(String::as_str)), None, "{linked}");
        }
        for unlinked in ["0.0.9", "0.1.99", "0.2.0", "1.0.0", "0.1", "x"] {
            let names = imports(unlinked);
            assert_eq!(
                first_unsupported(names.iter().map(String::as_str)),
                Some(names[1].as_str()),
                "{unlinked}"
            );
        }
        assert_eq!(first_unsupported(["llamabox:inference/llm"]), Some("llamabox:inference/llm"));
    }
}
