//! Build-time renderer of Ferry's templated SQL.
//!
//! Each crate that owns tables keeps its SQL in one directory, one file per
//! table, as `-- name: <query>` sections. A section is written once for both
//! engines; the mechanical differences are template tokens:
//!
//! | token | PostgreSQL | SQLite |
//! |---|---|---|
//! | `{now $N}` | `COALESCE($N::bigint, (extract(epoch FROM now()) * 1000)::bigint)` | `COALESCE($N, CAST(unixepoch('subsec') * 1000 AS INTEGER))` |
//! | `{least}` / `{greatest}` | `LEAST` / `GREATEST` | `MIN` / `MAX` (scalar) |
//! | `{pg:TEXT}` | `TEXT` (a cast, a row lock) | nothing |
//! | `{sqlite:TEXT}` | nothing | `TEXT` (what PostgreSQL writes another way beside a `{pg:…}`) |
//! | `{ids $N}` | `= ANY($N::bigint[])` | `IN (SELECT value FROM json_each($N))` |
//!
//! The clock parameter `$N` is the injected clock: `NULL` means the
//! database's own clock (invariant: one clock per statement).
//!
//! A query that really differs has two override sections,
//! `-- name: q [postgres]` and `-- name: q [sqlite]`, and one that exists only
//! on PostgreSQL is `-- name: q [postgres only]`. Anything else is a build
//! error: a section with only one engine's override, an unknown token, a
//! duplicate name.
//!
//! A block of SQL that several queries share is written once as a fragment,
//! `-- name: f [fragment]`, and included with `{use f $A $B …}`: the
//! fragment's own parameters `$1`, `$2`, … become the including query's
//! `$A`, `$B`, … (so each query keeps its own numbering); the fragment's
//! header comment stays in the file. Fragments may use
//! fragments and template tokens; they are not queries themselves. A
//! fragment nobody uses, an unknown fragment or a parameter the `use` does
//! not pass is a build error. A crate may also borrow another directory's
//! fragments ([`generate_sharing`]): the library's SQL that every reader of
//! one table must share (the outbox's pending rows read through the
//! delivered-ranges ledger) is written once.
//!
//! [`generate`] writes `$OUT_DIR/queries.rs`: a `Queries` struct with one
//! `&'static str` field per query, the static `QUERIES` (a `PerEngine`
//! pair), and, when there are any, `PostgresOnly`/`POSTGRES_ONLY` for the
//! PostgreSQL-only ones. A
//! query the code names but the SQL lacks is therefore a compile error.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// One engine's rendering target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// PostgreSQL.
    Postgres,
    /// SQLite.
    Sqlite,
}

/// Which engines a section is written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    Shared,
    Only(Engine),
    PostgresOnly,
    Fragment,
}

/// A parsed `-- name:` section.
#[derive(Debug, Clone)]
struct Section {
    name: String,
    scope: Scope,
    body: String,
    file: String,
}

/// Renders the template `sql` for `engine`, or says which token is wrong.
pub fn render(sql: &str, engine: Engine) -> Result<String, String> {
    let mut out = String::with_capacity(sql.len() + 64);
    let mut rest = sql;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let close = after.find('}').ok_or_else(|| {
            format!(
                "unclosed template token near {:?}",
                &rest[open..rest.len().min(open + 40)]
            )
        })?;
        let token = &after[..close];
        out.push_str(&expand(token, engine)?);
        rest = &after[close + 1..];
    }
    if rest.contains('}') {
        return Err("a '}' without its '{'".into());
    }
    out.push_str(rest);
    Ok(out)
}

fn param(arg: &str, token: &str) -> Result<String, String> {
    let arg = arg.trim();
    let ok = arg.len() > 1 && arg.starts_with('$') && arg[1..].bytes().all(|b| b.is_ascii_digit());
    if ok {
        Ok(arg.to_string())
    } else {
        Err(format!("{{{token}}} takes one parameter like $3"))
    }
}

