//! Envelope parsing and validation: any bytes from the broker either parse into an envelope
//! that survives normalisation and a re-encode round trip, or are refused with a reason code.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let now = chrono::Utc::now();
    let limits = fleet::task::Limits::default();
    let parsed = fleet::Envelope::parse(data, &limits);
    // The one-pass read of bytes agrees with parsing a `Value` and taking its fields out —
    // but for serde_json's private `RawValue` key, which the `Value` parse reads as JSON text
    // and the one-pass read as an ordinary field (envelope.rs's module doc).
    let raw_value_key = data
        .windows(b"$serde_json::private::RawValue".len())
        .any(|w| w == b"$serde_json::private::RawValue");
    if data.len() <= limits.max_bytes && !raw_value_key {
        let by_value = match serde_json::from_slice::<serde_json::Value>(data) {
            Err(e) => Err(fleet::task::Reject::MalformedJson(e.to_string())),
            Ok(v) => fleet::Envelope::from_value_limited(v, &limits),
        };
        match (&parsed, &by_value) {
            // A generated id differs by construction.
            (Ok(a), Ok(b)) => {
                let mut a = a.clone();
                if a.id != b.id && a.id.len() == 32 && b.id.len() == 32 {
                    a.id = b.id.clone();
                }
                assert_eq!(&a, b, "the bytes and the Value give different envelopes");
            }
            (a, b) => assert_eq!(a, b, "the bytes and the Value give different answers"),
        }
    }
    if let Ok(mut env) = parsed {
        if env.normalize(now, 5).is_ok() {
            // What the scheduler forwards must parse again as the same task.
            let again = fleet::Envelope::from_slice(&env.to_bytes(), usize::MAX).expect("a normalised envelope re-parses");
            assert_eq!(again.id, env.id);
            assert_eq!(again.kind, env.kind);
            let _ = env.selector().group_name();
        }
    }
});
