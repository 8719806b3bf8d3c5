//! Every key [`Settings`](super::Settings) accepts, read from the settings structs
//! themselves: a deserializer that, instead of reading values, walks the structs
//! serde derived and notes each field's path (`smtp.chunking`). A map's entries (the
//! lanes, the throttles) appear once, under a placeholder (`topology.lanes.<name>.weight`,
//! `throttle.<type>.limit`).
//!
//! Only tests use it: the README's reference of every key is checked against it.

use std::cell::RefCell;
use std::fmt;

use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

/// Every key, in the order the structs declare them.
pub(crate) fn keys() -> Vec<String> {
    let found = RefCell::new(Vec::new());
    super::Settings::deserialize(Probe {
        path: String::new(),
        found: &found,
    })
    .expect("the probe walks every settings struct");
    found.into_inner()
}

/// The placeholder a map's key is shown as.
fn placeholder(path: &str) -> &'static str {
    match path {
        "throttle" => "<type>",
        _ => "<name>",
    }
}

#[derive(Debug)]
struct ProbeError(String);

impl fmt::Display for ProbeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::error::Error for ProbeError {}

impl de::Error for ProbeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self(msg.to_string())
    }
}

/// The deserializer at one path: a struct is walked field by field, a map through one
/// placeholder entry; anything else is a key, answered with a value every field of
/// its kind accepts (`1`, `"1s"`, none, an empty list, the first variant).
struct Probe<'a> {
    path: String,
    found: &'a RefCell<Vec<String>>,
}

impl<'a> Probe<'a> {
    fn leaf(&self) {
        self.found.borrow_mut().push(self.path.clone());
    }

    fn at(&self, name: &str) -> Probe<'a> {
        Probe {
            path: if self.path.is_empty() {
                name.to_string()
            } else {
                format!("{}.{name}", self.path)
            },
            found: self.found,
        }
    }
}

macro_rules! leaf {
    ($($method:ident => |$v:ident| $body:expr;)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, $v: V) -> Result<V::Value, ProbeError> {
                self.leaf();
                $body
            }
        )*
    };
}