fn expand(token: &str, engine: Engine) -> Result<String, String> {
    let pg = engine == Engine::Postgres;
    if let Some(text) = token.strip_prefix("pg:") {
        return Ok(if pg { text.to_string() } else { String::new() });
    }
    if let Some(text) = token.strip_prefix("sqlite:") {
        return Ok(if pg { String::new() } else { text.to_string() });
    }
    let (head, arg) = token.split_once(' ').unwrap_or((token, ""));
    Ok(match head {
        "now" => {
            let p = param(arg, token)?;
            if pg {
                format!("COALESCE({p}::bigint, (extract(epoch FROM now()) * 1000)::bigint)")
            } else {
                format!("COALESCE({p}, CAST(unixepoch('subsec') * 1000 AS INTEGER))")
            }
        }
        "ids" => {
            let p = param(arg, token)?;
            if pg {
                format!("= ANY({p}::bigint[])")
            } else {
                format!("IN (SELECT value FROM json_each({p}))")
            }
        }
        "least" if arg.is_empty() => (if pg { "LEAST" } else { "MIN" }).to_string(),
        "greatest" if arg.is_empty() => (if pg { "GREATEST" } else { "MAX" }).to_string(),
        _ => return Err(format!("unknown template token {{{token}}}")),
    })
}

/// Replaces `$1`, `$2`, … in a fragment's text by `args` (one pass, so a
/// replacement is never replaced again).
fn remap(text: &str, args: &[&str], name: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'$' {
            let digits = bytes[i + 1..].iter().take_while(|b| b.is_ascii_digit()).count();
            if digits > 0 {
                let n: usize = text[i + 1..i + 1 + digits]
                    .parse()
                    .map_err(|_| "bad parameter".to_string())?;
                let arg = n.checked_sub(1).and_then(|k| args.get(k)).ok_or_else(|| {
                    format!(
                        "fragment {name} uses ${n} but the {{use}} passes {} parameter(s)",
                        args.len()
                    )
                })?;
                out.push_str(arg);
                i += 1 + digits;
                continue;
            }
        }
        let ch = text[i..].chars().next().expect("in bounds");
        out.push(ch);
        i += ch.len_utf8();
    }
    Ok(out)
}

/// Expands every `{use name $A …}` in `body` with the fragment's text, its
/// parameters renumbered, until none is left (a fragment may use another;
/// a cycle is caught by the expansion budget). Records the names used.
fn include(body: &str, fragments: &BTreeMap<String, String>, used: &mut Vec<String>) -> Result<String, String> {
    let mut text = body.to_string();
    for _ in 0..256 {
        let Some(start) = text.find("{use ") else {
            return Ok(text);
        };
        let end = start + text[start..].find('}').ok_or("unclosed {use …}")?;
        let mut words = text[start + 5..end].split_whitespace();
        let name = words.next().ok_or("{use} needs a fragment name")?.to_string();
        let args: Vec<&str> = words.collect();
        if let Some(bad) = args.iter().find(|a| param(a, "use").is_err()) {
            return Err(format!("{{use {name}}} takes parameters like $3, not {bad}"));
        }
        let frag = fragments.get(&name).ok_or_else(|| format!("unknown fragment {name}"))?;
        let expanded = remap(frag, &args, &name)?;
        text = format!("{}{}{}", &text[..start], expanded, &text[end + 1..]);
        used.push(name);
    }
    Err("fragments use each other in a cycle (or more than 256 times)".into())
}

