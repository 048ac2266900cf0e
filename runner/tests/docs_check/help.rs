//! What a command accepts, read from its own `--help` (clap's layout): its flags, whether each takes a value, and
//! its subcommands. The real binaries answer; nothing here copies their flags.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::Command;
use std::rc::Rc;

#[derive(Debug, Default)]
pub struct HelpSpec {
    /// `--jobs`, `-j`, ... → whether it takes a value.
    pub flags: HashMap<String, bool>,
    pub subcommands: Vec<String>,
    /// The usage line asks for `<COMMAND>`: a word after the command must be one of `subcommands`.
    pub requires_subcommand: bool,
}

impl HelpSpec {
    pub fn parse(text: &str) -> HelpSpec {
        let mut spec = HelpSpec::default();
        let mut in_commands = false;
        for line in text.lines() {
            let t = line.trim_start();
            if line.starts_with("Usage:") {
                spec.requires_subcommand = line.contains("<COMMAND>");
            }
            if !line.starts_with(' ') {
                in_commands = line.trim_end() == "Commands:";
                continue;
            }
            if in_commands {
                if let Some(word) = t.split_whitespace().next() {
                    spec.subcommands.push(word.to_string());
                }
            } else if t.starts_with('-') {
                // `-j, --jobs <JOBS>  Runs at a time`: the names, then a value placeholder, then the description
                // after two spaces (or on the next line).
                let names = t.split("  ").next().unwrap_or(t);
                let takes_value = names.contains('<');
                for word in names.split([' ', ',']).filter(|w| w.starts_with('-')) {
                    spec.flags.insert(word.to_string(), takes_value);
                }
            }
        }
        spec
    }
}

/// `program [subcommands…] --help`, parsed, or why it cannot be had (the binary is not built).
pub trait HelpSource {
    /// The programs whose command lines the docs are searched for.
    fn programs(&self) -> Vec<String>;
    fn help(&self, program: &str, subcommands: &[String]) -> Result<Rc<HelpSpec>, String>;
}

type Cached = Result<Rc<HelpSpec>, String>;

/// Runs the real binaries, each help once.
pub struct BinaryHelp {
    binaries: BTreeMap<String, Result<PathBuf, String>>,
    cache: RefCell<HashMap<Vec<String>, Cached>>,
}

impl BinaryHelp {
    /// `(program, path, the command that builds it)`; a path that is not a file makes that program's flags
    /// uncheckable, saying how to build it.
    pub fn new(binaries: &[(&str, PathBuf, &str)]) -> BinaryHelp {
        let binaries = binaries
            .iter()
            .map(|(name, path, build)| {
                let found = if path.is_file() {
                    Ok(path.clone())
                } else {
                    Err(format!("{name} is not built at {} (build it: {build})", path.display()))
                };
                (name.to_string(), found)
            })
            .collect();
        BinaryHelp { binaries, cache: RefCell::new(HashMap::new()) }
    }

    /// Why each program that is not built cannot answer.
    pub fn missing(&self) -> Vec<String> {
        self.binaries.values().filter_map(|b| b.as_ref().err().cloned()).collect()
    }

    fn run(&self, program: &str, subcommands: &[String]) -> Cached {
        let binary = self.binaries.get(program).ok_or_else(|| format!("{program}: not a program the check knows"))?;
        let binary = binary.clone()?;
        let out = Command::new(&binary)
            .args(subcommands)
            .arg("--help")
            .output()
            .map_err(|e| format!("{}: {e}", binary.display()))?;
        if !out.status.success() {
            return Err(format!(
                "`{program} {} --help` failed ({}): {}",
                subcommands.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(Rc::new(HelpSpec::parse(&String::from_utf8_lossy(&out.stdout))))
    }
}

impl HelpSource for BinaryHelp {
    fn programs(&self) -> Vec<String> {
        self.binaries.keys().cloned().collect()
    }

    fn help(&self, program: &str, subcommands: &[String]) -> Result<Rc<HelpSpec>, String> {
        let key: Vec<String> = std::iter::once(program.to_string()).chain(subcommands.iter().cloned()).collect();
        if let Some(hit) = self.cache.borrow().get(&key) {
            return hit.clone();
        }
        let answer = self.run(program, subcommands);
        self.cache.borrow_mut().insert(key, answer.clone());
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clap_help_gives_flags_values_and_subcommands() {
        let spec = HelpSpec::parse(
            "Usage: vhca-run [OPTIONS] <COMMAND>\n\nCommands:\n  suite  Run a suite\n  help   Print this\n\n\
             Options:\n  -j, --jobs <JOBS>  Runs at a time\n      --cold         Boot cold\n      --socket-path <P>\n\
             \x20         Unix socket\n",
        );
        assert!(spec.requires_subcommand);
        assert_eq!(spec.subcommands, ["suite", "help"]);
        assert_eq!(spec.flags.get("-j"), Some(&true));
        assert_eq!(spec.flags.get("--jobs"), Some(&true));
        assert_eq!(spec.flags.get("--cold"), Some(&false));
        assert_eq!(spec.flags.get("--socket-path"), Some(&true));
        assert_eq!(spec.flags.len(), 4);
    }

    #[test]
    fn a_binary_not_built_says_how_to_build_it() {
        let build = "cargo build --release -p vhca-loader";
        let help = BinaryHelp::new(&[("vhca-load", PathBuf::from("/nonexistent/vhca-load"), build)]);
        assert!(help.missing().iter().any(|why| why.contains(build)), "{:?}", help.missing());
        assert!(help.help("vhca-load", &[]).is_err_and(|why| why.contains(build)));
    }
}
