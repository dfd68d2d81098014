//! Grammars for constrained sampling, matched by llguidance (an Earley parser built for
//! untrusted grammars in multi-tenant services) instead of llama.cpp's GBNF matcher.
//!
//! Why: llama.cpp's matcher keeps one stack per ambiguous parse and cannot be stopped
//! within a call. A 412-byte grammar (`r_i ::= r_{i+1} "x" | r_{i+1} "y"`, 16 deep)
//! took 14 s in one `llama_sampler_init_grammar`, and `x ::= "a" x "b" | "a" x "c" | ""`
//! doubles its stacks with every accepted token. llguidance bounds every step by
//! [`ParserLimits`] (lexer fuel and Earley items per token mask, lexer states, grammar
//! size), so no grammar within the caps can make one call run longer than a few tens
//! of milliseconds, and it also compiles JSON Schema.
//!
//! Plugins still write GBNF, llama.cpp's format. [`parse_gbnf`] reads it exactly as
//! llama.cpp's `llama_grammar_parser` does (same comments, line ends, escapes,
//! repetition rules and errors; a differential test below checks both on generated
//! grammars), measures it (nesting, repetitions) on what it parsed, and writes it as
//! llguidance's Lark-like syntax with every terminal one code point long, so
//! llguidance's lexer never has to choose between overlapping terminals and the
//! language is GBNF's, character for character.
//!
//! Differences from llama.cpp, all refusals or supersets: left-recursive grammars are
//! accepted (an Earley parser handles them; llama.cpp refuses them); negated tokens
//! (`!<x>`) and code points that are not Unicode scalar values (surrogates, above
//! U+10FFFF; they could never match decoded text) are refused with a reason.

use std::fmt::Write as _;
use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use super::{Error, Result, Token};

/// Caps on one grammar, checked on what was parsed before llguidance sees it.
#[derive(Clone, Copy, Debug)]
pub struct GrammarCaps {
    /// Longest grammar text in bytes.
    pub max_bytes: usize,
    /// Deepest nesting of `(` groups: each level is a recursion of the parser here and
    /// in llguidance's Lark reader, on the caller's stack.
    pub max_nesting: usize,
    /// Copies all `{m,n}` of a grammar may ask for together (the largest bound of each,
    /// multiplied through nested repetitions): llguidance expands a bounded repetition
    /// into that many symbols.
    pub max_repetitions: u64,
}

impl Default for GrammarCaps {
    fn default() -> Self {
        Self { max_bytes: 16 << 10, max_nesting: 64, max_repetitions: 4096 }
    }
}

/// llama.cpp's `MAX_REPETITION_THRESHOLD`: a larger minimum is an error, a larger
/// maximum means "no maximum" (as llama.cpp reads it).
const LLAMA_MAX_REPETITION: u64 = 2000;

/// llguidance's limits for one grammar. Its defaults are tuned for a server with
/// hundreds of MB per request; these keep one sampler to a few tens of MB and one
/// token's mask to a few tens of milliseconds on the slowest CPU the host targets.
fn parser_limits() -> ParserLimits {
    ParserLimits {
        // Earley items per token mask (~20k/ms): 2.5 ms.
        step_max_items: 50_000,
        // Lexer work per token mask (~14k/ms): 14 ms.
        step_lexer_fuel: 200_000,
        // Building the grammar's lexer (~50k/ms): 20 ms.
        initial_lexer_fuel: 1_000_000,
        // ~1-2 KB each: at most ~30 MB of lexer states per sampler (default 250k).
        max_lexer_states: 20_000,
        // Symbols in productions; GBNF text is capped at 16 KiB before this.
        max_grammar_size: 200_000,
        max_items_in_row: 2000,
        precompute_large_lexemes: true,
        // Errors name the grammar, never the tokens so far: messages go back to a guest.
        verbose_errors: false,
    }
}

// ---------------------------------------------------------------------------------
// GBNF, read as llama.cpp reads it
// ---------------------------------------------------------------------------------

/// One element of a sequence.
#[derive(Clone, Debug, PartialEq)]
enum Item {
    /// Code points, in order (may be empty: `""`).
    Literal(Vec<u32>),
    /// `[...]` or `[^...]`: inclusive code point ranges (a range may be empty, lo > hi).
    Class { negated: bool, ranges: Vec<(u32, u32)> },
    /// `.`: any one code point.
    Any,
    /// A reference to rule `symbol`.
    Rule(usize),
    /// `( alternates )`.
    Group(Vec<Vec<Item>>),
    /// `<[id]>` or `<text>` (one token of the vocabulary).
    Token(u32),
    /// `x*`, `x+`, `x?`, `x{m}`, `x{m,}`, `x{m,n}`; `max: None` = unbounded.
    Repeat { item: Box<Item>, min: u64, max: Option<u64> },
}

impl Item {
    /// Whether llama.cpp emits no element for it (so a repetition after it is an
    /// error there: "expecting preceding item").
    fn is_empty(&self) -> bool {
        match self {
            Item::Literal(chars) => chars.is_empty(),
            Item::Repeat { max: Some(0), .. } => true,
            _ => false,
        }
    }
}

/// A parsed GBNF grammar: rule names by symbol id, and each defined rule's alternates.
#[derive(Debug)]
struct Gbnf {
    names: Vec<String>,
    rules: Vec<Option<Vec<Vec<Item>>>>,
    root: usize,
    /// Deepest group nesting and the repetition copies asked for, as parsed.
    #[cfg(test)]
    nesting: usize,
    #[cfg(test)]
    repetitions: u64,
}

struct Parser<'a> {
    text: &'a str,
    src: &'a [u8],
    pos: usize,
    names: Vec<String>,
    rules: Vec<Option<Vec<Vec<Item>>>>,
    /// Resolves `<text>` tokens (None: no vocabulary, as llama.cpp without one).
    resolve: &'a dyn Fn(&str) -> Option<u32>,
    depth: usize,
    deepest: usize,
    max_nesting: usize,
}

/// The language a grammar was written in, which its errors name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GrammarSyntax {
    /// llama.cpp's GBNF (`sampler-params.grammar`).
    Gbnf,
    /// JSON Schema (`sampler-params.json-schema`).
    JsonSchema,
}

impl std::fmt::Display for GrammarSyntax {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Gbnf => "grammar",
            Self::JsonSchema => "json-schema",
        })
    }
}

/// A GBNF grammar's error.
fn err<T>(what: impl Into<String>) -> Result<T> {
    Err(Error::Grammar { syntax: GrammarSyntax::Gbnf, reason: what.into() })
}