fn parse(file: &str, text: &str) -> Result<Vec<Section>, String> {
    let mut sections: Vec<Section> = Vec::new();
    for line in text.lines() {
        if let Some(decl) = line.strip_prefix("-- name: ") {
            let decl = decl.trim();
            let (name, scope) = match decl.split_once(' ') {
                None => (decl, Scope::Shared),
                Some((name, "[postgres]")) => (name, Scope::Only(Engine::Postgres)),
                Some((name, "[sqlite]")) => (name, Scope::Only(Engine::Sqlite)),
                Some((name, "[postgres only]")) => (name, Scope::PostgresOnly),
                Some((name, "[fragment]")) => (name, Scope::Fragment),
                Some((_, other)) => return Err(format!("{file}: unknown section tag {other}")),
            };
            let valid = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !valid {
                return Err(format!("{file}: query name {name:?} is not a snake_case identifier"));
            }
            sections.push(Section {
                name: name.to_string(),
                scope,
                body: String::new(),
                file: file.to_string(),
            });
        } else if let Some(s) = sections.last_mut() {
            s.body.push_str(line);
            s.body.push('\n');
        }
    }
    for s in &mut sections {
        s.body = s.body.trim().to_string();
        if s.body.is_empty() {
            return Err(format!("{file}: query {} has no SQL", s.name));
        }
    }
    Ok(sections)
}

/// The rendered queries of one directory: name → (PostgreSQL, SQLite), and
/// the PostgreSQL-only ones.
#[derive(Debug, Default)]
pub struct Rendered {
    /// Queries both engines have, by name.
    pub shared: BTreeMap<String, (String, String)>,
    /// Queries only PostgreSQL has, by name.
    pub postgres_only: BTreeMap<String, String>,
}

/// Parses and renders `(file name, text)` pairs; every error names its file and query.
pub fn render_files(files: &[(String, String)]) -> Result<Rendered, String> {
    render_files_sharing(files, &[])
}

