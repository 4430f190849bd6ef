//! How the local API's enum fields appear in JSON (`shardcache status --json` and the
//! other `--json` outputs): by name, as in the `.proto` file (`WAIT_TIMEOUT`), never as
//! bare numbers; a number no enum value has (a newer daemon) stays a number.
//!
//! prost stores enum fields as `i32`; `build.rs` points each at its function here.

use serde::Serializer;

use crate::local::v1::{ErrorCode, FallbackReason, Reason};

fn by_name<S: Serializer>(s: S, v: i32, name: Option<&'static str>) -> Result<S::Ok, S::Error> {
    match name {
        Some(n) => s.serialize_str(n),
        None => s.serialize_i32(v),
    }
}

/// `FallbackCount.reason`.
pub fn fallback_reason<S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
    by_name(
        s,
        *v,
        FallbackReason::try_from(*v).ok().map(|r| r.as_str_name()),
    )
}

/// `Refused.reason`.
pub fn reason<S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
    by_name(s, *v, Reason::try_from(*v).ok().map(|r| r.as_str_name()))
}

/// `ErrorReply.code`.
pub fn error_code<S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
    by_name(s, *v, ErrorCode::try_from(*v).ok().map(|r| r.as_str_name()))
}

#[cfg(test)]
mod tests {
    use crate::local::v1 as pb;

    #[test]
    fn enum_fields_are_written_by_name_and_unknown_numbers_as_numbers() {
        let c = pb::FallbackCount {
            reason: pb::FallbackReason::WaitTimeout as i32,
            opens: 3,
            ..Default::default()
        };
        let j = serde_json::to_value(c).unwrap();
        assert_eq!(j["reason"], "FALLBACK_REASON_WAIT_TIMEOUT", "{j}");
        let r = pb::Refused {
            reason: pb::Reason::NotFound as i32,
            ..Default::default()
        };
        let j = serde_json::to_value(r).unwrap();
        assert!(j["reason"].as_str().unwrap().contains("NOT_FOUND"), "{j}");
        let e = pb::ErrorReply {
            code: 999,
            ..Default::default()
        };
        assert_eq!(serde_json::to_value(e).unwrap()["code"], 999);
    }
}