impl<'de> de::Deserializer<'de> for Probe<'_> {
    type Error = ProbeError;

    leaf! {
        deserialize_any => |v| v.visit_str("1s");
        deserialize_bool => |v| v.visit_bool(false);
        deserialize_i8 => |v| v.visit_u64(1);
        deserialize_i16 => |v| v.visit_u64(1);
        deserialize_i32 => |v| v.visit_u64(1);
        deserialize_i64 => |v| v.visit_u64(1);
        deserialize_u8 => |v| v.visit_u64(1);
        deserialize_u16 => |v| v.visit_u64(1);
        deserialize_u32 => |v| v.visit_u64(1);
        deserialize_u64 => |v| v.visit_u64(1);
        deserialize_f32 => |v| v.visit_f64(0.5);
        deserialize_f64 => |v| v.visit_f64(0.5);
        deserialize_char => |v| v.visit_char('x');
        deserialize_str => |v| v.visit_str("1s");
        deserialize_string => |v| v.visit_str("1s");
        deserialize_bytes => |v| v.visit_bytes(b"1s");
        deserialize_byte_buf => |v| v.visit_bytes(b"1s");
        deserialize_option => |v| v.visit_none();
        deserialize_unit => |v| v.visit_unit();
        deserialize_seq => |v| v.visit_seq(Empty);
        deserialize_identifier => |v| v.visit_str("1s");
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        v: V,
    ) -> Result<V::Value, ProbeError> {
        self.deserialize_unit(v)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        v: V,
    ) -> Result<V::Value, ProbeError> {
        v.visit_newtype_struct(self)
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, v: V) -> Result<V::Value, ProbeError> {
        self.deserialize_seq(v)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: usize,
        v: V,
    ) -> Result<V::Value, ProbeError> {
        self.deserialize_seq(v)
    }

    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, ProbeError> {
        let name = placeholder(&self.path);
        v.visit_map(Fields {
            names: vec![name],
            probe: self,
        })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, ProbeError> {
        v.visit_map(Fields {
            names: fields.to_vec(),
            probe: self,
        })
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, ProbeError> {
        self.leaf();
        v.visit_enum(variants[0].into_deserializer())
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, ProbeError> {
        v.visit_unit()
    }
}

/// A struct's fields (or a map's one placeholder entry), each probed at its path.
struct Fields<'a> {
    names: Vec<&'static str>,
    probe: Probe<'a>,
}

impl<'de> MapAccess<'de> for Fields<'_> {
    type Error = ProbeError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, ProbeError> {
        match self.names.first() {
            Some(name) => seed.deserialize((*name).into_deserializer()).map(Some),
            None => Ok(None),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, ProbeError> {
        let name = self.names.remove(0);
        seed.deserialize(self.probe.at(name))
    }
}

/// An empty list.
struct Empty;

impl<'de> SeqAccess<'de> for Empty {
    type Error = ProbeError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        _: T,
    ) -> Result<Option<T::Value>, ProbeError> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    fn readme() -> String {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
        std::fs::read_to_string(path).expect("README.md")
    }

    /// The keys of the table under README's `heading`, to the next heading: the first
    /// cell of each row, where `` `a.b.c` / `.d` `` names `a.b.c` and `a.b.d`.
    fn table_keys(readme: &str, heading: &str) -> Vec<String> {
        let start = readme
            .find(&format!("\n{heading}\n"))
            .unwrap_or_else(|| panic!("README has no {heading:?}"));
        let section = &readme[start + heading.len() + 2..];
        let section = &section[..section.find("\n#").unwrap_or(section.len())];
        let mut keys = Vec::new();
        for row in section.lines().filter(|l| l.starts_with("| `")) {
            let cell = row[1..].split(" | ").next().unwrap();
            let names: Vec<&str> = cell.split('`').skip(1).step_by(2).collect();
            let first = names[0];
            let stem = &first[..first.rfind('.').expect("a key has a section")];
            keys.push(first.to_string());
            for more in &names[1..] {
                let suffix = more.strip_prefix('.').unwrap_or_else(|| {
                    panic!("{more:?} in {cell:?}: a further key in a row is `.name`")
                });
                keys.push(format!("{stem}.{suffix}"));
            }
        }
        keys
    }

    #[test]
    fn the_readme_reference_lists_exactly_the_keys_the_settings_accept() {
        let readme = readme();
        let listed = table_keys(&readme, "### Every key");
        let accepted = super::keys();
        let mut seen = BTreeSet::new();
        let twice: Vec<&String> = listed.iter().filter(|k| !seen.insert(*k)).collect();
        assert!(twice.is_empty(), "listed twice in README: {twice:?}");
        let listed: BTreeSet<&String> = listed.iter().collect();
        let accepted: BTreeSet<&String> = accepted.iter().collect();
        let missing: Vec<_> = accepted.difference(&listed).collect();
        let unknown: Vec<_> = listed.difference(&accepted).collect();
        assert!(
            missing.is_empty() && unknown.is_empty(),
            "README's \"Every key\" table is not the settings: missing {missing:?}, \
             not a key {unknown:?}"
        );
    }

    #[test]
    fn the_keys_a_deployment_sets_are_keys_and_few() {
        let readme = readme();
        let needed = table_keys(&readme, "### The keys a deployment sets");
        let accepted = super::keys();
        for key in &needed {
            assert!(accepted.contains(key), "{key} is not a key");
        }
        assert!((8..=12).contains(&needed.len()), "about ten: {needed:?}");
        let fixed = accepted.iter().filter(|k| !k.contains('<')).count();
        println!(
            "{} keys ({fixed} fixed, the rest per lane and per throttle); a deployment \
             reads {}",
            accepted.len(),
            needed.len()
        );
    }

    #[test]
    fn the_probe_finds_nested_sections_and_map_entries() {
        let keys = super::keys();
        for key in [
            "amqp.url",
            "feedback.sns.topic_arns",
            "transport.timeout",
            "smtp.chunking",
            "topology.lanes.<name>.weight",
            "throttle.<type>.policy",
        ] {
            assert!(keys.iter().any(|k| k == key), "{key}: {keys:?}");
        }
        assert!(!keys.iter().any(|k| k == "smtp.timeout"), "moved");
    }
}
