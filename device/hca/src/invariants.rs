//! What every command's response and log lines must satisfy, whatever the request was: checked after each command
//! by the HCA's property tests (tests/robustness.rs) and by its fuzz harness (fuzz/src/hca_commands.rs), so the two
//! hold the device to one definition of the contract.

use vhca_proto::{CommandHeader, Opcode, ResponseHeader, Status, RESPONSE_HEADER_SIZE};
use zerocopy::FromBytes;

use crate::event_records::HcaEvent;

/// Checks one command: `response` is what `Hca::execute` returned for `request`, `events` the lines it logged
/// meanwhile. The response decodes, echoes the request's opcode and tag (a request too short to have them is
/// BAD_LENGTH), carries exactly the opcode's response body when accepted and no body when refused; the log has one
/// `command` line with that status, and a refusal also one `refused` line with a non-empty cause. Returns the status
/// and the response body, or what broke.
pub fn check_command<'r>(
    request: &[u8],
    response: &'r [u8],
    events: &[HcaEvent],
) -> Result<(Status, &'r [u8]), String> {
    if response.len() < RESPONSE_HEADER_SIZE {
        return Err(format!("response of {} bytes", response.len()));
    }
    let (header, body) = ResponseHeader::read_from_prefix(response).map_err(|_| "no response header".to_string())?;
    let status =
        Status::from_u32(header.status.get()).ok_or_else(|| format!("undecodable status {}", header.status.get()))?;
    if header.body_len.get() as usize != body.len() {
        return Err(format!("body_len {} is not the {} bytes after the header", header.body_len.get(), body.len()));
    }
    match CommandHeader::read_from_prefix(request) {
        Ok((asked, _)) => {
            if (header.opcode.get(), header.tag.get()) != (asked.opcode.get(), asked.tag.get()) {
                return Err(format!(
                    "opcode/tag {}/{} not echoed: {}/{}",
                    asked.opcode.get(),
                    asked.tag.get(),
                    header.opcode.get(),
                    header.tag.get()
                ));
            }
        }
        Err(_) if status != Status::BadLength => {
            return Err(format!("a request shorter than its header answered {status:?}"));
        }
        Err(_) => {}
    }
    match (status, Opcode::from_u32(header.opcode.get())) {
        (Status::Ok, Some(opcode)) if body.len() != opcode.response_size() => {
            return Err(format!("{opcode:?} accepted with a {}-byte body", body.len()));
        }
        (Status::Ok, None) => return Err(format!("unknown opcode {} accepted", header.opcode.get())),
        (Status::Ok, Some(_)) => {}
        _ if !body.is_empty() => return Err(format!("a refusal ({status:?}) carries a body")),
        _ => {}
    }
    let statuses: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            HcaEvent::Command { status, .. } => Some(status.as_str()),
            _ => None,
        })
        .collect();
    if statuses != [status.name()] {
        return Err(format!("command lines {statuses:?}, not one with {}", status.name()));
    }
    let reasons: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            HcaEvent::Refused { reason, .. } => Some(reason.as_str()),
            _ => None,
        })
        .collect();
    match (status, reasons.as_slice()) {
        (Status::Ok, []) => {}
        (Status::Ok, _) => return Err(format!("accepted but refused: {reasons:?}")),
        (_, [reason]) if !reason.is_empty() => {}
        _ => return Err(format!("refused ({status:?}) with causes {reasons:?}, not one")),
    }
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use vhca_proto::{CommandHeader, ResponseHeader, Status};
    use zerocopy::IntoBytes;

    use super::*;

    fn request(opcode: Opcode, tag: u32) -> Vec<u8> {
        let header =
            CommandHeader { opcode: (opcode as u32).into(), tag: tag.into(), body_len: 0.into(), reserved: 0.into() };
        header.as_bytes().to_vec()
    }

    fn response(status: Status, opcode: u32, tag: u32, body: &[u8]) -> Vec<u8> {
        let header = ResponseHeader {
            status: (status as u32).into(),
            opcode: opcode.into(),
            tag: tag.into(),
            body_len: (body.len() as u32).into(),
        };
        [header.as_bytes(), body].concat()
    }

    fn command(status: Status) -> HcaEvent {
        HcaEvent::Command { opcode: "alloc_pd".into(), tag: 7, status: status.name().into() }
    }

    fn refused(reason: &str) -> HcaEvent {
        HcaEvent::Refused { opcode: "alloc_pd".into(), tag: 7, reason: reason.into() }
    }

    #[test]
    fn a_well_formed_answer_passes_and_each_broken_rule_is_named() {
        let asked = request(Opcode::AllocPd, 7);
        let ok_body = vec![0u8; Opcode::AllocPd.response_size()];
        let op = Opcode::AllocPd as u32;
        let good = response(Status::Ok, op, 7, &ok_body);
        assert_eq!(check_command(&asked, &good, &[command(Status::Ok)]), Ok((Status::Ok, &ok_body[..])));
        let refusal = response(Status::InvalidParam, op, 7, &[]);
        let why = [refused("no such PD"), command(Status::InvalidParam)];
        assert!(check_command(&asked, &refusal, &why).is_ok());

        let broken = |response: &[u8], events: &[HcaEvent]| check_command(&asked, response, events).unwrap_err();
        assert!(broken(&good[..8], &[]).contains("response of 8 bytes"));
        assert!(broken(&response(Status::Ok, op, 8, &ok_body), &[command(Status::Ok)]).contains("not echoed"));
        assert!(broken(&response(Status::Ok, op, 7, &[]), &[command(Status::Ok)]).contains("accepted with a 0-byte"));
        assert!(broken(&response(Status::InvalidParam, op, 7, &[1]), &why).contains("carries a body"));
        assert!(broken(&good, &[]).contains("command lines []"));
        assert!(broken(&good, &[command(Status::Ok), refused("x")]).contains("accepted but refused"));
        assert!(broken(&refusal, &[command(Status::InvalidParam)]).contains("not one"));
        assert!(broken(&refusal, &[refused(""), command(Status::InvalidParam)]).contains("not one"));
        let answer = response(Status::Ok, 0, 0, &[]);
        let short = check_command(&asked[..4], &answer, &[command(Status::Ok)]);
        assert!(short.unwrap_err().contains("shorter than its header"));
    }
}
