//! Turns the command line's HCA and fault-injection choices into one `HcaConfig`, checked before anything is created.
//! Every refusal names the flag and the value that caused it, so a run's reproducer line can be fixed by eye.

use std::path::{Path, PathBuf};

use vhca_hca::{FaultInjection, HcaConfig, InjectionParseError};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--inject {value}: {source}")]
    Inject { value: String, source: InjectionParseError },
    #[error("--inject-config {}: cannot read the file: {source}", path.display())]
    ReadInjectConfig { path: PathBuf, source: std::io::Error },
    #[error("--inject-config {}: {source}", path.display())]
    ParseInjectConfig { path: PathBuf, source: InjectionParseError },
}

/// What the command line may change of the HCA. `None` keeps `HcaConfig::default()`'s value.
#[derive(Debug, Clone, Default)]
pub struct HcaChoices {
    pub map_registers: u32,
    pub max_pd: Option<u32>,
    pub max_cq: Option<u32>,
    pub max_qp: Option<u32>,
    pub max_mr: Option<u32>,
    pub probe_pages: bool,
    pub revalidate_stale: bool,
    /// `--inject-config`: read first, so `--inject` flags override single knobs of it.
    pub inject_config: Option<PathBuf>,
    /// `--inject KEY=VALUE`, in command-line order (a later one wins).
    pub inject: Vec<String>,
}

impl HcaChoices {
    pub fn to_config(&self) -> Result<HcaConfig, ConfigError> {
        let defaults = HcaConfig::default();
        Ok(HcaConfig {
            map_registers: self.map_registers,
            max_pd: self.max_pd.unwrap_or(defaults.max_pd),
            max_cq: self.max_cq.unwrap_or(defaults.max_cq),
            max_qp: self.max_qp.unwrap_or(defaults.max_qp),
            max_mr: self.max_mr.unwrap_or(defaults.max_mr),
            probe_pages: self.probe_pages,
            revalidate_stale: self.revalidate_stale,
            injection: self.injection()?,
            ..defaults
        })
    }

    fn injection(&self) -> Result<FaultInjection, ConfigError> {
        let mut injection = match &self.inject_config {
            Some(path) => read_inject_config(path)?,
            None => FaultInjection::default(),
        };
        for kv in &self.inject {
            injection.parse_kv(kv).map_err(|source| ConfigError::Inject { value: kv.clone(), source })?;
        }
        Ok(injection)
    }
}

fn read_inject_config(path: &Path) -> Result<FaultInjection, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| ConfigError::ReadInjectConfig { path: path.to_path_buf(), source })?;
    FaultInjection::from_json(&text)
        .map_err(|source| ConfigError::ParseInjectConfig { path: path.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn choices(inject: &[&str]) -> HcaChoices {
        HcaChoices { map_registers: 64, inject: inject.iter().map(|s| s.to_string()).collect(), ..Default::default() }
    }

    #[test]
    fn flags_reach_the_config() {
        let mut c = choices(&["fail_reg_mr=2", "drop_completion=0x3"]);
        c.max_mr = Some(5);
        c.revalidate_stale = true;
        let config = c.to_config().unwrap();
        assert_eq!(config.map_registers, 64);
        assert_eq!(config.max_mr, 5);
        assert_eq!(config.max_qp, HcaConfig::default().max_qp);
        assert!(config.revalidate_stale && !config.probe_pages);
        assert_eq!(config.injection.fail_reg_mr, Some(2));
        assert_eq!(config.injection.drop_completion, Some(3));
    }

    #[test]
    fn inject_flags_override_the_config_file() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        write!(file, r#"{{"fail_reg_mr": 4, "fail_ring_map": 1}}"#).unwrap();
        let mut c = choices(&["fail_reg_mr=7"]);
        c.inject_config = Some(file.path().to_path_buf());
        let injection = c.to_config().unwrap().injection;
        assert_eq!((injection.fail_reg_mr, injection.fail_ring_map), (Some(7), Some(1)));
    }

    #[test]
    fn refusals_name_the_flag_and_value() {
        let err = choices(&["fail_reg_mr=1", "fail_reg_mr=x"]).to_config().unwrap_err().to_string();
        assert!(err.starts_with("--inject fail_reg_mr=x:"), "{err}");
        assert!(err.contains("'x' is not a number"), "{err}");
        let err = choices(&["nope=1"]).to_config().unwrap_err().to_string();
        assert!(err.contains("--inject nope=1") && err.contains("unknown injection key 'nope'"), "{err}");

        let mut c = choices(&[]);
        c.inject_config = Some("/nonexistent/vhca-inject.json".into());
        let err = c.to_config().unwrap_err().to_string();
        assert!(err.starts_with("--inject-config /nonexistent/vhca-inject.json: cannot read"), "{err}");

        let mut file = tempfile::NamedTempFile::new().unwrap();
        write!(file, r#"{{"fail_reg_mr": "soon"}}"#).unwrap();
        c.inject_config = Some(file.path().to_path_buf());
        let err = c.to_config().unwrap_err().to_string();
        assert!(err.contains("--inject-config") && err.contains("injection config:"), "{err}");
    }
}