/// [`render_files`] with the fragments of `borrowed` (other directories'
/// files: only their `[fragment]` sections are read) usable by `{use}` as
/// well; a borrowed fragment need not be used here.
pub fn render_files_sharing(files: &[(String, String)], borrowed: &[(String, String)]) -> Result<Rendered, String> {
    let mut pg: BTreeMap<String, (String, String)> = BTreeMap::new();
    let mut sqlite: BTreeMap<String, (String, String)> = BTreeMap::new();
    let mut out = Rendered::default();
    let mut seen: BTreeMap<(String, &'static str), String> = BTreeMap::new();
    let mut sections = Vec::new();
    for (file, text) in files {
        sections.extend(parse(file, text)?);
    }
    let mut fragments: BTreeMap<String, String> = BTreeMap::new();
    let mut borrowed_sections = Vec::new();
    for (file, text) in borrowed {
        borrowed_sections.extend(parse(file, text)?);
    }
    let mut own = Vec::new();
    for (s, is_own) in sections
        .iter()
        .map(|s| (s, true))
        .chain(borrowed_sections.iter().map(|s| (s, false)))
        .filter(|(s, _)| s.scope == Scope::Fragment)
    {
        // The header comment documents the fragment in its file; the
        // including query does not carry it.
        let body: Vec<&str> = s
            .body
            .lines()
            .skip_while(|l| l.trim_start().starts_with("--"))
            .collect();
        if fragments.insert(s.name.clone(), body.join("\n")).is_some() {
            return Err(format!("{}: fragment {} is defined twice", s.file, s.name));
        }
        if is_own {
            own.push(s.name.clone());
        }
    }
    let mut used = Vec::new();
    for s in &sections {
        // Fragments' own uses count, so a fragment only used by another is used.
        include(&s.body, &fragments, &mut used).map_err(|e| format!("{}: {}: {e}", s.file, s.name))?;
    }
    if let Some(unused) = own.iter().find(|f| !used.contains(f)) {
        return Err(format!("fragment {unused} is never used"));
    }
    for mut s in sections.into_iter().filter(|s| s.scope != Scope::Fragment) {
        s.body = include(&s.body, &fragments, &mut used).map_err(|e| format!("{}: {}: {e}", s.file, s.name))?;
        {
            let slots: &[&'static str] = match s.scope {
                Scope::Shared => &["postgres", "sqlite"],
                Scope::Only(Engine::Postgres) => &["postgres"],
                Scope::Only(Engine::Sqlite) => &["sqlite"],
                Scope::PostgresOnly => &["postgres only"],
                Scope::Fragment => unreachable!("fragments were filtered out"),
            };
            for slot in slots {
                if let Some(first) = seen.insert((s.name.clone(), slot), s.file.clone()) {
                    return Err(format!(
                        "query {} is defined twice for {slot} ({first} and {})",
                        s.name, s.file
                    ));
                }
            }
            let ctx = |e: String| format!("{}: query {}: {e}", s.file, s.name);
            match s.scope {
                Scope::Shared => {
                    pg.insert(
                        s.name.clone(),
                        (s.file.clone(), render(&s.body, Engine::Postgres).map_err(ctx)?),
                    );
                    sqlite.insert(
                        s.name.clone(),
                        (s.file.clone(), render(&s.body, Engine::Sqlite).map_err(ctx)?),
                    );
                }
                Scope::Only(Engine::Postgres) => {
                    pg.insert(
                        s.name.clone(),
                        (s.file.clone(), render(&s.body, Engine::Postgres).map_err(ctx)?),
                    );
                }
                Scope::Only(Engine::Sqlite) => {
                    sqlite.insert(
                        s.name.clone(),
                        (s.file.clone(), render(&s.body, Engine::Sqlite).map_err(ctx)?),
                    );
                }
                Scope::PostgresOnly => {
                    out.postgres_only
                        .insert(s.name.clone(), render(&s.body, Engine::Postgres).map_err(ctx)?);
                }
                Scope::Fragment => {}
            }
        }
    }
    for (name, (file, pg_sql)) in pg {
        let Some((_, sqlite_sql)) = sqlite.remove(&name) else {
            return Err(format!(
                "{file}: query {name} has a [postgres] override but no [sqlite] one (tag it [postgres only] if SQLite has no equivalent)"
            ));
        };
        if out.postgres_only.contains_key(&name) {
            return Err(format!("{file}: query {name} is both shared and [postgres only]"));
        }
        out.shared.insert(name, (pg_sql, sqlite_sql));
    }
    if let Some((name, (file, _))) = sqlite.into_iter().next() {
        return Err(format!(
            "{file}: query {name} has a [sqlite] override but no [postgres] one"
        ));
    }
    Ok(out)
}

/// Reads every `*.sql` file in `dir` (relative to the crate root), renders
/// it, and writes `$OUT_DIR/queries.rs`. `per_engine` is the path of
/// `ferry::store::PerEngine` as the including crate sees it (`crate::store::PerEngine`
/// inside `ferry`). Panics with the file and query on any template error,
/// which fails the build.
pub fn generate(dir: &str, per_engine: &str) {
    generate_sharing(dir, per_engine, &[]);
}

/// [`generate`], also reading the `[fragment]` sections of the files
/// `borrowed` (paths relative to the crate root, e.g.
/// `../sql/outbox_delivered.sql`), so one statement's shared part is
/// written once for every crate that reads the same table.
pub fn generate_sharing(dir: &str, per_engine: &str, borrowed: &[&str]) {
    let root = std::env::var("CARGO_MANIFEST_DIR").expect("run from a build script");
    let mut shared = Vec::new();
    for file in borrowed {
        let path = Path::new(&root).join(file);
        println!("cargo:rerun-if-changed={}", path.display());
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        shared.push((file.to_string(), text));
    }
    let dir_path = Path::new(&root).join(dir);
    println!("cargo:rerun-if-changed={}", dir_path.display());
    let mut files = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(&dir_path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir_path.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "sql"))
        .collect();
    entries.sort();
    for path in entries {
        println!("cargo:rerun-if-changed={}", path.display());
        let name = path.file_name().expect("file name").to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        files.push((format!("{dir}/{name}"), text));
    }
    let rendered = render_files_sharing(&files, &shared).unwrap_or_else(|e| panic!("templated SQL: {e}"));
    let out = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("queries.rs");
    std::fs::write(&out, emit(&rendered, per_engine)).unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
}