fn is_word_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'-'
}

impl<'a> Parser<'a> {
    fn peek(&self) -> u8 {
        self.src.get(self.pos).copied().unwrap_or(0)
    }

    fn at(&self, offset: usize) -> u8 {
        self.src.get(self.pos + offset).copied().unwrap_or(0)
    }

    /// Up to 20 bytes of the text from here, for error messages (as llama.cpp's "at ...").
    fn here(&self) -> String {
        let rest = &self.src[self.pos.min(self.src.len())..];
        let end = rest.len().min(20);
        String::from_utf8_lossy(&rest[..end]).into_owned()
    }

    /// Spaces, tabs and `#` comments (ended by CR or LF), and CR / LF where newlines are
    /// allowed: llama.cpp's `parse_space`.
    fn space(&mut self, newline_ok: bool) {
        loop {
            match self.peek() {
                b' ' | b'\t' => self.pos += 1,
                b'\r' | b'\n' if newline_ok => self.pos += 1,
                b'#' => {
                    while !matches!(self.peek(), 0 | b'\r' | b'\n') {
                        self.pos += 1;
                    }
                }
                _ => return,
            }
        }
    }

    fn name(&mut self) -> Result<&'a str> {
        let start = self.pos;
        while is_word_char(self.peek()) {
            self.pos += 1;
        }
        if self.pos == start {
            return err(format!("expecting name at {}", self.here()));
        }
        // Word characters are ASCII.
        Ok(std::str::from_utf8(&self.src[start..self.pos]).unwrap_or_default())
    }

    fn int(&mut self) -> Result<u64> {
        let start = self.pos;
        while self.peek().is_ascii_digit() {
            self.pos += 1;
        }
        if self.pos == start {
            return err(format!("expecting integer at {}", self.here()));
        }
        // llama.cpp's std::stoull throws on overflow.
        std::str::from_utf8(&self.src[start..self.pos])
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or_else(|| err("repetition count out of range"), Ok)
    }

    fn symbol(&mut self, name: &str) -> usize {
        match self.names.iter().position(|n| n == name) {
            Some(id) => id,
            None => {
                self.names.push(name.to_owned());
                self.rules.push(None);
                self.names.len() - 1
            }
        }
    }

    fn hex(&mut self, size: usize) -> Result<u32> {
        let mut value: u32 = 0;
        for _ in 0..size {
            let digit = (self.peek() as char).to_digit(16);
            match digit {
                Some(d) => value = (value << 4) | d,
                None => return err(format!("expecting {size} hex chars at {}", self.here())),
            }
            self.pos += 1;
        }
        Ok(value)
    }

    /// One (possibly escaped) code point: llama.cpp's `parse_char`.
    fn char(&mut self) -> Result<u32> {
        match self.peek() {
            0 => err("unexpected end of input"),
            b'\\' => {
                let escape = self.at(1);
                self.pos += 2;
                match escape {
                    b'x' => self.hex(2),
                    b'u' => self.hex(4),
                    b'U' => self.hex(8),
                    b't' => Ok('\t' as u32),
                    b'r' => Ok('\r' as u32),
                    b'n' => Ok('\n' as u32),
                    b'\\' | b'"' | b'[' | b']' | b'-' => Ok(escape as u32),
                    _ => {
                        self.pos -= 2;
                        err(format!("unknown escape at {}", self.here()))
                    }
                }
            }
            _ => {
                // Every position the parser stops at is a character boundary (it steps
                // over ASCII bytes or whole characters).
                let Some(c) = self.text.get(self.pos..).and_then(|rest| rest.chars().next()) else {
                    return err("unexpected end of input");
                };
                self.pos += c.len_utf8();
                Ok(c as u32)
            }
        }
    }

    fn token(&mut self) -> Result<u32> {
        let start = self.pos;
        self.pos += 1; // '<'
        if self.peek() == b'[' {
            self.pos += 1;
            let id = self.int()?;
            let id = u32::try_from(id).map_or_else(
                |_| err(format!("parsed token id is too big at {}", self.here())),
                Ok,
            )?;
            for close in [b']', b'>'] {
                if self.peek() != close {
                    return err(format!("expecting '{}' at {}", close as char, self.here()));
                }
                self.pos += 1;
            }
            return Ok(id);
        }
        while !matches!(self.peek(), 0 | b'>') {
            self.pos += 1;
        }
        if self.peek() != b'>' {
            return err(format!("expecting '>' at {}", self.here()));
        }
        self.pos += 1;
        let text = String::from_utf8_lossy(&self.src[start..self.pos]).into_owned();
        (self.resolve)(&text).map_or_else(|| err(format!("invalid token '{text}'")), Ok)
    }

    fn alternates(&mut self, nested: bool) -> Result<Vec<Vec<Item>>> {
        let mut alternates = vec![self.sequence(nested)?];
        while self.peek() == b'|' {
            self.pos += 1;
            self.space(true);
            alternates.push(self.sequence(nested)?);
        }
        Ok(alternates)
    }

    fn sequence(&mut self, nested: bool) -> Result<Vec<Item>> {
        let mut items: Vec<Item> = Vec::new();
        loop {
            let c = self.peek();
            let item = match c {
                b'"' => {
                    self.pos += 1;
                    let mut chars = Vec::new();
                    while self.peek() != b'"' {
                        chars.push(self.char()?);
                    }
                    self.pos += 1;
                    Item::Literal(chars)
                }
                b'[' => {
                    self.pos += 1;
                    let negated = self.peek() == b'^';
                    if negated {
                        self.pos += 1;
                    }
                    let mut ranges = Vec::new();
                    while self.peek() != b']' {
                        let lo = self.char()?;
                        let mut hi = lo;
                        if self.peek() == b'-' && self.at(1) != b']' {
                            if self.at(1) == 0 {
                                return err("unexpected end of input");
                            }
                            self.pos += 1;
                            hi = self.char()?;
                        }
                        ranges.push((lo, hi));
                    }
                    self.pos += 1;
                    Item::Class { negated, ranges }
                }
                b'<' => Item::Token(self.token()?),
                b'!' => {
                    self.pos += 1;
                    if self.peek() != b'<' {
                        return err(format!("expecting '<' at {}", self.here()));
                    }
                    self.token()?;
                    return err("negated tokens (!<...>) are not supported");
                }
                c if is_word_char(c) => {
                    let name = self.name()?;
                    Item::Rule(self.symbol(name))
                }
                b'(' => {
                    self.pos += 1;
                    self.space(true);
                    self.depth += 1;
                    self.deepest = self.deepest.max(self.depth);
                    if self.depth > self.max_nesting {
                        return err(format!(
                            "nests groups deeper than the limit {}",
                            self.max_nesting
                        ));
                    }
                    let group = self.alternates(true)?;
                    self.depth -= 1;
                    if self.peek() != b')' {
                        return err(format!("expecting ')' at {}", self.here()));
                    }
                    self.pos += 1;
                    Item::Group(group)
                }
                b'.' => {
                    self.pos += 1;
                    Item::Any
                }
                b'*' | b'+' | b'?' | b'{' => {
                    self.pos += 1;
                    self.space(nested);
                    let (min, max) = match c {
                        b'*' => (0, None),
                        b'+' => (1, None),
                        b'?' => (0, Some(1)),
                        _ => self.braces(nested)?,
                    };
                    match items.pop() {
                        Some(last) if !last.is_empty() => {
                            items.push(Item::Repeat { item: Box::new(last), min, max });
                            continue;
                        }
                        _ => {
                            return err(format!(
                                "expecting preceding item to */+/?/{{ at {}",
                                self.here()
                            ))
                        }
                    }
                }
                _ => return Ok(items),
            };
            self.space(nested);
            items.push(item);
        }
    }

    /// `{m}`, `{m,}`, `{m,n}` after the `{` (and its spaces).
    fn braces(&mut self, nested: bool) -> Result<(u64, Option<u64>)> {
        if !self.peek().is_ascii_digit() {
            return err(format!("expecting an int at {}", self.here()));
        }
        let min = self.int()?;
        self.space(nested);
        let max = match self.peek() {
            b'}' => Some(min),
            b',' => {
                self.pos += 1;
                self.space(nested);
                let max = if self.peek().is_ascii_digit() {
                    let max = self.int()?;
                    self.space(nested);
                    Some(max)
                } else {
                    None
                };
                if self.peek() != b'}' {
                    return err(format!("expecting '}}' at {}", self.here()));
                }
                max
            }
            _ => return err(format!("expecting ',' at {}", self.here())),
        };
        self.pos += 1;
        self.space(nested);
        if min > LLAMA_MAX_REPETITION {
            return err("number of repetitions exceeds sane defaults, please reduce the number of repetitions");
        }
        let max = max.filter(|&m| m <= LLAMA_MAX_REPETITION);
        if let Some(max) = max {
            // llama.cpp computes max - min in unsigned 64 bits and would generate rules
            // until the host runs out of memory.
            if max < min {
                return err(format!("repetition {{{min},{max}}} has a maximum below its minimum"));
            }
        }
        Ok((min, max))
    }

    fn rule(&mut self) -> Result<()> {
        let name = self.name()?;
        self.space(false);
        if !self.src[self.pos.min(self.src.len())..].starts_with(b"::=") {
            return err(format!("expecting ::= at {}", self.here()));
        }
        let id = self.symbol(name);
        self.pos += 3;
        self.space(true);
        let alternates = self.alternates(false)?;
        // A redefinition replaces the earlier one, as in llama.cpp.
        self.rules[id] = Some(alternates);
        match self.peek() {
            b'\r' => self.pos += if self.at(1) == b'\n' { 2 } else { 1 },
            b'\n' => self.pos += 1,
            0 => {}
            _ => return err(format!("expecting newline or end at {}", self.here())),
        }
        self.space(true);
        Ok(())
    }
}

