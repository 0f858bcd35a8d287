//! ARCHITECTURE.md stays a true map: every path it names (a `dir/file.rs`
//! or a `dir/` in backticks, relative to the repository or to any folder
//! in it, with `{a,b}` alternatives) exists in the repository.

use std::collections::BTreeSet;
use std::path::Path;

/// Every file (`a/b.rs`) and folder (`a/b/`) of the repository, relative to
/// its root, without build output and version control.
fn repository_paths(root: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut pending = vec![String::new()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(root.join(&dir)).unwrap_or_else(|e| panic!("reading {dir:?}: {e}"));
        for entry in entries {
            let entry = entry.expect("a directory entry");
            let name = entry.file_name().to_string_lossy().into_owned();
            if matches!(name.as_str(), "target" | ".git" | "node_modules") {
                continue;
            }
            let path = format!("{dir}{name}");
            if entry.file_type().expect("a file type").is_dir() {
                out.insert(format!("{path}/"));
                pending.push(format!("{path}/"));
            } else {
                out.insert(path);
            }
        }
    }
    out
}

/// The words of the backtick spans of `text` that look like a path: a
/// folder (`relay/src/store/`) or a file in a folder (`lane/task.rs`).
fn named_paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, span) in text.split('`').enumerate() {
        if i % 2 == 0 {
            continue;
        }
        for word in span.split_whitespace() {
            let word = word.trim_end_matches([',', ';', ':', ')']);
            let pathlike = word.chars().all(|c| c.is_ascii_alphanumeric() || "_-./{},".contains(c));
            let (head, last) = word.rsplit_once('/').unwrap_or(("", word));
            let file = last.contains('.') && !last.ends_with('.');
            if pathlike && !word.starts_with('/') && !head.is_empty() && (last.is_empty() || file) {
                out.extend(expand(word));
            }
        }
    }
    out
}

/// `a/{b,c}/d` as `a/b/d` and `a/c/d`.
fn expand(word: &str) -> Vec<String> {
    match (word.find('{'), word.find('}')) {
        (Some(open), Some(close)) if open < close => word[open + 1..close]
            .split(',')
            .flat_map(|alt| expand(&format!("{}{alt}{}", &word[..open], &word[close + 1..])))
            .collect(),
        _ => vec![word.to_owned()],
    }
}

#[test]
fn architecture_names_only_paths_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let map = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let paths = repository_paths(root);
    let named = named_paths(&map);
    assert!(named.len() > 20, "too few paths found, is the parser broken? {named:?}");
    let missing: Vec<&String> = named
        .iter()
        .filter(|p| !paths.iter().any(|real| real == *p || real.ends_with(&format!("/{p}"))))
        .collect();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names paths that do not exist: {missing:?}"
    );
}

#[test]
fn the_path_check_reads_folders_files_and_alternatives() {
    let named = named_paths(
        "see `relay/src/store/`, `lane/task.rs` and `migrations/{postgres,sqlite}/` but not `/readyz`, `a/b` or `x.rs`",
    );
    assert_eq!(
        named,
        [
            "relay/src/store/",
            "lane/task.rs",
            "migrations/postgres/",
            "migrations/sqlite/"
        ]
    );
}
