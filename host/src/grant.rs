//! Grants: which llamabox interfaces a plugin may import. A plugin that imports one it
//! was not granted is refused when it is loaded, naming the import, never at its first
//! call: imports are fixed in the component, so the check is complete before it runs.

use std::fmt;
use std::str::FromStr;

use crate::component::PACKAGE;

/// One llamabox interface a plugin may be granted (`llamabox:inference/NAME`).
/// `types` holds only types and is never withheld.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Interface {
    /// Models, contexts, tokenizing and decoding.
    Llm,
    /// Host-side generation, samplers and chat templates.
    Generate,
    /// Embeddings of token sequences.
    Embeddings,
    /// Images and audio through a projector.
    Media,
    /// Cancel tokens, and sharing them with other instances of the plugin's group.
    Cancel,
    /// The async (WASI 0.3) forms of the long calls.
    AsyncCalls,
}

impl Interface {
    /// Every interface, in the order `Grant`'s `Display` lists them.
    pub const ALL: [Interface; 6] = [
        Interface::Llm,
        Interface::Generate,
        Interface::Embeddings,
        Interface::Media,
        Interface::Cancel,
        Interface::AsyncCalls,
    ];

    /// The interface's WIT name.
    pub fn name(self) -> &'static str {
        match self {
            Interface::Llm => "llm",
            Interface::Generate => "generate",
            Interface::Embeddings => "embeddings",
            Interface::Media => "media",
            Interface::Cancel => "cancel",
            Interface::AsyncCalls => "async-calls",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

impl fmt::Display for Interface {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Interface {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Interface::ALL.into_iter().find(|i| i.name() == s).ok_or_else(|| {
            let names: Vec<_> = Interface::ALL.iter().map(|i| i.name()).collect();
            format!("{s:?} is no llamabox interface (one of: {})", names.join(", "))
        })
    }
}

/// The llamabox interfaces a plugin may import. Everything else a plugin may do is
/// granted elsewhere: its models, environment and limits in its config, no network
/// ever.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Grant(u8);

impl Grant {
    /// Every interface: the grant of a plugin given by a local path, as before grants.
    pub fn all() -> Self {
        Self::of(Interface::ALL)
    }

    /// No interface: the default for a plugin pulled from a registry.
    pub fn none() -> Self {
        Self(0)
    }

    /// Exactly these interfaces.
    pub fn of(interfaces: impl IntoIterator<Item = Interface>) -> Self {
        Self(interfaces.into_iter().fold(0, |bits, i| bits | i.bit()))
    }

    /// Whether a plugin with this grant may import `interface`.
    pub fn allows(self, interface: Interface) -> bool {
        self.0 & interface.bit() != 0
    }

    /// The first of `imports` (a component's import names) that is a llamabox interface
    /// this grant withholds, with the interface's name (`None` if it is no interface of
    /// this host at all: the link check then names it).
    pub fn first_withheld<'a>(
        self,
        imports: impl IntoIterator<Item = &'a str>,
    ) -> Option<(&'a str, Option<Interface>)> {
        imports.into_iter().find_map(|import| {
            let rest = import.strip_prefix(PACKAGE)?;
            let name = rest.split('@').next().unwrap_or(rest);
            if name == "types" {
                return None;
            }
            match name.parse::<Interface>() {
                Ok(interface) if self.allows(interface) => None,
                Ok(interface) => Some((import, Some(interface))),
                Err(_) => Some((import, None)),
            }
        })
    }
}

impl fmt::Display for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<_> =
            Interface::ALL.iter().filter(|i| self.allows(**i)).map(|i| i.name()).collect();
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join(","))
        }
    }
}

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Grant({self})")
    }
}

impl FromStr for Grant {
    type Err = String;

    /// `llm,generate`, `all` or `none`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "all" => Ok(Grant::all()),
            "none" | "" => Ok(Grant::none()),
            list => list
                .split(',')
                .map(|n| n.trim().parse())
                .collect::<Result<Vec<_>, _>>()
                .map(Grant::of),
        }
    }
}

/// In a config file: a list of interface names, or `"all"` or `"none"`.
impl<'de> serde::Deserialize<'de> for Grant {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Written {
            List(Vec<Interface>),
            Word(String),
        }
        match Written::deserialize(deserializer)? {
            Written::List(list) => Ok(Grant::of(list)),
            Written::Word(word) => word.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_withholds_what_it_does_not_name_and_never_types() {
        let grant: Grant = "llm, generate".parse().unwrap();
        let imports = [
            "wasi:cli/environment@0.2.12",
            "llamabox:inference/types@0.1.0",
            "llamabox:inference/llm@0.1.0",
            "llamabox:inference/generate@0.1.0",
            "llamabox:inference/media@0.1.0",
        ];
        assert_eq!(
            grant.first_withheld(imports),
            Some(("llamabox:inference/media@0.1.0", Some(Interface::Media)))
        );
        assert_eq!(Grant::all().first_withheld(imports), None);
        assert_eq!(
            Grant::none().first_withheld(imports).map(|(i, _)| i),
            Some("llamabox:inference/llm@0.1.0")
        );
        assert_eq!(
            Grant::all().first_withheld(["llamabox:inference/secrets@9.0.0"]),
            Some(("llamabox:inference/secrets@9.0.0", None))
        );
    }

    #[test]
    fn grants_parse_and_print_by_interface_name() {
        assert_eq!("all".parse::<Grant>().unwrap(), Grant::all());
        assert_eq!("none".parse::<Grant>().unwrap(), Grant::none());
        assert_eq!(
            Grant::of([Interface::AsyncCalls, Interface::Llm]).to_string(),
            "llm,async-calls"
        );
        assert_eq!(Grant::none().to_string(), "none");
        let e = "llm,network".parse::<Grant>().unwrap_err();
        assert!(e.contains("\"network\" is no llamabox interface"), "{e}");
    }
}