/// Parse GBNF as llama.cpp's parser does, and check it against `caps`. `resolve` maps a
/// `<text>` token to its id (llama.cpp tokenizes it with special tokens parsed).
fn parse_gbnf(
    text: &str,
    root: &str,
    caps: &GrammarCaps,
    resolve: &dyn Fn(&str) -> Option<u32>,
) -> Result<Gbnf> {
    if text.len() > caps.max_bytes {
        return Err(Error::limit("max-grammar-bytes", text.len(), caps.max_bytes));
    }
    if text.contains('\0') || root.contains('\0') {
        return err("contains a NUL byte");
    }
    if text.trim().is_empty() {
        return err("is empty");
    }
    if root.is_empty() {
        return err("root rule name is empty");
    }
    let mut p = Parser {
        text,
        src: text.as_bytes(),
        pos: 0,
        names: Vec::new(),
        rules: Vec::new(),
        resolve,
        depth: 0,
        deepest: 0,
        max_nesting: caps.max_nesting,
    };
    p.space(true);
    while p.pos < p.src.len() {
        p.rule()?;
    }
    if let Some(id) = p.rules.iter().position(Option::is_none) {
        return err(format!("undefined rule identifier '{}'", p.names[id]));
    }
    let Some(root) = p.names.iter().position(|n| n == root) else {
        return err(format!("grammar does not contain a root symbol '{root}'"));
    };
    let repetitions =
        p.rules.iter().flatten().flatten().flatten().map(copies).fold(0u64, u64::saturating_add);
    if repetitions > caps.max_repetitions {
        return err(format!(
            "repetitions {{m,n}} add up to {repetitions} copies, above the limit {}",
            caps.max_repetitions
        ));
    }
    Ok(Gbnf {
        names: p.names,
        rules: p.rules,
        root,
        #[cfg(test)]
        nesting: p.deepest,
        #[cfg(test)]
        repetitions,
    })
}

/// Copies of symbols that bounded repetitions in `item` expand to, nested ones
/// multiplied through (`("a"{100}){100}` is 10 000; `*`, `+` and `?` cost nothing).
fn copies(item: &Item) -> u64 {
    match item {
        Item::Repeat { item, min, max } => match max.unwrap_or(*min) {
            0 | 1 => copies(item),
            own => own.saturating_mul(copies(item).max(1)),
        },
        Item::Group(alternates) => {
            alternates.iter().flatten().map(copies).fold(0, u64::saturating_add)
        }
        _ => 0,
    }
}

impl Gbnf {
    #[cfg(test)]
    fn nesting(&self) -> usize {
        self.nesting
    }

    #[cfg(test)]
    fn repetitions(&self) -> u64 {
        self.repetitions
    }