/// The Rust source for `rendered` (see [`generate`]).
pub fn emit(rendered: &Rendered, per_engine: &str) -> String {
    let mut s = String::new();
    s.push_str("/// This crate's named queries: one field per `-- name:` section, rendered for one engine.\n");
    s.push_str("#[derive(Debug)]\npub struct Queries {\n");
    for name in rendered.shared.keys() {
        let _ = writeln!(s, "    /// The `{name}` query.\n    pub {name}: &'static str,");
    }
    s.push_str("}\n\nimpl Queries {\n    /// Every query as `(name, sql)`, for the prepare check each crate runs on both engines.\n");
    s.push_str("    pub fn all(&self) -> Vec<(&'static str, &'static str)> {\n        vec![\n");
    for name in rendered.shared.keys() {
        let _ = writeln!(s, "            ({name:?}, self.{name}),");
    }
    s.push_str("        ]\n    }\n}\n\n");
    s.push_str("/// The queries rendered for PostgreSQL and for SQLite.\n");
    let _ = writeln!(s, "pub static QUERIES: {per_engine}<Queries> = {per_engine} {{");
    for (field, idx) in [("postgres", 0), ("sqlite", 1)] {
        let _ = writeln!(s, "    {field}: Queries {{");
        for (name, pair) in &rendered.shared {
            let sql = if idx == 0 { &pair.0 } else { &pair.1 };
            let _ = writeln!(s, "        {name}: {sql:?},");
        }
        s.push_str("    },\n");
    }
    s.push_str("};\n\n");
    if rendered.postgres_only.is_empty() {
        return s;
    }
    s.push_str(
        "/// Queries only PostgreSQL has (data-modifying CTEs, NOTIFY); SQLite runs the equivalent step by step.\n",
    );
    s.push_str("#[derive(Debug)]\npub struct PostgresOnly {\n");
    for name in rendered.postgres_only.keys() {
        let _ = writeln!(s, "    /// The `{name}` query.\n    pub {name}: &'static str,");
    }
    s.push_str("}\n\nimpl PostgresOnly {\n    /// Every query as `(name, sql)`.\n    pub fn all(&self) -> Vec<(&'static str, &'static str)> {\n        vec![\n");
    for name in rendered.postgres_only.keys() {
        let _ = writeln!(s, "            ({name:?}, self.{name}),");
    }
    s.push_str("        ]\n    }\n}\n\n/// The PostgreSQL-only queries.\npub static POSTGRES_ONLY: PostgresOnly = PostgresOnly {\n");
    for (name, sql) in &rendered.postgres_only {
        let _ = writeln!(s, "    {name}: {sql:?},");
    }
    s.push_str("};\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_render_per_engine() {
        let t = "SELECT {now $2} AS at, {least}(a, b) FROM t WHERE id {ids $1}{pg: FOR UPDATE}{sqlite: LIMIT 1}";
        assert_eq!(
            render(t, Engine::Postgres).unwrap(),
            "SELECT COALESCE($2::bigint, (extract(epoch FROM now()) * 1000)::bigint) AS at, LEAST(a, b) FROM t WHERE id = ANY($1::bigint[]) FOR UPDATE"
        );
        assert_eq!(
            render(t, Engine::Sqlite).unwrap(),
            "SELECT COALESCE($2, CAST(unixepoch('subsec') * 1000 AS INTEGER)) AS at, MIN(a, b) FROM t WHERE id IN (SELECT value FROM json_each($1)) LIMIT 1"
        );
    }

    #[test]
    fn bad_templates_are_build_errors() {
        assert!(render("{now}", Engine::Postgres).is_err());
        assert!(render("{nope}", Engine::Sqlite).is_err());
        assert!(render("{now $1", Engine::Sqlite).is_err());
        assert!(render("a }", Engine::Sqlite).is_err());
        let one_sided = vec![("t.sql".to_string(), "-- name: q [postgres]\nSELECT 1\n".to_string())];
        assert!(render_files(&one_sided).unwrap_err().contains("no [sqlite]"));
        let twice = vec![(
            "t.sql".to_string(),
            "-- name: q\nSELECT 1\n-- name: q\nSELECT 2\n".to_string(),
        )];
        assert!(render_files(&twice).unwrap_err().contains("twice"));
        let both = vec![(
            "t.sql".to_string(),
            "-- name: q [postgres]\nSELECT 1\n-- name: q [sqlite]\nSELECT 2\n-- name: r [postgres only]\nNOTIFY x\n"
                .to_string(),
        )];
        let r = render_files(&both).unwrap();
        assert_eq!(r.shared["q"], ("SELECT 1".to_string(), "SELECT 2".to_string()));
        assert_eq!(r.postgres_only["r"], "NOTIFY x");
    }

    #[test]
    fn fragments_are_included_with_their_parameters_renumbered() {
        let files = vec![(
            "t.sql".to_string(),
            "-- name: due [fragment]\n-- Due in $1 at $2, $3 unused.\nqueue = $1 AND at <= {now $2}\n\
             -- name: pick [fragment]\nSELECT id FROM t WHERE {use due $1 $2} LIMIT $3\n\
             -- name: a\n{use pick $1 $2 $3}\n\
             -- name: b\n{use pick $9 $10 $1}\n"
                .to_string(),
        )];
        let r = render_files(&files).unwrap();
        assert_eq!(
            r.shared["b"].1,
            "SELECT id FROM t WHERE queue = $9 AND at <= COALESCE($10, CAST(unixepoch('subsec') * 1000 AS INTEGER)) LIMIT $1"
        );
        assert!(r.shared["a"]
            .0
            .starts_with("SELECT id FROM t WHERE queue = $1 AND at <= COALESCE($2::bigint"));
        assert!(!r.shared.contains_key("due") && !r.shared.contains_key("pick"));
        let missing = vec![(
            "t.sql".to_string(),
            "-- name: f [fragment]\nx = $2\n-- name: q\nSELECT {use f $1}\n".to_string(),
        )];
        assert!(render_files(&missing).unwrap_err().contains("uses $2"));
        let unused = vec![(
            "t.sql".to_string(),
            "-- name: f [fragment]\nx\n-- name: q\nSELECT 1\n".to_string(),
        )];
        assert!(render_files(&unused).unwrap_err().contains("never used"));
        let cycle = vec![(
            "t.sql".to_string(),
            "-- name: f [fragment]\n{use f}\n-- name: q\nSELECT {use f}\n".to_string(),
        )];
        assert!(render_files(&cycle).unwrap_err().contains("cycle"));
    }

    #[test]
    fn borrowed_fragments_are_usable_and_need_no_use_here() {
        let lib = vec![(
            "../sql/o.sql".to_string(),
            "-- name: pending [fragment]\n-- Pending rows.\n(SELECT id FROM o WHERE lane = $1)\n\
             -- name: unused [fragment]\nx\n-- name: q\nSELECT 1\n"
                .to_string(),
        )];
        let files = vec![(
            "sql/c.sql".to_string(),
            "-- name: c\nSELECT count(*) FROM {use pending $2} p\n".to_string(),
        )];
        let r = render_files_sharing(&files, &lib).unwrap();
        assert_eq!(
            r.shared["c"].0,
            "SELECT count(*) FROM (SELECT id FROM o WHERE lane = $2) p"
        );
        assert!(!r.shared.contains_key("q"), "only a borrowed file's fragments are read");
        let twice = vec![(
            "sql/c.sql".to_string(),
            "-- name: pending [fragment]\ny\n-- name: c\nSELECT {use pending}\n".to_string(),
        )];
        assert!(render_files_sharing(&twice, &lib).unwrap_err().contains("twice"));
    }
}
