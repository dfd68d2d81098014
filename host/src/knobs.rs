//! One definition per knob: [`knob_group!`] turns a list of knobs (doc, type, default)
//! into the struct the code reads and the overrides that a flag or a TOML key sets, so
//! a knob's flag, file key, default and docs cannot drift apart. Used by the plugin
//! limits (`[limits.*]`) and by serve's `[requests]`.

/// The shown default of a knob: its literal when the expression would read badly.
macro_rules! shown {
    ($shown:literal; $default:expr) => {
        $shown
    };
    (; $default:expr) => {
        stringify!($default)
    };
}

/// The type a flag or key gives for a knob: the knob's own, or the one after `as`
/// (an `Option<u32>` knob whose unset default means "derived" is set by a plain `u32`).
macro_rules! given_ty {
    ($ty:ty) => {
        $ty
    };
    ($ty:ty, $given:ty) => {
        $given
    };
}

/// A given value into the knob's own type.
macro_rules! knob_value {
    ($value:expr, $ty:ty) => {
        $value.clone()
    };
    ($value:expr, $ty:ty, $given:ty) => {
        <$ty as From<$given>>::from($value.clone())
    };
}

/// One group of knobs, from one list: `doc, name: type [as given] = default [; "shown"]`.
/// Makes the group (every knob set, `Default` from the list) and its overrides (every
/// knob optional: a flag and a TOML key each, named as the knob, the doc its help).
///
/// `$key` names the group's table; `$heading` is the flags' help heading; `$where` says
/// where the overrides come from, for their doc (a literal, or `concat!` of literals).
macro_rules! knob_group {
    (
        $(#[doc = $group_doc:literal])*
        $group:ident, $overrides:ident, $key:literal, $heading:literal, $where:expr, {
            $(
                $(#[doc = $doc:literal])*
                $field:ident: $ty:ty $(as $given:ty)? = $default:expr $(; $shown:literal)?,
            )*
        }
    ) => {
        $(#[doc = $group_doc])*
        #[doc = ""]
        #[doc = concat!("`#[non_exhaustive]`: start from `", stringify!($group), "::default()`.")]
        #[derive(Clone, Debug, PartialEq)]
        #[non_exhaustive]
        pub struct $group {
            $(
                $(#[doc = $doc])*
                #[doc = concat!("Default: ", shown!($($shown)?; $default), ".")]
                pub $field: $ty,
            )*
        }

        impl Default for $group {
            fn default() -> Self {
                Self { $($field: $default,)* }
            }
        }

        #[doc = concat!("The knobs of [`", stringify!($group), "`] that differ from a base: ", $where, ".")]
        #[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
        #[cfg_attr(feature = "cli", derive(clap::Args))]
        #[cfg_attr(feature = "cli", command(next_help_heading = $heading))]
        #[serde(deny_unknown_fields)]
        #[non_exhaustive]
        pub struct $overrides {
            $(
                $(#[doc = $doc])*
                #[cfg_attr(feature = "cli", arg(
                    long,
                    value_name = "N",
                    help = concat!($($doc,)* " [default: ", shown!($($shown)?; $default), "]")
                        .trim_start(),
                ))]
                pub $field: Option<given_ty!($ty $(, $given)?)>,
            )*
        }

        #[allow(dead_code, reason = "not every group is read from a table of groups")]
        impl $overrides {
            /// Its table's name in serve.toml.
            pub(crate) const KEY: &str = $key;

            /// These knobs set on `group`.
            pub(crate) fn apply_to(&self, group: &mut $group) {
                $(if let Some(value) = &self.$field {
                    group.$field = knob_value!(value, $ty $(, $given)?);
                })*
            }

            /// The group these knobs make over its defaults.
            pub fn resolve(&self) -> $group {
                let mut group = $group::default();
                self.apply_to(&mut group);
                group
            }

            /// These knobs, and `under`'s where these leave one unset (flags over a
            /// file, a plugin's table over the server's).
            pub fn or(&self, under: &Self) -> Self {
                Self { $($field: self.$field.clone().or_else(|| under.$field.clone()),)* }
            }

            /// Reads `key`'s value from `map` if `key` is one of these knobs.
            pub(crate) fn read_knob<'de, A: serde::de::MapAccess<'de>>(
                &mut self,
                key: &str,
                map: &mut A,
            ) -> Result<bool, A::Error> {
                match key {
                    $(stringify!($field) => self.$field = Some(map.next_value()?),)*
                    _ => return Ok(false),
                }
                Ok(true)
            }
        }
    };
}