    /// The grammar in llguidance's Lark syntax. Rule `x` becomes `g-x` (upper-case
    /// letters as `_` + lower case, which GBNF names cannot contain: no collisions), and
    /// every group a rule of its own, `g_N` (as llama.cpp's reader does too): the text
    /// nests at most one level, far below the limit of llguidance's reader (30 levels).
    ///
    /// llguidance compiles rules depth-first from `start`, one recursion per reference
    /// to a rule not yet compiled: a 16 KiB chain `r0 ::= r1`, `r1 ::= r2`, ... of 1200
    /// rules overflowed a 2 MiB stack. So `start` first lists every rule after the
    /// rules it refers to (a post-order, found here without recursion) in an
    /// alternative that matches nothing: each rule is compiled when what it refers to
    /// already is, one level deep.
    fn to_lark(&self) -> String {
        let mut lark = Lark { rules: Vec::new(), groups: Vec::new() };
        for (id, alternates) in self.rules.iter().enumerate() {
            if let Some(alternates) = alternates {
                self.write_rule(&mut lark, self.lark_name(id), alternates);
            }
        }
        // Groups found while writing add more groups of their own: a work list.
        let mut n = 0;
        while n < lark.groups.len() {
            let alternates = lark.groups[n];
            self.write_rule(&mut lark, format!("g_{n}"), alternates);
            n += 1;
        }
        let root = self.lark_name(self.root);
        let mut out = format!("start: {NOTHING}");
        for name in post_order(&lark.rules, &root) {
            out.push(' ');
            out.push_str(name);
        }
        let _ = writeln!(out, " | {root}");
        for rule in &lark.rules {
            let _ = writeln!(out, "{}: {}", rule.name, rule.body);
        }
        out
    }

    fn write_rule<'g>(&'g self, lark: &mut Lark<'g>, name: String, alternates: &'g [Vec<Item>]) {
        let mut body = String::new();
        let first_group = lark.groups.len();
        let mut refs = Vec::new();
        self.write_alternates(&mut body, &mut lark.groups, &mut refs, alternates);
        refs.extend((first_group..lark.groups.len()).map(|n| format!("g_{n}")));
        lark.rules.push(LarkRule { name, body, refs });
    }

    fn lark_name(&self, id: usize) -> String {
        let mut name = String::from("g-");
        for c in self.names[id].chars() {
            if c.is_ascii_uppercase() {
                name.push('_');
                name.push(c.to_ascii_lowercase());
            } else {
                name.push(c);
            }
        }
        name
    }

    fn write_alternates<'g>(
        &self,
        out: &mut String,
        groups: &mut Vec<&'g [Vec<Item>]>,
        refs: &mut Vec<String>,
        alternates: &'g [Vec<Item>],
    ) {
        for (i, sequence) in alternates.iter().enumerate() {
            if i > 0 {
                out.push_str(" | ");
            }
            let before = out.len();
            for item in sequence {
                self.write_item(out, groups, refs, item);
            }
            if out.len() == before {
                out.push_str("\"\"");
            }
        }
    }

    fn write_item<'g>(
        &self,
        out: &mut String,
        groups: &mut Vec<&'g [Vec<Item>]>,
        refs: &mut Vec<String>,
        item: &'g Item,
    ) {
        match item {
            Item::Literal(chars) => {
                for &c in chars {
                    match char::from_u32(c) {
                        Some(c) => write_string(out, c),
                        None => out.push_str(NOTHING),
                    }
                }
            }
            Item::Class { negated, ranges } => write_class(out, *negated, ranges),
            Item::Any => out.push_str(" /(?s:.)/ "),
            Item::Rule(id) => {
                let name = self.lark_name(*id);
                let _ = write!(out, " {name} ");
                refs.push(name);
            }
            Item::Group(alternates) => {
                let _ = write!(out, " g_{} ", groups.len());
                groups.push(alternates);
            }
            Item::Token(id) => {
                let _ = write!(out, " <[{id}]> ");
            }
            Item::Repeat { item, min, max } => {
                out.push_str(" (");
                self.write_item(out, groups, refs, item);
                out.push(')');
                let _ = match (min, max) {
                    (0, None) => write!(out, "* "),
                    (1, None) => write!(out, "+ "),
                    (0, Some(1)) => write!(out, "? "),
                    (min, None) => write!(out, "{{{min},}} "),
                    (min, Some(max)) => write!(out, "{{{min},{max}}} "),
                };
            }
        }
    }
}

/// Lark rules being written, and the groups still to write as rules of their own.
struct Lark<'g> {
    rules: Vec<LarkRule>,
    groups: Vec<&'g [Vec<Item>]>,
}

struct LarkRule {
    name: String,
    body: String,
    /// The rules its body refers to.
    refs: Vec<String>,
}

/// The rules reachable from `root`, each after every rule it refers to (except along
/// a cycle), by an explicit stack: grammars are guest input, recursion depth is not.
fn post_order<'a>(rules: &'a [LarkRule], root: &'a str) -> Vec<&'a str> {
    let index: std::collections::HashMap<&str, &LarkRule> =
        rules.iter().map(|r| (r.name.as_str(), r)).collect();
    let mut seen = std::collections::HashSet::new();
    let mut order = Vec::new();
    // (rule, how many of its references have been pushed)
    let mut stack: Vec<(&LarkRule, usize)> = Vec::new();
    if let Some(&r) = index.get(root) {
        seen.insert(root);
        stack.push((r, 0));
    }
    while let Some((rule, next)) = stack.last_mut() {
        match rule.refs.get(*next) {
            Some(name) => {
                *next += 1;
                if let Some(&r) = index.get(name.as_str()) {
                    if seen.insert(name.as_str()) {
                        stack.push((r, 0));
                    }
                }
            }
            None => {
                order.push(rule.name.as_str());
                stack.pop();
            }
        }
    }
    order
}

/// A terminal that matches nothing (a code point no text can contain).
const NOTHING: &str = " /[^\\x{0}-\\x{10FFFF}]/ ";

/// One code point as a JSON-syntax string terminal.
fn write_string(out: &mut String, c: char) {
    out.push_str(" \"");
    match c {
        '"' => out.push_str("\\\""),
        '\\' => out.push_str("\\\\"),
        c if (c as u32) < 0x20 || c as u32 == 0x7f => {
            let _ = write!(out, "\\u{:04x}", c as u32);
        }
        c => out.push(c),
    }
    out.push_str("\" ");
}

