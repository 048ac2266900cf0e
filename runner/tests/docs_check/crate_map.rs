//! docs/architecture.md's crate map against the workspace: every member crate in the picture and in the table,
//! each row with the crate's real folder, exactly the workspace crates its Cargo.toml depends on, and (with a layer
//! column) each of those on a layer below its own.

use std::collections::BTreeSet;
use std::path::Path;

use super::markdown::Doc;
use super::Problem;

pub const SECTION: &str = "Crates";

pub struct Crate {
    pub folder: String,
    pub name: String,
    /// The workspace crates among its [dependencies] (target-specific ones too; never dev- or build-dependencies).
    pub uses: BTreeSet<String>,
}

fn toml_file(root: &Path, path: &str) -> Result<toml::Table, String> {
    let text = std::fs::read_to_string(root.join(path)).map_err(|e| format!("{path}: {e}"))?;
    text.parse().map_err(|e| format!("{path}: {e}"))
}

/// The root Cargo.toml's members, each with its package name and dependencies.
pub fn workspace(root: &Path) -> Result<Vec<Crate>, String> {
    let manifest = toml_file(root, "Cargo.toml")?;
    let members = manifest
        .get("workspace")
        .and_then(|w| w.get("members"))
        .and_then(|m| m.as_array())
        .ok_or("Cargo.toml: no [workspace] members")?;
    let mut crates = Vec::new();
    for member in members {
        let folder = member.as_str().ok_or("Cargo.toml: a member that is not a string")?.to_string();
        let path = format!("{folder}/Cargo.toml");
        let package = toml_file(root, &path)?;
        let name = package
            .get("package")
            .and_then(|p| p.get("name"))
            .and_then(|n| n.as_str())
            .ok_or(format!("{path}: no package name"))?
            .to_string();
        let targets = package.get("target").and_then(|t| t.as_table()).into_iter().flat_map(|t| t.values());
        let tables = package.get("dependencies").into_iter().chain(targets.filter_map(|t| t.get("dependencies")));
        let uses = tables.filter_map(|t| t.as_table()).flat_map(|t| t.keys().cloned()).collect();
        crates.push(Crate { folder, name, uses });
    }
    let names: BTreeSet<String> = crates.iter().map(|c| c.name.clone()).collect();
    for c in &mut crates {
        c.uses.retain(|u| names.contains(u));
    }
    Ok(crates)
}

/// A row of the crate table: `| folder | crate | what | uses |`, uses written without the `vhca-` prefix.
struct Row {
    line: usize,
    folder: String,
    uses: BTreeSet<String>,
    /// Index of its layer, in the order the table's layers first appear (top first); None without a layer column.
    layer: Option<usize>,
}

fn cells(line: &str) -> Vec<String> {
    let t = line.trim().trim_start_matches('|').trim_end_matches('|');
    t.split('|').map(|c| c.trim().replace('`', "")).collect()
}

pub fn check(doc: &Doc, crates: &[Crate]) -> Vec<Problem> {
    let problem = |line: usize, claim: String, why: String| Problem { doc: doc.path.clone(), line, claim, why };
    let Some((start, end)) = doc.section(SECTION) else {
        return vec![problem(1, format!("section \"{SECTION}\""), "missing: the crate map lives there".into())];
    };
    let mut rows = std::collections::BTreeMap::new();
    let mut picture = String::new();
    let mut columns: Option<(usize, usize, usize)> = None;
    let mut layer_column = None;
    let mut layers: Vec<String> = Vec::new();
    for line in start..end {
        let text = &doc.lines[line - 1];
        if !text.trim_start().starts_with('|') {
            picture.push_str(text);
            picture.push('\n');
            continue;
        }
        let c = cells(text);
        if c.iter().all(|c| c.chars().all(|ch| matches!(ch, '-' | ':' | ' '))) {
            continue; // the header's separator
        }
        let Some((folder, name, uses)) = columns else {
            let find = |h: &str| c.iter().position(|cell| cell.to_lowercase().starts_with(h));
            columns = find("folder").zip(find("crate")).zip(find("uses")).map(|((f, n), u)| (f, n, u));
            layer_column = find("layer");
            continue;
        };
        let get = |i: usize| c.get(i).cloned().unwrap_or_default();
        let uses = get(uses)
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty() && *u != "—" && *u != "-")
            .map(|u| format!("vhca-{u}"))
            .collect();
        let name = get(name).split_whitespace().next().unwrap_or_default().to_string();
        let layer = layer_column.map(|i| {
            let layer = get(i);
            layers.iter().position(|l| *l == layer).unwrap_or_else(|| {
                layers.push(layer);
                layers.len() - 1
            })
        });
        rows.insert(name, Row { line, folder: get(folder).trim_end_matches('/').to_string(), uses, layer });
    }
    let mut out = Vec::new();
    if columns.is_none() {
        out.push(problem(start, "the crate table".into(), "no table with folder, crate and uses columns".into()));
    }
    let in_picture = |name: &str| {
        picture.match_indices(name).any(|(i, _)| {
            let is_name = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
            !picture[..i].chars().next_back().is_some_and(is_name)
                && !picture[i + name.len()..].chars().next().is_some_and(is_name)
        })
    };
    for c in crates {
        let claim = format!("crate `{}` ({})", c.name, c.folder);
        let Some(row) = rows.get(&c.name) else {
            let why = if in_picture(&c.name) { "no row in the crate table" } else { "missing from the crate map" };
            out.push(problem(start, claim, why.into()));
            continue;
        };
        if !in_picture(&c.name) {
            out.push(problem(start, claim.clone(), "has a row but is not in the picture".into()));
        }
        if row.folder != c.folder {
            out.push(problem(
                row.line,
                claim.clone(),
                format!("the table says folder {}, the workspace {}", row.folder, c.folder),
            ));
        }
        let short = |set: BTreeSet<&String>| {
            set.into_iter().map(|u| u.trim_start_matches("vhca-")).collect::<Vec<_>>().join(", ")
        };
        let missing: BTreeSet<&String> = c.uses.difference(&row.uses).collect();
        let extra: BTreeSet<&String> = row.uses.difference(&c.uses).collect();
        if !missing.is_empty() {
            out.push(problem(row.line, claim.clone(), format!("its Cargo.toml also depends on {}", short(missing))));
        }
        if !extra.is_empty() {
            out.push(problem(row.line, claim.clone(), format!("its Cargo.toml does not depend on {}", short(extra))));
        }
        let layer_of = |name: &String| rows.get(name).and_then(|r| r.layer);
        let level: BTreeSet<&String> = c
            .uses
            .iter()
            .filter(|u| row.layer.is_some() && layer_of(u).is_some_and(|l| Some(l) <= row.layer))
            .collect();
        if !level.is_empty() {
            out.push(problem(row.line, claim.clone(), format!("uses {}, not on a layer below its own", short(level))));
        }
    }
    for (name, row) in &rows {
        if !crates.iter().any(|c| &c.name == name) {
            out.push(problem(row.line, format!("crate `{name}`"), "not a workspace member".into()));
        }
    }
    out
}
