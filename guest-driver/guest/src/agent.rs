//! The resident agent: with `vhca.agent=1` the guest announces itself on the console and waits for one run request
//! (a JSON line), so a snapshot taken while it waits can be restored once per run with that run's options.

use std::io::{BufRead, Write};

use serde::Deserialize;

/// The line the runner waits for before it saves the guest.
pub const READY_LINE: &str = "VHCA-AGENT-READY";
/// The kernel command-line word that turns the agent on.
pub const AGENT_WORD: &str = "vhca.agent=1";

/// What the runner sends: the run's `vhca.KEY=VALUE` words, exactly as a cold boot puts them on the kernel command
/// line.
#[derive(Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RunRequest {
    pub params: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("console: {0}")]
    Io(#[from] std::io::Error),
    #[error("the console closed before a run request came")]
    Closed,
    #[error("run request is not {{\"params\": [\"vhca.KEY=VALUE\", ...]}}: {0}")]
    Parse(String),
    #[error("run request word {0:?} is not one vhca.KEY=VALUE word")]
    Word(String),
}

/// True if the kernel command line asks for the agent.
pub fn enabled(cmdline: &str) -> bool {
    cmdline.split_whitespace().any(|w| w == AGENT_WORD)
}

/// Parses one request line. Each word must stay one word, because the options parser reads words.
pub fn parse_request(line: &str) -> Result<RunRequest, AgentError> {
    let request: RunRequest = serde_json::from_str(line.trim()).map_err(|e| AgentError::Parse(e.to_string()))?;
    for word in &request.params {
        if !word.starts_with("vhca.") || word.split_whitespace().count() != 1 {
            return Err(AgentError::Word(word.clone()));
        }
    }
    Ok(request)
}

/// Announces readiness and blocks until the runner's request line arrives on `input`.
pub fn wait_for_request(input: &mut dyn BufRead, output: &mut dyn Write) -> Result<RunRequest, AgentError> {
    writeln!(output, "{READY_LINE}")?;
    output.flush()?;
    let mut line = String::new();
    if input.read_line(&mut line)? == 0 {
        return Err(AgentError::Closed);
    }
    parse_request(&line)
}

/// Stops the console echoing what the runner types, so the request does not come back into the serial log as if the
/// guest had said it. Line buffering stays on: one read returns the whole request line.
pub fn quiet_console() {
    // SAFETY: termios is a plain C struct for which all-zero bytes are a valid value; tcgetattr fills it in.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: fd 0 is the console (or any fd: the calls then fail with ENOTTY and change nothing); `t` is a valid,
    // exclusively borrowed termios for both calls.
    unsafe {
        if libc::tcgetattr(0, &mut t) == 0 {
            t.c_lflag &= !(libc::ECHO | libc::ECHONL);
            libc::tcsetattr(0, libc::TCSANOW, &t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_one_request_after_announcing_itself() {
        let mut input =
            std::io::Cursor::new(b"{\"params\":[\"vhca.scenario=smoke\",\"vhca.verifier=0xaa\"]}\nrest\n".to_vec());
        let mut out = Vec::new();
        let request = wait_for_request(&mut input, &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "VHCA-AGENT-READY\n");
        assert_eq!(request.params, ["vhca.scenario=smoke", "vhca.verifier=0xaa"]);
    }

    #[test]
    fn bad_requests_name_their_fault() {
        assert!(matches!(parse_request("scenario=smoke"), Err(AgentError::Parse(_))));
        assert!(matches!(parse_request("{\"params\":[\"vhca.a=1 vhca.b=2\"]}"), Err(AgentError::Word(_))));
        assert!(matches!(parse_request("{\"params\":[\"quiet\"]}"), Err(AgentError::Word(_))));
        assert!(matches!(parse_request("{\"params\":[], \"x\": 1}"), Err(AgentError::Parse(_))));
        let mut empty = std::io::Cursor::new(Vec::new());
        assert!(matches!(wait_for_request(&mut empty, &mut Vec::new()), Err(AgentError::Closed)));
    }

    #[test]
    fn the_agent_word_must_be_exact() {
        assert!(enabled("console=ttyS0 vhca.agent=1 quiet"));
        assert!(!enabled("console=ttyS0 vhca.agent=10"));
        assert!(!enabled(""));
    }
}