/// A character class as a one-code-point regex terminal. Empty ranges (lo > hi, which
/// llama.cpp keeps and never matches) are dropped; surrogates and values above
/// U+10FFFF, which no decoded text contains, are cut out of the ranges.
fn write_class(out: &mut String, negated: bool, ranges: &[(u32, u32)]) {
    let mut body = String::new();
    for &(lo, hi) in ranges {
        for (lo, hi) in [(lo, hi.min(0xD7FF)), (lo.max(0xE000), hi.min(0x10FFFF))] {
            if lo <= hi {
                let _ = write!(body, "\\x{{{lo:x}}}-\\x{{{hi:x}}}");
            }
        }
    }
    match (negated, body.is_empty()) {
        (false, true) => out.push_str(NOTHING),
        (true, true) => out.push_str(" /(?s:.)/ "),
        (false, false) => {
            let _ = write!(out, " /[{body}]/ ");
        }
        (true, false) => {
            let _ = write!(out, " /[^{body}]/ ");
        }
    }
}

// ---------------------------------------------------------------------------------
// Matching: one model's token environment, one matcher per sampler
// ---------------------------------------------------------------------------------

/// A model's vocabulary as llguidance sees it, built once per model on first use.
/// What the grammar engine needs of a model: its vocabulary, and the place where the
/// [`GrammarEnv`] built from it is kept (built once per model). The model implements it,
/// so that grammars never name the model's type.
pub(crate) trait Vocabulary {
    /// Vocabulary size: tokens are in [0, n_vocab).
    fn n_vocab(&self) -> u32;
    /// Whether `token` ends generation.
    fn is_eog(&self, token: Token) -> bool;
    /// One token's bytes (`special`: control tokens as their text).
    fn token_to_piece(&self, token: Token, special: bool) -> Result<Vec<u8>>;
    /// `text` as tokens, special-token text parsed: how GBNF's `<text>` is looked up.
    fn tokenize_special(&self, text: &str) -> Result<Vec<Token>>;
    /// This vocabulary's environment, built by the first grammar.
    fn grammar_env(&self) -> Result<&GrammarEnv>;
}

pub(crate) struct GrammarEnv {
    factory: ParserFactory,
    /// The model's end-of-generation tokens: allowed where the grammar may end.
    eog: Vec<u32>,
}

impl GrammarEnv {
    /// Every token's bytes (control tokens marked as special, so text grammars never
    /// match them), and every end-of-generation token as an end the grammar may allow.
    pub(crate) fn new(model: &dyn Vocabulary) -> Result<Self> {
        let n_vocab = model.n_vocab();
        let mut words = Vec::with_capacity(n_vocab as usize);
        let mut eog = Vec::new();
        for token in 0..n_vocab as Token {
            if model.is_eog(token) {
                eog.push(token as u32);
            }
            let piece = model.token_to_piece(token, false)?;
            words.push(if piece.is_empty() {
                let special = model.token_to_piece(token, true)?;
                if special.is_empty() {
                    Vec::new()
                } else {
                    [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &special].concat()
                }
            } else {
                piece
            });
        }
        // toktrie asserts on an empty list of ends (a panic, not an error).
        let Some(&first) = eog.first() else {
            return Err(Error::InvalidArgument(
                "this model has no end-of-generation token, which a grammar needs to end".into(),
            ));
        };
        let trie = TokTrie::from(&TokRxInfo::new(n_vocab, first), &words).with_eos_tokens(&eog);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::Backend(format!("grammar engine: {e}")))?;
        factory.quiet();
        *factory.limits_mut() = parser_limits();
        Ok(Self { factory, eog })
    }
}

/// Deepest nesting of objects and arrays in a JSON Schema: llguidance's schema compiler
/// recurses per level (serde_json's own parse limit is 128).
const MAX_SCHEMA_DEPTH: usize = 32;

/// How deep objects and arrays nest in `value`, counted without recursion.
fn json_depth(value: &serde_json::Value) -> usize {
    let mut stack = vec![(value, 1)];
    let mut deepest = 0;
    while let Some((v, depth)) = stack.pop() {
        deepest = deepest.max(depth);
        match v {
            serde_json::Value::Array(items) => stack.extend(items.iter().map(|i| (i, depth + 1))),
            serde_json::Value::Object(map) => stack.extend(map.values().map(|i| (i, depth + 1))),
            _ => {}
        }
    }
    deepest
}

/// The sampler that holds a constraint moves between threads (`unsafe impl Send for
/// Sampler` relies on this): checked here, by the compiler.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<Constraint>();
};

/// A grammar's state while a stream of tokens is sampled.
pub struct Constraint {
    matcher: Matcher,
    eog: Vec<u32>,
    /// What it was written in, for its errors.
    syntax: GrammarSyntax,
}

impl Constraint {
    /// `text` in GBNF from start rule `root`, read exactly as llama.cpp would read it
    /// and checked against `caps`; `<text>` tokens are looked up as llama.cpp does
    /// (tokenized with special tokens parsed, exactly one token).
    pub(crate) fn gbnf(
        model: &dyn Vocabulary,
        text: &str,
        root: &str,
        caps: &GrammarCaps,
    ) -> Result<Self> {
        let resolve = |piece: &str| match model.tokenize_special(piece).as_deref() {
            Ok([token]) => Some(*token as u32),
            _ => None,
        };
        let gbnf = parse_gbnf(text, root, caps, &resolve)?;
        Self::from_lark(model.grammar_env()?, gbnf.to_lark())
    }

    /// Compile `lark` (llguidance syntax) for the model whose environment this is.
    fn from_lark(env: &GrammarEnv, lark: String) -> Result<Self> {
        Self::compile(env, TopLevelGrammar::from_lark(lark), GrammarSyntax::Gbnf)
    }

    /// Output that is JSON valid against `schema` (JSON Schema text), compact: no
    /// whitespace outside strings, as OpenAI's structured output writes it. Capped like
    /// a grammar (`caps.max_bytes`) and [`MAX_SCHEMA_DEPTH`] levels deep.
    pub(crate) fn json_schema(
        model: &dyn Vocabulary,
        schema: &str,
        caps: &GrammarCaps,
    ) -> Result<Self> {
        if schema.len() > caps.max_bytes {
            return Err(Error::limit("max-grammar-bytes", schema.len(), caps.max_bytes));
        }
        let mut value: serde_json::Value = serde_json::from_str(schema)
            .map_err(|e| Error::InvalidArgument(format!("json-schema is not JSON: {e}")))?;
        let depth = json_depth(&value);
        if depth > MAX_SCHEMA_DEPTH {
            return Err(Error::InvalidArgument(format!(
                "json-schema nests {depth} levels deep, above the limit {MAX_SCHEMA_DEPTH}"
            )));
        }
        match &mut value {
            serde_json::Value::Object(map) if map.contains_key("x-guidance") => {
                return Err(Error::InvalidArgument(
                    "json-schema: x-guidance is set by the host".into(),
                ));
            }
            serde_json::Value::Object(map) => {
                map.insert(
                    "x-guidance".into(),
                    serde_json::json!({ "whitespace_flexible": false }),
                );
            }
            serde_json::Value::Bool(_) => {}
            _ => {
                return Err(Error::InvalidArgument(
                    "json-schema must be a JSON object or a boolean".into(),
                ))
            }
        }
        let grammar = TopLevelGrammar::from_json_schema(value);
        Self::compile(model.grammar_env()?, grammar, GrammarSyntax::JsonSchema)
    }

    fn compile(env: &GrammarEnv, grammar: TopLevelGrammar, syntax: GrammarSyntax) -> Result<Self> {
        let parser = env.factory.create_parser(grammar);
        let matcher = Matcher::new(parser);
        if let Some(reason) = matcher.get_error() {
            return Err(Error::Grammar { syntax, reason });
        }
        Ok(Self { matcher, eog: env.eog.clone(), syntax })
    }

    /// The matcher's error, as this grammar's.
    fn failed<T>(&self, reason: impl ToString) -> Result<T> {
        Err(Error::Grammar { syntax: self.syntax, reason: reason.to_string() })
    }

    /// Which tokens may come next (end-of-generation tokens once the grammar may end).
    /// A grammar that outgrows its per-token limits fails here, and for good.
    pub fn mask(&mut self) -> Result<SimpleVob> {
        // Once the grammar can only end, llguidance stops its parser: the ends remain.
        self.matcher.compute_mask_or_eos().or_else(|e| self.failed(e))
    }

    /// Whether `token` may come next (without computing the whole mask): an end of
    /// generation where the grammar may end, any other token where it continues it.
    pub fn allows(&mut self, token: Token) -> bool {
        if self.eog.contains(&(token as u32)) {
            return self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false);
        }
        self.matcher.validate_tokens(&[token as u32]).is_ok_and(|n| n == 1)
    }

    pub fn accept(&mut self, token: Token) -> Result<()> {
        if self.matcher.is_stopped() && self.eog.contains(&(token as u32)) {
            return Ok(()); // another end after the end
        }
        self.matcher.consume_token(token as u32).or_else(|e| self.failed(e))
    }

    /// Back to the start of the grammar.
    pub fn reset(&mut self) -> Result<()> {
        self.matcher.reset().or_else(|e| self.failed(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_tokens(_: &str) -> Option<u32> {
        None
    }

    fn parse(text: &str) -> Result<Gbnf> {
        parse_gbnf(text, "root", &GrammarCaps::default(), &no_tokens)
    }

    #[test]
    fn comments_end_at_cr_as_in_llama_cpp() {
        // The attack that crashed the host: a `#` comment ended by CR hid a second rule
        // from a scanner that ended comments at LF only. Here the second rule is seen,
        // and its nesting is measured and refused.
        let deep =
            format!("root ::= x # comment\rx ::= {}\"a\"{}", "(".repeat(8155), ")".repeat(8155));
        let e = parse(&deep).unwrap_err().to_string();
        assert!(e.contains("nests groups deeper than the limit 64"), "{e}");
        let hidden = format!("root ::= x # c\rx ::= {}", "\"a\"{0,2000} ".repeat(3));
        let e = parse(&hidden).unwrap_err().to_string();
        assert!(e.contains("add up to 6000"), "{e}");
        // CR, LF and CRLF end rules; a comment ends at either.
        let g = parse("root ::= a # one\r\na ::= \"x\" # two\rb ::= \"y\"\n").unwrap();
        assert_eq!(g.names, ["root", "a", "b"]);
    }

    #[test]
    fn repetitions_and_nesting_are_measured_on_what_was_parsed() {
        assert_eq!(parse("root ::= (\"a\"{10}){10}").unwrap().repetitions(), 100);
        let e = parse("root ::= (\"a\"{100}){100}").unwrap_err_or_default();
        assert!(e.contains("10000 copies"), "{e}");
        assert_eq!(parse("root ::= \"a\"* \"b\"+ \"c\"? [d]{3,} ").unwrap().repetitions(), 3);
        assert_eq!(parse("root ::= (((\"a\")))").unwrap().nesting(), 3);
        // Parentheses inside literals, classes and comments are not nesting.
        let g = parse(&format!("root ::= \"{}\" [(] # {}\n", "(".repeat(100), "(".repeat(100)))
            .unwrap();
        assert_eq!(g.nesting(), 0);
    }

    /// Test helper: the error text of a parse expected to fail, or "" if it parsed.
    trait ErrText {
        fn unwrap_err_or_default(self) -> String;
    }
    impl ErrText for Result<Gbnf> {
        fn unwrap_err_or_default(self) -> String {
            self.err().map(|e| e.to_string()).unwrap_or_default()
        }
    }

    /// The longest chain of rules the caps allow compiles on a thread with a small
    /// stack (llguidance compiles rules depth-first: this overflowed 2 MiB at 1200).
    #[test]
    fn a_chain_of_rules_as_long_as_the_caps_allow_compiles_on_a_small_stack() {
        let mut text = String::from("root::=r0\n");
        let mut n = 0;
        while text.len() < GrammarCaps::default().max_bytes - 32 {
            text += &format!("r{n}::=r{}\n", n + 1);
            n += 1;
        }
        text += &format!("r{n}::=[0-9]\n");
        let env = ApproximateTokEnv::single_byte_env();
        let lark = parse(&text).unwrap().to_lark();
        let compiled = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || {
                let factory = ParserFactory::new_simple(&env).unwrap();
                Matcher::new(factory.create_parser(TopLevelGrammar::from_lark(lark))).get_error()
            })
            .unwrap()
            .join()
            .expect("compiling a long chain must not overflow the stack");
        assert_eq!(compiled, None, "{n} rules");
        assert!(n > 1200, "{n} rules: longer than the chain that overflowed");
    }

    #[test]
    fn refusals_name_their_reason() {
        for (text, reason) in [
            ("root ::= \"a\"{ 5 , 2 }", "maximum below its minimum"),
            ("root ::= \"a\"{2001}", "exceeds sane defaults"),
            ("root ::= x", "undefined rule identifier 'x'"),
            ("a ::= \"x\"", "does not contain a root symbol"),
            ("root ::= \"\" *", "expecting preceding item"),
            ("root ::= \"a\"{0} +", "expecting preceding item"),
            ("root ::= \"a\"\n | \"b\"", "expecting name"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= \"\\x4\"", "expecting 2 hex chars"),
            ("root ::= \"a", "unexpected end of input"),
            ("root ::= [a-", "unexpected end of input"),
            ("root ::= (\"a\"", "expecting ')'"),
            ("root ::= \"a\" )", "expecting newline or end"),
            ("root = \"a\"", "expecting ::="),
            ("root ::= !<[5]>", "negated tokens"),
            ("root ::= <foo>", "invalid token '<foo>'"),
            ("   ", "is empty"),
            ("root ::= \"\0\"", "NUL"),
        ] {
            let e = parse(text).unwrap_err_or_default();
            assert!(e.contains(reason), "{text:?}: {e:?} should say {reason:?}");
        }
        let big = format!("root ::= \"{}\"", "a".repeat(16 << 10));
        assert!(matches!(
            parse(&big),
            Err(Error::LimitExceeded { limit: "max-grammar-bytes", requested, max: 16384 })
                if requested == big.len() as u64
        ));
        // What llama.cpp accepts: newlines inside groups and after `|`, a max above 2000
        // read as "no maximum", empty alternatives, redefinitions (the last one wins).
        let g =
            parse("root ::= (\"a\"\n | \"b\") |\n \"c\"{1,5000} | \"\"\nroot ::= \"z\"").unwrap();
        assert_eq!(g.rules[0].as_ref().map(Vec::len), Some(1));
        assert!(parse("root ::= (\"a\"\n\"b\")").is_ok());
        assert!(parse("root ::= \"a\" | ").is_ok());
    }

    #[test]
    fn lark_has_one_code_point_per_terminal() {
        let g =
            parse("root ::= \"a\\\"\\x7f\" [^a-c\\]] . Name*\nName ::= [\\u00e9-\\u00e8] | \"\"")
                .unwrap();
        let lark = g.to_lark();
        assert!(lark.starts_with(&format!("start: {NOTHING} g-_name g-root | g-root\n")), "{lark}");
        assert!(lark.contains(r#" "a"  "\""  "\u007f" "#), "{lark}");
        assert!(lark.contains(r"/[^\x{61}-\x{63}\x{5d}-\x{5d}]/"), "{lark}");
        assert!(lark.contains(" ( g-_name )* "), "{lark}");
        let nested = parse("root ::= ((\"a\" | (\"b\")) \"c\")+").unwrap().to_lark();
        let rules = "g-root:  ( g_0 )+ \ng_0:  g_1  \"c\" \ng_1:  \"a\"  |  g_2 \ng_2:  \"b\" \n";
        assert_eq!(nested, format!("start: {NOTHING} g_2 g_1 g_0 g-root | g-root\n{rules}"));
        // An empty range matches nothing, as in llama.cpp; an empty alternative is "".
        assert!(lark.contains(&format!("g-_name: {NOTHING} | \"\"")), "{lark}");
    }
}

/// Grammars matched by llama.cpp and by llguidance from our translation must accept
/// the same strings (and the same grammars), fed byte token by byte token.
#[cfg(all(test, feature = "synthetic"))]
mod differential {
    use super::*;
    use crate::synthetic::{SplitMix64, TextModelSpec};
    use crate::Model;
    use llama_cpp_sys_2 as sys;

    struct Rng(SplitMix64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0.next_u64() % n
        }
        fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
            items[self.below(items.len() as u64) as usize]
        }
    }

    /// Terminals over a small alphabet with the escapes, classes and line ends that
    /// parsers get wrong, or a reference to a later rule (`lo..rules`). References only
    /// go forward: llama.cpp's matcher misses left recursion through a nullable prefix
    /// (`root ::= r1 root?` with `r1 ::= .*`) and grows until the process runs out of
    /// memory, which is the grammar bomb this engine replaced, not a difference.
    fn atom(r: &mut Rng, lo: usize, rules: usize) -> String {
        match r.below(9) {
            0 | 1 => format!(
                "\"{}\"",
                (0..r.below(3))
                    .map(|_| r
                        .pick(&["a", "b", "\\n", "\\r", "\\x61", "\\u00e9", "é", "\\\"", "\\\\"]))
                    .collect::<String>()
            ),
            2 => format!(
                "[{}{}]",
                r.pick(&["", "^"]),
                (0..1 + r.below(2))
                    .map(|_| r.pick(&["a", "b-c", "\\n", "\\u00e0-\\u00ff", "\\]", "c-a", "\\-"]))
                    .collect::<String>()
            ),
            3 => ".".into(),
            4 | 5 if lo < rules => format!("r{}", lo as u64 + r.below((rules - lo) as u64)),
            4 | 5 => "tail".into(),
            _ => String::new(),
        }
    }

    /// Items and their separators; CR and LF end a rule at the top level, so they only
    /// separate items inside groups (where llama.cpp's reader allows newlines).
    fn sequence(r: &mut Rng, lo: usize, rules: usize, depth: u32) -> String {
        let mut s = String::new();
        for _ in 0..1 + r.below(3) {
            let mut item = if depth < 2 && r.below(4) == 0 {
                format!("({})", alternates(r, lo, rules, depth + 1, true))
            } else {
                atom(r, lo, rules)
            };
            if item.is_empty() {
                item = "\"a\"".into();
            }
            item.push_str(r.pick(&["", "", "", "*", "+", "?", "{2}", "{0,2}", "{1,}", " "]));
            s.push_str(&item);
            s.push_str(if depth > 0 {
                r.pick(&[" ", " # note\r", "\n", "\r\n\t", "\t"])
            } else {
                r.pick(&[" ", "  ", "\t", " ", " "])
            });
        }
        s
    }

    fn alternates(r: &mut Rng, lo: usize, rules: usize, depth: u32, nested: bool) -> String {
        let sep = if nested {
            r.pick(&[" | ", "\n| ", " |\n", " | # c\r\n"])
        } else {
            r.pick(&[" | ", " |\n ", " | # c\r"])
        };
        (0..1 + r.below(3)).map(|_| sequence(r, lo, rules, depth)).collect::<Vec<_>>().join(sep)
    }

    fn grammar(r: &mut Rng) -> String {
        let rules = 1 + r.below(3) as usize;
        let mut g = String::new();
        for i in 0..rules {
            let name = if i == 0 { "root".to_string() } else { format!("r{i}") };
            g.push_str(&format!(
                "{name} ::= {}{}",
                alternates(r, i + 1, rules, 0, false),
                r.pick(&["\n", "\r\n", "\r", "\n\n# x\n"])
            ));
        }
        // Recursion on the right, which both matchers take.
        g + "tail ::= \"b\" tail | \"c\"\n"
    }

    /// Each byte's token in the generated vocabulary (it has all 256 `<0xXX>` tokens).
    fn byte_tokens(model: &Model) -> Vec<Token> {
        let mut tokens = vec![-1; 256];
        for t in 0..model.n_vocab() as Token {
            if let Ok(piece) = model.token_to_piece(t, false) {
                if let [b] = piece[..] {
                    if tokens[b as usize] < 0 {
                        tokens[b as usize] = t;
                    }
                }
            }
        }
        assert!(tokens.iter().all(|&t| t >= 0), "the generated vocabulary has a token per byte");
        tokens
    }

    struct Llama(*mut sys::llama_sampler);
    impl Llama {
        /// One candidate through llama.cpp's grammar stage: is it allowed?
        fn allows(&self, token: Token) -> bool {
            let mut one = sys::llama_token_data { id: token, logit: 0.0, p: 0.0 };
            let mut array = sys::llama_token_data_array {
                data: &mut one,
                size: 1,
                selected: -1,
                sorted: false,
            };
            // SAFETY: a live grammar sampler (freed only in `Drop`) and an array of one
            // candidate, `one`, alive across the call; a token of the model's vocabulary.
            unsafe { sys::llama_sampler_apply(self.0, &mut array) };
            one.logit != f32::NEG_INFINITY
        }
        fn accept(&self, token: Token) {
            // SAFETY: a live grammar sampler; `allows` said yes, so llama.cpp's grammar does
            // not throw (an exception must not unwind into Rust).
            unsafe { sys::llama_sampler_accept(self.0, token) }
        }
    }
    impl Drop for Llama {
        fn drop(&mut self) {
            // SAFETY: made by llama_sampler_init_grammar, owned by this `Llama` alone, freed
            // once.
            unsafe { sys::llama_sampler_free(self.0) }
        }
    }

    #[test]
    fn llguidance_and_llama_cpp_accept_the_same_strings() {
        let dir = std::env::temp_dir().join(format!("llamabox-grammar-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tiny.gguf");
        TextModelSpec::tiny().write(&path).unwrap();
        let model = Model::load(&path).unwrap();
        let bytes = byte_tokens(&model);
        let eos = model.eos().expect("the generated model has an end of sequence");
        let seed =
            std::env::var("LLAMABOX_GRAMMAR_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(7);
        let grammars: u64 = std::env::var("LLAMABOX_GRAMMAR_CASES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(150);
        let mut r = Rng(SplitMix64(seed));
        let (mut compared, mut strings, mut refused_both) = (0, 0, 0);
        for case in 0..grammars {
            let mut text = grammar(&mut r);
            if r.below(5) == 0 {
                // A syntax error somewhere: drop one byte at a character boundary.
                let at = r.below(text.len() as u64) as usize;
                if text.is_char_boundary(at) && text.is_char_boundary(at + 1) {
                    text.remove(at);
                }
            }
            if std::env::var_os("LLAMABOX_GRAMMAR_TRACE").is_some() {
                eprintln!("case {case}: {text:?}");
            }
            let ours = parse_gbnf(&text, "root", &GrammarCaps::default(), &|_| None)
                .and_then(|g| Constraint::from_lark(model.grammar_env()?, g.to_lark()));
            let c_text = std::ffi::CString::new(text.clone()).unwrap();
            // SAFETY: NUL-terminated strings alive for the call (llama.cpp parses and does not
            // keep them) and the vocabulary of `model`, which outlives `theirs` (dropped
            // every case); null on a parse failure.
            let (theirs, reason) = super::super::backend::with_errors(|| unsafe {
                sys::llama_sampler_init_grammar(
                    model.vocab_ptr(),
                    c_text.as_ptr(),
                    c"root".as_ptr(),
                )
            });
            let theirs = (!theirs.is_null()).then(|| Llama(theirs));
            match (ours, theirs) {
                (Err(_), None) => refused_both += 1,
                // An Earley parser takes left recursion, which llama.cpp refuses.
                (Ok(_), None) if reason.contains("left recursion") => {}
                (Ok(_), None) => {
                    panic!("case {case}: llama.cpp refused ({reason}) what we accept:\n{text:?}")
                }
                (Err(e), Some(_)) => {
                    panic!("case {case}: we refused ({e}) what llama.cpp accepts:\n{text:?}")
                }
                (Ok(mut ours), Some(theirs)) => {
                    compared += 1;
                    for _ in 0..12 {
                        // A random walk: each step a byte both matchers must agree on.
                        ours.reset().unwrap();
                        // SAFETY: a live grammar sampler (`theirs` owns it); resets only its
                        // own state.
                        unsafe { sys::llama_sampler_reset(theirs.0) };
                        // ASCII only: fed a byte at a time, a split character is where the
                        // two differ by design. llama.cpp refuses a character's first byte
                        // in a negated class if any completion could be excluded (0xC3 in
                        // [^à-ÿ], though "Ã" is allowed); llguidance keeps it open.
                        let alphabet = ["a", "b", "c", "\n", "\r", "\"", "\\", "-", "]", "z", " "];
                        let mut walked = String::new();
                        for _ in 0..1 + r.below(8) {
                            let next = r.pick(&alphabet);
                            for &b in next.as_bytes() {
                                let t = bytes[b as usize];
                                let (a, b) = (ours.allows(t), theirs.allows(t));
                                assert_eq!(a, b, "case {case}: after {walked:?}, byte {t} allowed by llguidance {a}, llama.cpp {b}:\n{text:?}");
                                if !a {
                                    break;
                                }
                                ours.accept(t).unwrap();
                                theirs.accept(t);
                            }
                            walked.push_str(next);
                            let (a, b) = (ours.allows(eos), theirs.allows(eos));
                            assert_eq!(a, b, "case {case}: end after {walked:?}: llguidance {a}, llama.cpp {b}:\n{text:?}");
                            strings += 1;
                        }
                    }
                }
            }
        }
        eprintln!(
            "{compared} grammars compared on {strings} prefixes, {refused_both} refused by both"
        );
        assert!(
            compared > grammars / 3 && refused_both > 0,
            "the generator must exercise both paths"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
